//! The KV cache, owned outside the model, in fixed blocks (paged).
//!
//! A [`KvPool`] holds a budget of blocks of `block_tokens` tokens. A
//! sequence ([`SeqKv`]) holds a table of blocks and grows a block at a time;
//! dropping it gives its blocks back, so a cancelled or finished request
//! never leaks KV. Within a block, storage is token-major per layer
//! (`[block_tokens, kv_heads, head_dim]` of f16 by default, or f32), so
//! attention reads a block's keys as one contiguous slice.
//!
//! With the prefix cache on, every full block is keyed by a chained hash of
//! its tokens (and those before it, and the model); a new sequence whose
//! prompt starts with cached blocks takes them instead of computing them
//! ([`SeqKv::attach_prefix`]). A cached block is read-only; one nobody holds
//! stays cached until its memory is needed, least recently used first.

mod blocks;
mod elem;
mod io;
mod seq;
mod store;

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

pub use blocks::BlockCounts;
pub use seq::SeqKv;

use blocks::Blocks;
pub(crate) use elem::{with_elem, KvElem};
use pdserve_protocol::internal::KvReport;
use pdserve_protocol::prefix::{block_hash, PrefixDigest};
pub(crate) use store::Half;
use store::Store;

/// Shape of one token's KV in one layer, and the layer count.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvLayout {
    pub n_layers: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
}

impl KvLayout {
    /// Values of K (or of V) per token in one layer.
    pub fn row(&self) -> usize {
        self.n_kv_heads * self.head_dim
    }

    /// Bytes of K plus V for `tokens` tokens in one layer, in `dtype`.
    pub fn layer_bytes(&self, tokens: usize, dtype: KvDtype) -> usize {
        2 * tokens * self.row() * dtype.size()
    }

    /// Bytes of K plus V for one token across all layers, stored as `dtype`.
    pub fn bytes_per_token(&self, dtype: KvDtype) -> usize {
        self.n_layers * self.layer_bytes(1, dtype)
    }
}

/// Element type of the KV store, and of exported KV bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum KvDtype {
    F32,
    F16,
}

/// The KV store's element type when none is asked for.
pub const DEFAULT_KV_DTYPE: KvDtype = KvDtype::F16;

impl KvDtype {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            Self::F32 => 4,
            Self::F16 => 2,
        }
    }
}

/// Errors of the KV cache.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KvError {
    #[error("KV cache budget exhausted: {requested} tokens requested, {free} of {budget} free")]
    Exhausted {
        requested: usize,
        free: usize,
        budget: usize,
    },
    #[error("sequence KV capacity exceeded: {needed} tokens needed, capacity is {capacity}")]
    CapacityExceeded { needed: usize, capacity: usize },
    #[error("KV layout mismatch: {0}")]
    LayoutMismatch(String),
    #[error("invalid KV import: {0}")]
    BadImport(String),
    #[error("KV rows out of range: {0}")]
    OutOfRange(String),
}

impl KvError {
    /// A short stable name, for metric labels and error codes.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Exhausted { .. } => "kv_exhausted",
            Self::CapacityExceeded { .. } => "kv_capacity_exceeded",
            Self::LayoutMismatch(_) => "kv_layout_mismatch",
            Self::BadImport(_) => "kv_bad_import",
            Self::OutOfRange(_) => "kv_out_of_range",
        }
    }
}

/// A snapshot of the pool's usage.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvUsage {
    /// Tokens of the blocks live sequences hold (what admission counts).
    pub reserved_tokens: usize,
    /// Tokens actually written into live sequences.
    pub stored_tokens: usize,
    pub budget_tokens: usize,
    pub sequences: usize,
    pub block_tokens: usize,
    pub blocks: BlockCounts,
}

impl KvUsage {
    /// Tokens new sequences can still take: free blocks and cached blocks
    /// nobody holds (reclaimed when needed).
    pub fn free_tokens(&self) -> usize {
        (self.blocks.free + self.blocks.cached) * self.block_tokens
    }

    /// Held share of the budget, in [0, 1].
    pub fn usage_ratio(&self) -> f64 {
        match self.budget_tokens {
            0 => 1.0,
            b => self.reserved_tokens as f64 / b as f64,
        }
    }
}

/// How a pool is built.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvConfig {
    /// The budget, rounded up to whole blocks.
    pub budget_tokens: usize,
    /// Tokens per block.
    pub block_tokens: usize,
    /// Keep full blocks for reuse by later sequences with the same prefix.
    pub prefix_cache: bool,
    /// The model's fingerprint, part of every block's hash.
    pub fingerprint: u64,
    /// Element type of the stored K and V.
    pub dtype: KvDtype,
}

/// Tokens per block when none is asked for.
pub const DEFAULT_BLOCK_TOKENS: usize = 16;

/// Prefix-cache counters, in prompt tokens.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PrefixStats {
    /// Prompt tokens looked up.
    pub queried_tokens: u64,
    /// Prompt tokens found cached.
    pub hit_tokens: u64,
    /// Cached blocks reclaimed for new work.
    pub evictions: u64,
}

#[derive(Debug)]
struct PoolInner {
    layout: KvLayout,
    cfg: KvConfig,
    n_blocks: usize,
    blocks: Mutex<Blocks>,
    store: Store,
    stored: AtomicUsize,
    sequences: AtomicUsize,
    queried: AtomicU64,
    hits: AtomicU64,
    /// The last digest built, with the cache version it describes.
    digest: Mutex<Option<(u64, PrefixDigest)>>,
}

impl PoolInner {
    fn blocks(&self) -> MutexGuard<'_, Blocks> {
        // The bookkeeping is left consistent by every operation.
        self.blocks.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn exhausted(&self, requested_blocks: usize, available: usize) -> KvError {
        let b = self.cfg.block_tokens;
        KvError::Exhausted {
            requested: requested_blocks * b,
            free: available * b,
            budget: self.n_blocks * b,
        }
    }

    fn hash(&self, parent: u64, tokens: &[u32]) -> u64 {
        block_hash(parent, tokens, self.cfg.fingerprint)
    }
}

/// A KV memory budget shared by many sequences. Cheap to clone.
#[derive(Debug, Clone)]
pub struct KvPool {
    inner: Arc<PoolInner>,
}

impl KvPool {
    /// A pool for `layout` of `budget_tokens` (in blocks of
    /// [`DEFAULT_BLOCK_TOKENS`] of [`DEFAULT_KV_DTYPE`]), without the prefix cache.
    pub fn new(layout: KvLayout, budget_tokens: usize) -> Self {
        let cfg = KvConfig {
            budget_tokens,
            block_tokens: DEFAULT_BLOCK_TOKENS,
            prefix_cache: false,
            fingerprint: 0,
            dtype: DEFAULT_KV_DTYPE,
        };
        Self::with_config(layout, cfg)
    }

    pub fn with_config(layout: KvLayout, mut cfg: KvConfig) -> Self {
        cfg.block_tokens = cfg.block_tokens.max(1);
        let n_blocks = cfg.budget_tokens.div_ceil(cfg.block_tokens);
        let inner = PoolInner {
            layout,
            cfg,
            n_blocks,
            blocks: Mutex::new(Blocks::new(n_blocks, cfg.prefix_cache)),
            store: Store::new(layout, n_blocks, cfg.block_tokens, cfg.dtype),
            stored: AtomicUsize::new(0),
            sequences: AtomicUsize::new(0),
            queried: AtomicU64::new(0),
            hits: AtomicU64::new(0),
            digest: Mutex::new(None),
        };
        Self {
            inner: Arc::new(inner),
        }
    }

    pub fn layout(&self) -> KvLayout {
        self.inner.layout
    }

    pub fn config(&self) -> KvConfig {
        self.inner.cfg
    }

    /// An empty sequence that holds no block yet.
    pub fn sequence(&self) -> SeqKv {
        SeqKv::new(self.inner.clone())
    }

    /// A sequence with blocks for `capacity` tokens, or
    /// [`KvError::Exhausted`] when the pool cannot cover them.
    pub fn allocate(&self, capacity: usize) -> Result<SeqKv, KvError> {
        let mut s = self.sequence();
        s.reserve_to(capacity)?;
        Ok(s)
    }

    /// Leading tokens of `tokens` a new sequence would find in the prefix
    /// cache now (whole blocks, at most all but the last token).
    pub fn cached_prefix(&self, tokens: &[u32]) -> usize {
        let b = self.inner.cfg.block_tokens;
        let blocks = self.inner.blocks();
        let mut parent = 0;
        let mut n = 0;
        for chunk in tokens[..tokens.len().saturating_sub(1)].chunks_exact(b) {
            let hash = self.inner.hash(parent, chunk);
            if !blocks.contains(hash, parent, chunk) {
                break;
            }
            (parent, n) = (hash, n + b);
        }
        n
    }

    pub fn usage(&self) -> KvUsage {
        let b = self.inner.cfg.block_tokens;
        let blocks = self.inner.blocks().counts();
        KvUsage {
            reserved_tokens: blocks.used * b,
            stored_tokens: self.inner.stored.load(Ordering::Relaxed),
            budget_tokens: self.inner.n_blocks * b,
            sequences: self.inner.sequences.load(Ordering::Relaxed),
            block_tokens: b,
            blocks,
        }
    }

    /// What the prefix cache holds, for KV-aware routing; `None` when the
    /// cache is off. Rebuilt only when the cached blocks changed.
    pub fn prefix_digest(&self) -> Option<PrefixDigest> {
        if !self.inner.cfg.prefix_cache {
            return None;
        }
        let mut last = self.inner.digest.lock().unwrap_or_else(|p| p.into_inner());
        let (version, hashes) = {
            let blocks = self.inner.blocks();
            match &*last {
                Some((v, d)) if *v == blocks.version => return Some(d.clone()),
                _ => (blocks.version, blocks.cached_hashes()),
            }
        };
        let cfg = self.inner.cfg;
        let digest = PrefixDigest::new(cfg.block_tokens as u32, cfg.fingerprint, hashes);
        *last = Some((version, digest.clone()));
        Some(digest)
    }

    /// The pool's state as the worker layer reports it.
    pub fn report(&self) -> KvReport {
        let (u, p) = (self.usage(), self.prefix_stats());
        KvReport {
            used_tokens: u.reserved_tokens as u64,
            capacity_tokens: u.budget_tokens as u64,
            blocks_used: u.blocks.used as u64,
            blocks_cached: u.blocks.cached as u64,
            blocks_free: u.blocks.free as u64,
            prefix_queried_tokens: p.queried_tokens,
            prefix_hit_tokens: p.hit_tokens,
            evictions: p.evictions,
        }
    }

    pub fn prefix_stats(&self) -> PrefixStats {
        PrefixStats {
            queried_tokens: self.inner.queried.load(Ordering::Relaxed),
            hit_tokens: self.inner.hits.load(Ordering::Relaxed),
            evictions: self.inner.blocks().evictions,
        }
    }
}

#[cfg(test)]
mod tests;
