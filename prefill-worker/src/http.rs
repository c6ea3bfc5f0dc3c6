//! HTTP handlers: prefill jobs (and their cancellation), health, readiness,
//! load and metrics.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::extract::rejection::JsonRejection;
use axum::extract::{Path, State};
use axum::http::{header, StatusCode};
use axum::response::IntoResponse;
use axum::routing::{delete, get, post};
use axum::{Json, Router};
use bytes::Bytes;
use pdserve_engine::sampler::SamplingParams;
use pdserve_engine::Model;
use pdserve_protocol::internal::{
    validate_request_id, ErrorBody, LoadReport, PrefillJob, PrefillResult,
};
use pdserve_runtime::http::ApiError;
use pdserve_runtime::kv_upload::upload;
use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;

use crate::engine::{Computed, EngineHandle, Task};
use crate::metrics::PrefillMetrics;

/// Everything the handlers share.
pub struct AppState {
    pub model: Arc<Model>,
    pub engine: EngineHandle,
    pub metrics: Arc<PrefillMetrics>,
    pub client: reqwest::Client,
    /// Cancellation tokens of jobs queued or running, by request id.
    pub jobs: Mutex<HashMap<String, CancellationToken>>,
    pub ready: AtomicBool,
}

impl AppState {
    /// Jobs queued, running, or still delivering their KV.
    pub fn in_flight(&self) -> u64 {
        self.jobs().len() as u64
    }

    fn jobs(&self) -> std::sync::MutexGuard<'_, HashMap<String, CancellationToken>> {
        self.jobs.lock().unwrap_or_else(|p| p.into_inner())
    }
}

pub fn routes(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/v1/internal/prefill", post(prefill))
        .route("/v1/internal/prefill/{request_id}", delete(cancel))
        .route("/health", get(|| async { "ok" }))
        .route("/ready", get(ready))
        .route("/load", get(load))
        .route("/metrics", get(metrics))
        .with_state(state)
}

/// Cancels the job when the handler ends for any reason, including the
/// router dropping the request; the engine stops after the current layer.
struct JobGuard {
    state: Arc<AppState>,
    id: String,
    cancel: CancellationToken,
}

impl Drop for JobGuard {
    fn drop(&mut self) {
        self.cancel.cancel();
        self.state.jobs().remove(&self.id);
    }
}

async fn prefill(
    State(state): State<Arc<AppState>>,
    body: Result<Json<PrefillJob>, JsonRejection>,
) -> Result<Json<PrefillResult>, ApiError> {
    let Json(job) = body.map_err(|e| ApiError(ErrorBody::fatal("invalid_json", e.body_text())))?;
    if !state.ready.load(Ordering::Relaxed) {
        return Err(ApiError(ErrorBody::retryable(
            "not_ready",
            "the worker is not ready or is draining",
        )));
    }
    validate(&state.model, &job).map_err(ApiError)?;
    let cancel = CancellationToken::new();
    {
        let mut jobs = state.jobs();
        if jobs.contains_key(&job.request_id) {
            return Err(ApiError(ErrorBody::fatal(
                "duplicate_request_id",
                "a job with this id is in progress",
            )));
        }
        jobs.insert(job.request_id.clone(), cancel.clone());
    }
    let _guard = JobGuard {
        state: state.clone(),
        id: job.request_id.clone(),
        cancel: cancel.clone(),
    };
    let (frames_tx, frames_rx) = mpsc::channel::<Bytes>(16);
    let (reply_tx, reply_rx) = oneshot::channel();
    let deadline = Duration::from_millis(job.deadline_ms.max(1));
    let (id, tokens, url) = (
        job.request_id.clone(),
        job.prompt_tokens.len() as u32,
        job.kv_destination.clone(),
    );
    let cancelled = cancel.clone();
    let task = Task {
        job,
        enqueued: Instant::now(),
        cancel,
        frames: frames_tx,
        reply: reply_tx,
    };
    state.engine.submit(task).map_err(ApiError)?;
    let work = async {
        let upload_started = Instant::now();
        let uploading = async {
            upload(&state.client, &url, frames_rx).await?;
            Ok::<Instant, ErrorBody>(Instant::now())
        };
        let (computed, uploaded) = tokio::join!(reply_rx, uploading);
        let computed = computed
            .map_err(|_| ErrorBody::retryable("engine_stopped", "the prefill engine stopped"))??;
        let acked = uploaded?;
        let m = &state.metrics;
        m.kv_transfer_seconds
            .observe((acked - upload_started).as_secs_f64());
        let tail = acked.saturating_duration_since(computed.finished_at);
        m.transfer_tail_seconds.observe(tail.as_secs_f64());
        Ok::<Computed, ErrorBody>(computed)
    };
    // A cancel stops the upload too (dropping it aborts the stream, so the
    // decode worker never commits the KV), unless the KV was delivered first.
    let result = tokio::select! {
        biased;
        r = tokio::time::timeout(deadline, work) => r.unwrap_or_else(|_| Err(ErrorBody::retryable(
            "deadline_exceeded",
            format!("KV not delivered within {} ms", deadline.as_millis()),
        ))),
        _ = cancelled.cancelled() => Err(crate::engine::cancelled()),
    };
    let status = if result.is_ok() { "ok" } else { "error" };
    state.metrics.requests.with_label_values(&[status]).inc();
    let c = result.map_err(|e| {
        tracing::warn!(request_id = %id, "prefill failed: {e}");
        ApiError(e)
    })?;
    Ok(Json(PrefillResult {
        request_id: id,
        prompt_tokens: tokens,
        first_token: c.first_token,
        queue_seconds: c.queue_seconds,
        compute_seconds: c.compute_seconds,
        transfer_bytes: c.bytes,
    }))
}

fn validate(model: &Model, job: &PrefillJob) -> Result<(), ErrorBody> {
    validate_request_id(&job.request_id)?;
    let bad = |m: String| Err(ErrorBody::fatal("invalid_request", m));
    model
        .config()
        .check_prompt(&job.prompt_tokens, 0)
        .map_err(|e| ErrorBody::fatal(e.kind(), e.to_string()))?;
    if !(job.kv_destination.starts_with("http://") || job.kv_destination.starts_with("https://")) {
        return bad(format!(
            "kv_destination `{}` is not an http(s) URL",
            job.kv_destination
        ));
    }
    SamplingParams::from(&job.sampling)
        .validate()
        .map_err(|e| ErrorBody::fatal("invalid_sampling", e.to_string()))
}

async fn cancel(State(state): State<Arc<AppState>>, Path(id): Path<String>) -> StatusCode {
    match state.jobs().get(&id) {
        Some(token) => {
            token.cancel();
            StatusCode::OK
        }
        None => StatusCode::NOT_FOUND,
    }
}

async fn ready(State(state): State<Arc<AppState>>) -> StatusCode {
    match state.ready.load(Ordering::Relaxed) {
        true => StatusCode::OK,
        false => StatusCode::SERVICE_UNAVAILABLE,
    }
}

async fn load(State(state): State<Arc<AppState>>) -> Json<LoadReport> {
    Json(load_report(&state))
}

/// The load report the router balances and scales on.
pub fn load_report(state: &AppState) -> LoadReport {
    let s = &state.engine.stats;
    LoadReport {
        queued_requests: s.queue.requests(),
        queued_tokens: s.queue.tokens(),
        active_sequences: s.running.load(Ordering::Relaxed),
        kv_used_tokens: 0,
        kv_free_tokens: 0,
        tokens_per_second: f64::from_bits(s.tokens_per_second.load(Ordering::Relaxed)),
        ready: state.ready.load(Ordering::Relaxed),
    }
}

async fn metrics(State(state): State<Arc<AppState>>) -> impl IntoResponse {
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        pdserve_runtime::metrics::render(&state.metrics.registry),
    )
}
