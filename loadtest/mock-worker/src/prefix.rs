//! A simulated prefix cache: the block hashes a real worker would hold,
//! without the KV. Lookups take whole leading blocks (never the last prompt
//! token, as the real cache), inserts add a prompt's full blocks, and the
//! least recently used blocks go once more are held than the budget has
//! room for. It reports the same digest and counters as the real cache, so
//! KV-aware routing and the cache's metrics can be exercised on mocks.
//!
//! Simplification: a prompt's blocks count as cached from the moment its
//! KV is taken (the real cache registers them as the forward pass writes
//! them), and generated tokens are not cached.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Mutex, MutexGuard};

use pdserve_protocol::hash::Prehashed;
use pdserve_protocol::internal::KvReport;
use pdserve_protocol::prefix::{block_hashes, PrefixDigest};
use pdserve_worker::kv::KvArgs;

#[derive(Debug, Default)]
struct Inner {
    /// Block hash → its stamp in `lru`.
    stamps: HashMap<u64, u64, Prehashed>,
    /// Stamp → block hash, oldest first.
    lru: BTreeMap<u64, u64>,
    clock: u64,
    queried: u64,
    hits: u64,
    evictions: u64,
    /// The last digest built, with the `clock` it describes.
    digest: Option<(u64, PrefixDigest)>,
}

impl Inner {
    fn touch(&mut self, hash: u64) {
        if let Some(old) = self.stamps.get(&hash) {
            self.lru.remove(old);
        }
        self.clock += 1;
        self.stamps.insert(hash, self.clock);
        self.lru.insert(self.clock, hash);
    }
}

/// A mock worker's prefix cache.
#[derive(Debug)]
pub struct PrefixCache {
    on: bool,
    block_tokens: usize,
    seed: u64,
    capacity_blocks: usize,
    inner: Mutex<Inner>,
}

impl PrefixCache {
    /// A cache per `kv`'s flags holding up to `capacity_tokens`; `seed` is
    /// the model fingerprint the block hashes use.
    pub fn new(kv: &KvArgs, capacity_tokens: usize, seed: u64) -> Self {
        let block_tokens = kv.kv_block_tokens.max(1);
        Self {
            on: kv.prefix_cache.is_on(),
            block_tokens,
            seed,
            capacity_blocks: capacity_tokens / block_tokens,
            inner: Mutex::default(),
        }
    }

    /// Tokens the cache holds at most.
    pub fn capacity_tokens(&self) -> usize {
        self.capacity_blocks * self.block_tokens
    }

    fn inner(&self) -> MutexGuard<'_, Inner> {
        // Every operation leaves the maps consistent.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Leading tokens of `prompt` the cache holds (whole blocks, at most
    /// all but the last token), marked used; counted as a query and a hit.
    pub fn lookup(&self, prompt: &[u32]) -> usize {
        let usable = &prompt[..prompt.len().saturating_sub(1)];
        let hashes = match self.on {
            true => block_hashes(usable, self.block_tokens, self.seed),
            false => Vec::new(),
        };
        self.lookup_hashed(prompt.len(), &hashes)
    }

    /// [`Self::lookup`] of a prompt of `len` tokens whose full blocks hash
    /// to `hashes` (more than the usable ones may be given): for a caller
    /// that hashes each prompt once.
    pub fn lookup_hashed(&self, len: usize, hashes: &[u64]) -> usize {
        if !self.on {
            return 0;
        }
        let usable = len.saturating_sub(1) / self.block_tokens;
        let mut inner = self.inner();
        let mut found = 0;
        for &h in hashes.iter().take(usable) {
            if !inner.stamps.contains_key(&h) {
                break;
            }
            inner.touch(h);
            found += 1;
        }
        let hit = found * self.block_tokens;
        inner.queried += len as u64;
        inner.hits += hit as u64;
        hit
    }

    /// Adds the full blocks of `tokens`, evicting the least recently used
    /// beyond the capacity.
    pub fn insert(&self, tokens: &[u32]) {
        self.insert_with(tokens, |_, _| {});
    }

    /// [`Self::insert`], telling `changed` of each block hash that enters
    /// (`true`) or leaves (`false`) the cache: the store and evict events a
    /// simulated router follows instead of re-reading the whole digest.
    pub fn insert_with(&self, tokens: &[u32], changed: impl FnMut(u64, bool)) {
        if self.on {
            self.insert_hashed(&block_hashes(tokens, self.block_tokens, self.seed), changed);
        }
    }

    /// [`Self::insert_with`] of the blocks hashed `hashes`.
    pub fn insert_hashed(&self, hashes: &[u64], mut changed: impl FnMut(u64, bool)) {
        if !self.on {
            return;
        }
        let mut inner = self.inner();
        for &h in hashes {
            if !inner.stamps.contains_key(&h) {
                changed(h, true);
            }
            inner.touch(h);
        }
        while inner.stamps.len() > self.capacity_blocks {
            let Some((_, h)) = inner.lru.pop_first() else {
                break;
            };
            inner.stamps.remove(&h);
            inner.evictions += 1;
            changed(h, false);
        }
    }

    /// What the cache holds, newest first; `None` when it is off.
    pub fn digest(&self) -> Option<PrefixDigest> {
        if !self.on {
            return None;
        }
        let mut inner = self.inner();
        if let Some((clock, d)) = &inner.digest {
            if *clock == inner.clock {
                return Some(d.clone());
            }
        }
        let hashes: Vec<u64> = inner.lru.values().rev().copied().collect();
        let d = PrefixDigest::new(self.block_tokens as u32, self.seed, hashes);
        inner.digest = Some((inner.clock, d.clone()));
        Some(d)
    }

    /// The cache's counters in a KV report (the caller fills in the budget).
    pub fn report(&self, used_tokens: u64, capacity_tokens: u64) -> KvReport {
        let inner = self.inner();
        let b = self.block_tokens as u64;
        let cached = inner.stamps.len() as u64;
        KvReport {
            used_tokens,
            capacity_tokens,
            blocks_used: used_tokens.div_ceil(b),
            blocks_cached: cached,
            blocks_free: (capacity_tokens / b).saturating_sub(used_tokens.div_ceil(b) + cached),
            prefix_queried_tokens: inner.queried,
            prefix_hit_tokens: inner.hits,
            evictions: inner.evictions,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pdserve_worker::kv::Switch;

    fn cache(capacity_tokens: usize, on: Switch) -> PrefixCache {
        let kv = KvArgs {
            kv_block_tokens: 4,
            prefix_cache: on,
            kv_cache_dtype: pdserve_protocol::kvwire::KvDtype::F16,
        };
        PrefixCache::new(&kv, capacity_tokens, 9)
    }

    #[test]
    fn whole_leading_blocks_hit_and_the_last_token_never_does() {
        let c = cache(64, Switch::On);
        let p: Vec<u32> = (0..8).collect();
        assert_eq!(c.lookup(&p), 0);
        c.insert(&p);
        assert_eq!(c.lookup(&p), 4, "the last token is always computed");
        let longer: Vec<u32> = (0..13).collect();
        assert_eq!(c.lookup(&longer), 8);
        let set = c.digest().unwrap().parse().unwrap();
        assert_eq!(set.leading_blocks(&block_hashes(&longer, 4, 9)), 2);
        let r = c.report(0, 64);
        assert_eq!((r.prefix_queried_tokens, r.prefix_hit_tokens), (29, 12));
    }

    #[test]
    fn the_least_recently_used_blocks_go_first() {
        let c = cache(8, Switch::On);
        let a: Vec<u32> = (0..9).collect();
        let b: Vec<u32> = (100..109).collect();
        let mut events = Vec::new();
        c.insert_with(&a, |h, present| events.push((h, present)));
        c.insert_with(&b, |h, present| events.push((h, present)));
        assert_eq!(c.lookup(&a), 0, "a's blocks were evicted for b's");
        assert_eq!(c.lookup(&b), 8);
        assert_eq!(c.report(0, 8).evictions, 2);
        let (ha, hb) = (block_hashes(&a, 4, 9), block_hashes(&b, 4, 9));
        let stored = |h: &[u64]| h.iter().map(|&h| (h, true)).collect::<Vec<_>>();
        let evicted = ha.iter().map(|&h| (h, false));
        let want: Vec<_> = stored(&ha)
            .into_iter()
            .chain(stored(&hb))
            .chain(evicted)
            .collect();
        assert_eq!(events, want, "every store and every eviction, in order");
        c.insert_with(&b, |h, present| panic!("{h} {present}: nothing changed"));
    }

    #[test]
    fn off_means_no_hits_and_no_digest() {
        let c = cache(64, Switch::Off);
        c.insert(&[1, 2, 3, 4, 5]);
        assert_eq!(c.lookup(&[1, 2, 3, 4, 5]), 0);
        assert!(c.digest().is_none());
    }
}
