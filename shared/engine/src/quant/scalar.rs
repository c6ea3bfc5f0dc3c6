//! The portable path, and the definition every other path matches bit for bit.

use super::act::ActRow;
use super::{BlockKind, Panel, SharedOut, Tile, QK};

/// Every cell of a tile, one dot product at a time.
///
/// # Safety
/// The tile's cells must be the caller's to write (see `QMatrix::matmul_with`).
pub(crate) unsafe fn run_tile(t: &Tile<'_>, out: SharedOut) {
    for i in 0..t.act.rows() {
        let x = t.act.row(i);
        for o in t.outs.clone() {
            let y = dot(t.w, o - t.outs.start, x);
            // SAFETY: the caller's contract.
            unsafe { out.put(i * t.stride + o, y) };
        }
    }
}

/// Lane `lane` of a panel times one activation row: the canonical sum.
pub(crate) fn dot(w: Panel<'_>, lane: usize, x: ActRow<'_>) -> f32 {
    let mut acc = 0f32;
    for b in 0..w.blocks {
        let sum: i32 = (0..QK)
            .map(|e| w.quant(lane, b, e) * x.qs[b * QK + e] as i32)
            .sum();
        let at = b * super::PANEL + lane;
        acc = (sum as f32).mul_add(w.d[at].to_f32() * x.d[b], acc);
        if w.kind == BlockKind::Q4_1 {
            acc = w.m[at].to_f32().mul_add(x.sx[b], acc);
        }
    }
    acc
}
