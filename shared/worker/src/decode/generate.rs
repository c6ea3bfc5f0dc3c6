//! `POST /v1/internal/generate`: validate, reserve KV, then either queue a
//! local prefill or wait (under a lease) for a prefill worker's KV stream.

use std::sync::Arc;
use std::time::Duration;

use axum::extract::rejection::JsonRejection;
use axum::extract::State;
use axum::response::Response;
use axum::Json;
use pdserve_protocol::internal::{ErrorBody, ErrorKind, GenerateEvent, GenerateRequest, KvSource};
use tokio::sync::mpsc;

use super::lease::Pending;
use super::{DecodeBackend, DecodeJob, DecodeServer};
use crate::http::{json_body, ndjson, ApiError};

pub(super) async fn generate<B: DecodeBackend>(
    State(server): State<Arc<DecodeServer<B>>>,
    body: Result<Json<GenerateRequest>, JsonRejection>,
) -> Result<Response, ApiError> {
    let req = json_body(body)?;
    server.readiness.admit()?;
    crate::validate::generate(server.backend.config(), &req)?;
    let capacity = req.prompt_tokens.len() + req.sampling.max_tokens as usize;
    let kv = server.backend.reserve(capacity)?;
    let (tx, rx) = mpsc::unbounded_channel();
    let mut waiting = None;
    match req.kv_source {
        KvSource::Local => {
            // Counted from here (the reservation is in the KV usage); the
            // event goes first, before the engine can stream a token.
            let report_seq = server.backend.stats().acknowledge();
            let _ = tx.send(GenerateEvent::Reserved {
                kv_url: None,
                report_seq,
            });
            server.backend.submit(DecodeJob {
                request_id: req.request_id,
                prompt: req.prompt_tokens,
                sampling: req.sampling,
                kv,
                first: None,
                events: tx,
            })?;
        }
        KvSource::Remote { lease_ms } => {
            let id = req.request_id.clone();
            let url = format!("{}/v1/internal/kv/{id}", server.public_url);
            let mut map = server.pending();
            if map.contains_key(&id) {
                return Err(ApiError(ErrorBody::fatal(
                    ErrorKind::DuplicateRequestId,
                    "this request id is already waiting for KV",
                )));
            }
            // Counted from here: the reservation is in the KV usage.
            let report_seq = server.backend.stats().acknowledge();
            let _ = tx.send(GenerateEvent::Reserved {
                kv_url: Some(url),
                report_seq,
            });
            let lease = server.start_lease(&id, Duration::from_millis(lease_ms));
            let pending = Pending {
                prompt: req.prompt_tokens,
                sampling: req.sampling,
                kv,
                events: tx,
                lease,
            };
            map.insert(id.clone(), pending);
            drop(map);
            waiting = Some((server.clone(), id));
        }
    }
    Ok(stream_events(Events {
        rx: Some(rx),
        waiting,
    }))
}

/// The receiving end of a generate stream. Dropping it (the client went
/// away) releases at once a reservation still waiting for its KV.
struct Events<B: DecodeBackend> {
    rx: Option<mpsc::UnboundedReceiver<GenerateEvent>>,
    waiting: Option<(Arc<DecodeServer<B>>, String)>,
}

impl<B: DecodeBackend> Drop for Events<B> {
    fn drop(&mut self) {
        drop(self.rx.take());
        if let Some((server, id)) = &self.waiting {
            server.release_abandoned(id);
        }
    }
}

/// Streams events as JSON lines until the engine drops the sender.
fn stream_events<B: DecodeBackend>(mut events: Events<B>) -> Response {
    ndjson(futures_util::stream::poll_fn(move |cx| {
        match events.rx.as_mut() {
            Some(rx) => rx.poll_recv(cx),
            None => std::task::Poll::Ready(None),
        }
    }))
}
