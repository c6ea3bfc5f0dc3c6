//! What the simulated router sees of each pool, and the simulated workers'
//! prefix caches whose digests it reads.

use std::collections::HashMap;
use std::sync::Arc;

use pdserve_mock_worker::prefix::PrefixCache;
use pdserve_protocol::hash::Prehashed;
use pdserve_protocol::internal::LoadReport;
use pdserve_protocol::prefix::{block_hash, digest_key, PrefixSet};
use pdserve_router::policy::{Policy, RequestInfo};
use pdserve_router::registry::WorkerView;

use super::{ClusterCfg, Seq, SEED};

/// A worker's prefix cache, with the store and evict events its next
/// digest will carry to the router.
pub(super) struct Cache {
    blocks: PrefixCache,
    pub(super) pending: Vec<(u64, bool)>,
}

impl Cache {
    pub(super) fn new(cfg: &ClusterCfg) -> Self {
        Self {
            blocks: PrefixCache::new(&cfg.kv, cfg.kv_cache_tokens, SEED),
            pending: Vec::new(),
        }
    }

    pub(super) fn insert(&mut self, hashes: &[u64]) {
        let Self { blocks, pending } = self;
        blocks.insert_hashed(hashes, |h, present| pending.push((h, present)));
    }

    pub(super) fn lookup(&self, seq: &Seq) -> usize {
        self.blocks.lookup_hashed(seq.req.prompt.len(), &seq.hashes)
    }
}

/// What the router sees of one pool, and its policy. Workers a request has
/// already tried are moved to the end of `views` and left out of the next
/// choice, so a retry costs no copy of the pool.
pub(super) struct Placement {
    views: Vec<WorkerView>,
    worker_at: Vec<usize>,
    pos_of: Vec<usize>,
    policy: Box<dyn Policy>,
    /// Whether the policy reads digests (`prefix`, with the cache on).
    indexed: bool,
    block_tokens: usize,
    /// Digest key → the workers whose last digest lists it: the prefix
    /// policy is told each worker's cached tokens
    /// ([`RequestInfo::known_cached`]) at the cost of the workers holding
    /// the prompt's first block, not of the whole pool.
    index: HashMap<u32, Vec<usize>, Prehashed>,
    /// Leading prompt tokens each view holds, for the request being placed.
    known: Vec<u64>,
}

impl Placement {
    pub(super) fn new(
        pool: &str,
        n: usize,
        policy: Box<dyn Policy>,
        indexed: bool,
        block_tokens: usize,
    ) -> Self {
        Self {
            views: (0..n).map(|i| view(pool, i)).collect(),
            worker_at: (0..n).collect(),
            pos_of: (0..n).collect(),
            policy,
            indexed,
            block_tokens,
            index: HashMap::default(),
            known: vec![0; n],
        }
    }

    pub(super) fn view_mut(&mut self, w: usize) -> &mut WorkerView {
        &mut self.views[self.pos_of[w]]
    }

    /// Worker `w`'s digest reaches the router: its view and the index take
    /// the blocks stored and evicted since the last one.
    pub(super) fn report(&mut self, w: usize, changes: &[(u64, bool)]) {
        let block = self.block_tokens as u32;
        let view = &mut self.views[self.pos_of[w]];
        let set = view
            .prefix
            .get_or_insert_with(|| Arc::new(PrefixSet::from_hashes(block, SEED, [])));
        let set = Arc::make_mut(set);
        for &(h, present) in changes {
            if !set.update(h, present) {
                continue;
            }
            let key = digest_key(h);
            match present {
                true => self.index.entry(key).or_default().push(w),
                false => {
                    let holders = self.index.entry(key).or_default();
                    if let Some(i) = holders.iter().position(|&x| x == w) {
                        holders.swap_remove(i);
                    }
                    if holders.is_empty() {
                        self.index.remove(&key);
                    }
                }
            }
        }
    }

    /// Fills `known` for a prompt of `len` tokens whose full blocks hash to
    /// `hashes`, from the index: what the policy would find in each digest.
    pub(super) fn prepare(&mut self, len: usize, hashes: &[u64]) {
        if !self.indexed {
            return;
        }
        self.known.iter_mut().for_each(|k| *k = 0);
        let usable = &hashes[..(len.saturating_sub(1) / self.block_tokens).min(hashes.len())];
        let Some(first) = usable.first() else { return };
        for &w in self.index.get(&digest_key(*first)).into_iter().flatten() {
            let pos = self.pos_of[w];
            if let Some(set) = &self.views[pos].prefix {
                self.known[pos] = (set.leading_blocks(usable) * self.block_tokens) as u64;
            }
        }
    }

    /// The first of up to `attempts` choices, each among the workers not
    /// yet tried, that `takes`: the router's retries over a pool.
    pub(super) fn choose(
        &mut self,
        base: RequestInfo,
        attempts: usize,
        mut takes: impl FnMut(usize) -> bool,
    ) -> Option<usize> {
        (0..attempts.max(1))
            .map_while(|k| self.pick(base, k))
            .find(|&w| takes(w))
    }

    /// The policy's choice among all but the last `excluded` views; the
    /// chosen one joins the excluded.
    fn pick(&mut self, base: RequestInfo, excluded: usize) -> Option<usize> {
        let n = self.views.len().checked_sub(excluded).filter(|&n| n > 0)?;
        let info = RequestInfo {
            known_cached: self.indexed.then_some(&self.known[..n]),
            ..base
        };
        let pos = self.policy.select(&self.views[..n], &info)?;
        let w = self.worker_at[pos];
        let last = n - 1;
        self.views.swap(pos, last);
        self.worker_at.swap(pos, last);
        self.known.swap(pos, last);
        self.pos_of[self.worker_at[pos]] = pos;
        self.pos_of[self.worker_at[last]] = last;
        Some(w)
    }
}

pub(super) fn view(pool: &str, i: usize) -> WorkerView {
    WorkerView {
        url: format!("sim://{pool}/{i}"),
        load: LoadReport {
            ready: true,
            ..Default::default()
        },
        assigned_requests: 0,
        assigned_tokens: 0,
        assigned_prefill_tokens: 0,
        fingerprint: Some(SEED),
        prefix: None,
    }
}

/// Appends to `hashes` (those of the leading full blocks of `tokens`) the
/// chained hashes of the full blocks after them.
pub(super) fn extend_hashes(hashes: &mut Vec<u64>, tokens: &[u32], block_tokens: usize) {
    let mut parent = hashes.last().copied().unwrap_or(0);
    let done = hashes.len() * block_tokens;
    for chunk in tokens[done.min(tokens.len())..].chunks_exact(block_tokens) {
        parent = block_hash(parent, chunk, SEED);
        hashes.push(parent);
    }
}
