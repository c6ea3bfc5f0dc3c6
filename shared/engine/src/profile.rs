//! Cumulative time per stage of the forward pass, always on (a few atomic
//! adds per layer), for benchmarks and step-time breakdowns.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

/// The stages of a forward pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stage {
    Embed,
    /// RMS norms, rotary embeddings, residual adds, SwiGLU.
    Elementwise,
    QkvMatmul,
    Attention,
    OutMatmul,
    GateUpMatmul,
    DownMatmul,
    LmHead,
}

impl Stage {
    pub const ALL: [Stage; 8] = [
        Stage::Embed,
        Stage::Elementwise,
        Stage::QkvMatmul,
        Stage::Attention,
        Stage::OutMatmul,
        Stage::GateUpMatmul,
        Stage::DownMatmul,
        Stage::LmHead,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Stage::Embed => "embed",
            Stage::Elementwise => "norm/rope/residual/swiglu",
            Stage::QkvMatmul => "qkv matmul",
            Stage::Attention => "attention",
            Stage::OutMatmul => "attn out matmul",
            Stage::GateUpMatmul => "gate+up matmul",
            Stage::DownMatmul => "down matmul",
            Stage::LmHead => "final norm + lm head",
        }
    }
}

/// Nanoseconds spent per stage since the last reset.
#[derive(Debug, Default)]
pub struct StageClock {
    nanos: [AtomicU64; 8],
}

impl StageClock {
    /// Runs `f`, charging its time to `stage`.
    pub(crate) fn time<T>(&self, stage: Stage, f: impl FnOnce() -> T) -> T {
        let start = Instant::now();
        let out = f();
        self.nanos[stage as usize].fetch_add(start.elapsed().as_nanos() as u64, Ordering::Relaxed);
        out
    }

    /// Seconds per stage, in [`Stage::ALL`] order.
    pub fn snapshot(&self) -> Vec<(Stage, f64)> {
        Stage::ALL
            .iter()
            .map(|s| {
                (
                    *s,
                    self.nanos[*s as usize].load(Ordering::Relaxed) as f64 * 1e-9,
                )
            })
            .collect()
    }

    /// Adds seconds per stage (e.g. a saved snapshot) to the clock.
    pub fn add(&self, times: &[(Stage, f64)]) {
        for (s, secs) in times {
            self.nanos[*s as usize].fetch_add((secs * 1e9) as u64, Ordering::Relaxed);
        }
    }

    pub fn reset(&self) {
        self.nanos
            .iter()
            .for_each(|n| n.store(0, Ordering::Relaxed));
    }
}

/// The machine's read bandwidth: the best of 3 passes summing a 256 MB
/// buffer on every model thread (candle's pool).
pub fn read_bandwidth_gb_s() -> f64 {
    let words = vec![1u64; 32 << 20];
    let chunks = 64;
    let per = words.len() / chunks;
    let mut best = 0f64;
    for _ in 0..3 {
        let total = std::sync::atomic::AtomicU64::new(0);
        let t = Instant::now();
        candle_core::utils::barrier_pool().execute_chunked(chunks, |range| {
            for c in range {
                let s = words[c * per..(c + 1) * per]
                    .iter()
                    .fold(0u64, |a, w| a.wrapping_add(*w));
                total.fetch_add(s, std::sync::atomic::Ordering::Relaxed);
            }
        });
        std::hint::black_box(total.into_inner());
        best = best.max((words.len() * 8) as f64 / t.elapsed().as_secs_f64() / 1e9);
    }
    best
}
