//! The KV cache's flags and report, the same for every backend.

pub use pdserve_protocol::internal::KvReport;
use pdserve_protocol::kvwire::KvDtype;
use pdserve_runtime::metrics::{self as m, labels};
use prometheus::{IntCounter, IntGaugeVec, Registry};

/// On or off.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Switch {
    On,
    Off,
}

impl Switch {
    pub fn is_on(self) -> bool {
        self == Self::On
    }
}

/// The KV cache flags of every worker.
#[derive(clap::Args, Debug, Clone)]
pub struct KvArgs {
    /// Tokens per KV block: the unit of allocation and of prefix reuse.
    #[arg(long, env = "PDSERVE_KV_BLOCK_TOKENS", default_value_t = 16)]
    pub kv_block_tokens: usize,
    /// Keep full KV blocks after their request, for later prompts that start
    /// the same way (a shared system prompt, the earlier turns of a chat).
    #[arg(long, env = "PDSERVE_PREFIX_CACHE", value_enum, default_value = "on")]
    pub prefix_cache: Switch,
    /// Element type of the stored K and V: f16 (half the memory and half
    /// the bytes each decode step reads) or f32. Prefill and decode workers
    /// must match for disaggregated output to equal aggregated output.
    #[arg(long, env = "PDSERVE_KV_CACHE_DTYPE", default_value = "f16")]
    pub kv_cache_dtype: KvDtype,
}

/// The KV budget in tokens: `bytes` over the model's `bytes_per_token`
/// when a byte budget is given, else `tokens`.
pub fn budget_tokens(tokens: usize, bytes: Option<u64>, bytes_per_token: usize) -> usize {
    match bytes {
        Some(bytes) => (bytes / bytes_per_token.max(1) as u64) as usize,
        None => tokens,
    }
}

/// The KV cache series every worker exports, prefill and decode alike.
pub struct KvMetrics {
    /// Blocks by state: used, cached (reclaimable), free.
    pub blocks: IntGaugeVec,
    /// Prompt tokens looked up in the prefix cache, and found (counted
    /// from the pool's own totals at each scrape).
    pub prefix_queries: IntCounter,
    pub prefix_hits: IntCounter,
    pub evictions: IntCounter,
}

impl KvMetrics {
    pub fn new(r: &Registry) -> Self {
        Self {
            blocks: m::int_gauge_vec(
                r,
                m::KV_CACHE_BLOCKS,
                "KV blocks by state: used (held by sequences), cached (reclaimable), free.",
                &["state"],
            ),
            prefix_queries: m::counter(
                r,
                m::PREFIX_CACHE_QUERIES_TOTAL,
                "Prompt tokens looked up in the prefix cache.",
            ),
            prefix_hits: m::counter(
                r,
                m::PREFIX_CACHE_HITS_TOTAL,
                "Prompt tokens found in the prefix cache (not computed).",
            ),
            evictions: m::counter(
                r,
                m::KV_CACHE_EVICTIONS_TOTAL,
                "Cached KV blocks reclaimed for new work.",
            ),
        }
    }

    /// Sets the series from the cache's report.
    pub fn publish(&self, r: &KvReport) {
        for (state, n) in [
            (labels::KV_BLOCKS_USED, r.blocks_used),
            (labels::KV_BLOCKS_CACHED, r.blocks_cached),
            (labels::KV_BLOCKS_FREE, r.blocks_free),
        ] {
            self.blocks.with_label_values(&[state]).set(n as i64);
        }
        for (c, total) in [
            (&self.prefix_queries, r.prefix_queried_tokens),
            (&self.prefix_hits, r.prefix_hit_tokens),
            (&self.evictions, r.evictions),
        ] {
            c.inc_by(total.saturating_sub(c.get()));
        }
    }
}
