//! Matrix multiplication over GGUF quantized blocks as the file stores them
//! (Q4_0, Q4_1, Q8_0), against activations quantized to 8 bits per block of
//! 32 values.
//!
//! # One canonical sum, every path
//! The AVX-512 VNNI, AVX2 and portable paths compute the same float sum, bit
//! for bit, so a prefill worker and a decode worker on different CPUs produce
//! the same KV and the same tokens:
//! - activations are quantized by one function ([`act`]) whatever the path;
//! - a row's blocks are taken four at a time (a *quad*, 128 values), and a
//!   trailing pair when the count is 2 more than a multiple of 4;
//! - each block gives 4 *lanes*; lane `l` sums, exactly in integers, the
//!   products of elements `4l..4l+4` and `16+4l..16+4l+4` (see [`position`]);
//! - lane `l` of the quad's block `j` is added into float accumulator
//!   `4j + l` (16 of them) as `fma(partial, dw × dx, acc)`, quad after quad,
//!   the trailing pair last (into accumulators 0–7);
//! - Q4_1's minimum (and Q4_0's `−8`, as a minimum of `−8·d`) adds
//!   `fma(m, dx × Σq, acc)` per block, block `b` into lane `b % 8` of 8 more;
//! - the 16 fold to 8 (`a[j] + a[j + 8]`), the minimums' lanes are added, and
//!   one fixed tree reduces the 8 ([`hsum8`]).
//!
//! Fused multiply-add is exactly specified, so the portable path reproduces
//! it with `f32::mul_add`. The result for a (row, output) pair does not
//! depend on the batch, the tiling or the thread count: chunked prefill
//! equals one-shot prefill, and batched decode equals single decode.

mod act;
mod kernel;
mod scalar;
#[cfg(test)]
mod tests;
#[cfg(target_arch = "x86_64")]
mod x86;

use candle_core::quantized::GgmlDType;
use half::f16;

pub(crate) use act::QAct;
pub use kernel::{active_kernel, set_kernel, Kernel, KernelChoice};

/// Values per quantization block (all supported formats).
pub(crate) const QK: usize = 32;
/// Blocks per quad, the unit the kernels step by.
pub(crate) const QUAD: usize = 4;
/// Output rows per unit of work shared out among threads.
const ROWS_PER_TASK: usize = 16;
/// Activation rows that share one unpacking of a weight row.
pub(crate) const ROW_TILE: usize = 8;

/// A block format the kernels read as stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BlockKind {
    /// `d·(q − 8)`, 4-bit `q`; 18 bytes per block.
    Q4_0,
    /// `d·q + m`, 4-bit `q`; 20 bytes per block.
    Q4_1,
    /// `d·q`, 8-bit signed `q`; 34 bytes per block.
    Q8_0,
}

impl BlockKind {
    pub fn from_ggml(dtype: GgmlDType) -> Option<Self> {
        match dtype {
            GgmlDType::Q4_0 => Some(Self::Q4_0),
            GgmlDType::Q4_1 => Some(Self::Q4_1),
            GgmlDType::Q8_0 => Some(Self::Q8_0),
            _ => None,
        }
    }

    /// Bytes of quants per block.
    pub(crate) fn qs_bytes(self) -> usize {
        match self {
            Self::Q4_0 | Self::Q4_1 => QK / 2,
            Self::Q8_0 => QK,
        }
    }

    /// Bytes per block in the GGUF file.
    fn stored_bytes(self) -> usize {
        match self {
            Self::Q4_0 => 18,
            Self::Q4_1 => 20,
            Self::Q8_0 => 34,
        }
    }

    /// Whether 4-bit weights (pairs split into low and high nibbles).
    pub(crate) fn is_q4(self) -> bool {
        !matches!(self, Self::Q8_0)
    }
}

/// A weight matrix `[rows, cols]` in one block format, one output per row.
/// The blocks' bytes are kept as stored, with quants and scales split apart
/// so each row's quants are contiguous; nothing is padded.
#[derive(Debug, Clone)]
pub struct QMatrix {
    kind: BlockKind,
    rows: usize,
    cols: usize,
    /// `rows × blocks × qs_bytes` quants: 4-bit ones as stored, 8-bit ones
    /// reordered by [`position`] (as the activations are).
    qs: Vec<u8>,
    /// Scales, `scale_stride` per row: the row's blocks, then zeros up to
    /// a multiple of 8 (so minimums are summed 8 blocks at a time).
    d: Vec<f16>,
    /// Minimums (Q4_1 only), laid out as `d`.
    m: Vec<f16>,
}

/// Per-block values of a row padded with zeros to a multiple of 8 blocks.
pub(crate) fn scale_stride(blocks: usize) -> usize {
    blocks.next_multiple_of(8)
}

/// One weight row, borrowed.
#[derive(Clone, Copy)]
pub(crate) struct WRow<'a> {
    pub qs: &'a [u8],
    pub d: &'a [f16],
    /// Empty unless Q4_1.
    pub m: &'a [f16],
}

impl QMatrix {
    /// Whether an input width can be multiplied by these kernels (whole pairs of blocks).
    pub fn supports(cols: usize) -> bool {
        cols > 0 && cols.is_multiple_of(2 * QK)
    }

    /// Splits GGUF blocks (`rows × cols / 32` of them, row-major) into quants and scales.
    pub fn from_blocks(kind: BlockKind, rows: usize, cols: usize, data: &[u8]) -> Option<Self> {
        let nb = cols / QK;
        if !Self::supports(cols) || data.len() != rows * nb * kind.stored_bytes() {
            return None;
        }
        let qb = kind.qs_bytes();
        let stride = scale_stride(nb);
        let mut qs = Vec::with_capacity(rows * nb * qb);
        let mut d = Vec::with_capacity(rows * stride);
        let mut m = Vec::new();
        let half = |b: &[u8]| f16::from_le_bytes([b[0], b[1]]);
        for row in data.chunks_exact(nb * kind.stored_bytes()) {
            for block in row.chunks_exact(kind.stored_bytes()) {
                d.push(half(&block[0..2]));
                let quants = match kind {
                    BlockKind::Q4_1 => {
                        m.push(half(&block[2..4]));
                        &block[4..]
                    }
                    BlockKind::Q4_0 | BlockKind::Q8_0 => &block[2..],
                };
                qs.extend_from_slice(quants);
            }
            if kind == BlockKind::Q8_0 {
                let row_qs = qs.len() - nb * QK;
                let natural = qs[row_qs..].to_vec();
                for (i, q) in natural.into_iter().enumerate() {
                    qs[row_qs + position(nb, i / QK, i % QK)] = q;
                }
            }
            d.resize(d.len() + stride - nb, f16::ZERO);
            if kind == BlockKind::Q4_1 {
                m.resize(m.len() + stride - nb, f16::ZERO);
            }
        }
        Some(Self {
            kind,
            rows,
            cols,
            qs,
            d,
            m,
        })
    }

    /// Stacks matrices of the same kind and width along the output dimension.
    pub fn concat(parts: Vec<QMatrix>) -> Option<Self> {
        let mut it = parts.into_iter();
        let mut out = it.next()?;
        for p in it {
            if p.kind != out.kind || p.cols != out.cols {
                return None;
            }
            out.rows += p.rows;
            out.qs.extend_from_slice(&p.qs);
            out.d.extend_from_slice(&p.d);
            out.m.extend_from_slice(&p.m);
        }
        Some(out)
    }

    pub fn kind(&self) -> BlockKind {
        self.kind
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Bytes a pass over the matrix reads: the file's blocks, and the
    /// scales' padding (under 1% for usual widths).
    pub fn bytes(&self) -> usize {
        self.qs.len() + 2 * (self.d.len() + self.m.len())
    }

    #[inline(always)]
    fn blocks(&self) -> usize {
        self.cols / QK
    }

    /// Row `r`: its quants, and its scales (and minimums) with their padding.
    #[inline(always)]
    pub(crate) fn row(&self, r: usize) -> WRow<'_> {
        let (nb, stride) = (self.blocks(), scale_stride(self.blocks()));
        let qb = nb * self.kind.qs_bytes();
        WRow {
            qs: &self.qs[r * qb..(r + 1) * qb],
            d: &self.d[r * stride..(r + 1) * stride],
            m: match self.m.is_empty() {
                true => &[],
                false => &self.m[r * stride..(r + 1) * stride],
            },
        }
    }

    /// `y = x · Wᵀ` for `x` of `[n, cols]` (row-major): returns `[n, rows]`,
    /// on the active kernel and candle's thread pool.
    pub fn matmul(&self, x: &[f32]) -> Vec<f32> {
        self.matmul_with(active_kernel(), x)
    }

    /// [`Self::matmul`] on a chosen kernel (which must be available).
    pub fn matmul_with(&self, kernel: Kernel, x: &[f32]) -> Vec<f32> {
        assert!(
            x.len().is_multiple_of(self.cols),
            "input is not a whole number of rows"
        );
        assert!(
            kernel.available(),
            "this CPU cannot run the {kernel} kernels"
        );
        let n = x.len() / self.cols;
        let act = QAct::quantize(x, self.cols);
        let mut y = vec![0f32; n * self.rows];
        let out = SharedOut::new(&mut y);
        let tasks = self.rows.div_ceil(ROWS_PER_TASK);
        let run = |range: std::ops::Range<usize>| {
            for task in range {
                let o0 = task * ROWS_PER_TASK;
                let o1 = (o0 + ROWS_PER_TASK).min(self.rows);
                // SAFETY: each task writes only columns o0..o1 of `y`, tasks
                // are distinct, and `y` outlives the pool call.
                unsafe { self.run_task(kernel, &act, o0..o1, n, out) };
            }
        };
        // Under 32 task-rows of work is not worth waking the pool.
        crate::threads::for_ranges(tasks, (2 * ROWS_PER_TASK).div_ceil(n.max(1)), run);
        y
    }

    /// Computes outputs `outs` of every activation row.
    ///
    /// # Safety
    /// `out` points to `n × self.rows` floats that no one else writes in columns `outs`.
    unsafe fn run_task(
        &self,
        kernel: Kernel,
        act: &QAct,
        outs: std::ops::Range<usize>,
        n: usize,
        out: SharedOut,
    ) {
        let mut r0 = 0;
        while r0 < n {
            let rows = r0..(r0 + ROW_TILE).min(n);
            let tile = Tile {
                w: self,
                act,
                rows: rows.clone(),
                outs: outs.clone(),
            };
            // SAFETY: the tile's cells lie in this task's columns (caller's contract).
            unsafe { kernel::run_tile(kernel, &tile, out) };
            r0 = rows.end;
        }
    }
}

/// Activation rows × weight rows: one call of a kernel path.
pub(crate) struct Tile<'a> {
    pub w: &'a QMatrix,
    pub act: &'a QAct,
    /// Activation rows, at most [`ROW_TILE`].
    pub rows: std::ops::Range<usize>,
    /// Weight rows (outputs).
    pub outs: std::ops::Range<usize>,
}

impl Tile<'_> {
    /// Blocks per row.
    #[inline(always)]
    pub fn blocks(&self) -> usize {
        self.w.blocks()
    }
}

/// The output that tasks write disjoint columns of.
pub(crate) type SharedOut = crate::threads::Disjoint<f32>;

/// The fixed reduction of 8 lanes: `((a0+a4)+(a2+a6)) + ((a1+a5)+(a3+a7))`,
/// the order a 256-bit register folds in.
pub(crate) fn hsum8(a: &[f32; 8]) -> f32 {
    let x = [a[0] + a[4], a[1] + a[5], a[2] + a[6], a[3] + a[7]];
    (x[0] + x[2]) + (x[1] + x[3])
}

/// Where element `e` of block `b` (of a row of `nb` blocks) sits in a row of
/// activations, and of 8-bit weights: a quad holds its 4 blocks' elements
/// 0–15, then their elements 16–31 (the order 4-bit weights unpack in: low
/// nibbles, then high); a trailing pair does the same for 2 blocks.
pub(crate) fn position(nb: usize, b: usize, e: usize) -> usize {
    let quads = nb / QUAD;
    let (base, j, group) = match b < quads * QUAD {
        true => ((b / QUAD) * QUAD * QK, b % QUAD, QUAD),
        false => (quads * QUAD * QK, b - quads * QUAD, 2),
    };
    base + (e / 16) * group * 16 + j * 16 + e % 16
}
