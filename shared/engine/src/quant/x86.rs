//! The AVX2 and AVX-512 VNNI paths. Each computes exactly what
//! [`super::scalar::dot`] computes: the same integer lane partials, the same
//! float operations in the same order.

use std::arch::x86_64::*;

use super::act::ActRow;
use super::{BlockKind, SharedOut, Tile, WRow, QK, QUAD};

/// Computes a tile on the AVX2 path.
///
/// # Safety
/// `Kernel::Avx2.available()`, and the tile's cells are the caller's to write.
pub(crate) unsafe fn run_tile_avx2(t: &Tile<'_>, out: SharedOut) {
    // 16 ymm registers hold the two accumulators of at most 4 cells.
    for start in t.rows.clone().step_by(4) {
        let sub = Tile {
            rows: start..(start + 4).min(t.rows.end),
            outs: t.outs.clone(),
            ..*t
        };
        unsafe {
            match sub.rows.len() {
                1 => by_outputs::<1>(&sub, out, 2, avx2::<2, 1>, avx2::<1, 1>),
                2 => by_outputs::<2>(&sub, out, 2, avx2::<2, 2>, avx2::<1, 2>),
                3 => by_outputs::<3>(&sub, out, 1, avx2::<1, 3>, avx2::<1, 3>),
                _ => by_outputs::<4>(&sub, out, 1, avx2::<1, 4>, avx2::<1, 4>),
            }
        }
    }
}

/// Computes a tile on the AVX-512 VNNI path.
///
/// # Safety
/// `Kernel::Avx512Vnni.available()`, and the tile's cells are the caller's to write.
pub(crate) unsafe fn run_tile_avx512(t: &Tile<'_>, out: SharedOut) {
    // Few activation rows: take several weight rows at once, so each
    // activation load serves them all and their sums run side by side.
    unsafe {
        match t.rows.len() {
            1 => by_outputs::<1>(t, out, 2, avx512::<2, 1>, avx512::<1, 1>),
            2 => by_outputs::<2>(t, out, 2, avx512::<2, 2>, avx512::<1, 2>),
            3 => by_outputs::<3>(t, out, 2, avx512::<2, 3>, avx512::<1, 3>),
            4 => by_outputs::<4>(t, out, 2, avx512::<2, 4>, avx512::<1, 4>),
            5 => by_outputs::<5>(t, out, 1, avx512::<1, 5>, avx512::<1, 5>),
            6 => by_outputs::<6>(t, out, 1, avx512::<1, 6>, avx512::<1, 6>),
            7 => by_outputs::<7>(t, out, 1, avx512::<1, 7>, avx512::<1, 7>),
            _ => by_outputs::<8>(t, out, 1, avx512::<1, 8>, avx512::<1, 8>),
        }
    }
}

/// A kernel over weight rows `o..o + OB` and the tile's `R` activation rows.
type Block<const R: usize> = unsafe fn(&Tile<'_>, &[ActRow<'_>; R], usize, SharedOut);

/// Walks the tile's outputs `ob` at a time with `wide`, the rest with `one`.
unsafe fn by_outputs<const R: usize>(
    t: &Tile<'_>,
    out: SharedOut,
    ob: usize,
    wide: Block<R>,
    one: Block<R>,
) {
    // The activation rows' slices, found once for all the tile's outputs.
    let rows: [ActRow<'_>; R] = std::array::from_fn(|i| t.act.row(t.rows.start + i));
    let split = t.outs.start + t.outs.len() / ob * ob;
    for o in (t.outs.start..split).step_by(ob) {
        if t.rows.start == 0 && o + AHEAD < t.w.rows() {
            prefetch_row(t.w.row(o + AHEAD));
        }
        unsafe { wide(t, &rows, o, out) };
    }
    for o in split..t.outs.end {
        unsafe { one(t, &rows, o, out) };
    }
}

/// How many weight rows ahead of the one being multiplied the first
/// activation tile asks for (the pass that brings the weights from memory).
const AHEAD: usize = 8;

/// Asks for a weight row's quants and scales to be brought into cache.
#[inline(always)]
fn prefetch_row(w: WRow<'_>) {
    for off in (0..w.qs.len()).step_by(64) {
        // SAFETY: prefetching is a hint and never faults; the address is in bounds.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(w.qs.as_ptr().add(off) as *const i8) };
    }
    for s in [w.d, w.m].into_iter().filter(|s| !s.is_empty()) {
        // SAFETY: as above.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(s.as_ptr() as *const i8) };
    }
}

/// The fixed 8-lane reduction of [`super::hsum8`].
#[target_feature(enable = "avx2")]
unsafe fn hsum8(v: __m256) -> f32 {
    let x4 = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    let x2 = _mm_add_ps(x4, _mm_movehl_ps(x4, x4));
    _mm_cvtss_f32(_mm_add_ss(x2, _mm_shuffle_ps(x2, x2, 1)))
}

/// `count` f16 scales from `d[at..]` as floats (count 2 or 4).
#[target_feature(enable = "avx2,f16c")]
unsafe fn scales(d: &[half::f16], at: usize, count: usize) -> __m128 {
    let p = d.as_ptr().add(at);
    let bits = match count {
        2 => _mm_cvtsi32_si128(std::ptr::read_unaligned(p as *const i32)),
        _ => _mm_loadl_epi64(p as *const __m128i),
    };
    _mm_cvtph_ps(bits)
}

/// Per row, the lanes of Σ `minimum × dx × Σq`, block `b` into lane `b % 8`
/// (padding blocks add zeros, as in the scalar path).
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn minimums<const R: usize>(
    kind: BlockKind,
    w: WRow<'_>,
    rows: &[ActRow<'_>; R],
) -> [__m256; R] {
    let mut acc = [_mm256_setzero_ps(); R];
    for g in 0..w.d.len() / 8 {
        let m = match kind {
            BlockKind::Q4_1 => _mm256_cvtph_ps(_mm_loadu_si128(w.m.as_ptr().add(8 * g) as _)),
            _ => _mm256_mul_ps(
                _mm256_cvtph_ps(_mm_loadu_si128(w.d.as_ptr().add(8 * g) as _)),
                _mm256_set1_ps(-8.0),
            ),
        };
        for i in 0..R {
            let sx = _mm256_loadu_ps(rows[i].sx.as_ptr().add(8 * g));
            acc[i] = _mm256_fmadd_ps(m, sx, acc[i]);
        }
    }
    acc
}

/// Adds the minimums to a cell's 8 folded lanes, reduces them and writes the cell.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn finish<const R: usize>(
    t: &Tile<'_>,
    o: usize,
    rows: &[ActRow<'_>; R],
    folded: [__m256; R],
    out: SharedOut,
) {
    let kind = t.w.kind();
    let mins = match kind.is_q4() {
        true => Some(minimums(kind, t.w.row(o), rows)),
        false => None,
    };
    for i in 0..R {
        let lanes = match &mins {
            Some(m) => _mm256_add_ps(folded[i], m[i]),
            None => folded[i],
        };
        out.put((t.rows.start + i) * t.w.rows() + o, hsum8(lanes));
    }
}

/// u8 × i8 products summed 4 to a lane (exact for these operands: the 16-bit
/// pair sums stay below 32,767).
#[target_feature(enable = "avx2")]
unsafe fn dot_u8i8(u: __m256i, s: __m256i) -> __m256i {
    _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1))
}

/// One weight row's two blocks at `b` (of a quad's half or the trailing
/// pair) ready for AVX2: low and high halves as unsigned bytes, the signs
/// for 8-bit weights, and the lane scales.
struct Pair256 {
    lo: __m256i,
    hi: __m256i,
    /// 8-bit weights' own bytes, whose signs move onto the activations.
    sign: Option<(__m256i, __m256i)>,
    dw: __m256,
}

/// Loads blocks `b, b + 1` of `w`; `lo_at`/`hi_at` are their halves' offsets
/// in an 8-bit row (the same as in the activation row).
#[target_feature(enable = "avx2,f16c")]
unsafe fn pair256(kind: BlockKind, w: WRow<'_>, b: usize, lo_at: usize, hi_at: usize) -> Pair256 {
    let dw = _mm256_permutevar8x32_ps(
        _mm256_castps128_ps256(scales(w.d, b, 2)),
        _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1),
    );
    if kind.is_q4() {
        let nibble = _mm256_set1_epi8(0x0f);
        let v = _mm256_loadu_si256(w.qs.as_ptr().add(b * QK / 2) as _);
        let lo = _mm256_and_si256(v, nibble);
        let hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble);
        Pair256 {
            lo,
            hi,
            sign: None,
            dw,
        }
    } else {
        let l = _mm256_loadu_si256(w.qs.as_ptr().add(lo_at) as _);
        let h = _mm256_loadu_si256(w.qs.as_ptr().add(hi_at) as _);
        Pair256 {
            lo: _mm256_abs_epi8(l),
            hi: _mm256_abs_epi8(h),
            sign: Some((l, h)),
            dw,
        }
    }
}

/// `fma(cvt(partials), dw × sv, acc)` for one pair and one activation row.
#[target_feature(enable = "avx2,fma")]
unsafe fn pair_step(
    w: &Pair256,
    x: ActRow<'_>,
    b: usize,
    lo_at: usize,
    hi_at: usize,
    acc: __m256,
) -> __m256 {
    let mut xl = _mm256_loadu_si256(x.qs.as_ptr().add(lo_at) as _);
    let mut xh = _mm256_loadu_si256(x.qs.as_ptr().add(hi_at) as _);
    if let Some((sl, sh)) = w.sign {
        (xl, xh) = (_mm256_sign_epi8(xl, sl), _mm256_sign_epi8(xh, sh));
    }
    let p = match w.sign {
        // 4-bit weights: each 16-bit pair sum is at most 2 · 15 · 128, so the
        // low and high halves' pair sums add in 16 bits without overflow and
        // one widening add gives each lane its 8 products: the same integers
        // with one multiply-port instruction fewer.
        None => _mm256_madd_epi16(
            _mm256_add_epi16(
                _mm256_maddubs_epi16(w.lo, xl),
                _mm256_maddubs_epi16(w.hi, xh),
            ),
            _mm256_set1_epi16(1),
        ),
        // 8-bit weights: a pair sum reaches 2 · 128 · 127, so each half widens first.
        Some(_) => _mm256_add_epi32(dot_u8i8(w.lo, xl), dot_u8i8(w.hi, xh)),
    };
    let s = _mm256_mul_ps(w.dw, _mm256_loadu_ps(x.sv.as_ptr().add(4 * b)));
    _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), s, acc)
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn avx2<const OB: usize, const R: usize>(
    t: &Tile<'_>,
    rows: &[ActRow<'_>; R],
    o0: usize,
    out: SharedOut,
) {
    let ws: [WRow<'_>; OB] = std::array::from_fn(|j| t.w.row(o0 + j));
    let (kind, nb) = (t.w.kind(), t.blocks());
    let quads = nb / QUAD;
    // acc[0]: the quads' first pairs and the trailing pair; acc[1]: their second pairs.
    let mut acc = [[[_mm256_setzero_ps(); R]; OB]; 2];
    let mut step = |half: usize, b: usize, lo_at: usize, hi_at: usize| {
        let pw: [Pair256; OB] = std::array::from_fn(|j| pair256(kind, ws[j], b, lo_at, hi_at));
        for i in 0..R {
            for j in 0..OB {
                acc[half][j][i] = pair_step(&pw[j], rows[i], b, lo_at, hi_at, acc[half][j][i]);
            }
        }
    };
    for q in 0..quads {
        let base = q * QUAD * QK;
        step(0, 4 * q, base, base + 64);
        step(1, 4 * q + 2, base + 32, base + 96);
    }
    if nb % QUAD != 0 {
        let base = quads * QUAD * QK;
        step(0, 4 * quads, base, base + 32);
    }
    let [first, second] = &acc;
    for (j, (a, b)) in first.iter().zip(second).enumerate() {
        let folded = std::array::from_fn(|i| _mm256_add_ps(a[i], b[i]));
        finish(t, o0 + j, rows, folded, out);
    }
}

/// A weight row's quad ready for AVX-512.
struct Quad512 {
    lo: __m512i,
    hi: __m512i,
    neg_lo: __mmask64,
    neg_hi: __mmask64,
    dw: __m512,
}

#[target_feature(enable = "avx512f,avx512bw,avx2,f16c")]
unsafe fn quad512(kind: BlockKind, w: WRow<'_>, q: usize) -> Quad512 {
    let spread = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    let dw = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(scales(w.d, 4 * q, 4)));
    if kind.is_q4() {
        let nibble = _mm512_set1_epi8(0x0f);
        let v = _mm512_loadu_si512(w.qs.as_ptr().add(64 * q) as _);
        let lo = _mm512_and_si512(v, nibble);
        let hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
        Quad512 {
            lo,
            hi,
            neg_lo: 0,
            neg_hi: 0,
            dw,
        }
    } else {
        let l = _mm512_loadu_si512(w.qs.as_ptr().add(128 * q) as _);
        let h = _mm512_loadu_si512(w.qs.as_ptr().add(128 * q + 64) as _);
        Quad512 {
            lo: _mm512_abs_epi8(l),
            hi: _mm512_abs_epi8(h),
            neg_lo: _mm512_movepi8_mask(l),
            neg_hi: _mm512_movepi8_mask(h),
            dw,
        }
    }
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn avx512<const OB: usize, const R: usize>(
    t: &Tile<'_>,
    rows: &[ActRow<'_>; R],
    o0: usize,
    out: SharedOut,
) {
    let ws: [WRow<'_>; OB] = std::array::from_fn(|j| t.w.row(o0 + j));
    let (kind, nb) = (t.w.kind(), t.blocks());
    let quads = nb / QUAD;
    let zero = _mm512_setzero_si512();
    let mut acc = [[_mm512_setzero_ps(); R]; OB];
    for q in 0..quads {
        let wq: [Quad512; OB] = std::array::from_fn(|j| quad512(kind, ws[j], q));
        for i in 0..R {
            let xq = rows[i].qs.as_ptr().add(q * QUAD * QK);
            let (x0, x1) = (
                _mm512_loadu_si512(xq as _),
                _mm512_loadu_si512(xq.add(64) as _),
            );
            let sv = _mm512_loadu_ps(rows[i].sv.as_ptr().add(16 * q));
            for j in 0..OB {
                let w = &wq[j];
                let (xl, xh) = match kind.is_q4() {
                    true => (x0, x1),
                    false => (
                        _mm512_mask_sub_epi8(x0, w.neg_lo, zero, x0),
                        _mm512_mask_sub_epi8(x1, w.neg_hi, zero, x1),
                    ),
                };
                let p = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(zero, w.lo, xl), w.hi, xh);
                let s = _mm512_mul_ps(w.dw, sv);
                acc[j][i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), s, acc[j][i]);
            }
        }
    }
    for j in 0..OB {
        let mut lo: [__m256; R] = std::array::from_fn(|i| _mm512_castps512_ps256(acc[j][i]));
        if nb % QUAD != 0 {
            // The trailing pair, last, into lanes 0–7 (as the AVX2 path adds it).
            let base = quads * QUAD * QK;
            let pw = pair256(kind, ws[j], 4 * quads, base, base + 32);
            for i in 0..R {
                lo[i] = pair_step(&pw, rows[i], 4 * quads, base, base + 32, lo[i]);
            }
        }
        let folded = std::array::from_fn(|i| {
            let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[j][i]), 1));
            _mm256_add_ps(lo[i], hi)
        });
        finish(t, o0 + j, rows, folded, out);
    }
}
