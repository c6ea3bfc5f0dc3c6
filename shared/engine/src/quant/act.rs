//! Activations quantized to 8 bits per block of 32 values, in their natural
//! order. One function quantizes for every kernel path.

use super::QK;
use crate::threads::{for_ranges, Disjoint};

/// `n` rows of quantized activations.
pub(crate) struct QAct {
    blocks: usize,
    /// `n × blocks × 32` quants.
    qs: Vec<i8>,
    /// `n × blocks` scales.
    d: Vec<f32>,
    /// `n × blocks`: `scale × Σ quants` (Q4_1's minimums).
    sx: Vec<f32>,
    /// `n × blocks`: `Σ quants`, exact (the weights' offsets).
    sum: Vec<i32>,
}

/// One row of [`QAct`], borrowed.
#[derive(Clone, Copy)]
pub(crate) struct ActRow<'a> {
    pub qs: &'a [i8],
    pub d: &'a [f32],
    pub sx: &'a [f32],
}

/// Row `r`'s parts as addresses, for the SIMD kernels: no slice to build
/// or check per row (the kernels check the row range once per call).
#[derive(Clone, Copy)]
pub(crate) struct RowPtr {
    pub qs: *const i8,
    pub d: *const f32,
    pub sx: *const f32,
    pub sum: *const i32,
}

/// One row's outputs, borrowed mutably while it is quantized.
struct RowOut<'a> {
    qs: &'a mut [i8],
    d: &'a mut [f32],
    sx: &'a mut [f32],
    sum: &'a mut [i32],
}

impl RowOut<'_> {
    fn block(&mut self, b: usize, scale: f32, sum: i32) {
        self.d[b] = scale;
        self.sx[b] = scale * sum as f32;
        self.sum[b] = sum;
    }
}

impl QAct {
    /// Quantizes `x` (`[n, cols]`, `cols` a multiple of 32); many rows are
    /// shared out on candle's thread pool.
    pub fn quantize(x: &[f32], cols: usize) -> Self {
        let blocks = cols / QK;
        let n = x.len() / cols;
        let mut act = Self {
            blocks,
            qs: vec![0i8; n * cols],
            d: vec![0f32; n * blocks],
            sx: vec![0f32; n * blocks],
            sum: vec![0i32; n * blocks],
        };
        let (qs, d, sx, sum) = (
            Disjoint::new(&mut act.qs),
            Disjoint::new(&mut act.d),
            Disjoint::new(&mut act.sx),
            Disjoint::new(&mut act.sum),
        );
        let rows = |range: std::ops::Range<usize>| {
            for r in range {
                // SAFETY: row `r`'s slices are disjoint from every other row's,
                // and the vectors outlive the pool call.
                let out = unsafe {
                    RowOut {
                        qs: qs.rows(r, cols),
                        d: d.rows(r, blocks),
                        sx: sx.rows(r, blocks),
                        sum: sum.rows(r, blocks),
                    }
                };
                quantize_row(&x[r * cols..(r + 1) * cols], out);
            }
        };
        for_ranges(n, 8, rows);
        act
    }

    pub fn rows(&self) -> usize {
        self.d.len() / self.blocks.max(1)
    }

    pub fn blocks(&self) -> usize {
        self.blocks
    }

    /// Row `r`'s addresses.
    ///
    /// # Panics
    /// If `r` is not a row.
    #[inline(always)]
    pub fn row_ptr(&self, r: usize) -> RowPtr {
        assert!(r < self.rows(), "row {r} of {}", self.rows());
        let nb = self.blocks;
        // SAFETY: row `r` exists, so these offsets lie inside the vectors.
        unsafe {
            RowPtr {
                qs: self.qs.as_ptr().add(r * nb * QK),
                d: self.d.as_ptr().add(r * nb),
                sx: self.sx.as_ptr().add(r * nb),
                sum: self.sum.as_ptr().add(r * nb),
            }
        }
    }

    #[inline(always)]
    pub fn row(&self, r: usize) -> ActRow<'_> {
        let nb = self.blocks;
        ActRow {
            qs: &self.qs[r * nb * QK..(r + 1) * nb * QK],
            d: &self.d[r * nb..(r + 1) * nb],
            sx: &self.sx[r * nb..(r + 1) * nb],
        }
    }
}

/// Quantizes one row, on AVX2 when the CPU has it (the same bits either way).
fn quantize_row(x: &[f32], out: RowOut<'_>) {
    #[cfg(target_arch = "x86_64")]
    if crate::simd::avx2_fma() {
        // SAFETY: the CPU has AVX2 (checked above); the slices are one row's.
        return unsafe { x86::quantize_row(x, out) };
    }
    quantize_row_portable(x, out)
}

fn quantize_row_portable(x: &[f32], mut out: RowOut<'_>) {
    for (b, xb) in x.chunks_exact(QK).enumerate() {
        let (scale, sum) = quantize_block(xb, &mut out.qs[b * QK..(b + 1) * QK]);
        out.block(b, scale, sum);
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

    use super::{block_scale, RowOut, QK};

    /// [`super::quantize_row_portable`], eight values at a time: the same
    /// scale, the same rounding (to nearest, ties to even), the same clamp.
    ///
    /// # Safety
    /// The CPU has AVX2.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn quantize_row(x: &[f32], mut out: RowOut<'_>) {
        let nb = x.len() / QK;
        assert!(out.qs.len() >= nb * QK && out.d.len() >= nb);
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
            // SAFETY: block `b`'s 32 quants lie inside the row (asserted above).
            unsafe { _mm256_storeu_si256(out.qs.as_mut_ptr().add(b * QK) as _, bytes) };
            out.block(b, d, sum);
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

/// One quantized row's quants, scales, `sx` and sums.
#[cfg(test)]
pub(crate) type RowParts = (Vec<i8>, Vec<f32>, Vec<f32>, Vec<i32>);

/// Both quantizers on the same row: (SIMD, portable).
#[cfg(test)]
pub(crate) fn quantize_both(x: &[f32]) -> [RowParts; 2] {
    let nb = x.len() / QK;
    let run = |f: &dyn Fn(&[f32], RowOut<'_>)| {
        let (mut q, mut d, mut sx, mut sum) = (
            vec![0i8; x.len()],
            vec![0f32; nb],
            vec![0f32; nb],
            vec![0i32; nb],
        );
        f(
            x,
            RowOut {
                qs: &mut q,
                d: &mut d,
                sx: &mut sx,
                sum: &mut sum,
            },
        );
        (q, d, sx, sum)
    };
    [run(&quantize_row), run(&quantize_row_portable)]
}

/// Quantizes one block into `qs`: scale `max|x| / 127`, quants rounded to
/// nearest (ties to even). Returns (scale, Σ quants).
fn quantize_block(x: &[f32], qs: &mut [i8]) -> (f32, i32) {
    let (d, id) = block_scale(x.iter().fold(0f32, |m, v| m.max(v.abs())));
    let mut sum = 0i32;
    for (v, q) in x.iter().zip(qs.iter_mut()) {
        *q = (v * id).round_ties_even().clamp(-127.0, 127.0) as i8;
        sum += *q as i32;
    }
    (d, sum)
}
