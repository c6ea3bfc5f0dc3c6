//! Hand-written kernels over raw slices: rotary embeddings and causal attention
//! against the external KV cache. Attention runs one task per (token row, KV
//! head), so all query heads that share a KV head read each K/V row once, and
//! sequences of different lengths batch without padding.

use crate::kv::KvElem;
use crate::simd;
use crate::threads::{for_ranges, for_rows, Disjoint};

#[cfg(target_arch = "x86_64")]
mod x86;

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
/// (each slice holds `block_tokens` rows, the last one possibly fewer), in
/// the KV store's element type `T`.
pub(crate) struct SeqView<'a, T> {
    pub k: Vec<&'a [T]>,
    pub v: Vec<&'a [T]>,
    pub block_tokens: usize,
}

/// Causal attention. `q` is `[rows, n_heads * head_dim]`; row `r` belongs to
/// sequence `row_seq[r].0` at absolute position `row_seq[r].1` and attends to
/// that sequence's KV rows `0..=pos`. Writes `[rows, n_heads * head_dim]` into `out`.
///
/// Work items are (row, KV head) pairs, shared out on candle's own thread
/// pool: the same threads that run the quantized matmuls, so the two never
/// compete for cores. K and V are read as stored (f32 or f16) and widened
/// to f32 exactly, so the result is the f32 computation over those values.
pub(crate) fn attention<T: KvElem>(
    q: &[f32],
    seqs: &[SeqView<'_, T>],
    row_seq: &[(usize, usize)],
    heads: Heads,
    out: &mut [f32],
) {
    let width = heads.group() * heads.head_dim;
    assert_eq!(
        out.len(),
        row_seq.len() * heads.n_kv_heads * width,
        "attention output has the wrong size"
    );
    let tiles = row_tiles(row_seq, tiled(heads));
    let items = tiles.len() * heads.n_kv_heads;
    let out = Disjoint::new(out);
    for_ranges(items, 1, |range| {
        let mut scratch = Scratch::default();
        for item in range {
            // The longest contexts first, so the last items handed out are
            // the short ones and the threads finish together.
            let item = items - 1 - item;
            let (rows, kvh) = (
                tiles[item / heads.n_kv_heads].clone(),
                item % heads.n_kv_heads,
            );
            // SAFETY: each (row, KV head) chunk of `out` belongs to exactly one
            // item, items are distinct, and `out` outlives this call (the pool
            // call returns only after every worker is done).
            let chunk = |row: usize| unsafe { out.rows(row * heads.n_kv_heads + kvh, width) };
            match rows.len() {
                1 => attend_one(
                    q,
                    seqs,
                    row_seq,
                    heads,
                    rows.start,
                    kvh,
                    &mut scratch,
                    chunk(rows.start),
                ),
                _ => attend_tile(q, seqs, row_seq, heads, rows, kvh, &mut scratch, chunk),
            }
        }
    });
}

/// Rows of one sequence, at consecutive positions, that share a tile.
const TILE_ROWS: usize = 16;

/// Whether rows of a sequence share their widened K and V ([`attend_tile`]).
fn tiled(heads: Heads) -> bool {
    #[cfg(target_arch = "x86_64")]
    if simd::avx2_fma() && heads.head_dim.is_multiple_of(8) {
        return true;
    }
    false
}

/// Cuts the rows into tiles: runs of at most [`TILE_ROWS`] consecutive rows
/// of one sequence at consecutive positions (a prefill chunk's rows), or
/// single rows when `tiled` is false.
fn row_tiles(row_seq: &[(usize, usize)], tiled: bool) -> Vec<std::ops::Range<usize>> {
    let mut tiles: Vec<std::ops::Range<usize>> = Vec::new();
    for (r, &(seq, pos)) in row_seq.iter().enumerate() {
        match tiles.last_mut() {
            Some(t)
                if tiled && t.len() < TILE_ROWS && row_seq[r - 1] == (seq, pos.wrapping_sub(1)) =>
            {
                t.end = r + 1
            }
            _ => tiles.push(r..r + 1),
        }
    }
    tiles
}

/// A worker's buffers, reused across its items.
#[derive(Default)]
struct Scratch {
    scores: Vec<f32>,
    /// One head's K or V row, widened (portable path).
    row: Vec<f32>,
    /// A tile's K and V of one head, widened, `head_dim` per token.
    k: Vec<f32>,
    v: Vec<f32>,
}

/// The query heads of one KV head for the rows of a tile: the sequence's K
/// and V of that head are widened to f32 once for all of them, then each
/// row is attended as [`attend_one`] would (the same values, the same
/// operations in the same order: the same bits).
#[allow(clippy::too_many_arguments)]
fn attend_tile<'o, T: KvElem>(
    q: &[f32],
    seqs: &[SeqView<'_, T>],
    row_seq: &[(usize, usize)],
    heads: Heads,
    rows: std::ops::Range<usize>,
    kvh: usize,
    scratch: &mut Scratch,
    mut out: impl FnMut(usize) -> &'o mut [f32],
) {
    let hd = heads.head_dim;
    let kv_row = heads.n_kv_heads * hd;
    let (seq, last) = row_seq[rows.end - 1];
    let (view, ctx_max, b) = (&seqs[seq], last + 1, seqs[seq].block_tokens);
    scratch.k.resize(ctx_max * hd, 0.0);
    scratch.v.resize(ctx_max * hd, 0.0);
    for (src, dst) in [(&view.k, &mut scratch.k), (&view.v, &mut scratch.v)] {
        for (t, wide) in dst.chunks_exact_mut(hd).enumerate() {
            let row = &src[t / b][(t % b) * kv_row + kvh * hd..][..hd];
            T::widen(row, wide);
        }
    }
    let Scratch { scores, k, v, .. } = scratch;
    let wide = SeqView {
        k: vec![&k[..]],
        v: vec![&v[..]],
        block_tokens: ctx_max,
    };
    let at = HeadRows {
        stride: hd,
        offset: 0,
        hd,
    };
    for r in rows {
        attend_rows(q, &wide, at, row_seq[r].1, heads, r, kvh, scores, out(r));
    }
}

/// The query heads of one KV head for one row, against that sequence's KV.
#[allow(clippy::too_many_arguments)]
fn attend_one<T: KvElem>(
    q: &[f32],
    seqs: &[SeqView<'_, T>],
    row_seq: &[(usize, usize)],
    heads: Heads,
    row: usize,
    kvh: usize,
    scratch: &mut Scratch,
    out: &mut [f32],
) {
    let (seq, pos) = row_seq[row];
    let view = &seqs[seq];
    if tiled(heads) {
        let at = HeadRows {
            stride: heads.n_kv_heads * heads.head_dim,
            offset: kvh * heads.head_dim,
            hd: heads.head_dim,
        };
        return attend_rows(q, view, at, pos, heads, row, kvh, &mut scratch.scores, out);
    }
    let (hd, group) = (heads.head_dim, heads.group());
    let q0 = row * heads.n_heads * hd + kvh * group * hd;
    let Scratch {
        scores, row: wide, ..
    } = scratch;
    scores.clear();
    scores.resize(group * (pos + 1), 0.0);
    wide.resize(hd, 0.0);
    portable(&q[q0..q0 + group * hd], view, heads, kvh, scores, wide, out);
}

/// Where one KV head's rows lie: each block's slice, `stride` elements per
/// token, the head's `hd` values at `offset`.
#[derive(Clone, Copy)]
pub(super) struct HeadRows {
    pub stride: usize,
    pub offset: usize,
    pub hd: usize,
}

/// One row's query heads of KV head `kvh` against the head's rows `at` in
/// `view`, on the AVX2 kernels ([`tiled`] holds).
#[allow(clippy::too_many_arguments)]
fn attend_rows<T: KvElem>(
    q: &[f32],
    view: &SeqView<'_, T>,
    at: HeadRows,
    pos: usize,
    heads: Heads,
    row: usize,
    kvh: usize,
    scores: &mut Vec<f32>,
    out: &mut [f32],
) {
    let (hd, group) = (heads.head_dim, heads.group());
    let q0 = row * heads.n_heads * hd + kvh * group * hd;
    let q = &q[q0..q0 + group * hd];
    let ctx = pos + 1;
    let scale = 1.0 / (hd as f32).sqrt();
    scores.clear();
    scores.resize(group * ctx, 0.0);
    #[cfg(target_arch = "x86_64")]
    // SAFETY: AVX2, FMA and F16C are present and `hd` is a multiple of 8
    // (`tiled`), and the view's blocks hold the sequence's rows up to `pos`
    // in `at`'s layout (the KV cache's, or a tile's widened copy).
    unsafe {
        x86::scores(q, view, at, ctx, scale, scores);
        softmax_rows(scores, group, ctx);
        x86::values(scores, view, at, ctx, out);
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (view, at, q, scale, out);
        unreachable!("tiled() is false off x86");
    }
}

/// [`attend_one`] for any CPU and head width: one key at a time, each
/// widened to f32 first.
fn portable<T: KvElem>(
    q: &[f32],
    view: &SeqView<'_, T>,
    heads: Heads,
    kvh: usize,
    scores: &mut [f32],
    wide: &mut Vec<f32>,
    out: &mut [f32],
) {
    let (hd, group, b) = (heads.head_dim, heads.group(), view.block_tokens);
    let (kv_row, head) = (heads.n_kv_heads * hd, kvh * hd);
    let ctx = scores.len() / group;
    let scale = 1.0 / (hd as f32).sqrt();
    let each = |blocks: &[&[T]], wide: &mut Vec<f32>, f: &mut dyn FnMut(usize, &[f32])| {
        for (i, block) in blocks.iter().enumerate().take(ctx.div_ceil(b)) {
            for (j, r) in block.chunks_exact(kv_row).take(ctx - i * b).enumerate() {
                T::widen(&r[head..head + hd], wide);
                f(i * b + j, wide);
            }
        }
    };
    each(&view.k, wide, &mut |t, k| {
        for g in 0..group {
            scores[g * ctx + t] = simd::dot(&q[g * hd..(g + 1) * hd], k) * scale;
        }
    });
    softmax_rows(scores, group, ctx);
    out.fill(0.0);
    each(&view.v, wide, &mut |t, v| {
        for g in 0..group {
            simd::axpy(scores[g * ctx + t], v, &mut out[g * hd..(g + 1) * hd]);
        }
    });
}

/// Softmax of each of `group` rows of `ctx` scores, in place.
fn softmax_rows(scores: &mut [f32], group: usize, ctx: usize) {
    for s in scores.chunks_exact_mut(ctx).take(group) {
        let total = simd::exp_shifted(s, simd::max(s));
        s.iter_mut().for_each(|p| *p /= total);
    }
}

/// Rows at which the element-wise stages go to the pool: below it, waking
/// the other threads costs more than it saves.
pub(crate) const PARALLEL_ROWS: usize = 16;

/// RMS normalisation of each `dim`-wide row of `x`, scaled by `weight`.
pub(crate) fn rms_norm(x: &[f32], weight: &[f32], eps: f64) -> Vec<f32> {
    let dim = weight.len();
    let mut out = vec![0f32; x.len()];
    for_rows(&mut out, dim, PARALLEL_ROWS, |r, dst| {
        let src = &x[r * dim..(r + 1) * dim];
        let ms = simd::dot(src, src) / dim as f32;
        let inv = 1.0 / (ms + eps as f32).sqrt();
        for ((d, s), w) in dst.iter_mut().zip(src).zip(weight) {
            *d = s * inv * w;
        }
    });
    out
}

/// `silu(gate) * up` for rows laid out as `[gate(ffn) | up(ffn)]`.
pub(crate) fn swiglu(gate_up: &[f32], ffn: usize) -> Vec<f32> {
    let mut out = vec![0f32; gate_up.len() / 2];
    for_rows(&mut out, ffn, PARALLEL_ROWS, |r, dst| {
        let (gate, up) = gate_up[2 * r * ffn..2 * (r + 1) * ffn].split_at(ffn);
        for ((d, g), u) in dst.iter_mut().zip(gate).zip(up) {
            *d = g / (1.0 + simd::exp(-g)) * u;
        }
    });
    out
}

/// `x += y`, row by row (`dim` wide).
pub(crate) fn add_rows(x: &mut [f32], y: &[f32], dim: usize) {
    for_rows(x, dim, PARALLEL_ROWS, |r, row| {
        row.iter_mut()
            .zip(&y[r * dim..(r + 1) * dim])
            .for_each(|(a, b)| *a += b)
    });
}

#[cfg(test)]
mod tests;
