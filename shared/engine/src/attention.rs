//! Hand-written kernels over raw slices: rotary embeddings and causal attention
//! against the external KV cache. Attention runs one task per (token row, KV
//! head), so all query heads that share a KV head read each K/V row once, and
//! sequences of different lengths batch without padding.

use crate::simd;

/// Shape of the attention heads.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Heads {
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
}

impl Heads {
    fn group(&self) -> usize {
        self.n_heads / self.n_kv_heads
    }
}

/// Precomputed rotary tables, interleaved-pair convention (GGUF Llama).
#[derive(Debug)]
pub(crate) struct Rope {
    half: usize,
    max_pos: usize,
    cos: Vec<f32>,
    sin: Vec<f32>,
}

impl Rope {
    pub fn new(head_dim: usize, theta: f32, max_pos: usize) -> Self {
        let half = head_dim / 2;
        let inv_freq: Vec<f32> = (0..half)
            .map(|i| 1f32 / theta.powf((2 * i) as f32 / head_dim as f32))
            .collect();
        let mut cos = Vec::with_capacity(max_pos * half);
        let mut sin = Vec::with_capacity(max_pos * half);
        for p in 0..max_pos {
            for f in &inv_freq {
                let angle = p as f32 * f;
                cos.push(angle.cos());
                sin.push(angle.sin());
            }
        }
        Self {
            half,
            max_pos,
            cos,
            sin,
        }
    }

    pub fn max_pos(&self) -> usize {
        self.max_pos
    }

    /// Rotates every head of one row (`heads * head_dim` values) for position `pos`.
    pub fn apply(&self, row: &mut [f32], pos: usize) {
        let cos = &self.cos[pos * self.half..(pos + 1) * self.half];
        let sin = &self.sin[pos * self.half..(pos + 1) * self.half];
        for head in row.chunks_exact_mut(2 * self.half) {
            for (i, pair) in head.chunks_exact_mut(2).enumerate() {
                let (x0, x1) = (pair[0], pair[1]);
                pair[0] = x0 * cos[i] - x1 * sin[i];
                pair[1] = x0 * sin[i] + x1 * cos[i];
            }
        }
    }
}

/// One sequence's view for attention: its KV in this layer, block by block
/// (each slice holds `block_tokens` rows, the last one possibly fewer).
pub(crate) struct SeqView<'a> {
    pub k: Vec<&'a [f32]>,
    pub v: Vec<&'a [f32]>,
    pub block_tokens: usize,
}

/// Causal attention. `q` is `[rows, n_heads * head_dim]`; row `r` belongs to
/// sequence `row_seq[r].0` at absolute position `row_seq[r].1` and attends to
/// that sequence's KV rows `0..=pos`. Writes `[rows, n_heads * head_dim]` into `out`.
///
/// Work items are (row, KV head) pairs, shared out on candle's own thread
/// pool: the same threads that run the quantized matmuls, so the two never
/// compete for cores.
pub(crate) fn attention(
    q: &[f32],
    seqs: &[SeqView<'_>],
    row_seq: &[(usize, usize)],
    heads: Heads,
    out: &mut [f32],
) {
    let width = heads.group() * heads.head_dim;
    let items = row_seq.len() * heads.n_kv_heads;
    assert_eq!(
        out.len(),
        items * width,
        "attention output has the wrong size"
    );
    let out_ptr = SharedOut(out.as_mut_ptr());
    candle_core::utils::barrier_pool().execute_chunked(items, |range| {
        let mut scores = Vec::new();
        for item in range {
            // SAFETY: each item writes only its own `width`-wide chunk of `out`,
            // items are distinct, and `out` outlives this call (execute_chunked
            // returns only after every worker is done).
            let chunk = unsafe { std::slice::from_raw_parts_mut(out_ptr.at(item * width), width) };
            attend_one(q, seqs, row_seq, heads, item, &mut scores, chunk);
        }
    });
}

/// A pointer to the output that worker threads write disjoint chunks of.
#[derive(Clone, Copy)]
struct SharedOut(*mut f32);
// SAFETY: writers touch disjoint ranges (see `attention`).
unsafe impl Send for SharedOut {}
unsafe impl Sync for SharedOut {}

impl SharedOut {
    /// # Safety
    /// `offset` must be within the output the pointer was made from.
    unsafe fn at(self, offset: usize) -> *mut f32 {
        unsafe { self.0.add(offset) }
    }
}

/// The query heads of one KV head for one row, against that sequence's KV.
fn attend_one(
    q: &[f32],
    seqs: &[SeqView<'_>],
    row_seq: &[(usize, usize)],
    heads: Heads,
    item: usize,
    scores: &mut Vec<f32>,
    out: &mut [f32],
) {
    let (hd, group) = (heads.head_dim, heads.group());
    let kv_row = heads.n_kv_heads * hd;
    let (row, kvh) = (item / heads.n_kv_heads, item % heads.n_kv_heads);
    let (seq, pos) = row_seq[row];
    let view = &seqs[seq];
    let q0 = row * heads.n_heads * hd + kvh * group * hd;
    let q = &q[q0..q0 + group * hd];
    let ctx = pos + 1;
    let scale = 1.0 / (hd as f32).sqrt();
    let head = kvh * hd;
    scores.clear();
    scores.resize(group * ctx, 0.0);
    let b = view.block_tokens;
    for (i, block) in view.k.iter().enumerate().take(ctx.div_ceil(b)) {
        let t0 = i * b;
        for (j, k) in block.chunks_exact(kv_row).take(ctx - t0).enumerate() {
            let k = &k[head..head + hd];
            for g in 0..group {
                scores[g * ctx + t0 + j] = simd::dot(&q[g * hd..(g + 1) * hd], k) * scale;
            }
        }
    }
    for g in 0..group {
        let s = &mut scores[g * ctx..(g + 1) * ctx];
        let total = simd::exp_shifted(s, simd::max(s));
        s.iter_mut().for_each(|p| *p /= total);
    }
    out.fill(0.0);
    for (i, block) in view.v.iter().enumerate().take(ctx.div_ceil(b)) {
        let t0 = i * b;
        for (j, v) in block.chunks_exact(kv_row).take(ctx - t0).enumerate() {
            let v = &v[head..head + hd];
            for g in 0..group {
                simd::axpy(scores[g * ctx + t0 + j], v, &mut out[g * hd..(g + 1) * hd]);
            }
        }
    }
}

/// RMS normalisation of each `dim`-wide row of `x`, scaled by `weight`.
pub(crate) fn rms_norm(x: &[f32], weight: &[f32], eps: f64) -> Vec<f32> {
    let dim = weight.len();
    let mut out = vec![0f32; x.len()];
    for (src, dst) in x.chunks_exact(dim).zip(out.chunks_exact_mut(dim)) {
        let ms = simd::dot(src, src) / dim as f32;
        let inv = 1.0 / (ms + eps as f32).sqrt();
        for ((d, s), w) in dst.iter_mut().zip(src).zip(weight) {
            *d = s * inv * w;
        }
    }
    out
}

/// `silu(gate) * up` for rows laid out as `[gate(ffn) | up(ffn)]`.
pub(crate) fn swiglu(gate_up: &[f32], ffn: usize) -> Vec<f32> {
    let rows = gate_up.len() / (2 * ffn);
    let mut out = Vec::with_capacity(rows * ffn);
    for row in gate_up.chunks_exact(2 * ffn) {
        let (gate, up) = row.split_at(ffn);
        out.extend(gate.iter().zip(up).map(|(g, u)| g / (1.0 + (-g).exp()) * u));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Naive reference: per head, full softmax over 0..=pos.
    fn naive(q: &[f32], k: &[f32], v: &[f32], pos: usize, h: Heads) -> Vec<f32> {
        let hd = h.head_dim;
        let mut out = vec![0f32; h.n_heads * hd];
        for head in 0..h.n_heads {
            let kvh = head / h.group();
            let qh = &q[head * hd..(head + 1) * hd];
            let mut s: Vec<f32> = (0..=pos)
                .map(|t| {
                    let kt = &k[t * h.n_kv_heads * hd + kvh * hd..][..hd];
                    qh.iter().zip(kt).map(|(a, b)| a * b).sum::<f32>() / (hd as f32).sqrt()
                })
                .collect();
            let m = s.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let total: f32 = s
                .iter_mut()
                .map(|x| {
                    *x = (*x - m).exp();
                    *x
                })
                .sum();
            s.iter_mut().for_each(|x| *x /= total);
            for (t, p) in s.iter().enumerate() {
                let vt = &v[t * h.n_kv_heads * hd + kvh * hd..][..hd];
                for i in 0..hd {
                    out[head * hd + i] += p * vt[i];
                }
            }
        }
        out
    }

    /// Contiguous rows cut into blocks of `block_tokens`.
    fn paged<'a>(k: &'a [f32], v: &'a [f32], kv_row: usize, block_tokens: usize) -> SeqView<'a> {
        let cut = |x: &'a [f32]| x.chunks(block_tokens * kv_row).collect();
        SeqView {
            k: cut(k),
            v: cut(v),
            block_tokens,
        }
    }

    fn values(n: usize, seed: u32) -> Vec<f32> {
        (0..n)
            .map(|i| {
                ((i as u32).wrapping_mul(2654435761).wrapping_add(seed) % 1000) as f32 / 500.0 - 1.0
            })
            .collect()
    }

    #[test]
    fn batched_attention_matches_naive_per_sequence() {
        let h = Heads {
            n_heads: 6,
            n_kv_heads: 2,
            head_dim: 20,
        };
        let kv_row = h.n_kv_heads * h.head_dim;
        let lens = [1usize, 7, 3];
        let ks: Vec<Vec<f32>> = lens.iter().map(|&n| values(n * kv_row, n as u32)).collect();
        let vs: Vec<Vec<f32>> = lens
            .iter()
            .map(|&n| values(n * kv_row, 99 + n as u32))
            .collect();
        // Rows: the last token of seq 0, the last three of seq 1, one of seq 2 at pos 1.
        let row_seq = vec![(0, 0), (1, 4), (1, 5), (1, 6), (2, 1)];
        let q = values(row_seq.len() * h.n_heads * h.head_dim, 7);
        let seqs: Vec<SeqView> = ks
            .iter()
            .zip(&vs)
            .map(|(k, v)| paged(k, v, kv_row, 2))
            .collect();
        let mut out = vec![0f32; q.len()];
        attention(&q, &seqs, &row_seq, h, &mut out);
        let w = h.n_heads * h.head_dim;
        for (r, &(s, pos)) in row_seq.iter().enumerate() {
            let want = naive(&q[r * w..(r + 1) * w], &ks[s], &vs[s], pos, h);
            for (a, b) in out[r * w..(r + 1) * w].iter().zip(&want) {
                assert!((a - b).abs() < 1e-5, "row {r}: {a} vs {b}");
            }
        }
    }

    #[test]
    fn rope_at_zero_is_identity_and_preserves_norm() {
        let rope = Rope::new(8, 10_000.0, 16);
        let orig = values(16, 3);
        let mut x = orig.clone();
        rope.apply(&mut x, 0);
        assert_eq!(x, orig);
        rope.apply(&mut x, 9);
        assert_ne!(x, orig);
        let n0: f32 = orig.iter().map(|v| v * v).sum();
        let n1: f32 = x.iter().map(|v| v * v).sum();
        assert!((n0 - n1).abs() < 1e-4);
    }

    /// Kernel speed in isolation (`cargo test --release -p pdserve-engine --lib
    /// attention_decode_speed -- --ignored --nocapture`).
    #[test]
    #[ignore]
    fn attention_decode_speed() {
        let h = Heads {
            n_heads: 9,
            n_kv_heads: 3,
            head_dim: 64,
        };
        let (ctx, seqs) = (140, 16);
        let ks: Vec<Vec<f32>> = (0..seqs)
            .map(|i| values(ctx * h.n_kv_heads * h.head_dim, i as u32))
            .collect();
        let kv_row = h.n_kv_heads * h.head_dim;
        let views: Vec<SeqView> = ks.iter().map(|k| paged(k, k, kv_row, 16)).collect();
        let row_seq: Vec<(usize, usize)> = (0..seqs).map(|i| (i, ctx - 1)).collect();
        let q = values(seqs * h.n_heads * h.head_dim, 5);
        let mut out = vec![0f32; q.len()];
        let start = std::time::Instant::now();
        for _ in 0..300 {
            attention(&q, &views, &row_seq, h, &mut out);
        }
        eprintln!(
            "one layer, {seqs} sequences of {ctx}: {:?}",
            start.elapsed() / 300
        );
    }
}
