//! The element types the KV store can hold: f32, or f16 (the default),
//! which halves the bytes every decode step reads over a long context, as
//! llama.cpp and vLLM keep their caches. K and V are rounded to f16 once,
//! when they are written; everything that reads them (attention, export)
//! reads those same values, so local, imported and cached KV agree exactly.

use half::f16;
use half::slice::HalfFloatSliceExt;

use super::KvDtype;

/// An element of the KV store.
pub(crate) trait KvElem: Copy + Send + Sync + 'static {
    const DTYPE: KvDtype;

    /// `dst[i] = src[i]`, rounded to nearest even where it must be.
    fn narrow(src: &[f32], dst: &mut [Self]);

    /// `dst[i] = src[i]`, exactly.
    fn widen(src: &[Self], dst: &mut [f32]);

    /// Eight elements from `p` as eight f32 lanes.
    ///
    /// # Safety
    /// AVX2 and F16C are available and `p..p + 8` is readable.
    #[cfg(target_arch = "x86_64")]
    unsafe fn load8(p: *const Self) -> std::arch::x86_64::__m256;
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
