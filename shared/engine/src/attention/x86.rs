//! The AVX2 attention kernels. Each key's score is one fixed sum, whether it
//! is computed alone or among eight: per lane, fused multiply-adds over the
//! head's 8-wide chunks in order; then `((l0+l1)+(l2+l3)) + ((l4+l5)+(l6+l7))`.
//! Each output element is `Σ_t p_t·v_t` by fused multiply-adds in key order,
//! as the portable path computes it. So a row's result never depends on how
//! many keys share its block, how the KV is cut into blocks, or the batch.

use std::arch::x86_64::*;

use super::{HeadRows, SeqView};
use crate::kv::KvElem;

/// Keys scored together.
const KEYS: usize = 8;
/// Floats per register.
const LANE: usize = 8;

/// `scores[g * ctx + t] = scale · (q_g · k_t)` for every query head `g` of
/// `q` (`group × hd`) and every key `t < ctx` of `keys`.
///
/// # Safety
/// AVX2, FMA and F16C are available; `hd` is a multiple of 8; every block
/// holds `block_tokens` rows of `stride` elements (the last one at least the
/// rows `ctx` needs), and `offset + hd <= stride`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn scores<T: KvElem>(
    q: &[f32],
    view: &SeqView<'_, T>,
    at: HeadRows,
    ctx: usize,
    scale: f32,
    scores: &mut [f32],
) {
    let group = q.len() / at.hd;
    debug_assert!(scores.len() >= group * ctx);
    let b = view.block_tokens;
    for (i, block) in view.k.iter().enumerate().take(ctx.div_ceil(b)) {
        let (t0, n) = (i * b, b.min(ctx - i * b));
        debug_assert!(block.len() >= (n - 1) * at.stride + at.offset + at.hd);
        let key = |j: usize| unsafe { block.as_ptr().add(j * at.stride + at.offset) };
        for g in 0..group {
            let qg = unsafe { q.as_ptr().add(g * at.hd) };
            let dst = unsafe { scores.as_mut_ptr().add(g * ctx + t0) };
            let mut j = 0;
            while j + KEYS <= n {
                let keys: [*const T; KEYS] = std::array::from_fn(|k| key(j + k));
                unsafe {
                    let s = reduce8(dots::<T, KEYS>(qg, keys, at.hd));
                    _mm256_storeu_ps(dst.add(j), _mm256_mul_ps(s, _mm256_set1_ps(scale)));
                }
                j += KEYS;
            }
            for j in j..n {
                unsafe { *dst.add(j) = reduce1(dots(qg, [key(j)], at.hd)[0]) * scale };
            }
        }
    }
}

/// Lane partials of `q · k` for each key.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn dots<T: KvElem, const K: usize>(
    q: *const f32,
    keys: [*const T; K],
    hd: usize,
) -> [__m256; K] {
    let mut acc = [_mm256_setzero_ps(); K];
    for c in (0..hd).step_by(LANE) {
        let qv = unsafe { _mm256_loadu_ps(q.add(c)) };
        for k in 0..K {
            acc[k] = _mm256_fmadd_ps(qv, unsafe { T::load8(keys[k].add(c)) }, acc[k]);
        }
    }
    acc
}

/// Eight keys' lane partials to their eight sums (lane `k` = key `k`).
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn reduce8(a: [__m256; KEYS]) -> __m256 {
    let h01 = _mm256_hadd_ps(a[0], a[1]);
    let h23 = _mm256_hadd_ps(a[2], a[3]);
    let h45 = _mm256_hadd_ps(a[4], a[5]);
    let h67 = _mm256_hadd_ps(a[6], a[7]);
    // Per key: (l0+l1)+(l2+l3) in the low half, (l4+l5)+(l6+l7) in the high.
    let h0123 = _mm256_hadd_ps(h01, h23);
    let h4567 = _mm256_hadd_ps(h45, h67);
    let lo = _mm256_permute2f128_ps(h0123, h4567, 0x20);
    let hi = _mm256_permute2f128_ps(h0123, h4567, 0x31);
    _mm256_add_ps(lo, hi)
}

/// One key's lane partials to its sum, as [`reduce8`] adds them.
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn reduce1(a: __m256) -> f32 {
    let mut l = [0f32; LANE];
    unsafe { _mm256_storeu_ps(l.as_mut_ptr(), a) };
    ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]))
}

/// `out[g] = Σ_t p[g * ctx + t] · v_t` for each query head `g` of `out`
/// (`group × hd`).
///
/// # Safety
/// As [`scores`], with `p` holding `group × ctx` weights.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn values<T: KvElem>(
    p: &[f32],
    view: &SeqView<'_, T>,
    at: HeadRows,
    ctx: usize,
    out: &mut [f32],
) {
    let group = out.len() / at.hd;
    debug_assert!(p.len() >= group * ctx);
    let mut g = 0;
    while g < group {
        let ng = (group - g).min(2);
        let mut c = 0;
        while c < at.hd {
            let wide = at.hd - c >= 4 * LANE;
            unsafe {
                match (ng, wide) {
                    (2, true) => values_tile::<T, 2, 4>(p, view, at, ctx, g, c, out),
                    (2, false) => values_tile::<T, 2, 1>(p, view, at, ctx, g, c, out),
                    (_, true) => values_tile::<T, 1, 4>(p, view, at, ctx, g, c, out),
                    (_, false) => values_tile::<T, 1, 1>(p, view, at, ctx, g, c, out),
                }
            }
            c += if wide { 4 * LANE } else { LANE };
        }
        g += ng;
    }
}

/// Heads `g0..g0 + NG`, values `c0..c0 + 8·NC`, accumulated in registers.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn values_tile<T: KvElem, const NG: usize, const NC: usize>(
    p: &[f32],
    view: &SeqView<'_, T>,
    at: HeadRows,
    ctx: usize,
    g0: usize,
    c0: usize,
    out: &mut [f32],
) {
    let b = view.block_tokens;
    let mut acc = [[_mm256_setzero_ps(); NC]; NG];
    for (i, block) in view.v.iter().enumerate().take(ctx.div_ceil(b)) {
        let (t0, n) = (i * b, b.min(ctx - i * b));
        debug_assert!(block.len() >= (n - 1) * at.stride + at.offset + at.hd);
        for j in 0..n {
            let row = unsafe { block.as_ptr().add(j * at.stride + at.offset + c0) };
            let v: [__m256; NC] = std::array::from_fn(|k| unsafe { T::load8(row.add(k * LANE)) });
            for (g, acc) in acc.iter_mut().enumerate() {
                let w = _mm256_set1_ps(p[(g0 + g) * ctx + t0 + j]);
                for k in 0..NC {
                    acc[k] = _mm256_fmadd_ps(w, v[k], acc[k]);
                }
            }
        }
    }
    for (g, acc) in acc.iter().enumerate() {
        let dst = &mut out[(g0 + g) * at.hd + c0..][..NC * LANE];
        for (k, a) in acc.iter().enumerate() {
            unsafe { _mm256_storeu_ps(dst.as_mut_ptr().add(k * LANE), *a) };
        }
    }
}
