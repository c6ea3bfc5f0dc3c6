//! KV block bookkeeping, integers only: which blocks are free, who holds
//! each block (a reference count), and the prefix cache: full blocks keyed
//! by a chained hash of their tokens, kept after their last holder is gone
//! and evicted least recently used when memory runs out.

use std::collections::{BTreeMap, HashMap};

/// A block's index in the pool's storage.
pub(crate) type BlockId = u32;

/// What a cached block holds, to tell a true hit from a hash collision.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Content {
    hash: u64,
    parent: u64,
    tokens: Box<[u32]>,
}

#[derive(Debug, Clone, Default)]
struct Meta {
    refs: u32,
    /// Set once the block is full and in the prefix cache: it never changes again.
    cached: Option<Content>,
    /// When it last lost its last holder (its key in the LRU).
    stamp: u64,
}

/// The block pool's bookkeeping.
#[derive(Debug)]
pub(crate) struct Blocks {
    meta: Vec<Meta>,
    free: Vec<BlockId>,
    by_hash: HashMap<u64, BlockId>,
    /// Cached blocks nobody holds, oldest first: reclaimable.
    lru: BTreeMap<u64, BlockId>,
    clock: u64,
    prefix_cache: bool,
    pub evictions: u64,
    /// Bumped whenever the set of cached blocks changes.
    pub version: u64,
}

/// Blocks by state.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BlockCounts {
    /// Held by at least one sequence.
    pub used: usize,
    /// In the prefix cache and held by nobody: reclaimable.
    pub cached: usize,
    pub free: usize,
}

impl Blocks {
    pub fn new(n_blocks: usize, prefix_cache: bool) -> Self {
        Self {
            meta: vec![Meta::default(); n_blocks],
            // Popped from the end: the low blocks go first.
            free: (0..n_blocks as BlockId).rev().collect(),
            by_hash: HashMap::new(),
            lru: BTreeMap::new(),
            clock: 0,
            prefix_cache,
            evictions: 0,
            version: 0,
        }
    }

    pub fn counts(&self) -> BlockCounts {
        BlockCounts {
            used: self.meta.len() - self.free.len() - self.lru.len(),
            cached: self.lru.len(),
            free: self.free.len(),
        }
    }

    /// Blocks a new allocation can take (free, or reclaimable from the cache).
    pub fn available(&self) -> usize {
        self.free.len() + self.lru.len()
    }

    /// `n` blocks, all or none, evicting the least recently used cached
    /// blocks when no free one is left.
    pub fn allocate(&mut self, n: usize) -> Option<Vec<BlockId>> {
        if n > self.available() {
            return None;
        }
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            let b = match self.free.pop() {
                Some(b) => b,
                None => self.evict_oldest()?,
            };
            self.meta[b as usize].refs = 1;
            out.push(b);
        }
        Some(out)
    }

    fn evict_oldest(&mut self) -> Option<BlockId> {
        let (_, b) = self.lru.pop_first()?;
        if let Some(c) = self.meta[b as usize].cached.take() {
            self.by_hash.remove(&c.hash);
            self.version += 1;
        }
        self.evictions += 1;
        Some(b)
    }

    /// One more holder of `b`.
    fn retain(&mut self, b: BlockId) {
        let m = &mut self.meta[b as usize];
        if m.refs == 0 {
            self.lru.remove(&m.stamp);
        }
        m.refs += 1;
    }

    /// One holder fewer: a block nobody holds goes back to the free list,
    /// or, when it is cached, to the LRU of reclaimable blocks.
    pub fn release(&mut self, b: BlockId) {
        let m = &mut self.meta[b as usize];
        m.refs = m.refs.saturating_sub(1);
        if m.refs > 0 {
            return;
        }
        match m.cached.is_some() {
            true => {
                self.clock += 1;
                m.stamp = self.clock;
                self.lru.insert(self.clock, b);
            }
            false => self.free.push(b),
        }
    }

    /// Whether its one holder may write into `b` (nobody shares or caches it).
    pub fn is_exclusive(&self, b: BlockId) -> bool {
        let m = &self.meta[b as usize];
        m.refs == 1 && m.cached.is_none()
    }

    /// The cached block holding `tokens` after the block hashed `parent`,
    /// taken (one more holder); `None` on a miss.
    pub fn lookup(&mut self, hash: u64, parent: u64, tokens: &[u32]) -> Option<BlockId> {
        let b = *self.by_hash.get(&hash)?;
        let c = self.meta[b as usize].cached.as_ref()?;
        if c.parent != parent || *c.tokens != *tokens {
            return None;
        }
        self.retain(b);
        Some(b)
    }

    /// Whether a cached block holds `tokens` after the block hashed `parent`.
    pub fn contains(&self, hash: u64, parent: u64, tokens: &[u32]) -> bool {
        let Some(&b) = self.by_hash.get(&hash) else {
            return false;
        };
        let c = self.meta[b as usize].cached.as_ref();
        c.is_some_and(|c| c.parent == parent && *c.tokens == *tokens)
    }

    /// Enters the full block `b` into the prefix cache, unless the cache is
    /// off or an equal block is in it already. From now on `b` is read-only.
    pub fn register(&mut self, b: BlockId, hash: u64, parent: u64, tokens: &[u32]) {
        if !self.prefix_cache || self.by_hash.contains_key(&hash) {
            return;
        }
        self.meta[b as usize].cached = Some(Content {
            hash,
            parent,
            tokens: tokens.into(),
        });
        self.by_hash.insert(hash, b);
        self.version += 1;
    }

    /// The hashes of the cached blocks: those held by sequences first, then
    /// the reclaimable ones, most recently used first.
    pub fn cached_hashes(&self) -> Vec<u64> {
        let hash = |b: &BlockId| self.meta[*b as usize].cached.as_ref().map(|c| c.hash);
        let held = self
            .by_hash
            .values()
            .filter(|b| self.meta[**b as usize].refs > 0);
        held.filter_map(hash)
            .chain(self.lru.values().rev().filter_map(hash))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_are_taken_all_or_none_and_freed_on_release() {
        let mut b = Blocks::new(4, true);
        let got = b.allocate(3).unwrap();
        assert_eq!(got, vec![0, 1, 2]);
        assert!(b.allocate(2).is_none(), "all or none");
        assert_eq!(
            b.counts(),
            BlockCounts {
                used: 3,
                cached: 0,
                free: 1
            }
        );
        got.iter().for_each(|&x| b.release(x));
        assert_eq!(b.counts().free, 4);
    }

    #[test]
    fn cached_blocks_outlive_their_holders_until_evicted_oldest_first() {
        let mut b = Blocks::new(3, true);
        let blocks = b.allocate(3).unwrap();
        for (i, &x) in blocks.iter().enumerate() {
            b.register(x, 100 + i as u64, 0, &[i as u32]);
            assert!(!b.is_exclusive(x), "a cached block is read-only");
        }
        b.release(blocks[1]);
        b.release(blocks[0]);
        assert_eq!(
            b.counts(),
            BlockCounts {
                used: 1,
                cached: 2,
                free: 0
            }
        );
        // A hit takes the block back from the LRU.
        assert_eq!(b.lookup(100, 0, &[0]), Some(blocks[0]));
        assert_eq!(b.lookup(100, 0, &[9]), None, "the tokens must match");
        assert_eq!(b.lookup(100, 5, &[0]), None, "the parent must match");
        // Room for one: block 1 (the only unheld cached one) is evicted.
        assert_eq!(b.allocate(1), Some(vec![blocks[1]]));
        assert_eq!(b.evictions, 1);
        assert_eq!(b.lookup(101, 0, &[1]), None);
        // Held blocks first, then the reclaimable ones, newest first.
        b.release(blocks[0]);
        assert_eq!(b.cached_hashes(), vec![102, 100]);
    }

    #[test]
    fn with_the_cache_off_nothing_is_kept() {
        let mut b = Blocks::new(2, false);
        let x = b.allocate(1).unwrap()[0];
        b.register(x, 7, 0, &[1]);
        assert!(b.is_exclusive(x));
        b.release(x);
        assert_eq!(b.lookup(7, 0, &[1]), None);
        assert_eq!(b.counts().free, 2);
    }
}
