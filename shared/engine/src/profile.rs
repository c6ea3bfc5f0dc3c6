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
