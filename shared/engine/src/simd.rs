//! Small vector kernels. `dot` and `axpy` use AVX2+FMA when the CPU has them
//! (detected at run time, so one binary runs everywhere); the rest is written
//! so LLVM vectorizes it: fixed-width chunks, independent accumulators, and a
//! branch-free polynomial `exp`.

use std::sync::OnceLock;

const W: usize = 16;

/// Whether the CPU has AVX2, FMA and F16C (checked once; every CPU with
/// the first two has the third).
pub(crate) fn avx2_fma() -> bool {
    static HAS: OnceLock<bool> = OnceLock::new();
    *HAS.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            is_x86_feature_detected!("avx2")
                && is_x86_feature_detected!("fma")
                && is_x86_feature_detected!("f16c")
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            false
        }
    })
}

/// Dot product.
#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if avx2_fma() {
        // SAFETY: the CPU supports AVX2 and FMA (checked above).
        return unsafe { x86::dot(a, b) };
    }
    dot_portable(a, b)
}

fn dot_portable(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let (ca, ta) = a[..n].as_chunks::<W>();
    let (cb, tb) = b[..n].as_chunks::<W>();
    let mut acc = [0f32; W];
    for (x, y) in ca.iter().zip(cb) {
        for i in 0..W {
            acc[i] += x[i] * y[i];
        }
    }
    let tail: f32 = ta.iter().zip(tb).map(|(x, y)| x * y).sum();
    sum_lanes(&acc) + tail
}

/// Sum of a slice.
#[inline]
pub fn sum(a: &[f32]) -> f32 {
    let (chunks, tail) = a.as_chunks::<W>();
    let mut acc = [0f32; W];
    for c in chunks {
        for i in 0..W {
            acc[i] += c[i];
        }
    }
    sum_lanes(&acc) + tail.iter().sum::<f32>()
}

#[inline]
fn sum_lanes(acc: &[f32; W]) -> f32 {
    let mut half = [0f32; W / 2];
    for i in 0..W / 2 {
        half[i] = acc[i] + acc[i + W / 2];
    }
    half.iter().sum()
}

/// `y += a * x`.
#[inline]
pub fn axpy(a: f32, x: &[f32], y: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if avx2_fma() {
        // SAFETY: the CPU supports AVX2 and FMA (checked above).
        return unsafe { x86::axpy(a, x, y) };
    }
    for (yi, xi) in y.iter_mut().zip(x) {
        *yi += a * xi;
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    /// # Safety
    /// The CPU must support AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn dot(a: &[f32], b: &[f32]) -> f32 {
        let n = a.len().min(b.len());
        let (pa, pb) = (a.as_ptr(), b.as_ptr());
        let mut acc = [_mm256_setzero_ps(); 4];
        let mut i = 0;
        // SAFETY (all loads): i + width <= n <= both lengths.
        while i + 32 <= n {
            for (j, a) in acc.iter_mut().enumerate() {
                let (x, y) = unsafe {
                    (
                        _mm256_loadu_ps(pa.add(i + 8 * j)),
                        _mm256_loadu_ps(pb.add(i + 8 * j)),
                    )
                };
                *a = _mm256_fmadd_ps(x, y, *a);
            }
            i += 32;
        }
        while i + 8 <= n {
            let (x, y) = unsafe { (_mm256_loadu_ps(pa.add(i)), _mm256_loadu_ps(pb.add(i))) };
            acc[0] = _mm256_fmadd_ps(x, y, acc[0]);
            i += 8;
        }
        let v = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
        let v = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        let v = _mm_add_ps(v, _mm_movehl_ps(v, v));
        let v = _mm_add_ss(v, _mm_shuffle_ps(v, v, 1));
        let tail: f32 = a[i..n].iter().zip(&b[i..n]).map(|(x, y)| x * y).sum();
        _mm_cvtss_f32(v) + tail
    }

    /// # Safety
    /// The CPU must support AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn axpy(a: f32, x: &[f32], y: &mut [f32]) {
        let n = x.len().min(y.len());
        let (px, py) = (x.as_ptr(), y.as_mut_ptr());
        let va = _mm256_set1_ps(a);
        let mut i = 0;
        // SAFETY: i + 8 <= n <= both lengths.
        while i + 8 <= n {
            unsafe {
                let v = _mm256_fmadd_ps(va, _mm256_loadu_ps(px.add(i)), _mm256_loadu_ps(py.add(i)));
                _mm256_storeu_ps(py.add(i), v);
            }
            i += 8;
        }
        for (yi, xi) in y[i..n].iter_mut().zip(&x[i..n]) {
            *yi += a * xi;
        }
    }
}

/// Maximum of a slice (`-inf` when empty; NaNs are ignored).
#[inline]
pub fn max(a: &[f32]) -> f32 {
    a.iter().copied().fold(f32::NEG_INFINITY, f32::max)
}

/// `x[i] = exp(x[i] - shift)` for every element; returns the sum of the results.
#[inline]
pub fn exp_shifted(x: &mut [f32], shift: f32) -> f32 {
    for v in x.iter_mut() {
        *v = exp(*v - shift);
    }
    sum(x)
}

/// `exp(x)` to about 2 ulp where the result is a normal f32; exactly 0 below
/// that (so `exp(-inf) == 0`).
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    let y = exp_clamped(x);
    if x < -87.3 {
        0.0
    } else {
        y
    }
}

#[inline(always)]
fn exp_clamped(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_145_75;
    const LN2_LO: f32 = 1.428_606_8e-6;
    // Adding then subtracting 1.5·2²³ rounds to the nearest integer without a branch.
    const ROUND: f32 = 12_582_912.0;
    let x = x.clamp(-87.3, 88.7);
    let n = (x * LOG2E + ROUND) - ROUND;
    let r = x - n * LN2_HI - n * LN2_LO;
    // Taylor terms to r⁶ on |r| ≤ ln2/2.
    let p = 1.0
        + r * (1.0
            + r * (0.5
                + r * (1.0 / 6.0 + r * (1.0 / 24.0 + r * (1.0 / 120.0 + r * (1.0 / 720.0))))));
    let scale = f32::from_bits(((n as i32 + 127) << 23) as u32);
    p * scale
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_is_accurate_across_the_range() {
        let mut worst = 0f32;
        let mut x = -87.0f32;
        while x < 88.0 {
            let (got, want) = (exp(x), x.exp());
            worst = worst.max(((got - want) / want).abs());
            x += 0.0137;
        }
        assert!(worst < 1e-6, "max relative error {worst}");
        assert_eq!(exp(-200.0), 0.0);
        assert_eq!(exp(f32::NEG_INFINITY), 0.0);
        assert!(exp(-87.0) > 0.0);
    }

    #[test]
    fn simd_and_portable_dot_agree() {
        for n in [0, 3, 8, 31, 64, 100] {
            let a: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin()).collect();
            let b: Vec<f32> = (0..n).map(|i| (i as f32 * 0.11).cos()).collect();
            assert!((dot(&a, &b) - dot_portable(&a, &b)).abs() < 1e-4, "n = {n}");
            let mut y1 = b.clone();
            axpy(0.5, &a, &mut y1);
            let y2: Vec<f32> = b.iter().zip(&a).map(|(y, x)| y + 0.5 * x).collect();
            assert!(y1.iter().zip(&y2).all(|(p, q)| (p - q).abs() < 1e-6));
        }
    }

    #[test]
    fn reductions_handle_tails() {
        let a: Vec<f32> = (0..37).map(|i| i as f32 * 0.25 - 3.0).collect();
        let b: Vec<f32> = (0..37).map(|i| 1.0 - i as f32 * 0.1).collect();
        let want: f32 = a.iter().zip(&b).map(|(x, y)| x * y).sum();
        assert!((dot(&a, &b) - want).abs() < 1e-4);
        assert!((sum(&a) - a.iter().sum::<f32>()).abs() < 1e-4);
        assert_eq!(max(&a), 6.0);
        let mut e = vec![0.0f32, 1.0, 2.0];
        let s = exp_shifted(&mut e, 2.0);
        assert!((s - (1.0 + (-1f32).exp() + (-2f32).exp())).abs() < 1e-6);
    }
}
