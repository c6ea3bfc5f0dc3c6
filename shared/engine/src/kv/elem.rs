//! The element types the KV store can hold: f32, or f16 (the default),
//! which halves the bytes every decode step reads over a long context, as
//! llama.cpp and vLLM keep their caches. K and V are rounded to f16 once,
//! when they are written; everything that reads them (attention, export)
//! reads those same values, so local, imported and cached KV agree exactly.

use half::f16;
use half::slice::HalfFloatSliceExt;

use super::KvDtype;

/// Runs `$body` with the type name `$t` standing for the Rust element type
/// of the runtime [`KvDtype`] `$dtype`: one place that turns the store's
/// type into a monomorphised call.
macro_rules! with_elem {
    ($dtype:expr, $t:ident => $body:expr) => {
        match $dtype {
            $crate::kv::KvDtype::F32 => {
                type $t = f32;
                $body
            }
            $crate::kv::KvDtype::F16 => {
                type $t = ::half::f16;
                $body
            }
        }
    };
}
pub(crate) use with_elem;

/// An element of the KV store.
pub(crate) trait KvElem: Copy + Default + Send + Sync + 'static {
    const DTYPE: KvDtype;

    /// `dst[i] = src[i]`, rounded to nearest even where it must be.
    fn narrow(src: &[f32], dst: &mut [Self]);

    /// `dst[i] = src[i]`, exactly.
    fn widen(src: &[Self], dst: &mut [f32]);

    /// Appends `src` to `out` as little-endian bytes, unchanged: one copy.
    fn put_le(src: &[Self], out: &mut Vec<u8>) {
        let start = out.len();
        // SAFETY: f32 and f16 have no padding; their bytes are plain memory.
        out.extend_from_slice(unsafe {
            std::slice::from_raw_parts(src.as_ptr().cast::<u8>(), std::mem::size_of_val(src))
        });
        to_from_le::<Self>(&mut out[start..]);
    }

    /// `dst[i]` from the little-endian bytes `src` (`dst.len()` elements): one copy.
    fn get_le(src: &[u8], dst: &mut [Self]) {
        let n = std::mem::size_of_val(dst);
        // SAFETY: as in `put_le`; and every bit pattern is an f32 or an f16.
        let bytes = unsafe { std::slice::from_raw_parts_mut(dst.as_mut_ptr().cast::<u8>(), n) };
        bytes.copy_from_slice(&src[..n]);
        to_from_le::<Self>(bytes);
    }

    /// Eight elements from `p` as eight f32 lanes.
    ///
    /// # Safety
    /// AVX2 and F16C are available and `p..p + 8` is readable.
    #[cfg(target_arch = "x86_64")]
    unsafe fn load8(p: *const Self) -> std::arch::x86_64::__m256;
}

/// Turns little-endian elements of `T` into native ones and back: nothing
/// to do on a little-endian machine.
fn to_from_le<T>(_bytes: &mut [u8]) {
    #[cfg(target_endian = "big")]
    _bytes
        .chunks_exact_mut(std::mem::size_of::<T>())
        .for_each(<[u8]>::reverse);
}

impl KvElem for f32 {
    const DTYPE: KvDtype = KvDtype::F32;

    fn narrow(src: &[f32], dst: &mut [Self]) {
        dst.copy_from_slice(src);
    }

    fn widen(src: &[Self], dst: &mut [f32]) {
        dst.copy_from_slice(src);
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8(p: *const Self) -> std::arch::x86_64::__m256 {
        // SAFETY: by the caller's contract.
        unsafe { std::arch::x86_64::_mm256_loadu_ps(p) }
    }
}

impl KvElem for f16 {
    const DTYPE: KvDtype = KvDtype::F16;

    fn narrow(src: &[f32], dst: &mut [Self]) {
        dst.convert_from_f32_slice(src);
    }

    fn widen(src: &[Self], dst: &mut [f32]) {
        src.convert_to_f32_slice(dst);
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8(p: *const Self) -> std::arch::x86_64::__m256 {
        use std::arch::x86_64::{_mm256_cvtph_ps, _mm_loadu_si128};
        // SAFETY: by the caller's contract (F16C for the conversion).
        unsafe { _mm256_cvtph_ps(_mm_loadu_si128(p.cast())) }
    }
}
