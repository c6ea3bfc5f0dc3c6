//! The pdserve decode worker: the real model behind the worker layer's
//! decode server. It reserves KV in the model's pool, imports a prompt's KV
//! from a prefill worker (or prefills it locally), and generates tokens with
//! continuous batching ([`engine`]). Everything on the network is
//! `pdserve_worker::decode`.

pub mod backend;
pub mod config;
pub mod engine;

use std::sync::Arc;

use pdserve_engine::Model;
use pdserve_worker::decode::{DecodeMetrics, DecodeServer};

pub use backend::RealDecode;
pub use config::Args;
use engine::EngineConfig;

/// The decode server over `model`, its scheduler thread started; `eos` ends
/// sequences, and KV ingest URLs name `public_url`. The worker starts ready.
pub fn build(
    model: Arc<Model>,
    eos: u32,
    args: &Args,
    public_url: String,
) -> Arc<DecodeServer<RealDecode>> {
    let metrics = Arc::new(DecodeMetrics::new());
    let cfg = EngineConfig {
        limits: args.decode.clone(),
        peak_bytes_per_second: args.peak_memory_bandwidth_gbps * 1e9,
    };
    let backend = RealDecode::spawn(model, eos, cfg, metrics.clone());
    DecodeServer::new(backend, metrics, public_url)
}
