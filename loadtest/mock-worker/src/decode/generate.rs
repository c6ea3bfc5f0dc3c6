//! `POST /v1/internal/generate`: validate, reserve KV, then either queue a
//! local prefill or wait (under a lease) for a prefill worker's KV stream.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::extract::rejection::JsonRejection;
use axum::extract::State;
use axum::response::Response;
use axum::Json;
use pdserve_engine::sampler::SamplingParams;
use pdserve_protocol::internal::{
    validate_request_id, ErrorBody, GenerateEvent, GenerateRequest, KvSource,
};
use pdserve_runtime::http::{ndjson, ApiError};
use tokio::sync::mpsc;

use super::batcher::Job;
use super::{DecodeState, LeaseTimer, Pending};
use crate::shape::MockShape;

/// Tells a reservation's lease from a later one's under the same request id.
static NEXT_LEASE: AtomicU64 = AtomicU64::new(0);

pub async fn generate(
    State(state): State<Arc<DecodeState>>,
    body: Result<Json<GenerateRequest>, JsonRejection>,
) -> Result<Response, ApiError> {
    let req = state.readiness.admit(body)?;
    validate(&state.shape, &req)?;
    let capacity = req.prompt_tokens.len() as u64 + u64::from(req.sampling.max_tokens);
    let kv = state.budget.reserve(capacity).map_err(ErrorBody::from)?;
    let (tx, rx) = mpsc::unbounded_channel();
    let prompt_len = req.prompt_tokens.len() as u32;
    let mut waiting = None;
    match req.kv_source {
        KvSource::Local => {
            let _ = tx.send(GenerateEvent::Reserved { kv_url: None });
            let job = Job {
                request_id: req.request_id,
                prompt_len,
                sampling: req.sampling,
                first: None,
                events: tx,
                kv,
            };
            state.batcher.submit(job)?;
        }
        KvSource::Remote { lease_ms } => {
            let url = format!("{}/v1/internal/kv/{}", state.public_url, req.request_id);
            let _ = tx.send(GenerateEvent::Reserved { kv_url: Some(url) });
            let id = req.request_id.clone();
            let mut map = state.pending();
            if map.contains_key(&id) {
                return Err(ApiError(ErrorBody::fatal(
                    "duplicate_request_id",
                    "this request id is already waiting for KV",
                )));
            }
            // Under the map's lock: the timer cannot look before the entry is in.
            let lease_id = NEXT_LEASE.fetch_add(1, Ordering::Relaxed);
            let within = Duration::from_millis(lease_ms);
            let timer = tokio::spawn(lease(state.clone(), id.clone(), lease_id, within));
            let pending = Pending {
                prompt_len,
                sampling: req.sampling,
                kv,
                events: tx,
                lease: LeaseTimer {
                    id: lease_id,
                    task: timer.abort_handle(),
                },
            };
            map.insert(id, pending);
            drop(map);
            waiting = Some((state.clone(), req.request_id));
        }
    }
    Ok(stream_events(Events {
        rx: Some(rx),
        waiting,
    }))
}

fn validate(shape: &MockShape, req: &GenerateRequest) -> Result<(), ErrorBody> {
    validate_request_id(&req.request_id)?;
    if req.sampling.max_tokens == 0 {
        return Err(ErrorBody::fatal(
            "invalid_request",
            "max_tokens must be at least 1",
        ));
    }
    let max_new = req.sampling.max_tokens as usize;
    shape
        .config
        .check_prompt(&req.prompt_tokens, max_new)
        .map_err(|e| ErrorBody::fatal(e.kind(), e.to_string()))?;
    SamplingParams::from(&req.sampling)
        .validate()
        .map_err(|e| ErrorBody::fatal("invalid_sampling", e.to_string()))
}

/// Releases a remote reservation whose KV has not arrived within its lease.
async fn lease(state: Arc<DecodeState>, id: String, lease: u64, within: Duration) {
    tokio::time::sleep(within).await;
    let mut map = state.pending();
    // Absent (or another request's): the KV arrived, or the client left.
    if map.get(&id).is_some_and(|p| p.lease.id == lease) {
        if let Some(p) = map.remove(&id) {
            tracing::warn!(request_id = %id, "KV lease expired: releasing the reservation");
            let _ = p.events.send(GenerateEvent::Error(ErrorBody::retryable(
                "kv_lease_expired",
                format!("the KV did not arrive within {} ms", within.as_millis()),
            )));
        }
    }
}

/// The receiving end of a generate stream. Dropping it (the client went
/// away) releases at once a reservation still waiting for its KV.
struct Events {
    rx: Option<mpsc::UnboundedReceiver<GenerateEvent>>,
    waiting: Option<(Arc<DecodeState>, String)>,
}

impl Drop for Events {
    fn drop(&mut self) {
        drop(self.rx.take());
        let Some((state, id)) = &self.waiting else {
            return;
        };
        let mut map = state.pending();
        // Closed: it is this stream's entry, not a later request's with the same id.
        if map.get(id).is_some_and(|p| p.events.is_closed()) {
            map.remove(id);
            tracing::info!(request_id = %id, "the client left while waiting for KV: reservation released");
        }
    }
}

/// Streams events as JSON lines until the batcher drops the sender.
fn stream_events(mut events: Events) -> Response {
    ndjson(futures_util::stream::poll_fn(move |cx| {
        match events.rx.as_mut() {
            Some(rx) => rx.poll_recv(cx),
            None => std::task::Poll::Ready(None),
        }
    }))
}
