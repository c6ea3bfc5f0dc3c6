//! Command-line flags (each with an environment variable).

use clap::Parser;
use pdserve_engine::args::ModelArgs;
use pdserve_protocol::kvwire::KvDtype;
use pdserve_worker::kv::KvArgs;
use pdserve_worker::prefill::DestinationArgs;
use pdserve_worker::ServerArgs;

/// pdserve prefill worker.
#[derive(Parser, Debug, Clone)]
#[command(name = "pdserve-prefill", version, about)]
pub struct Args {
    /// Port to listen on (0 picks a free one).
    #[arg(long, env = "PDSERVE_PREFILL_PORT", default_value_t = 8100)]
    pub port: u16,
    #[command(flatten)]
    pub model: ModelArgs,
    /// Prompt tokens per forward pass; longer prompts run in chunks.
    #[arg(long, env = "PDSERVE_PREFILL_CHUNK_TOKENS", default_value_t = 512)]
    pub prefill_chunk_tokens: usize,
    /// Prompt tokens one batched forward pass may hold: while jobs are
    /// queued, short prompts are run together up to this total (default:
    /// 128, or --prefill-chunk-tokens if smaller).
    #[arg(long, env = "PDSERVE_PREFILL_BATCH_TOKENS")]
    pub prefill_batch_tokens: Option<usize>,
    /// Jobs per batched forward pass at most (1 turns batching off).
    #[arg(long, env = "PDSERVE_PREFILL_BATCH_MAX_JOBS", default_value_t = 8)]
    pub prefill_batch_max_jobs: usize,
    /// Jobs that may wait before new ones are refused.
    #[arg(long, env = "PDSERVE_MAX_QUEUE", default_value_t = 64)]
    pub max_queue: usize,
    /// KV cache budget in tokens (46 KB a token for the default model): the
    /// running batch's prompts, and the prefix cache in the rest. At least
    /// the model's context length.
    #[arg(long, env = "PDSERVE_KV_CACHE_TOKENS", default_value_t = 32_768)]
    pub kv_cache_tokens: usize,
    /// KV cache budget in bytes, instead of --kv-cache-tokens.
    #[arg(long, env = "PDSERVE_KV_CACHE_BYTES")]
    pub kv_cache_bytes: Option<u64>,
    #[command(flatten)]
    pub kv: KvArgs,
    /// KV element type on the wire: f32 or f16. The default is the cache's
    /// own (--kv-cache-dtype), which sends the stored values exactly; f32
    /// over an f16 cache doubles the bytes, f16 over an f32 cache rounds.
    #[arg(long, env = "PDSERVE_KV_DTYPE")]
    pub kv_dtype: Option<KvDtype>,
    /// Peak matmul throughput of this machine in GFLOP/s, for the FLOPs-utilisation (MFU) estimate.
    #[arg(long, env = "PDSERVE_PEAK_GFLOPS", default_value_t = 410.0)]
    pub peak_gflops: f64,
    #[command(flatten)]
    pub destinations: DestinationArgs,
    #[command(flatten)]
    pub server: ServerArgs,
}

/// Batches of short prompts pay on a 2-core CPU up to about this many
/// tokens; bigger passes are no faster than one prompt after another
/// (docs/benchmarks.md, "Batching short prompts").
pub const DEFAULT_BATCH_TOKENS: usize = 128;

impl Args {
    /// The batched forward pass's token budget.
    pub fn batch_tokens(&self) -> usize {
        self.prefill_batch_tokens
            .unwrap_or(DEFAULT_BATCH_TOKENS.min(self.prefill_chunk_tokens))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_batch_budget_defaults_to_128_tokens_within_the_chunk() {
        let parse = |extra: &[&str]| {
            let mut argv = vec!["p", "--model", "m.gguf"];
            argv.extend_from_slice(extra);
            Args::parse_from(argv).batch_tokens()
        };
        assert_eq!(parse(&[]), 128);
        assert_eq!(parse(&["--prefill-chunk-tokens", "64"]), 64);
        assert_eq!(parse(&["--prefill-batch-tokens", "300"]), 300);
    }
}
