//! The pdserve decode worker: reserves KV for a request, takes the prompt's
//! KV from a prefill worker (or prefills locally), and generates tokens with
//! continuous batching, streaming them back as JSON lines.

pub mod config;
pub mod engine;
pub mod http;
pub mod ingest;
pub mod metrics;
pub mod state;

use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use pdserve_engine::{KvPool, Model};

pub use config::Args;
use engine::{EngineConfig, EngineHandle};
use metrics::DecodeMetrics;
use state::AppState;

/// Builds the worker's state around a loaded model: the KV pool, the engine
/// thread and the metrics. The worker starts ready.
pub fn build_state(model: Arc<Model>, eos: u32, args: &Args, public_url: String) -> Arc<AppState> {
    let metrics = Arc::new(DecodeMetrics::new());
    let pool = KvPool::new(model.kv_layout(), args.kv_cache_tokens);
    let engine_cfg = EngineConfig {
        max_batch: args.max_batch,
        prefill_chunk_tokens: args.prefill_chunk_tokens,
        queue_capacity: args.max_queue,
        peak_bytes_per_second: args.peak_memory_bandwidth_gbps * 1e9,
    };
    let engine = EngineHandle::spawn(model.clone(), eos, engine_cfg, metrics.clone());
    Arc::new(AppState {
        model,
        pool,
        engine,
        metrics,
        pending: Default::default(),
        public_url,
        ready: AtomicBool::new(true),
    })
}

/// The axum application.
pub fn build_app(state: Arc<AppState>) -> axum::Router {
    http::routes(state)
}
