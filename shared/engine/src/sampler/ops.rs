//! Numeric kernels of the sampler: the counter-based RNG, the vectorized
//! log-sum-exp statistics, the inverse-CDF draws and the top-logprob
//! selection. Everything here works on plain slices and never allocates more
//! than the candidate set it needs.

use std::cmp::Ordering;

use super::{SamplingError, SamplingParams};
use crate::simd;

const GOLDEN_GAMMA: u64 = 0x9E37_79B9_7F4A_7C15;

/// SplitMix64 finaliser: a bijective, well-avalanching 64-bit mixer.
fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A uniform draw in `[0, 1)` that depends only on `(seed, position)`.
///
/// No state is carried between calls: any process sampling the same request
/// at the same absolute token position gets the same value.
pub fn uniform(seed: u64, position: u64) -> f64 {
    let key = mix64(seed.wrapping_add(GOLDEN_GAMMA));
    let counter = position.wrapping_add(1).wrapping_mul(GOLDEN_GAMMA);
    let bits = mix64(mix64(key.wrapping_add(counter)) ^ key);
    // 53 high-quality bits map exactly onto the f64 mantissa.
    (bits >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
}

/// Maps NaN and infinities to `-inf`, i.e. "never sample this token".
pub(super) fn clean(x: f32) -> f32 {
    if x.is_finite() {
        x
    } else {
        f32::NEG_INFINITY
    }
}

/// Descending by logit, ties to the lower token id.
pub(super) fn by_logit_desc(a: &Candidate, b: &Candidate) -> Ordering {
    b.logit.total_cmp(&a.logit).then(a.id.cmp(&b.id))
}

/// Statistics gathered in one pass over the (penalised) logits.
pub(super) struct LogitStats {
    /// Largest finite logit.
    pub(super) max: f32,
    /// Lowest index holding `max`.
    pub(super) argmax: usize,
    /// `sum(exp(l - max))` over finite logits.
    pub(super) sum: f64,
    /// `sum(exp((l - max) / T))` over finite logits (0 when greedy).
    pub(super) scaled_sum: f64,
}

impl LogitStats {
    /// Two vectorized passes: the maximum, then the sums of exponentials.
    /// `inv_temp` is `None` for greedy decoding, which needs no scaled sum.
    pub(super) fn compute(logits: &[f32], inv_temp: Option<f32>) -> Result<Self, SamplingError> {
        let max = logits
            .iter()
            .fold(f32::NEG_INFINITY, |m, &x| m.max(clean(x)));
        if max == f32::NEG_INFINITY {
            return Err(SamplingError::NoFiniteLogits { len: logits.len() });
        }
        let argmax = logits.iter().position(|&x| clean(x) == max).unwrap_or(0);
        let sum = exp_sum(logits, max, 1.0);
        // At T == 1 the scaled sum equals the plain one: skip its exps.
        let scaled_sum = match inv_temp {
            None => 0.0,
            Some(1.0) => sum,
            Some(inv_t) => exp_sum(logits, max, inv_t),
        };
        Ok(Self {
            max,
            argmax,
            sum,
            scaled_sum,
        })
    }

    /// `log(sum(exp(l)))` over finite logits.
    pub(super) fn log_norm(&self) -> f32 {
        self.max + self.sum.ln() as f32
    }
}

/// True when top-k, top-p or min-p can remove any token.
pub(super) fn needs_truncation(params: &SamplingParams, vocab: usize) -> bool {
    params.top_k.is_some_and(|k| k < vocab) || params.top_p < 1.0 || params.min_p > 0.0
}

/// `sum(exp((l - max) * inv_t))` over finite logits, in f32 chunks summed in f64.
fn exp_sum(logits: &[f32], max: f32, inv_t: f32) -> f64 {
    let mut buf = [0f32; CHUNK];
    logits
        .chunks(CHUNK)
        .map(|c| f64::from(chunk_weights(c, max, inv_t, &mut buf[..c.len()])))
        .sum()
}

/// Writes `exp((l - max) * inv_t)` (0 for non-finite logits) into `out`; returns their sum.
fn chunk_weights(logits: &[f32], max: f32, inv_t: f32, out: &mut [f32]) -> f32 {
    for (w, &x) in out.iter_mut().zip(logits) {
        *w = (clean(x) - max) * inv_t;
    }
    simd::exp_shifted(out, 0.0)
}

const CHUNK: usize = 256;

/// Inverse-CDF draw over the whole vocabulary in id order, no allocation.
pub(super) fn draw_full(logits: &[f32], stats: &LogitStats, inv_t: f32, u: f64) -> usize {
    let target = u * stats.scaled_sum;
    let mut acc = 0.0f64;
    let mut buf = [0f32; CHUNK];
    let mut last = stats.argmax;
    for (c, chunk) in logits.chunks(CHUNK).enumerate() {
        let w = &mut buf[..chunk.len()];
        let total = f64::from(chunk_weights(chunk, stats.max, inv_t, w));
        if acc + total <= target {
            acc += total;
            continue;
        }
        for (i, &wi) in w.iter().enumerate() {
            acc += f64::from(wi);
            if wi > 0.0 {
                last = c * CHUNK + i;
                if acc > target {
                    return last;
                }
            }
        }
    }
    // Only reachable through rounding: the mass ran out just short of `target`.
    last
}

/// A surviving token during truncated sampling.
#[derive(Debug, Clone, Copy)]
pub(super) struct Candidate {
    id: u32,
    logit: f32,
}

/// Maps a logit to its unnormalised temperature-scaled probability
/// `exp((logit - max) / T)`, which is 1.0 for the most likely token.
#[derive(Debug, Clone, Copy)]
pub(super) struct Scale {
    max: f32,
    inv_t: f32,
}

impl Scale {
    fn weight(self, logit: f32) -> f64 {
        f64::from(((logit - self.max) * self.inv_t).exp())
    }
}

/// Applies top-k, top-p and min-p, then draws by inverse CDF over the
/// survivors: in canonical (descending logit, ascending id) order when top-k
/// or top-p reordered them, otherwise in id order.
pub(super) fn draw_truncated(
    logits: &[f32],
    params: &SamplingParams,
    stats: &LogitStats,
    inv_t: f32,
    u: f64,
) -> usize {
    let scale = Scale {
        max: stats.max,
        inv_t,
    };
    // min_p as a logit floor: weight >= min_p  <=>  logit >= max + T * ln(min_p).
    let floor = match params.min_p {
        m if m > 0.0 => stats.max + m.ln() / inv_t,
        _ => f32::NEG_INFINITY,
    };
    let top_k = params.top_k.filter(|&k| k < logits.len());
    // Without top-k, min_p can already prune while collecting.
    let early_floor = if top_k.is_some() {
        f32::NEG_INFINITY
    } else {
        floor
    };
    let mut cands: Vec<Candidate> = logits
        .iter()
        .zip(0u32..)
        .map(|(&raw, id)| Candidate {
            id,
            logit: clean(raw),
        })
        .filter(|c| c.logit != f32::NEG_INFINITY && c.logit >= early_floor)
        .collect();
    // Mass of the top-k set (renormalised by top-k): the nucleus reference.
    let mut mass = stats.scaled_sum;
    let mut sorted = false;
    if let Some(k) = top_k.filter(|&k| k >= 1 && k < cands.len()) {
        cands.select_nth_unstable_by(k - 1, by_logit_desc);
        cands.truncate(k);
        mass = cands.iter().map(|c| scale.weight(c.logit)).sum();
        // select_nth leaves an unspecified order: make the draw canonical.
        cands.sort_unstable_by(by_logit_desc);
        sorted = true;
    }
    cands.retain(|c| c.logit >= floor);
    if params.top_p < 1.0 {
        let threshold = f64::from(params.top_p) * mass;
        let keep = nucleus_prefix(&mut cands, threshold, scale, sorted);
        cands.truncate(keep);
    }
    inverse_cdf(&cands, scale, u).unwrap_or(stats.argmax)
}

/// Orders just enough of `cands` (descending) to find the nucleus, the
/// shortest prefix whose mass reaches `threshold`, and returns its length
/// (at least 1 when `cands` is non-empty). The sorted window grows
/// geometrically, so a typical nucleus costs an O(V) selection and a small
/// sort rather than a sort of the whole vocabulary.
pub(super) fn nucleus_prefix(
    cands: &mut [Candidate],
    threshold: f64,
    scale: Scale,
    sorted: bool,
) -> usize {
    let mut window = 64usize;
    loop {
        if sorted || window >= cands.len() {
            if !sorted {
                cands.sort_unstable_by(by_logit_desc);
            }
            return nucleus_len(cands, threshold, scale).unwrap_or(cands.len());
        }
        cands.select_nth_unstable_by(window - 1, by_logit_desc);
        let head = &mut cands[..window];
        head.sort_unstable_by(by_logit_desc);
        if let Some(keep) = nucleus_len(head, threshold, scale) {
            return keep;
        }
        window = window.saturating_mul(8);
    }
}

/// Number of leading `sorted` tokens needed for their mass to reach
/// `threshold`, or `None` when the whole slice stays below it.
pub(super) fn nucleus_len(sorted: &[Candidate], threshold: f64, scale: Scale) -> Option<usize> {
    let mut cum = 0.0f64;
    for (i, c) in sorted.iter().enumerate() {
        cum += scale.weight(c.logit);
        if cum >= threshold {
            return Some(i + 1);
        }
    }
    None
}

/// Draws from `cands` (renormalised) with the uniform value `u`.
pub(super) fn inverse_cdf(cands: &[Candidate], scale: Scale, u: f64) -> Option<usize> {
    let total: f64 = cands.iter().map(|c| scale.weight(c.logit)).sum();
    let target = u * total;
    let mut acc = 0.0f64;
    for c in cands {
        acc += scale.weight(c.logit);
        if acc > target {
            return Some(c.id as usize);
        }
    }
    cands.last().map(|c| c.id as usize)
}

/// The `n` largest finite logits as `(id, log-softmax)`, sorted descending,
/// ties to the lower id, in one pass with a small sorted buffer.
pub(super) fn top_logprobs(logits: &[f32], n: usize, log_norm: f32) -> Vec<(u32, f32)> {
    if n == 0 {
        return Vec::new();
    }
    let mut best: Vec<(u32, f32)> = Vec::with_capacity(n + 1);
    for (i, &raw) in logits.iter().enumerate() {
        let x = clean(raw);
        if x == f32::NEG_INFINITY {
            continue;
        }
        let full = best.len() == n;
        // Ids arrive ascending, so an equal logit never beats a kept one.
        if full && best.last().is_some_and(|&(_, worst)| x <= worst) {
            continue;
        }
        let at = best.partition_point(|&(_, kept)| kept >= x);
        best.insert(at, (i as u32, x));
        best.truncate(n);
    }
    best.into_iter().map(|(id, x)| (id, x - log_norm)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const UNIT: Scale = Scale {
        max: 0.0,
        inv_t: 1.0,
    };

    fn cands(probs: &[f32]) -> Vec<Candidate> {
        probs
            .iter()
            .zip(0..)
            .map(|(p, id)| Candidate { id, logit: p.ln() })
            .collect()
    }

    #[test]
    fn uniform_is_deterministic_in_range_and_balanced() {
        assert_eq!(uniform(7, 11), uniform(7, 11));
        assert_ne!(uniform(7, 11), uniform(7, 12));
        assert_ne!(uniform(7, 11), uniform(8, 11));
        let n = 100_000u64;
        let mut buckets = [0u32; 10];
        for pos in 0..n {
            let u = uniform(42, pos);
            assert!((0.0..1.0).contains(&u));
            buckets[(u * 10.0) as usize] += 1;
        }
        assert!(
            buckets.iter().all(|&b| (9_500..10_500).contains(&b)),
            "{buckets:?}"
        );
    }

    #[test]
    fn stats_match_a_naive_log_sum_exp() {
        let logits = [0.5f32, f32::NAN, -3.0, 2.0, f32::NEG_INFINITY, 2.0];
        let stats = LogitStats::compute(&logits, Some(2.0)).expect("finite values present");
        assert_eq!((stats.max, stats.argmax), (2.0, 3));
        let finite = [0.5f64, -3.0, 2.0, 2.0];
        let lse = finite.iter().map(|x| x.exp()).sum::<f64>().ln();
        assert!((f64::from(stats.log_norm()) - lse).abs() < 1e-5);
        let scaled: f64 = finite.iter().map(|x| ((x - 2.0) * 2.0).exp()).sum();
        assert!((stats.scaled_sum - scaled).abs() < 1e-6);
    }

    #[test]
    fn nucleus_keeps_the_shortest_prefix_reaching_the_mass() {
        let sorted = cands(&[0.5, 0.3, 0.15, 0.05]);
        assert_eq!(nucleus_len(&sorted, 0.5 * 0.999, UNIT), Some(1));
        assert_eq!(nucleus_len(&sorted, 0.7, UNIT), Some(2));
        assert_eq!(nucleus_len(&sorted, 0.85, UNIT), Some(3));
        assert_eq!(nucleus_len(&sorted, 0.0, UNIT), Some(1));
        assert_eq!(nucleus_len(&sorted, 2.0, UNIT), None);
        assert_eq!(nucleus_len(&[], 0.5, UNIT), None);
    }

    #[test]
    fn nucleus_window_grows_until_the_mass_is_reached() {
        // 1000 equal tokens: a 0.9 nucleus needs 900 of them, past two windows.
        let mut flat = cands(&[1.0; 1000]);
        assert_eq!(nucleus_prefix(&mut flat, 900.0 - 0.5, UNIT, false), 900);
        let ids: Vec<u32> = flat[..900].iter().map(|c| c.id).collect();
        assert_eq!(
            ids,
            (0..900).collect::<Vec<u32>>(),
            "sorted prefix, ties by id"
        );
        let mut peaked = cands(&[0.01, 0.9, 0.05, 0.04]);
        assert_eq!(nucleus_prefix(&mut peaked, 0.5, UNIT, false), 1);
        assert_eq!(peaked[0].id, 1);
    }

    #[test]
    fn inverse_cdf_walks_the_cumulative_mass() {
        let two: Vec<Candidate> = [4, 9]
            .iter()
            .map(|&id| Candidate { id, logit: 0.0 })
            .collect();
        assert_eq!(inverse_cdf(&two, UNIT, 0.0), Some(4));
        assert_eq!(inverse_cdf(&two, UNIT, 0.49), Some(4));
        assert_eq!(inverse_cdf(&two, UNIT, 0.51), Some(9));
        assert_eq!(inverse_cdf(&[], UNIT, 0.5), None);
    }

    #[test]
    fn top_logprobs_selects_in_one_pass() {
        let logits = [1.0f32, 3.0, 2.0, 3.0, f32::NAN, 0.0];
        let ids: Vec<u32> = top_logprobs(&logits, 3, 0.0).iter().map(|e| e.0).collect();
        assert_eq!(ids, vec![1, 3, 2]);
        assert!(top_logprobs(&logits, 0, 0.0).is_empty());
        assert_eq!(top_logprobs(&logits, 9, 1.0).len(), 5);
        assert_eq!(top_logprobs(&logits, 1, 1.0), vec![(1, 2.0)]);
    }
}
