//! The pdserve decode worker: the real model behind the worker layer's
//! decode server. It reserves KV in the model's pool, imports a prompt's KV
//! from a prefill worker (or prefills it locally), and generates tokens with
//! continuous batching ([`engine`]). Everything on the network is
//! `pdserve_worker::decode`.

pub mod backend;
pub mod config;
pub mod engine;
mod seq;

use std::sync::Arc;

use pdserve_engine::{KvConfig, KvPool, Model};
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
    let limits = &args.decode;
    let bytes_per_token = model.kv_layout().bytes_per_token().max(1) as u64;
    let budget_tokens = match limits.kv_cache_bytes {
        Some(bytes) => (bytes / bytes_per_token) as usize,
        None => limits.kv_cache_tokens,
    };
    let pool = KvPool::with_config(
        model.kv_layout(),
        KvConfig {
            budget_tokens,
            block_tokens: limits.kv.kv_block_tokens,
            prefix_cache: limits.kv.prefix_cache.is_on(),
            fingerprint: model.fingerprint(),
        },
    );
    let cfg = EngineConfig {
        limits: limits.clone(),
        peak_bytes_per_second: args.peak_memory_bandwidth_gbps * 1e9,
    };
    let backend = RealDecode::spawn(model, pool, eos, cfg, metrics.clone());
    DecodeServer::new(backend, metrics, public_url)
}
