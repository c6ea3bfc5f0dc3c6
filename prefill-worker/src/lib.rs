//! The pdserve prefill worker: runs prompts through the model, in chunks,
//! and streams their KV layer by layer to the decode worker named in each
//! job, with the first sampled token at the end.

pub mod config;
pub mod engine;
pub mod http;
pub mod metrics;
mod prefill;

use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use pdserve_engine::Model;

pub use config::Args;
use engine::{EngineConfig, EngineHandle};
use http::AppState;
use metrics::PrefillMetrics;

/// Builds the worker's state around a loaded model. The worker starts ready.
pub fn build_state(model: Arc<Model>, args: &Args) -> Arc<AppState> {
    let metrics = Arc::new(PrefillMetrics::new());
    let cfg = EngineConfig {
        chunk_tokens: args.prefill_chunk_tokens,
        batch_tokens: args.batch_tokens(),
        max_batch_jobs: args.prefill_batch_max_jobs.max(1),
        queue_capacity: args.max_queue,
        kv_dtype: args.kv_dtype,
        peak_flops: args.peak_gflops * 1e9,
    };
    let engine = EngineHandle::spawn(model.clone(), cfg, metrics.clone());
    Arc::new(AppState {
        model,
        engine,
        metrics,
        client: reqwest::Client::new(),
        jobs: Default::default(),
        ready: AtomicBool::new(true),
    })
}

/// The axum application.
pub fn build_app(state: Arc<AppState>) -> axum::Router {
    http::routes(state)
}
