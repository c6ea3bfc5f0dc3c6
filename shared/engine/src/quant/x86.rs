//! The AVX-512 VNNI and AVX2 paths. Each computes exactly what
//! [`super::scalar::dot`] computes: the same exact integer block sums, the
//! same float operations in the same order, one output row per lane.

use std::arch::x86_64::*;
use std::ptr::read_unaligned;

use super::act::RowPtr;
use super::{BlockKind, SharedOut, Tile, GROUP, PANEL, QK};

/// Calls `$f::<R, Q4, MIN>` for a block kind, with `R` the row count as
/// `$rows` (`upto8` or `upto4`) dispatches it.
macro_rules! by_kind {
    ($rows:ident, $f:ident, $kind:expr, $r:expr, ($($arg:expr),*)) => {
        match $kind {
            BlockKind::Q4_0 => $rows!($f, true, false, $r, ($($arg),*)),
            BlockKind::Q4_1 => $rows!($f, true, true, $r, ($($arg),*)),
            BlockKind::Q8_0 => $rows!($f, false, false, $r, ($($arg),*)),
        }
    };
}

macro_rules! upto8 {
    ($f:ident, $q4:expr, $min:expr, $r:expr, ($($arg:expr),*)) => {
        match $r {
            5 => $f::<5, $q4, $min>($($arg),*),
            6 => $f::<6, $q4, $min>($($arg),*),
            7 => $f::<7, $q4, $min>($($arg),*),
            r if r >= 8 => $f::<8, $q4, $min>($($arg),*),
            r => upto4!($f, $q4, $min, r, ($($arg),*)),
        }
    };
}

macro_rules! upto4 {
    ($f:ident, $q4:expr, $min:expr, $r:expr, ($($arg:expr),*)) => {
        match $r {
            1 => $f::<1, $q4, $min>($($arg),*),
            2 => $f::<2, $q4, $min>($($arg),*),
            3 => $f::<3, $q4, $min>($($arg),*),
            _ => $f::<4, $q4, $min>($($arg),*),
        }
    };
}

/// Activation rows per AVX-512 call: 8 × 2 accumulators fit the 32 registers.
const ROWS_512: usize = 8;
/// Activation rows per AVX2 call (16 registers).
const ROWS_256: usize = 4;

/// Computes a tile on the AVX-512 VNNI path.
///
/// # Safety
/// `Kernel::Avx512Vnni.available()`, and the tile's cells are the caller's to write.
pub(crate) unsafe fn run_tile_avx512(t: &Tile<'_>, out: SharedOut) {
    let n = t.act.rows();
    let mut r0 = 0;
    while r0 < n {
        let r = (n - r0).min(ROWS_512);
        unsafe { by_kind!(upto8, avx512, t.w.kind, r, (t, r0, out)) };
        r0 += r;
    }
}

/// Computes a tile on the AVX2 path, one half-panel (8 lanes) at a time.
///
/// # Safety
/// `Kernel::Avx2.available()`, and the tile's cells are the caller's to write.
pub(crate) unsafe fn run_tile_avx2(t: &Tile<'_>, out: SharedOut) {
    let n = t.act.rows();
    for half in 0..2 {
        if 8 * half >= t.outs.len() {
            break;
        }
        let mut r0 = 0;
        while r0 < n {
            let r = (n - r0).min(ROWS_256);
            unsafe { by_kind!(upto4, avx2, t.w.kind, r, (t, r0, half, out)) };
            r0 += r;
        }
    }
}

/// Activation rows `r0..r0 + R` of the tile, after checking that they
/// exist and that their width is the panel's.
#[inline(always)]
fn act_rows<const R: usize>(t: &Tile<'_>, r0: usize) -> [RowPtr; R] {
    let nb = t.w.blocks;
    assert!(t.w.qs.len() == nb * t.w.groups() && t.w.d.len() == nb * PANEL);
    assert!(t.w.m.is_empty() || t.w.m.len() == nb * PANEL);
    assert!(t.act.blocks() == nb && r0 + R <= t.act.rows());
    std::array::from_fn(|i| t.act.row_ptr(r0 + i))
}

/// Four activation quants of a row at offset `at` (within the row), as one lane.
///
/// # Safety
/// `at + 4` is within the row.
#[inline(always)]
unsafe fn four(x: &RowPtr, at: usize) -> i32 {
    unsafe { read_unaligned(x.qs.add(at) as *const i32) }
}

/// Writes lanes `lanes` of a row's `vals` to the tile's output row `row`.
#[inline(always)]
unsafe fn put_lanes(t: &Tile<'_>, out: SharedOut, row: usize, lane0: usize, vals: &[f32]) {
    let base = row * t.stride + t.outs.start + lane0;
    let real = t.outs.len().saturating_sub(lane0).min(vals.len());
    for (l, &v) in vals[..real].iter().enumerate() {
        unsafe { out.put(base + l, v) };
    }
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn avx512<const R: usize, const Q4: bool, const MIN: bool>(
    t: &Tile<'_>,
    r0: usize,
    out: SharedOut,
) {
    let w = t.w;
    let rows = act_rows::<R>(t, r0);
    let (groups, off) = (w.groups(), w.kind.offset());
    let nib = _mm512_set1_epi8(0x0f);
    let mut acc = [_mm512_setzero_ps(); R];
    for b in 0..w.blocks {
        // Q4_0's `q − 8` and Q8_0's `q + 128` as stored: start at `−offset × Σx`.
        let mut s: [__m512i; R] =
            std::array::from_fn(|i| _mm512_set1_epi32(-off * *rows[i].sum.add(b)));
        let qs = w.qs.as_ptr().add(b * groups) as *const u8;
        if Q4 {
            for k in 0..4 {
                let v = _mm512_load_si512(qs.add(GROUP * k) as _);
                let lo = _mm512_and_si512(v, nib);
                let hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), nib);
                for i in 0..R {
                    let at = b * QK + 4 * k;
                    s[i] = _mm512_dpbusd_epi32(s[i], lo, _mm512_set1_epi32(four(&rows[i], at)));
                    s[i] =
                        _mm512_dpbusd_epi32(s[i], hi, _mm512_set1_epi32(four(&rows[i], at + 16)));
                }
            }
        } else {
            for g in 0..QK / 4 {
                let v = _mm512_load_si512(qs.add(GROUP * g) as _);
                for i in 0..R {
                    let x = _mm512_set1_epi32(four(&rows[i], b * QK + 4 * g));
                    s[i] = _mm512_dpbusd_epi32(s[i], v, x);
                }
            }
        }
        let d = _mm512_cvtph_ps(_mm256_loadu_si256(w.d.as_ptr().add(b * PANEL) as _));
        for i in 0..R {
            let scale = _mm512_mul_ps(d, _mm512_set1_ps(*rows[i].d.add(b)));
            acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[i]), scale, acc[i]);
        }
        if MIN {
            let m = _mm512_cvtph_ps(_mm256_loadu_si256(w.m.as_ptr().add(b * PANEL) as _));
            for i in 0..R {
                acc[i] = _mm512_fmadd_ps(m, _mm512_set1_ps(*rows[i].sx.add(b)), acc[i]);
            }
        }
    }
    for (i, a) in acc.iter().enumerate() {
        let row = r0 + i;
        if t.outs.len() == PANEL {
            _mm512_storeu_ps(out.at(row * t.stride + t.outs.start), *a);
        } else {
            let mut vals = [0f32; PANEL];
            _mm512_storeu_ps(vals.as_mut_ptr(), *a);
            put_lanes(t, out, row, 0, &vals);
        }
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn avx2<const R: usize, const Q4: bool, const MIN: bool>(
    t: &Tile<'_>,
    r0: usize,
    half: usize,
    out: SharedOut,
) {
    let w = t.w;
    let rows = act_rows::<R>(t, r0);
    let groups = w.groups();
    // 8-bit weights go back to signed here (their signs move onto the
    // activations), so only Q4_0 starts from an offset.
    let off = if Q4 { w.kind.offset() } else { 0 };
    let (nib, ones, flip) = (
        _mm256_set1_epi8(0x0f),
        _mm256_set1_epi16(1),
        _mm256_set1_epi8(-128),
    );
    let lane0 = 8 * half;
    let mut acc = [_mm256_setzero_ps(); R];
    for b in 0..w.blocks {
        let mut s: [__m256i; R] =
            std::array::from_fn(|i| _mm256_set1_epi32(-off * *rows[i].sum.add(b)));
        let qs = (w.qs.as_ptr().add(b * groups) as *const u8).add(4 * lane0);
        if Q4 {
            // A pair sum is at most 2 · 15 · 127, so a block's 8 pair sums
            // per 16-bit lane (3,810 each) stay below 32,767: one widening
            // add per block gives the exact integers.
            let mut p: [__m256i; R] = [_mm256_setzero_si256(); R];
            for k in 0..4 {
                let v = _mm256_load_si256(qs.add(GROUP * k) as _);
                let lo = _mm256_and_si256(v, nib);
                let hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), nib);
                for i in 0..R {
                    let at = b * QK + 4 * k;
                    let xl = _mm256_set1_epi32(four(&rows[i], at));
                    let xh = _mm256_set1_epi32(four(&rows[i], at + 16));
                    let pair = _mm256_add_epi16(
                        _mm256_maddubs_epi16(lo, xl),
                        _mm256_maddubs_epi16(hi, xh),
                    );
                    p[i] = _mm256_add_epi16(p[i], pair);
                }
            }
            for i in 0..R {
                s[i] = _mm256_add_epi32(s[i], _mm256_madd_epi16(p[i], ones));
            }
        } else {
            // `|w| · (x with w's sign)`: a pair sum reaches 2 · 128 · 127,
            // so each widens on its own.
            for g in 0..QK / 4 {
                let v = _mm256_xor_si256(_mm256_load_si256(qs.add(GROUP * g) as _), flip);
                let a = _mm256_abs_epi8(v);
                for i in 0..R {
                    let x = _mm256_set1_epi32(four(&rows[i], b * QK + 4 * g));
                    let prod = _mm256_maddubs_epi16(a, _mm256_sign_epi8(x, v));
                    s[i] = _mm256_add_epi32(s[i], _mm256_madd_epi16(prod, ones));
                }
            }
        }
        let d = _mm256_cvtph_ps(_mm_loadu_si128(w.d.as_ptr().add(b * PANEL + lane0) as _));
        for i in 0..R {
            let scale = _mm256_mul_ps(d, _mm256_set1_ps(*rows[i].d.add(b)));
            acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[i]), scale, acc[i]);
        }
        if MIN {
            let m = _mm256_cvtph_ps(_mm_loadu_si128(w.m.as_ptr().add(b * PANEL + lane0) as _));
            for i in 0..R {
                acc[i] = _mm256_fmadd_ps(m, _mm256_set1_ps(*rows[i].sx.add(b)), acc[i]);
            }
        }
    }
    for (i, a) in acc.iter().enumerate() {
        let mut vals = [0f32; 8];
        _mm256_storeu_ps(vals.as_mut_ptr(), *a);
        put_lanes(t, out, r0 + i, lane0, &vals);
    }
}
