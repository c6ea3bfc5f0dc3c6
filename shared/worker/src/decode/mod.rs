//! The decode worker's HTTP side, over any engine that implements
//! [`DecodeBackend`]: `POST /v1/internal/generate` (reserve KV, then
//! prefill locally or wait under a lease for a prefill worker's KV, then
//! stream tokens as JSON lines), `POST /v1/internal/kv/{id}` (the KV
//! ingest), `/health`, `/ready`, `/load`, `/metrics`.
//!
//! A backend reserves KV ([`DecodeBackend::reserve`]), imports streamed KV
//! into a reservation ([`KvImport`]) and runs [`DecodeJob`]s, sending each
//! token on `job.events` ([`SeqStream`] does the bookkeeping). It drops a
//! sequence whose `events` receiver is gone: that is how a client that left
//! cancels it.

mod generate;
mod ingest;
mod lease;
mod metrics;
mod sequence;

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use axum::extract::DefaultBodyLimit;
use axum::routing::post;
use axum::Router;
use pdserve_protocol::internal::{ErrorBody, GenerateEvent, LoadReport, Pool, SamplingSpec};
use pdserve_protocol::kvwire::{KvDtype, KvShape};
use pdserve_protocol::prefix::PrefixDigest;
use pdserve_runtime::auth::InternalToken;
use pdserve_text::{ModelConfig, Sampled};
use sequence::HANDBACK_MARGIN as MARGIN;
use tokio::sync::mpsc;

pub use metrics::DecodeMetrics;
pub use sequence::{retire, Outcome, SeqStream, HANDBACK_MARGIN};

use crate::kv::{KvArgs, KvReport};
use crate::queue::EngineStats;
use crate::readiness::Readiness;
use crate::server::{worker_routes, Served, Service};

use lease::Pending;

/// Largest generate request body (a prompt of token ids).
const MAX_BODY_BYTES: usize = 8 << 20;

/// The flags of a decode worker's scheduler, whatever its backend.
#[derive(clap::Args, Debug, Clone)]
pub struct DecodeArgs {
    /// Sequences per decode step at most.
    #[arg(long, env = "PDSERVE_MAX_BATCH", default_value_t = 32)]
    pub max_batch: usize,
    /// KV cache budget in tokens (46 KB a token for the default model). A
    /// sequence takes blocks for its prompt when admitted, and a block at a
    /// time as it generates.
    #[arg(long, env = "PDSERVE_KV_CACHE_TOKENS", default_value_t = 65_536)]
    pub kv_cache_tokens: usize,
    /// KV cache budget in bytes, instead of --kv-cache-tokens.
    #[arg(long, env = "PDSERVE_KV_CACHE_BYTES")]
    pub kv_cache_bytes: Option<u64>,
    #[command(flatten)]
    pub kv: KvArgs,
    /// Prompt tokens per prefill chunk.
    #[arg(long, env = "PDSERVE_PREFILL_CHUNK_TOKENS", default_value_t = 512)]
    pub prefill_chunk_tokens: usize,
    /// Requests that may wait for the engine before new ones are refused
    /// (503, retryable).
    #[arg(long, env = "PDSERVE_MAX_QUEUE", default_value_t = 256)]
    pub max_queue: usize,
    /// A KV upload that sends nothing for this long fails, and its
    /// reservation waits for another upload until its lease ends.
    #[arg(long, env = "PDSERVE_KV_IDLE_TIMEOUT_MS", default_value_t = 10_000)]
    pub kv_idle_timeout_ms: u64,
}

/// A decode engine: the real model or a simulation of it.
pub trait DecodeBackend: Send + Sync + 'static {
    /// A sequence's reserved KV; dropping it gives the reservation back.
    type Kv: KvImport;
    /// The model's hyper-parameters, for validating requests.
    fn config(&self) -> &ModelConfig;
    /// What an incoming KV stream must match.
    fn kv_shape(&self) -> KvShape;
    /// Reserves KV for `prompt`, which will generate up to `max_tokens`:
    /// at least the prompt's blocks now, taking what the prefix cache holds
    /// of it ([`KvImport::cached`]). Too little free KV now is retryable,
    /// more than the whole budget fatal.
    fn reserve(&self, prompt: &[u32], max_tokens: u32) -> Result<Self::Kv, ErrorBody>;
    /// Queues a sequence without waiting; a full queue is retryable.
    fn submit(&self, job: DecodeJob<Self::Kv>) -> Result<(), ErrorBody>;
    /// The engine's load: queued and running sequences, recent throughput.
    fn stats(&self) -> &EngineStats;
    /// The KV cache's state.
    fn kv_usage(&self) -> KvReport;
    /// The blocks the prefix cache holds; `None` when it is off.
    fn prefix_digest(&self) -> Option<PrefixDigest>;
}

/// Rows of one layer's K and V, as a KV frame carries them.
#[derive(Debug, Clone, Copy)]
pub struct KvRows<'a> {
    pub layer: usize,
    pub dtype: KvDtype,
    /// The first row's position in the prompt.
    pub start: usize,
    /// Rows (tokens) in `k` and in `v`.
    pub n: usize,
    pub k: &'a [u8],
    pub v: &'a [u8],
}

/// A reservation that can take a prompt's KV as a prefill worker streams it.
pub trait KvImport: Send + 'static {
    /// Imports rows of one layer.
    fn import(&mut self, rows: KvRows<'_>) -> Result<(), ErrorBody>;
    /// The whole prompt, `tokens`, is in.
    fn finish(&mut self, tokens: &[u32]) -> Result<(), ErrorBody>;
    /// Forgets a partial import (the upload failed; another may follow).
    fn reset(&mut self);
    /// Leading prompt tokens already present (taken from the prefix cache).
    fn cached(&self) -> usize;
}

/// A sequence handed to a backend.
pub struct DecodeJob<Kv> {
    pub request_id: String,
    pub prompt: Vec<u32>,
    pub sampling: SamplingSpec,
    pub kv: Kv,
    /// The token a prefill worker sampled after the imported prompt;
    /// `None`: prefill the prompt here.
    pub first: Option<Sampled>,
    pub events: mpsc::UnboundedSender<GenerateEvent>,
}

/// A decode worker's network settings.
#[derive(Debug, Clone, Default)]
pub struct DecodeNet {
    /// What every internal route requires.
    pub token: InternalToken,
    /// How long a KV upload may send nothing.
    pub kv_idle_timeout: Duration,
}

impl DecodeNet {
    pub fn new(token: InternalToken, args: &DecodeArgs) -> Self {
        Self {
            token,
            kv_idle_timeout: Duration::from_millis(args.kv_idle_timeout_ms.max(1)),
        }
    }
}

/// The decode worker's HTTP side over backend `B`.
pub struct DecodeServer<B: DecodeBackend> {
    backend: B,
    metrics: Arc<DecodeMetrics>,
    /// Reservations waiting for their KV, by request id; one being ingested
    /// is taken out, and put back if the ingest fails.
    pending: Mutex<HashMap<String, Pending<B::Kv>>>,
    /// This worker's base URL as prefill workers reach it.
    public_url: String,
    net: DecodeNet,
    readiness: Readiness,
}

impl<B: DecodeBackend> DecodeServer<B> {
    /// The server over a started backend that reports into `metrics`; KV
    /// ingest URLs name `public_url`.
    pub fn new(
        backend: B,
        metrics: Arc<DecodeMetrics>,
        public_url: String,
        net: DecodeNet,
    ) -> Arc<Self> {
        Arc::new(Self {
            backend,
            metrics,
            pending: Mutex::default(),
            public_url,
            net,
            readiness: Readiness::default(),
        })
    }

    pub fn backend(&self) -> &B {
        &self.backend
    }

    /// The worker as a [`Service`], registering with `fingerprint` and `weights`.
    pub fn service(self: &Arc<Self>, fingerprint: u64, weights: &str) -> Service {
        let url = self.public_url.clone();
        Service::new(self, Pool::Decode, url, fingerprint, weights)
    }

    fn pending(&self) -> MutexGuard<'_, HashMap<String, Pending<B::Kv>>> {
        // Entries are whole values: the map is consistent even after a panic.
        self.pending.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Reservations waiting for their KV.
    pub fn waiting_for_kv(&self) -> usize {
        self.pending().len()
    }

    /// Draining: hands back the reservations still waiting for their KV
    /// (the router places them, and their prefill, elsewhere).
    fn hand_back_waiting(&self) {
        let waiting: Vec<_> = self.pending().drain().collect();
        for (id, p) in waiting {
            tracing::info!(request_id = %id, "draining: reservation handed back before its KV");
            let kind = pdserve_protocol::internal::ErrorKind::HandedBack;
            let body = ErrorBody::retryable(kind, "the decode worker is draining");
            let _ = p.events.send(GenerateEvent::Error(body));
        }
    }
}

impl<B: DecodeBackend> Served for DecodeServer<B> {
    /// The worker's routes.
    fn routes(self: &Arc<Self>) -> Router {
        let internal = Router::new()
            .route("/v1/internal/generate", post(generate::generate::<B>))
            .route("/v1/internal/kv/{request_id}", post(ingest::ingest::<B>));
        worker_routes(self, &self.net.token, internal).layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
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

    /// Stops admitting and tells the engine to hand back what cannot
    /// finish by `deadline`; reservations still waiting for their KV at the
    /// margin before the deadline are handed back then.
    fn start_drain(self: &Arc<Self>, deadline: std::time::Instant) {
        self.readiness.stop();
        self.backend.stats().start_drain(deadline);
        let server = self.clone();
        let cutoff = deadline.checked_sub(MARGIN).unwrap_or(deadline);
        tokio::spawn(async move {
            tokio::time::sleep_until(cutoff.into()).await;
            server.hand_back_waiting();
        });
    }

    /// Sequences queued, running or waiting for their KV.
    fn in_flight(&self) -> u64 {
        self.backend.stats().in_flight() + self.waiting_for_kv() as u64
    }

    fn metrics_page(&self) -> axum::response::Response {
        self.metrics.kv(&self.backend.kv_usage());
        crate::http::metrics_page(&self.metrics.registry)
    }
}
