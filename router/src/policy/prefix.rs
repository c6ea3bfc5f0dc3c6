//! The default for both pools: KV-aware. Each worker is scored by the
//! prompt blocks it would have to compute (those its prefix cache lacks,
//! from the digest in its load report) plus the blocks of work it already
//! has, `weight · uncached_blocks + active_blocks`, and the lowest score
//! wins. Active blocks are pending prompt tokens on a prefill worker and
//! held KV on a decode worker, counting work sent since its last report.
//!
//! A guard keeps one hot prefix from piling everything on the worker that
//! caches it: when the pool's loads differ by more than `balance_abs_tokens`
//! and by a factor of more than `balance_rel`, the least-loaded worker wins.
//! A decode worker must also have room for the reservation, as in
//! [`super::least_kv`].

use pdserve_protocol::internal::Pool;
use pdserve_protocol::prefix::block_hashes;

use super::{cost, Policy, RequestInfo};
use crate::registry::WorkerView;

/// Tuning of [`PrefixAware`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PrefixTuning {
    /// Weight of a prompt block to compute against a block of queued work.
    pub weight: f64,
    /// Load difference, in tokens, above which the guard may apply.
    pub balance_abs_tokens: u64,
    /// Load ratio (most over least loaded) above which the guard may apply.
    pub balance_rel: f64,
}

impl Default for PrefixTuning {
    fn default() -> Self {
        Self {
            weight: 1.0,
            balance_abs_tokens: 8192,
            balance_rel: 2.0,
        }
    }
}

pub struct PrefixAware {
    pool: Pool,
    tuning: PrefixTuning,
}

impl PrefixAware {
    pub fn new(pool: Pool, tuning: PrefixTuning) -> Self {
        Self { pool, tuning }
    }

    /// Whether loads from `min` to `max` are so uneven that balancing
    /// beats cache affinity.
    fn imbalanced(&self, min: u64, max: u64) -> bool {
        max.saturating_sub(min) > self.tuning.balance_abs_tokens
            && max as f64 > min as f64 * self.tuning.balance_rel
    }
}

fn free_kv(w: &WorkerView) -> u64 {
    w.load.kv_free_tokens.saturating_sub(w.assigned_tokens)
}

/// Leading prompt tokens `w`'s prefix cache holds, by its last digest (the
/// last prompt token is always computed).
pub fn cached_tokens(w: &WorkerView, prompt: &[u32]) -> u64 {
    PromptBlocks::new(prompt).cached_tokens(w)
}

/// A prompt's block hashes, computed once per block size and seed however
/// many workers it is matched against (workers of one model share both).
struct PromptBlocks<'a> {
    prompt: &'a [u32],
    hashes: Vec<((u32, u64), Vec<u64>)>,
}

impl<'a> PromptBlocks<'a> {
    fn new(prompt: &'a [u32]) -> Self {
        Self {
            prompt,
            hashes: Vec::new(),
        }
    }

    fn cached_tokens(&mut self, w: &WorkerView) -> u64 {
        let Some(set) = &w.prefix else { return 0 };
        let key = (set.block_tokens, set.seed);
        let i = match self.hashes.iter().position(|(k, _)| *k == key) {
            Some(i) => i,
            None => {
                let usable = &self.prompt[..self.prompt.len().saturating_sub(1)];
                let h = block_hashes(usable, set.block_tokens as usize, set.seed);
                self.hashes.push((key, h));
                self.hashes.len() - 1
            }
        };
        (set.leading_blocks(&self.hashes[i].1) * set.block_tokens as usize) as u64
    }
}

impl Policy for PrefixAware {
    fn name(&self) -> &'static str {
        "prefix"
    }

    /// Two passes over the workers and no allocation: this runs for every
    /// request, over pools of up to thousands of workers.
    fn select(&self, workers: &[WorkerView], req: &RequestInfo) -> Option<usize> {
        // Workers that may take the request: for decode, those with room
        // for the reservation (all of them when none has).
        let fits = |w: &WorkerView| self.pool == Pool::Prefill || free_kv(w) >= req.reserve_tokens;
        let any_fits = workers.iter().any(fits);
        let eligible = move || (0..workers.len()).filter(move |&i| !any_fits || fits(&workers[i]));
        let load = |i: usize| cost(self.pool, &workers[i]);
        let (mut min, mut max) = (u64::MAX, 0);
        for c in eligible().map(load) {
            (min, max) = (min.min(c), max.max(c));
        }
        if req.prompt.is_empty() || self.imbalanced(min, max) {
            return eligible().min_by_key(|&i| (load(i), workers[i].load.active_sequences));
        }
        let prompt = req.prompt.len() as u64;
        let mut blocks = PromptBlocks::new(req.prompt);
        let mut best: Option<((f64, u64), usize)> = None;
        for i in eligible() {
            let w = &workers[i];
            let block = w.prefix.as_ref().map_or(16, |s| s.block_tokens.max(1)) as f64;
            let cached = match req.known_cached {
                Some(known) => known.get(i).copied().unwrap_or(0).min(prompt),
                None => blocks.cached_tokens(w),
            };
            let uncached = (prompt - cached) as f64 / block;
            let score = self.tuning.weight * uncached.ceil() + load(i) as f64 / block;
            let key = (score, w.load.active_sequences);
            // The first of equal keys wins (as `min_by` would choose).
            if best.is_none_or(|(b, _)| key.partial_cmp(&b) == Some(std::cmp::Ordering::Less)) {
                best = Some((key, i));
            }
        }
        best.map(|(_, i)| i)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use pdserve_protocol::prefix::PrefixDigest;

    use super::*;
    use crate::policy::worker;

    /// A worker whose cache holds the first `blocks` blocks of `prompt`.
    fn holding(url: &str, prompt: &[u32], blocks: usize, queued: u64) -> WorkerView {
        let mut w = worker(url, queued, queued, 100_000);
        let hashes = block_hashes(prompt, 16, 5);
        let d = PrefixDigest::new(16, 5, hashes.into_iter().take(blocks));
        w.prefix = Some(Arc::new(d.parse().unwrap()));
        w
    }

    fn info(prompt: &[u32]) -> RequestInfo<'_> {
        RequestInfo {
            prompt_tokens: prompt.len() as u64,
            reserve_tokens: prompt.len() as u64 + 32,
            prompt,
            known_cached: None,
        }
    }

    #[test]
    fn the_worker_holding_the_prefix_wins_unless_it_is_much_busier() {
        let prompt: Vec<u32> = (0..1000).collect();
        let p = PrefixAware::new(Pool::Prefill, PrefixTuning::default());
        let ws = vec![holding("a", &prompt, 0, 0), holding("b", &prompt, 60, 0)];
        assert_eq!(p.select(&ws, &info(&prompt)), Some(1));
        assert_eq!(cached_tokens(&ws[1], &prompt), 960);
        // b saves 60 blocks; 900 queued tokens (57 blocks) do not outweigh them...
        let ws = vec![holding("a", &prompt, 0, 0), holding("b", &prompt, 60, 900)];
        assert_eq!(p.select(&ws, &info(&prompt)), Some(1));
        // ...1100 (69 blocks) do.
        let ws = vec![holding("a", &prompt, 0, 0), holding("b", &prompt, 60, 1100)];
        assert_eq!(p.select(&ws, &info(&prompt)), Some(0));
    }

    #[test]
    fn known_cached_tokens_choose_as_the_digests_would() {
        let prompt: Vec<u32> = (0..1000).collect();
        let p = PrefixAware::new(Pool::Prefill, PrefixTuning::default());
        for (b_blocks, b_queued) in [(60, 900), (60, 1100), (10, 0), (0, 0)] {
            let ws = vec![
                holding("a", &prompt, 0, 0),
                holding("b", &prompt, b_blocks, b_queued),
                holding("c", &prompt, b_blocks / 2, 0),
            ];
            let known: Vec<u64> = ws.iter().map(|w| cached_tokens(w, &prompt)).collect();
            let given = RequestInfo {
                known_cached: Some(&known),
                ..info(&prompt)
            };
            let case = format!("b holds {b_blocks} blocks, {b_queued} queued");
            assert_eq!(
                p.select(&ws, &given),
                p.select(&ws, &info(&prompt)),
                "{case}"
            );
        }
        // What is given is what counts: no digest, but b is said to hold 960.
        let ws = vec![worker("a", 0, 0, 100_000), worker("b", 0, 0, 100_000)];
        let given = RequestInfo {
            known_cached: Some(&[0, 960]),
            ..info(&prompt)
        };
        assert_eq!(p.select(&ws, &given), Some(1));
        assert_eq!(p.select(&ws, &info(&prompt)), Some(0));
    }

    #[test]
    fn a_saturated_pool_falls_back_to_least_load() {
        let prompt: Vec<u32> = (0..1000).collect();
        let tuning = PrefixTuning {
            weight: 1000.0,
            ..PrefixTuning::default()
        };
        let p = PrefixAware::new(Pool::Prefill, tuning);
        let ws = vec![
            holding("a", &prompt, 0, 100),
            holding("b", &prompt, 60, 5000),
        ];
        assert_eq!(
            p.select(&ws, &info(&prompt)),
            Some(1),
            "affinity within the guard"
        );
        let ws = vec![
            holding("a", &prompt, 0, 100),
            holding("b", &prompt, 60, 9000),
        ];
        assert_eq!(p.select(&ws, &info(&prompt)), Some(0), "the guard");
    }

    #[test]
    fn a_decode_worker_without_room_is_passed_over() {
        let prompt: Vec<u32> = (0..100).collect();
        let p = PrefixAware::new(Pool::Decode, PrefixTuning::default());
        let mut ws = vec![holding("a", &prompt, 0, 0), holding("b", &prompt, 6, 0)];
        ws[1].load.kv_free_tokens = 50;
        assert_eq!(p.select(&ws, &info(&prompt)), Some(0));
        assert_eq!(p.select(&[], &info(&prompt)), None);
    }
}
