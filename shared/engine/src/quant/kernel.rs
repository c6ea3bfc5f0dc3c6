//! Which code path multiplies: chosen once per process from what the CPU
//! has, or forced (`--kernel`) for tests and comparisons.

use std::sync::atomic::{AtomicU8, Ordering};

use super::{SharedOut, Tile};

/// A kernel path. All paths give bit-identical results.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Kernel {
    /// Portable Rust, any CPU.
    Scalar,
    /// x86-64 AVX2 (with F16C): the `x86-64-v3` baseline.
    Avx2,
    /// x86-64 AVX-512 (F, BW, VL) with VNNI.
    Avx512Vnni,
}

impl Kernel {
    pub const ALL: [Kernel; 3] = [Kernel::Avx512Vnni, Kernel::Avx2, Kernel::Scalar];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Scalar => "scalar",
            Self::Avx2 => "avx2",
            Self::Avx512Vnni => "avx512vnni",
        }
    }

    /// Whether this CPU can run the path.
    pub fn available(self) -> bool {
        match self {
            Self::Scalar => true,
            #[cfg(target_arch = "x86_64")]
            Self::Avx2 => {
                is_x86_feature_detected!("avx2")
                    && is_x86_feature_detected!("f16c")
                    && is_x86_feature_detected!("fma")
            }
            #[cfg(target_arch = "x86_64")]
            Self::Avx512Vnni => {
                Self::Avx2.available()
                    && is_x86_feature_detected!("avx512f")
                    && is_x86_feature_detected!("avx512bw")
                    && is_x86_feature_detected!("avx512vl")
                    && is_x86_feature_detected!("avx512vnni")
            }
            #[cfg(not(target_arch = "x86_64"))]
            _ => false,
        }
    }

    /// The fastest path this CPU has.
    pub fn best() -> Kernel {
        Self::ALL
            .into_iter()
            .find(|k| k.available())
            .unwrap_or(Kernel::Scalar)
    }

    fn code(self) -> u8 {
        match self {
            Self::Scalar => 1,
            Self::Avx2 => 2,
            Self::Avx512Vnni => 3,
        }
    }

    fn from_code(c: u8) -> Option<Self> {
        Self::ALL.into_iter().find(|k| k.code() == c)
    }
}

impl std::fmt::Display for Kernel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// `auto` or a path's name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KernelChoice {
    Auto,
    Forced(Kernel),
}

impl std::str::FromStr for KernelChoice {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.to_ascii_lowercase().as_str() {
            "auto" => Ok(Self::Auto),
            other => Kernel::ALL
                .into_iter()
                .find(|k| k.as_str() == other)
                .map(Self::Forced)
                .ok_or_else(|| {
                    format!("unknown kernel `{s}` (expected auto, avx512vnni, avx2 or scalar)")
                }),
        }
    }
}

static ACTIVE: AtomicU8 = AtomicU8::new(0);

/// The path matmuls use: the one set by [`set_kernel`], else the best available.
pub fn active_kernel() -> Kernel {
    match Kernel::from_code(ACTIVE.load(Ordering::Relaxed)) {
        Some(k) => k,
        None => {
            let k = Kernel::best();
            ACTIVE.store(k.code(), Ordering::Relaxed);
            k
        }
    }
}

/// Chooses the path for this process; fails if the CPU lacks it.
pub fn set_kernel(choice: KernelChoice) -> Result<Kernel, String> {
    let k = match choice {
        KernelChoice::Auto => Kernel::best(),
        KernelChoice::Forced(k) if k.available() => k,
        KernelChoice::Forced(k) => return Err(format!("this CPU cannot run the {k} kernels")),
    };
    ACTIVE.store(k.code(), Ordering::Relaxed);
    Ok(k)
}

/// Computes every cell of `tile` on `kernel`.
///
/// # Safety
/// The tile's cells must be the caller's to write, and `kernel` available.
pub(crate) unsafe fn run_tile(kernel: Kernel, tile: &Tile<'_>, out: SharedOut) {
    unsafe {
        match kernel {
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx512Vnni => super::x86::run_tile_avx512(tile, out),
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx2 => super::x86::run_tile_avx2(tile, out),
            _ => super::scalar::run_tile(tile, out),
        }
    }
}
