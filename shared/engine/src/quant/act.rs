//! Activations quantized to 8 bits per block of 32 values, laid out by
//! [`position`]. One function quantizes for every kernel path.

use super::{position, scale_stride, QK};
use crate::threads::{for_ranges, Disjoint};

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
            Disjoint::new(&mut act.qs),
            Disjoint::new(&mut act.sv),
            Disjoint::new(&mut act.sx),
        );
        let rows = |range: std::ops::Range<usize>| {
            for r in range {
                // SAFETY: row `r`'s slices are disjoint from every other row's,
                // and the vectors outlive the pool call.
                let (q, v, m) = unsafe { (qs.rows(r, cols), sv.rows(r, sv_w), sx.rows(r, sx_w)) };
                quantize_row(&x[r * cols..(r + 1) * cols], q, v, m);
            }
        };
        for_ranges(n, 8, rows);
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

/// Quantizes one row into its quants, lane scales and block sums, on AVX2
/// when the CPU has it (the same bits either way).
fn quantize_row(x: &[f32], qs: &mut [i8], sv: &mut [f32], sx: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if crate::simd::avx2_fma() {
        // SAFETY: the CPU has AVX2 (checked above); the slices are one row's.
        return unsafe { x86::quantize_row(x, qs, sv, sx) };
    }
    quantize_row_portable(x, qs, sv, sx)
}

fn quantize_row_portable(x: &[f32], qs: &mut [i8], sv: &mut [f32], sx: &mut [f32]) {
    let nb = x.len() / QK;
    for (b, (xb, lanes)) in x.chunks_exact(QK).zip(sv.chunks_exact_mut(4)).enumerate() {
        let (scale, sum) = quantize_block(xb, |e, q| qs[position(nb, b, e)] = q);
        lanes.fill(scale);
        sx[b] = scale * sum as f32;
    }
}

/// A block's scale from its largest magnitude, and the scale's inverse.
fn block_scale(amax: f32) -> (f32, f32) {
    let d = amax / 127.0;
    (d, if d > 0.0 { 1.0 / d } else { 0.0 })
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::{block_scale, position, QK};

    /// [`super::quantize_row_portable`], eight values at a time: the same
    /// scale, the same rounding (to nearest, ties to even), the same clamp.
    ///
    /// # Safety
    /// The CPU has AVX2; the slices are one row's (as the portable path takes them).
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn quantize_row(x: &[f32], qs: &mut [i8], sv: &mut [f32], sx: &mut [f32]) {
        let nb = x.len() / QK;
        assert!(qs.len() >= nb * QK && sv.len() >= 4 * nb && sx.len() >= nb);
        let abs = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fff_ffff));
        let (lo, hi) = (_mm256_set1_ps(-127.0), _mm256_set1_ps(127.0));
        let order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
        for b in 0..nb {
            let v: [__m256; 4] =
                std::array::from_fn(|k| unsafe { _mm256_loadu_ps(x.as_ptr().add(b * QK + 8 * k)) });
            let m = _mm256_max_ps(
                _mm256_max_ps(_mm256_and_ps(v[0], abs), _mm256_and_ps(v[1], abs)),
                _mm256_max_ps(_mm256_and_ps(v[2], abs), _mm256_and_ps(v[3], abs)),
            );
            let (d, id) = block_scale(hmax(m));
            let q: [__m256i; 4] = std::array::from_fn(|k| {
                let r = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
                    _mm256_mul_ps(v[k], _mm256_set1_ps(id)),
                );
                _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(r, lo), hi))
            });
            let sum = hsum_i32(_mm256_add_epi32(
                _mm256_add_epi32(q[0], q[1]),
                _mm256_add_epi32(q[2], q[3]),
            ));
            let bytes = _mm256_permutevar8x32_epi32(
                _mm256_packs_epi16(
                    _mm256_packs_epi32(q[0], q[1]),
                    _mm256_packs_epi32(q[2], q[3]),
                ),
                order,
            );
            unsafe {
                let dst = qs.as_mut_ptr();
                _mm_storeu_si128(
                    dst.add(position(nb, b, 0)) as _,
                    _mm256_castsi256_si128(bytes),
                );
                _mm_storeu_si128(
                    dst.add(position(nb, b, 16)) as _,
                    _mm256_extracti128_si256::<1>(bytes),
                );
            }
            sv[4 * b..4 * b + 4].fill(d);
            sx[b] = d * sum as f32;
        }
    }

    /// The largest of 8 lanes (exact in any order).
    #[target_feature(enable = "avx2")]
    unsafe fn hmax(v: __m256) -> f32 {
        let x = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let x = _mm_max_ps(x, _mm_movehl_ps(x, x));
        _mm_cvtss_f32(_mm_max_ss(x, _mm_shuffle_ps::<1>(x, x)))
    }

    /// The sum of 8 integer lanes (exact).
    #[target_feature(enable = "avx2")]
    unsafe fn hsum_i32(v: __m256i) -> i32 {
        let x = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256::<1>(v));
        let x = _mm_add_epi32(x, _mm_shuffle_epi32::<0b01_00_11_10>(x));
        _mm_cvtsi128_si32(_mm_add_epi32(x, _mm_shuffle_epi32::<0b10_11_00_01>(x)))
    }
}

/// A row quantizer: `(x, quants, lane scales, block sums)`.
#[cfg(test)]
type RowQuantizer = dyn Fn(&[f32], &mut [i8], &mut [f32], &mut [f32]);

/// Both quantizers on the same row: (SIMD, portable) quants, lane scales and sums.
#[cfg(test)]
pub(crate) fn quantize_both(x: &[f32]) -> [(Vec<i8>, Vec<f32>, Vec<f32>); 2] {
    let nb = x.len() / QK;
    let run = |f: &RowQuantizer| {
        let (mut q, mut v, mut m) = (vec![0i8; x.len()], vec![0f32; 4 * nb], vec![0f32; nb]);
        f(x, &mut q, &mut v, &mut m);
        (q, v, m)
    };
    [run(&quantize_row), run(&quantize_row_portable)]
}

/// Quantizes one block: scale `max|x| / 127`, quants rounded to nearest
/// (ties to even). Calls `put(element, quant)`; returns (scale, Σ quants).
fn quantize_block(x: &[f32], mut put: impl FnMut(usize, i8)) -> (f32, i32) {
    let (d, id) = block_scale(x.iter().fold(0f32, |m, v| m.max(v.abs())));
    let mut sum = 0i32;
    for (e, v) in x.iter().enumerate() {
        let q = (v * id).round_ties_even().clamp(-127.0, 127.0) as i8;
        sum += q as i32;
        put(e, q);
    }
    (d, sum)
}
