//! Hand-written kernels over raw slices: rotary embeddings and causal attention
//! against the external KV cache. Attention runs one rayon task per
//! (token row, KV head), so all query heads that share a KV head read each K/V
//! row once, and sequences of different lengths batch without padding.

use rayon::prelude::*;

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

/// One sequence's view for attention: its KV in this layer and where its rows sit.
pub(crate) struct SeqView<'a> {
    pub k: &'a [f32],
    pub v: &'a [f32],
}

/// Causal attention. `q` is `[rows, n_heads * head_dim]`; row `r` belongs to
/// sequence `row_seq[r].0` at absolute position `row_seq[r].1` and attends to
/// that sequence's KV rows `0..=pos`. Writes `[rows, n_heads * head_dim]` into `out`.
pub(crate) fn attention(
    q: &[f32],
    seqs: &[SeqView<'_>],
    row_seq: &[(usize, usize)],
    heads: Heads,
    out: &mut [f32],
) {
    let hd = heads.head_dim;
    let group = heads.group();
    let q_row = heads.n_heads * hd;
    let kv_row = heads.n_kv_heads * hd;
    let scale = 1.0 / (hd as f32).sqrt();
    out.par_chunks_mut(group * hd)
        .enumerate()
        .for_each_init(Vec::new, |scores, (item, out)| {
            let (row, kvh) = (item / heads.n_kv_heads, item % heads.n_kv_heads);
            let (seq, pos) = row_seq[row];
            let view = &seqs[seq];
            let q0 = row * q_row + kvh * group * hd;
            let q = &q[q0..q0 + group * hd];
            let ctx = pos + 1;
            scores.clear();
            scores.resize(group * ctx, 0.0);
            for t in 0..ctx {
                let k = &view.k[t * kv_row + kvh * hd..][..hd];
                for g in 0..group {
                    scores[g * ctx + t] = dot(&q[g * hd..(g + 1) * hd], k) * scale;
                }
            }
            out.fill(0.0);
            for g in 0..group {
                let s = &mut scores[g * ctx..(g + 1) * ctx];
                softmax_in_place(s);
                let o = &mut out[g * hd..(g + 1) * hd];
                for (t, p) in s.iter().enumerate() {
                    axpy(*p, &view.v[t * kv_row + kvh * hd..][..hd], o);
                }
            }
        });
}

/// Dot product with independent accumulators so it vectorizes.
#[inline]
pub(crate) fn dot(a: &[f32], b: &[f32]) -> f32 {
    const W: usize = 16;
    let mut acc = [0f32; W];
    let (ca, cb) = (a.chunks_exact(W), b.chunks_exact(W));
    let tail: f32 = ca
        .remainder()
        .iter()
        .zip(cb.remainder())
        .map(|(x, y)| x * y)
        .sum();
    for (x, y) in ca.zip(cb) {
        for i in 0..W {
            acc[i] += x[i] * y[i];
        }
    }
    acc.iter().sum::<f32>() + tail
}

/// `y += a * x`.
#[inline]
fn axpy(a: f32, x: &[f32], y: &mut [f32]) {
    for (yi, xi) in y.iter_mut().zip(x) {
        *yi += a * xi;
    }
}

fn softmax_in_place(s: &mut [f32]) {
    let max = s.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0.0;
    for x in s.iter_mut() {
        *x = (*x - max).exp();
        sum += *x;
    }
    let inv = 1.0 / sum;
    s.iter_mut().for_each(|x| *x *= inv);
}

/// RMS normalisation of each `dim`-wide row of `x`, scaled by `weight`.
pub(crate) fn rms_norm(x: &[f32], weight: &[f32], eps: f64) -> Vec<f32> {
    let dim = weight.len();
    let mut out = vec![0f32; x.len()];
    for (src, dst) in x.chunks_exact(dim).zip(out.chunks_exact_mut(dim)) {
        let ms = dot(src, src) / dim as f32;
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
            softmax_in_place(&mut s);
            for (t, p) in s.iter().enumerate() {
                let vt = &v[t * h.n_kv_heads * hd + kvh * hd..][..hd];
                for i in 0..hd {
                    out[head * hd + i] += p * vt[i];
                }
            }
        }
        out
    }

    fn values(n: usize, seed: u32) -> Vec<f32> {
        (0..n)
            .map(|i| ((i as u32).wrapping_mul(2654435761).wrapping_add(seed) % 1000) as f32 / 500.0 - 1.0)
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
        let vs: Vec<Vec<f32>> = lens.iter().map(|&n| values(n * kv_row, 99 + n as u32)).collect();
        // Rows: the last token of seq 0, the last three of seq 1, one of seq 2 at pos 1.
        let row_seq = vec![(0, 0), (1, 4), (1, 5), (1, 6), (2, 1)];
        let q = values(row_seq.len() * h.n_heads * h.head_dim, 7);
        let seqs: Vec<SeqView> = ks
            .iter()
            .zip(&vs)
            .map(|(k, v)| SeqView { k, v })
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

    #[test]
    fn dot_handles_tails() {
        let a = values(37, 1);
        let b = values(37, 2);
        let want: f32 = a.iter().zip(&b).map(|(x, y)| x * y).sum();
        assert!((dot(&a, &b) - want).abs() < 1e-4);
    }
}
