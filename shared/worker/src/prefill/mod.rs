//! The prefill worker's HTTP side, over any engine that implements
//! [`PrefillBackend`]: `POST /v1/internal/prefill` (run a prompt, stream its
//! KV to the decode worker the job names, answer once it is delivered),
//! `DELETE /v1/internal/prefill/{id}`, `/health`, `/ready`, `/load`,
//! `/metrics`.
//!
//! A backend takes [`PrefillTask`]s. For each it sends the KV stream's
//! frames (header, layers as they are computed, end frame with the first
//! token) into `task.frames`, which this layer uploads as they come, and
//! answers on `task.reply`. It stops a task once `task.cancel` fires: that
//! is how a `DELETE`, the router going away or a failed upload cancel it.

mod destinations;
pub mod frames;
mod handler;
mod metrics;

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use axum::routing::{delete, post};
use axum::Router;
use pdserve_protocol::internal::{ErrorBody, ErrorKind, LoadReport, Pool, PrefillJob};
use pdserve_protocol::prefix::PrefixDigest;
use pdserve_runtime::auth::InternalToken;
use pdserve_text::ModelConfig;
use tokio::sync::oneshot;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

pub use destinations::{DestinationArgs, Destinations};
pub use frames::FrameSender;
pub use metrics::PrefillMetrics;

use crate::kv::KvReport;
use crate::queue::EngineStats;
use crate::readiness::Readiness;
use crate::server::{worker_routes, Served, ServerArgs, Service};

/// A prefill engine: the real model or a simulation of it.
pub trait PrefillBackend: Send + Sync + 'static {
    /// The model's hyper-parameters, for validating jobs.
    fn config(&self) -> &ModelConfig;
    /// Queues a task without waiting; a full queue is a retryable error.
    fn submit(&self, task: PrefillTask) -> Result<(), ErrorBody>;
    /// The engine's load: queued and running jobs, recent throughput.
    fn stats(&self) -> &EngineStats;
    /// The KV cache's state (the working set of the running batch and the
    /// prefix cache).
    fn kv_usage(&self) -> KvReport;
    /// The blocks the prefix cache holds; `None` when it is off.
    fn prefix_digest(&self) -> Option<PrefixDigest>;
}

/// A job handed to a backend.
pub struct PrefillTask {
    pub job: PrefillJob,
    pub enqueued: Instant,
    /// Fires when the job is no longer wanted; the engine stops at the next layer.
    pub cancel: CancellationToken,
    /// Frames of the KV stream, read by the upload to the decode worker;
    /// sending never blocks (a slow receiver fails this job only).
    pub frames: FrameSender,
    pub reply: oneshot::Sender<Result<Computed, ErrorBody>>,
}

/// What a backend reports for a finished prompt.
#[derive(Debug)]
pub struct Computed {
    /// When the compute and sampling ended (the end frame was queued).
    pub finished_at: Instant,
    pub first_token: u32,
    pub queue_seconds: f64,
    pub compute_seconds: f64,
    /// Bytes of the KV stream.
    pub bytes: u64,
}

/// The error of a job cancelled by `DELETE` or by its caller going away.
pub fn cancelled() -> ErrorBody {
    ErrorBody::fatal(ErrorKind::Cancelled, "the job was cancelled")
}

/// The error of a frame that the upload no longer takes.
pub fn upload_stopped() -> ErrorBody {
    ErrorBody::retryable(
        ErrorKind::KvUploadFailed,
        "the KV upload to the decode worker stopped",
    )
}

/// A prefill worker's network settings: the internal token, where KV may
/// go, a job's longest deadline and its KV buffer.
pub struct PrefillNet {
    pub token: InternalToken,
    pub destinations: Destinations,
    pub max_job: Duration,
    pub upload_buffer_bytes: u64,
    /// Whether the KV stream's header frame carries the trace context.
    pub kv_trace_context: bool,
}

impl PrefillNet {
    /// From a worker's server flags and its destination flags.
    pub fn from_args(server: &ServerArgs, args: &DestinationArgs) -> Result<Self, String> {
        let token = server.auth.token();
        let routers = server.registration.routers();
        let destinations = Destinations::new(args, &routers, &token)?;
        if !destinations.has_sources() {
            tracing::warn!(
                "no decode workers known (no --router-url, --decode-url or --decode-dns): \
                 every prefill job will be refused"
            );
        }
        Ok(Self {
            token,
            destinations,
            max_job: Duration::from_secs(args.max_job_seconds.max(1)),
            upload_buffer_bytes: args.kv_upload_buffer_bytes,
            kv_trace_context: args.kv_trace_context,
        })
    }
}

/// The prefill worker's HTTP side over backend `B`.
pub struct PrefillServer<B> {
    backend: B,
    metrics: Arc<PrefillMetrics>,
    net: PrefillNet,
    client: reqwest::Client,
    /// Jobs queued, running or delivering, by request id.
    jobs: Mutex<HashMap<String, handler::Tracked>>,
    readiness: Readiness,
}

impl<B: PrefillBackend> PrefillServer<B> {
    /// The server over a started backend that reports into `metrics`.
    pub fn new(backend: B, metrics: Arc<PrefillMetrics>, net: PrefillNet) -> Arc<Self> {
        let client = reqwest::Client::builder()
            .pool_idle_timeout(pdserve_runtime::net::POOL_IDLE_TIMEOUT)
            .default_headers(net.token.client_headers())
            .build()
            .unwrap_or_default();
        Arc::new(Self {
            backend,
            metrics,
            net,
            client,
            jobs: Mutex::default(),
            readiness: Readiness::default(),
        })
    }

    pub fn backend(&self) -> &B {
        &self.backend
    }

    /// The worker as a [`Service`], registering at `url` with `fingerprint` and `weights`.
    pub fn service(self: &Arc<Self>, url: String, fingerprint: u64, weights: &str) -> Service {
        Service::new(self, Pool::Prefill, url, fingerprint, weights)
    }

    fn jobs(&self) -> MutexGuard<'_, HashMap<String, handler::Tracked>> {
        // Entries are whole values: the map is consistent even after a panic.
        self.jobs.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl<B: PrefillBackend> Served for PrefillServer<B> {
    /// The worker's routes.
    fn routes(self: &Arc<Self>) -> Router {
        let internal = Router::new()
            .route("/v1/internal/prefill", post(handler::prefill::<B>))
            .route(
                "/v1/internal/prefill/{request_id}",
                delete(handler::cancel::<B>),
            );
        worker_routes(self, &self.net.token, internal)
    }

    /// The load report the router balances and scales on.
    fn load_report(&self) -> LoadReport {
        let (kv, digest) = (self.backend.kv_usage(), self.backend.prefix_digest());
        let ready = self.readiness.is_ready();
        self.backend.stats().report_with_kv(ready, &kv, digest)
    }

    fn readiness(&self) -> &Readiness {
        &self.readiness
    }

    /// Stops taking jobs and returns the queued ones at once, retryable, for
    /// the router to run elsewhere; the ones being computed finish.
    fn start_drain(self: &Arc<Self>, _deadline: std::time::Instant) {
        self.readiness.stop();
        let returned = self.jobs().values().filter(|j| j.hand_back()).count();
        if returned > 0 {
            tracing::info!(
                jobs = returned,
                "draining: queued prefill jobs returned to the router"
            );
        }
    }

    /// Jobs queued, running, or still delivering their KV.
    fn in_flight(&self) -> u64 {
        self.jobs().len() as u64
    }

    fn metrics_page(&self) -> axum::response::Response {
        self.metrics.cache.publish(&self.backend.kv_usage());
        crate::http::metrics_page(&self.metrics.registry)
    }
}
