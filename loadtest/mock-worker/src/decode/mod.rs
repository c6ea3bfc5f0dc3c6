//! The mock decode worker: the real decode worker's HTTP surface over a
//! simulated continuous batcher and a KV budget in tokens.

pub mod batcher;
mod generate;
mod ingest;

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use axum::extract::{DefaultBodyLimit, State};
use axum::routing::{get, post};
use axum::{Json, Router};
use pdserve_protocol::internal::{GenerateEvent, LoadReport, SamplingSpec};
use tokio::sync::mpsc;

use crate::budget::{KvBudget, Reservation};
use crate::metrics::DecodeMetrics;
use crate::server::{metrics_page, Readiness};
use crate::shape::MockShape;
use batcher::{BatcherConfig, BatcherHandle};

/// Largest generate request body (a prompt of token ids).
const MAX_BODY_BYTES: usize = 8 << 20;

/// A sequence whose KV is expected from a prefill worker.
pub struct Pending {
    pub prompt_len: u32,
    pub sampling: SamplingSpec,
    pub kv: Reservation,
    pub events: mpsc::UnboundedSender<GenerateEvent>,
    pub lease: LeaseTimer,
}

/// The timer that releases a reservation whose KV is late. It stops as soon
/// as the reservation leaves the waiting map (KV in, client gone), so a long
/// lease leaves no sleeping task behind at high request rates.
pub struct LeaseTimer {
    /// Tells this lease from a later one under the same request id.
    pub id: u64,
    pub task: tokio::task::AbortHandle,
}

impl Drop for LeaseTimer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Everything the handlers share.
pub struct DecodeState {
    pub shape: MockShape,
    pub budget: Arc<KvBudget>,
    pub batcher: BatcherHandle,
    pub metrics: Arc<DecodeMetrics>,
    /// Reservations waiting for their KV, by request id; one being ingested
    /// is taken out, and put back if the ingest fails.
    pub pending: Mutex<HashMap<String, Pending>>,
    /// This worker's base URL as prefill workers reach it.
    pub public_url: String,
    pub readiness: Readiness,
}

impl DecodeState {
    /// Builds the state and starts the batcher (on the current tokio runtime).
    pub fn new(
        shape: MockShape,
        cfg: BatcherConfig,
        kv_tokens: u64,
        public_url: String,
    ) -> Arc<Self> {
        let metrics = Arc::new(DecodeMetrics::new());
        Arc::new(Self {
            shape,
            budget: KvBudget::new(kv_tokens),
            batcher: BatcherHandle::spawn(cfg, metrics.clone()),
            metrics,
            pending: Mutex::default(),
            public_url,
            readiness: Readiness::default(),
        })
    }

    pub fn pending(&self) -> MutexGuard<'_, HashMap<String, Pending>> {
        // Entries are whole values: the map is consistent even after a panic.
        self.pending.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Sequences queued, running or waiting for their KV.
    pub fn in_flight(&self) -> u64 {
        self.batcher.in_flight() + self.pending().len() as u64
    }

    /// The load report the router balances on.
    pub fn load_report(&self) -> LoadReport {
        let stats = &self.batcher.stats;
        LoadReport {
            queued_requests: stats.queue.requests(),
            queued_tokens: stats.queue.tokens(),
            active_sequences: stats.active.load(std::sync::atomic::Ordering::Relaxed),
            kv_used_tokens: self.budget.used(),
            kv_free_tokens: self.budget.free(),
            tokens_per_second: f64::from_bits(
                stats
                    .tokens_per_second
                    .load(std::sync::atomic::Ordering::Relaxed),
            ),
            ready: self.readiness.is_ready(),
        }
    }
}

/// The decode worker's routes, as the real one's.
pub fn routes(state: Arc<DecodeState>) -> Router {
    Router::new()
        .route("/v1/internal/generate", post(generate::generate))
        .route("/v1/internal/kv/{request_id}", post(ingest::ingest))
        .route("/health", get(|| async { "ok" }))
        .route(
            "/ready",
            get(|State(s): State<Arc<DecodeState>>| async move { s.readiness.status() }),
        )
        .route(
            "/load",
            get(|State(s): State<Arc<DecodeState>>| async move { Json(s.load_report()) }),
        )
        .route("/metrics", get(metrics))
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .with_state(state)
}

async fn metrics(State(state): State<Arc<DecodeState>>) -> impl axum::response::IntoResponse {
    let m = &state.metrics;
    let (used, capacity) = (state.budget.used(), state.budget.capacity());
    m.kv_used_tokens.set(used as f64);
    m.kv_capacity_tokens.set(capacity as f64);
    m.kv_usage_ratio.set(used as f64 / capacity.max(1) as f64);
    metrics_page(&m.common.registry)
}
