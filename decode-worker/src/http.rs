//! HTTP handlers: generate (a stream of JSON lines), health, readiness, load
//! and metrics. KV ingest lives in `ingest.rs`.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::rejection::JsonRejection;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use pdserve_engine::sampler::SamplingParams;
use pdserve_engine::KvError;
use pdserve_protocol::internal::{
    validate_request_id, ErrorBody, GenerateEvent, GenerateRequest, KvSource, LoadReport,
};
use pdserve_runtime::http::{ndjson, ApiError};
use tokio::sync::mpsc;

use crate::engine::{Job, Start};
use crate::state::{AppState, Pending};

/// How often a reservation waiting for KV checks its lease and its client.
const LEASE_POLL: Duration = Duration::from_millis(200);
/// Largest generate request body (a prompt of token ids).
const MAX_BODY_BYTES: usize = 8 << 20;

/// The worker's routes.
pub fn routes(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/v1/internal/generate", post(generate))
        .route("/v1/internal/kv/{request_id}", post(crate::ingest::ingest))
        .route("/health", get(|| async { "ok" }))
        .route("/ready", get(ready))
        .route("/load", get(load))
        .route("/metrics", get(metrics))
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .with_state(state)
}

async fn generate(
    State(state): State<Arc<AppState>>,
    body: Result<Json<GenerateRequest>, JsonRejection>,
) -> Result<Response, ApiError> {
    let Json(req) = body.map_err(|e| ApiError(ErrorBody::fatal("invalid_json", e.body_text())))?;
    if !state.ready.load(Ordering::Relaxed) {
        return Err(ApiError(ErrorBody::retryable(
            "not_ready",
            "the worker is not ready or is draining",
        )));
    }
    validate(&state, &req).map_err(ApiError)?;
    let capacity = req.prompt_tokens.len() + req.sampling.max_tokens as usize;
    let kv = state.pool.allocate(capacity).map_err(|e| {
        let retry = matches!(e, KvError::Exhausted { .. });
        let kind = e.kind();
        ApiError(match retry {
            true => ErrorBody::retryable(kind, e.to_string()),
            false => ErrorBody::fatal(kind, e.to_string()),
        })
    })?;
    let (tx, rx) = mpsc::unbounded_channel();
    match req.kv_source {
        KvSource::Local => {
            let _ = tx.send(GenerateEvent::Reserved { kv_url: None });
            let job = Job {
                request_id: req.request_id,
                prompt: req.prompt_tokens,
                sampling: req.sampling,
                kv,
                start: Start::Prefill,
                events: tx,
            };
            state.engine.submit(job).map_err(ApiError)?;
        }
        KvSource::Remote { lease_ms } => {
            let url = format!("{}/v1/internal/kv/{}", state.public_url, req.request_id);
            let _ = tx.send(GenerateEvent::Reserved { kv_url: Some(url) });
            let pending = Pending {
                prompt: req.prompt_tokens,
                sampling: req.sampling,
                kv,
                events: tx,
                lease_until: tokio::time::Instant::now() + Duration::from_millis(lease_ms),
            };
            let mut map = state.pending();
            if map.contains_key(&req.request_id) {
                return Err(ApiError(ErrorBody::fatal(
                    "duplicate_request_id",
                    "this request id is already waiting for KV",
                )));
            }
            map.insert(req.request_id.clone(), pending);
            drop(map);
            tokio::spawn(lease(
                state.clone(),
                req.request_id,
                Duration::from_millis(lease_ms),
            ));
        }
    }
    Ok(ndjson(tokio_stream_from(rx)))
}

/// Releases a remote reservation whose KV has not arrived in time, or whose
/// client (the router) has gone away while waiting. It holds no sender of
/// the stream, so a finished stream ends at once; it polls instead.
async fn lease(state: Arc<AppState>, id: String, within: Duration) {
    let until = tokio::time::Instant::now() + within;
    let mut tick = tokio::time::interval(LEASE_POLL);
    loop {
        tick.tick().await;
        let expired = tokio::time::Instant::now() >= until;
        let mut map = state.pending();
        // Absent: the KV is being ingested or has been admitted; the ingest owns it now.
        let abandoned = map.get(&id).is_some_and(|p| p.events.is_closed());
        if abandoned {
            map.remove(&id);
            tracing::info!(request_id = %id, "the client left while waiting for KV: reservation released");
            return;
        }
        if expired {
            if let Some(p) = map.remove(&id) {
                tracing::warn!(request_id = %id, "KV lease expired: releasing the reservation");
                let _ = p.events.send(GenerateEvent::Error(ErrorBody::retryable(
                    "kv_lease_expired",
                    format!("the KV did not arrive within {} ms", within.as_millis()),
                )));
            }
            return;
        }
    }
}

fn validate(state: &AppState, req: &GenerateRequest) -> Result<(), ErrorBody> {
    validate_request_id(&req.request_id)?;
    if req.sampling.max_tokens == 0 {
        return Err(ErrorBody::fatal(
            "invalid_request",
            "max_tokens must be at least 1",
        ));
    }
    let max_new = req.sampling.max_tokens as usize;
    state
        .model
        .config()
        .check_prompt(&req.prompt_tokens, max_new)
        .map_err(|e| ErrorBody::fatal(e.kind(), e.to_string()))?;
    let params = SamplingParams::from(&req.sampling);
    params
        .validate()
        .map_err(|e| ErrorBody::fatal("invalid_sampling", e.to_string()))
}

fn tokio_stream_from<T: Send + 'static>(
    mut rx: mpsc::UnboundedReceiver<T>,
) -> impl futures_util::Stream<Item = T> {
    futures_util::stream::poll_fn(move |cx| rx.poll_recv(cx))
}

async fn ready(State(state): State<Arc<AppState>>) -> StatusCode {
    match state.ready.load(Ordering::Relaxed) {
        true => StatusCode::OK,
        false => StatusCode::SERVICE_UNAVAILABLE,
    }
}

/// The load report the router balances on.
pub fn load_report(state: &AppState) -> LoadReport {
    let usage = state.pool.usage();
    let stats = &state.engine.stats;
    LoadReport {
        queued_requests: stats.queue.requests(),
        queued_tokens: stats.queue.tokens(),
        active_sequences: stats.active.load(Ordering::Relaxed),
        kv_used_tokens: usage.reserved_tokens as u64,
        kv_free_tokens: usage.free_tokens() as u64,
        tokens_per_second: f64::from_bits(stats.tokens_per_second.load(Ordering::Relaxed)),
        ready: state.ready.load(Ordering::Relaxed),
    }
}

async fn load(State(state): State<Arc<AppState>>) -> Json<LoadReport> {
    Json(load_report(&state))
}

async fn metrics(State(state): State<Arc<AppState>>) -> impl IntoResponse {
    let usage = state.pool.usage();
    let m = &state.metrics;
    m.kv_usage_ratio.set(usage.usage_ratio());
    m.kv_used_tokens.set(usage.reserved_tokens as f64);
    m.kv_capacity_tokens.set(usage.budget_tokens as f64);
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        pdserve_runtime::metrics::render(&m.registry),
    )
}
