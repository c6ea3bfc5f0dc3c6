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

    /// Whether the loads are so uneven that balancing beats cache affinity.
    fn imbalanced(&self, loads: &[u64]) -> bool {
        let (Some(&min), Some(&max)) = (loads.iter().min(), loads.iter().max()) else {
            return false;
        };
        max - min > self.tuning.balance_abs_tokens
            && max as f64 > min as f64 * self.tuning.balance_rel
    }

    /// Workers that may take the request: for decode, those with room for
    /// the reservation (all of them when none has).
    fn eligible(&self, workers: &[WorkerView], req: &RequestInfo) -> Vec<usize> {
        let all = (0..workers.len()).collect();
        if self.pool == Pool::Prefill {
            return all;
        }
        let fits: Vec<usize> = (0..workers.len())
            .filter(|&i| free_kv(&workers[i]) >= req.reserve_tokens)
            .collect();
        match fits.is_empty() {
            true => all,
            false => fits,
        }
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

    fn select(&self, workers: &[WorkerView], req: &RequestInfo) -> Option<usize> {
        let eligible = self.eligible(workers, req);
        let loads: Vec<u64> = eligible
            .iter()
            .map(|&i| cost(self.pool, &workers[i]))
            .collect();
        let least_loaded = || {
            let k = (0..eligible.len())
                .min_by_key(|&k| (loads[k], workers[eligible[k]].load.active_sequences));
            k.map(|k| eligible[k])
        };
        if req.prompt.is_empty() || self.imbalanced(&loads) {
            return least_loaded();
        }
        let prompt = req.prompt.len() as u64;
        let mut blocks = PromptBlocks::new(req.prompt);
        let score = |k: usize| {
            let w = &workers[eligible[k]];
            let block = w.prefix.as_ref().map_or(16, |s| s.block_tokens.max(1)) as f64;
            let uncached = (prompt - blocks.cached_tokens(w)) as f64 / block;
            self.tuning.weight * uncached.ceil() + loads[k] as f64 / block
        };
        let scores: Vec<f64> = (0..eligible.len()).map(score).collect();
        (0..eligible.len())
            .min_by(|&a, &b| {
                let key = |k: usize| (scores[k], workers[eligible[k]].load.active_sequences);
                key(a)
                    .partial_cmp(&key(b))
                    .unwrap_or(std::cmp::Ordering::Equal)
            })
            .map(|k| eligible[k])
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
