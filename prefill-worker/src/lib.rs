//! The pdserve prefill worker: the real model behind the worker layer's
//! prefill server. It runs prompts through the model, in chunks or batched
//! ([`engine`]), and streams their KV layer by layer to the decode worker
//! named in each job, with the first sampled token at the end. Everything
//! on the network is `pdserve_worker::prefill`.

pub mod config;
pub mod engine;
mod prefill;

use std::sync::Arc;

use pdserve_engine::sampler::grammars_for;
use pdserve_engine::Model;
use pdserve_worker::kv::budget_tokens;
use pdserve_worker::prefill::{PrefillMetrics, PrefillNet, PrefillServer};

pub use config::Args;
pub use engine::{EngineConfig, EngineHandle};

/// The prefill server over `model`, its model thread started. The worker
/// starts ready. Fails on a bad `--decode-url`.
pub fn build(model: Arc<Model>, args: &Args) -> Result<Arc<PrefillServer<EngineHandle>>, String> {
    let net = PrefillNet::from_args(&args.server, &args.destinations)?;
    let metrics = Arc::new(PrefillMetrics::new());
    // Room for a full batch of prompts or one whole prompt, at least.
    let cache_dtype = args.kv.kv_cache_dtype;
    let budget = budget_tokens(
        args.kv_cache_tokens,
        args.kv_cache_bytes,
        model.kv_layout().bytes_per_token(cache_dtype.into()),
    )
    .max(model.config().context_length)
    .max(args.batch_tokens());
    let pool = model.kv_pool(
        budget,
        args.kv.kv_block_tokens,
        args.kv.prefix_cache.is_on(),
        cache_dtype.into(),
    );
    let cfg = EngineConfig {
        chunk_tokens: args.prefill_chunk_tokens,
        batch_tokens: args.batch_tokens(),
        max_batch_jobs: args.prefill_batch_max_jobs.max(1),
        queue_capacity: args.max_queue,
        kv_dtype: args.kv_dtype.unwrap_or(cache_dtype).into(),
        peak_flops: args.peak_gflops * 1e9,
        grammars: grammars_for(&args.model.path, model.config().vocab_size),
    };
    Ok(PrefillServer::new(
        EngineHandle::spawn(model, pool, cfg, metrics.clone()),
        metrics,
        net,
    ))
}
