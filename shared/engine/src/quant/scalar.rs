//! The portable path, and the definition every other path matches bit for bit.

use super::act::ActRow;
use super::{hsum8, position, BlockKind, SharedOut, Tile, WRow, QK, QUAD};

/// Every cell of a tile, one dot product at a time.
///
/// # Safety
/// The tile's cells must be the caller's to write (see `QMatrix::run_task`).
pub(crate) unsafe fn run_tile(t: &Tile<'_>, out: SharedOut) {
    for i in t.rows.clone() {
        let x = t.act.row(i);
        for o in t.outs.clone() {
            let y = dot(t.w.kind(), t.w.row(o), x, t.blocks());
            // SAFETY: the caller's contract.
            unsafe { out.put(i * t.w.rows() + o, y) };
        }
    }
}

/// Weight element `e` of block `b`, as an integer quant.
fn weight(kind: BlockKind, w: WRow<'_>, nb: usize, b: usize, e: usize) -> i32 {
    match kind.is_q4() {
        true => {
            let byte = w.qs[b * QK / 2 + e % 16];
            match e < 16 {
                true => (byte & 0x0f) as i32,
                false => (byte >> 4) as i32,
            }
        }
        false => w.qs[position(nb, b, e)] as i8 as i32,
    }
}

/// The minimum of block `b`: Q4_1's `m`, Q4_0's `−8·d`, none for Q8_0.
fn minimum(kind: BlockKind, w: WRow<'_>, b: usize) -> f32 {
    match kind {
        BlockKind::Q4_1 => w.m[b].to_f32(),
        BlockKind::Q4_0 => -8.0 * w.d[b].to_f32(),
        BlockKind::Q8_0 => 0.0,
    }
}

/// One weight row times one activation row, over `nb` blocks.
pub(crate) fn dot(kind: BlockKind, w: WRow<'_>, x: ActRow<'_>, nb: usize) -> f32 {
    let quad_blocks = nb / QUAD * QUAD;
    let mut acc = [0f32; 16];
    // Quads in order, then the trailing pair; a block's accumulators are
    // 4 × (its index within the quad or pair) + lane.
    for b in 0..nb {
        let j = match b < quad_blocks {
            true => b % QUAD,
            false => b - quad_blocks,
        };
        let s = w.d[b].to_f32() * x.sv[4 * b];
        for lane in 0..4 {
            let partial: i32 = (0..4)
                .flat_map(|k| [4 * lane + k, 16 + 4 * lane + k])
                .map(|e| weight(kind, w, nb, b, e) * x.qs[position(nb, b, e)] as i32)
                .sum();
            let a = &mut acc[4 * j + lane];
            *a = (partial as f32).mul_add(s, *a);
        }
    }
    let mut folded: [f32; 8] = std::array::from_fn(|i| acc[i] + acc[i + 8]);
    if kind.is_q4() {
        // Over the padding too: zero scales times zero sums, as the SIMD paths add them.
        let mut mins = [0f32; 8];
        for b in 0..w.d.len() {
            mins[b % 8] = minimum(kind, w, b).mul_add(x.sx[b], mins[b % 8]);
        }
        for (f, m) in folded.iter_mut().zip(mins) {
            *f += m;
        }
    }
    hsum8(&folded)
}
