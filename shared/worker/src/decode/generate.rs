//! `POST /v1/internal/generate`: validate, reserve KV, then either queue a
//! local prefill or wait (under a lease) for a prefill worker's KV stream.

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::extract::rejection::JsonRejection;
use axum::extract::State;
use axum::response::Response;
use axum::Json;
use pdserve_protocol::internal::{ErrorBody, ErrorKind, GenerateEvent, GenerateRequest, KvSource};
use tokio::sync::mpsc;

use super::lease::Pending;
use super::{DecodeBackend, DecodeJob, DecodeServer, KvImport};
use crate::http::{json_body, ndjson, ApiError};

pub(super) async fn generate<B: DecodeBackend>(
    State(server): State<Arc<DecodeServer<B>>>,
    body: Result<Json<GenerateRequest>, JsonRejection>,
) -> Result<Response, ApiError> {
    let started = Instant::now();
    let req = json_body(body)?;
    server.readiness.admit()?;
    crate::validate::generate(server.backend.config(), &req)?;
    // Local or remote, the reservation takes what the prefix cache holds:
    // a prefill worker then sends only the rest (`cached_tokens`).
    let kv = server
        .backend
        .reserve(&req.prompt_tokens, req.sampling.max_tokens)?;
    let cached = kv.cached() as u32;
    crate::trace::record_job(&req.request_id, req.prompt_tokens.len(), cached);
    let (tx, rx) = mpsc::unbounded_channel();
    let request_id = req.request_id.clone();
    let waiting = match req.kv_source {
        KvSource::Local => {
            start_local(&server, req, kv, tx)?;
            None
        }
        KvSource::Remote { lease_ms } => Some(wait_for_kv(&server, req, kv, tx, lease_ms)?),
    };
    Ok(stream_events(Events {
        rx: Some(rx),
        waiting,
        request_id,
        started,
        trace: Traced::current(),
    }))
}

/// The `reserved` line: counted in every report after this one.
fn reserved<B: DecodeBackend>(
    server: &DecodeServer<B>,
    kv_url: Option<String>,
    kv: &B::Kv,
) -> GenerateEvent {
    GenerateEvent::Reserved {
        kv_url,
        report_seq: server.backend.stats().acknowledge(),
        cached_tokens: kv.cached() as u32,
    }
}

/// Queues a sequence whose prompt is prefilled here.
fn start_local<B: DecodeBackend>(
    server: &DecodeServer<B>,
    req: GenerateRequest,
    kv: B::Kv,
    tx: mpsc::UnboundedSender<GenerateEvent>,
) -> Result<(), ApiError> {
    // The event goes first, before the engine can stream a token.
    let _ = tx.send(reserved(server, None, &kv));
    server.backend.submit(DecodeJob {
        request_id: req.request_id,
        prompt: req.prompt_tokens,
        sampling: req.sampling,
        kv,
        first: None,
        events: tx,
    })?;
    Ok(())
}

/// Parks a reservation, under a lease, until a prefill worker streams its KV.
fn wait_for_kv<B: DecodeBackend>(
    server: &Arc<DecodeServer<B>>,
    req: GenerateRequest,
    kv: B::Kv,
    tx: mpsc::UnboundedSender<GenerateEvent>,
    lease_ms: u64,
) -> Result<(Arc<DecodeServer<B>>, String), ApiError> {
    let id = req.request_id;
    let mut map = server.pending();
    if map.contains_key(&id) {
        let msg = "this request id is already waiting for KV";
        return Err(ApiError(ErrorBody::fatal(
            ErrorKind::DuplicateRequestId,
            msg,
        )));
    }
    let url = format!("{}/v1/internal/kv/{id}", server.public_url);
    let _ = tx.send(reserved(server, Some(url), &kv));
    let lease = server.start_lease(&id, Duration::from_millis(lease_ms));
    let pending = Pending {
        prompt: req.prompt_tokens,
        sampling: req.sampling,
        kv,
        events: tx,
        lease,
    };
    map.insert(id.clone(), pending);
    Ok((server.clone(), id))
}

/// The receiving end of a generate stream. Dropping it (the stream ended,
/// or the client went away) releases at once a reservation still waiting
/// for its KV.
struct Events<B: DecodeBackend> {
    rx: Option<mpsc::UnboundedReceiver<GenerateEvent>>,
    waiting: Option<(Arc<DecodeServer<B>>, String)>,
    request_id: String,
    started: Instant,
    trace: Traced,
}

/// What the stream tells the call's span: the first token (an event), the
/// tokens generated, and an error.
struct Traced {
    span: tracing::Span,
    tokens: u64,
}

impl Traced {
    /// Reports to the current span (the call's).
    fn current() -> Self {
        Self {
            span: tracing::Span::current(),
            tokens: 0,
        }
    }

    fn see(&mut self, event: &GenerateEvent) {
        match event {
            GenerateEvent::Token { .. } => {
                if self.tokens == 0 {
                    pdserve_runtime::otel::event(&self.span, "first_token");
                }
                self.tokens += 1;
            }
            GenerateEvent::Finished {
                completion_tokens, ..
            } => {
                let span = &self.span;
                span.record("gen_ai.usage.output_tokens", *completion_tokens);
            }
            GenerateEvent::Error(e) => crate::trace::record_error(&self.span, &e.message),
            _ => {}
        }
    }
}

impl<B: DecodeBackend> Drop for Events<B> {
    fn drop(&mut self) {
        // The worker's own span of the request, from its arrival to the
        // end of its stream: what `loadtest/scripts/router_overhead.sh`
        // subtracts from the client's end-to-end time.
        let elapsed_us = self.started.elapsed().as_micros() as u64;
        tracing::debug!(request_id = %self.request_id, elapsed_us, "generate stream closed");
        drop(self.rx.take());
        if let Some((server, id)) = &self.waiting {
            server.release_abandoned(id);
        }
    }
}

/// Streams events as JSON lines until the engine drops the sender.
fn stream_events<B: DecodeBackend>(mut events: Events<B>) -> Response {
    ndjson(futures_util::stream::poll_fn(move |cx| {
        let polled = match events.rx.as_mut() {
            Some(rx) => rx.poll_recv(cx),
            None => std::task::Poll::Ready(None),
        };
        if let std::task::Poll::Ready(Some(event)) = &polled {
            events.trace.see(event);
        }
        polled
    }))
}
