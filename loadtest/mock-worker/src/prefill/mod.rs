//! The mock prefill worker: the real prefill worker's HTTP surface over a
//! simulated engine that streams real KV frames of the right size.

mod worker;

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use axum::extract::rejection::JsonRejection;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::routing::{delete, get, post};
use axum::{Json, Router};
use bytes::Bytes;
use pdserve_engine::sampler::SamplingParams;
use pdserve_protocol::internal::{
    validate_request_id, ErrorBody, LoadReport, PrefillJob, PrefillResult,
};
use pdserve_runtime::http::ApiError;
use pdserve_runtime::kv_upload::upload;
use pdserve_runtime::metrics::labels;
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::metrics::PrefillMetrics;
use crate::server::{metrics_page, Readiness};
use crate::shape::MockShape;
pub use worker::EngineConfig;
use worker::{Computed, EngineHandle, Task};

/// Everything the handlers share.
pub struct PrefillState {
    pub shape: MockShape,
    pub engine: EngineHandle,
    pub metrics: Arc<PrefillMetrics>,
    client: reqwest::Client,
    /// Cancellation tokens of jobs queued or running, by request id.
    jobs: Mutex<HashMap<String, CancellationToken>>,
    pub readiness: Readiness,
}

impl PrefillState {
    /// Builds the state and starts the engine (on the current tokio runtime).
    pub fn new(cfg: EngineConfig) -> Arc<Self> {
        let metrics = Arc::new(PrefillMetrics::new());
        Arc::new(Self {
            shape: cfg.shape.clone(),
            engine: EngineHandle::spawn(cfg, metrics.clone()),
            metrics,
            client: reqwest::Client::new(),
            jobs: Mutex::default(),
            readiness: Readiness::default(),
        })
    }

    fn jobs(&self) -> MutexGuard<'_, HashMap<String, CancellationToken>> {
        self.jobs.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn in_flight(&self) -> u64 {
        self.engine.in_flight()
    }

    /// The load report the router balances and scales on.
    pub fn load_report(&self) -> LoadReport {
        let s = &self.engine.stats;
        LoadReport {
            queued_requests: s.queue.requests(),
            queued_tokens: s.queue.tokens(),
            active_sequences: s.running.load(Ordering::Relaxed),
            kv_used_tokens: 0,
            kv_free_tokens: 0,
            tokens_per_second: f64::from_bits(s.tokens_per_second.load(Ordering::Relaxed)),
            ready: self.readiness.is_ready(),
        }
    }
}

/// The prefill worker's routes, as the real one's.
pub fn routes(state: Arc<PrefillState>) -> Router {
    Router::new()
        .route("/v1/internal/prefill", post(prefill))
        .route("/v1/internal/prefill/{request_id}", delete(cancel))
        .route("/health", get(|| async { "ok" }))
        .route(
            "/ready",
            get(|State(s): State<Arc<PrefillState>>| async move { s.readiness.status() }),
        )
        .route(
            "/load",
            get(|State(s): State<Arc<PrefillState>>| async move { Json(s.load_report()) }),
        )
        .route(
            "/metrics",
            get(|State(s): State<Arc<PrefillState>>| async move {
                metrics_page(&s.metrics.common.registry)
            }),
        )
        .with_state(state)
}

/// Cancels the job when the handler ends for any reason, including the
/// router dropping the request.
struct JobGuard {
    state: Arc<PrefillState>,
    id: String,
    cancel: CancellationToken,
}

impl JobGuard {
    /// Registers a job (for `DELETE`), refusing an id already in progress.
    fn track(state: &Arc<PrefillState>, id: &str) -> Result<Self, ApiError> {
        let cancel = CancellationToken::new();
        let mut jobs = state.jobs();
        if jobs.contains_key(id) {
            let msg = "a job with this id is in progress";
            return Err(ApiError(ErrorBody::fatal("duplicate_request_id", msg)));
        }
        jobs.insert(id.to_string(), cancel.clone());
        Ok(Self {
            state: state.clone(),
            id: id.to_string(),
            cancel,
        })
    }
}

impl Drop for JobGuard {
    fn drop(&mut self) {
        self.cancel.cancel();
        self.state.jobs().remove(&self.id);
    }
}

async fn prefill(
    State(state): State<Arc<PrefillState>>,
    body: Result<Json<PrefillJob>, JsonRejection>,
) -> Result<Json<PrefillResult>, ApiError> {
    let job = state.readiness.admit(body)?;
    validate(&state.shape, &job)?;
    let guard = JobGuard::track(&state, &job.request_id)?;
    let (frames_tx, frames_rx) = mpsc::channel::<Bytes>(16);
    let (reply_tx, reply_rx) = oneshot::channel();
    let deadline = Duration::from_millis(job.deadline_ms.max(1));
    let (id, tokens, url) = (
        job.request_id.clone(),
        job.prompt_tokens.len() as u32,
        job.kv_destination.clone(),
    );
    let task = Task {
        job,
        enqueued: Instant::now(),
        cancel: guard.cancel.clone(),
        frames: frames_tx,
        reply: reply_tx,
    };
    state.engine.submit(task)?;
    let work = deliver(&state, &url, frames_rx, reply_rx);
    let result = match tokio::time::timeout(deadline, work).await {
        Ok(r) => r,
        Err(_) => Err(ErrorBody::retryable(
            "deadline_exceeded",
            format!("KV not delivered within {} ms", deadline.as_millis()),
        )),
    };
    drop(guard);
    let status = match &result {
        Ok(_) => labels::STATUS_OK,
        Err(_) => labels::STATUS_ERROR,
    };
    state.metrics.common.finished(status);
    let c = result.inspect_err(|e| tracing::warn!(request_id = %id, "prefill failed: {e}"))?;
    Ok(Json(PrefillResult {
        request_id: id,
        prompt_tokens: tokens,
        first_token: c.first_token,
        queue_seconds: c.queue_seconds,
        compute_seconds: c.compute_seconds,
        transfer_bytes: c.bytes,
    }))
}

/// Uploads the frames while the engine produces them; done when both are.
async fn deliver(
    state: &PrefillState,
    url: &str,
    frames: mpsc::Receiver<Bytes>,
    reply: oneshot::Receiver<Result<Computed, ErrorBody>>,
) -> Result<Computed, ErrorBody> {
    let upload_started = Instant::now();
    let uploading = async {
        upload(&state.client, url, frames).await?;
        Ok::<Instant, ErrorBody>(Instant::now())
    };
    let (computed, uploaded) = tokio::join!(reply, uploading);
    let computed = computed
        .map_err(|_| ErrorBody::retryable("engine_stopped", "the prefill engine stopped"))??;
    let acked = uploaded?;
    let m = &state.metrics;
    m.common
        .kv_transfer_seconds
        .observe((acked - upload_started).as_secs_f64());
    let tail = acked.saturating_duration_since(computed.finished_at);
    m.transfer_tail_seconds.observe(tail.as_secs_f64());
    Ok(computed)
}

fn validate(shape: &MockShape, job: &PrefillJob) -> Result<(), ErrorBody> {
    validate_request_id(&job.request_id)?;
    shape
        .config
        .check_prompt(&job.prompt_tokens, 0)
        .map_err(|e| ErrorBody::fatal(e.kind(), e.to_string()))?;
    let url = &job.kv_destination;
    if !(url.starts_with("http://") || url.starts_with("https://")) {
        return Err(ErrorBody::fatal(
            "invalid_request",
            format!("kv_destination `{url}` is not an http(s) URL"),
        ));
    }
    SamplingParams::from(&job.sampling)
        .validate()
        .map_err(|e| ErrorBody::fatal("invalid_sampling", e.to_string()))
}

async fn cancel(State(state): State<Arc<PrefillState>>, Path(id): Path<String>) -> StatusCode {
    match state.jobs().get(&id) {
        Some(token) => {
            token.cancel();
            StatusCode::OK
        }
        None => StatusCode::NOT_FOUND,
    }
}
