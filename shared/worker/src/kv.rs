//! The KV cache's flags and report, the same for every backend.

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
}

/// A worker's KV cache, as its load report and metrics show it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct KvReport {
    /// Tokens of the blocks live sequences hold.
    pub used_tokens: u64,
    pub capacity_tokens: u64,
    pub blocks_used: u64,
    /// Cached blocks nobody holds (reclaimable).
    pub blocks_cached: u64,
    pub blocks_free: u64,
    /// Prompt tokens looked up in the prefix cache, and found.
    pub prefix_queried_tokens: u64,
    pub prefix_hit_tokens: u64,
    /// Cached blocks reclaimed for new work.
    pub evictions: u64,
}

impl KvReport {
    /// Tokens a new request can take: free and reclaimable blocks.
    pub fn free_tokens(&self) -> u64 {
        self.capacity_tokens.saturating_sub(self.used_tokens)
    }
}
