//! Shared state of the decode worker's HTTP side.

use std::collections::HashMap;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};

use pdserve_engine::{KvPool, Model, SeqKv};
use pdserve_protocol::internal::{GenerateEvent, SamplingSpec};
use tokio::sync::mpsc;

use crate::engine::EngineHandle;
use crate::metrics::DecodeMetrics;

/// A sequence whose KV is expected from a prefill worker.
pub struct Pending {
    pub prompt: Vec<u32>,
    pub sampling: SamplingSpec,
    pub kv: SeqKv,
    pub events: mpsc::UnboundedSender<GenerateEvent>,
    /// When the lease ends: a failed ingest after it releases the reservation.
    pub lease_until: tokio::time::Instant,
}

/// Everything the handlers share.
pub struct AppState {
    pub model: Arc<Model>,
    pub pool: KvPool,
    pub engine: EngineHandle,
    pub metrics: Arc<DecodeMetrics>,
    /// Reservations waiting for their KV, by request id. A sequence being
    /// ingested is taken out, and put back if the ingest fails.
    pub pending: Mutex<HashMap<String, Pending>>,
    /// This worker's base URL as others reach it (for KV ingest URLs).
    pub public_url: String,
    /// False while loading or draining.
    pub ready: AtomicBool,
}

impl AppState {
    pub fn pending(&self) -> std::sync::MutexGuard<'_, HashMap<String, Pending>> {
        // The map stays consistent even if a holder panicked: entries are whole values.
        self.pending.lock().unwrap_or_else(|p| p.into_inner())
    }
}
