//! Command-line flags (each with an environment variable).

use clap::Parser;
use pdserve_engine::args::ModelArgs;
use pdserve_worker::ServerArgs;

/// pdserve decode worker.
#[derive(Parser, Debug, Clone)]
#[command(name = "pdserve-decode", version, about)]
pub struct Args {
    /// Port to listen on (0 picks a free one).
    #[arg(long, env = "PDSERVE_DECODE_PORT", default_value_t = 8200)]
    pub port: u16,
    #[command(flatten)]
    pub model: ModelArgs,
    /// Sequences per decode step at most.
    #[arg(long, env = "PDSERVE_MAX_BATCH", default_value_t = 32)]
    pub max_batch: usize,
    /// KV cache budget in tokens (each token costs 46 KB for the default model).
    #[arg(long, env = "PDSERVE_KV_CACHE_TOKENS", default_value_t = 65_536)]
    pub kv_cache_tokens: usize,
    /// Prompt tokens per local prefill chunk.
    #[arg(long, env = "PDSERVE_PREFILL_CHUNK_TOKENS", default_value_t = 512)]
    pub prefill_chunk_tokens: usize,
    /// Sequences that may wait for the engine before requests are refused.
    #[arg(long, env = "PDSERVE_MAX_QUEUE", default_value_t = 256)]
    pub max_queue: usize,
    /// Peak memory bandwidth of this machine in GB/s, for the bandwidth-utilisation (MBU) estimate.
    #[arg(
        long,
        env = "PDSERVE_PEAK_MEMORY_BANDWIDTH_GBPS",
        default_value_t = 46.0
    )]
    pub peak_memory_bandwidth_gbps: f64,
    #[command(flatten)]
    pub server: ServerArgs,
}
