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

use pdserve_engine::sampler::grammars_for;
use pdserve_engine::Model;
use pdserve_worker::decode::{DecodeMetrics, DecodeNet, DecodeServer};
use pdserve_worker::kv::budget_tokens;

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
    let dtype = limits.kv.kv_cache_dtype.into();
    let budget_tokens = budget_tokens(
        limits.kv_cache_tokens,
        limits.kv_cache_bytes,
        model.kv_layout().bytes_per_token(dtype),
    );
    let pool = model.kv_pool(
        budget_tokens,
        limits.kv.kv_block_tokens,
        limits.kv.prefix_cache.is_on(),
        dtype,
    );
    let cfg = EngineConfig {
        limits: limits.clone(),
        peak_bytes_per_second: args.peak_memory_bandwidth_gbps * 1e9,
        grammars: grammars_for(&args.model.path, model.config().vocab_size),
    };
    let backend = RealDecode::spawn(model, pool, eos, cfg, metrics.clone());
    let net = DecodeNet::new(args.server.auth.token(), &args.decode);
    DecodeServer::new(backend, metrics, public_url, net)
}
