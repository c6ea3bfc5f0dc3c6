//! Activations quantized to 8 bits per block of 32 values, laid out by
//! [`position`]. One function quantizes for every kernel path.

use super::{position, scale_stride, QK};

/// `n` rows of quantized activations.
pub(crate) struct QAct {
    blocks: usize,
    /// `n × blocks × 32` quants, by [`position`].
    qs: Vec<i8>,
    /// `n × blocks × 4`: each block's scale, once per lane.
    sv: Vec<f32>,
    /// `scale × Σ quants` per block (used by 4-bit formats' minimums),
    /// padded with zeros as the weights' scales are.
    sx: Vec<f32>,
}

/// One row of [`QAct`], borrowed.
#[derive(Clone, Copy)]
pub(crate) struct ActRow<'a> {
    pub qs: &'a [i8],
    pub sv: &'a [f32],
    pub sx: &'a [f32],
}

impl QAct {
    /// Quantizes `x` (`[n, cols]`, `cols` a multiple of 64); many rows are
    /// shared out on candle's thread pool.
    pub fn quantize(x: &[f32], cols: usize) -> Self {
        let blocks = cols / QK;
        let n = x.len() / cols;
        let (sv_w, sx_w) = (4 * blocks, scale_stride(blocks));
        let mut act = Self {
            blocks,
            qs: vec![0i8; n * cols],
            sv: vec![0f32; n * sv_w],
            sx: vec![0f32; n * sx_w],
        };
        let (qs, sv, sx) = (
            Shared(act.qs.as_mut_ptr()),
            Shared(act.sv.as_mut_ptr()),
            Shared(act.sx.as_mut_ptr()),
        );
        let rows = |range: std::ops::Range<usize>| {
            for r in range {
                // SAFETY: row `r`'s slices are disjoint from every other row's,
                // and the vectors outlive the pool call.
                let (q, v, m) =
                    unsafe { (qs.slice(r, cols), sv.slice(r, sv_w), sx.slice(r, sx_w)) };
                quantize_row(&x[r * cols..(r + 1) * cols], q, v, m);
            }
        };
        match n < 8 {
            true => rows(0..n),
            false => candle_core::utils::barrier_pool().execute_chunked(n, rows),
        }
        act
    }

    #[inline(always)]
    pub fn row(&self, r: usize) -> ActRow<'_> {
        let (nb, stride) = (self.blocks, scale_stride(self.blocks));
        ActRow {
            qs: &self.qs[r * nb * QK..(r + 1) * nb * QK],
            sv: &self.sv[r * nb * 4..(r + 1) * nb * 4],
            sx: &self.sx[r * stride..(r + 1) * stride],
        }
    }
}

/// Quantizes one row into its quants, lane scales and block sums.
fn quantize_row(x: &[f32], qs: &mut [i8], sv: &mut [f32], sx: &mut [f32]) {
    let nb = x.len() / QK;
    for (b, (xb, lanes)) in x.chunks_exact(QK).zip(sv.chunks_exact_mut(4)).enumerate() {
        let (scale, sum) = quantize_block(xb, |e, q| qs[position(nb, b, e)] = q);
        lanes.fill(scale);
        sx[b] = scale * sum as f32;
    }
}

/// A vector that pool workers fill row by row.
#[derive(Clone, Copy)]
struct Shared<T>(*mut T);
// SAFETY: workers write disjoint rows (see `QAct::quantize`).
unsafe impl<T> Send for Shared<T> {}
unsafe impl<T> Sync for Shared<T> {}

impl<T> Shared<T> {
    /// Row `r` of width `w`.
    ///
    /// # Safety
    /// In bounds, and no other live reference to the row.
    #[allow(clippy::mut_from_ref)]
    unsafe fn slice<'a>(self, r: usize, w: usize) -> &'a mut [T] {
        unsafe { std::slice::from_raw_parts_mut(self.0.add(r * w), w) }
    }
}

/// Quantizes one block: scale `max|x| / 127`, quants rounded to nearest
/// (ties to even). Calls `put(element, quant)`; returns (scale, Σ quants).
fn quantize_block(x: &[f32], mut put: impl FnMut(usize, i8)) -> (f32, i32) {
    let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
    let d = amax / 127.0;
    let id = if d > 0.0 { 1.0 / d } else { 0.0 };
    let mut sum = 0i32;
    for (e, v) in x.iter().enumerate() {
        let q = (v * id).round_ties_even().clamp(-127.0, 127.0) as i8;
        sum += q as i32;
        put(e, q);
    }
    (d, sum)
}
