//! Matrix multiplication over GGUF quantized blocks as the file stores them
//! (Q4_0, Q4_1, Q8_0), against activations quantized to 8 bits per block of
//! 32 values.
//!
//! # Panels
//! A matrix's rows are grouped 16 at a time into *panels*: for each block
//! column, the 16 rows' quants are interleaved 4 bytes at a time, so one
//! 512-bit load holds 4 quant bytes of each of 16 rows and one VNNI
//! instruction (`vpdpbusd`) multiplies them by 4 activation quants broadcast
//! to every lane. A lane is an output row; its integer sum over a block is
//! exact and needs no reduction across lanes. The panel's 16 scales (and
//! Q4_1's minimums) of the block follow in their own arrays. Nothing is
//! padded but the last panel of a matrix whose row count is not a multiple
//! of 16.
//!
//! # One canonical sum, every path
//! The AVX-512 VNNI, AVX2 and portable paths compute the same float sum, bit
//! for bit, so a prefill worker and a decode worker on different CPUs produce
//! the same KV and the same tokens:
//! - activations are quantized by one function ([`act`]) whatever the path:
//!   quants `x`, scale `dx` and the exact `Σx` per block;
//! - per block `b`, the integer `s_b = Σ w·x` over its 32 elements, exactly
//!   (`w` the weight's signed quant: `q − 8` for Q4_0, `q` for Q4_1 and Q8_0);
//! - `acc = fma(s_b, d_b × dx_b, acc)`, blocks in order from `acc = 0`, and
//!   for Q4_1 after each block also `acc = fma(m_b, dx_b × Σx_b, acc)`.
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
/// Weight rows per panel: one 512-bit register of 32-bit lanes.
pub(crate) const PANEL: usize = 16;
/// Bytes of one quant group of a panel: 4 bytes of each of its rows.
pub(crate) const GROUP: usize = 4 * PANEL;

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

    /// Where the quants start in a stored block (after the scale, and Q4_1's minimum).
    fn qs_offset(self) -> usize {
        self.stored_bytes() - self.qs_bytes()
    }

    /// Whether 4-bit weights (pairs split into low and high nibbles).
    pub(crate) fn is_q4(self) -> bool {
        !matches!(self, Self::Q8_0)
    }

    /// What every weight quant is offset by against its stored unsigned
    /// form in a panel: Q4_0's `q − 8`, and Q8_0's quants stored plus 128.
    /// A block's integer sum starts at `−offset × Σx`.
    pub(crate) fn offset(self) -> i32 {
        match self {
            Self::Q4_0 => 8,
            Self::Q4_1 => 0,
            Self::Q8_0 => 128,
        }
    }
}

/// 64 bytes on a cache line's boundary, so a panel's quant groups load aligned.
#[derive(Debug, Clone, Copy)]
#[repr(C, align(64))]
pub(crate) struct Line(pub [u8; GROUP]);

/// A weight matrix `[rows, cols]` in one block format, one output per row,
/// in panels of 16 rows ([module docs](self)): the blocks' bytes as stored
/// (Q8_0's quants plus 128), regrouped; nothing is padded but the last panel.
#[derive(Debug, Clone)]
pub struct QMatrix {
    kind: BlockKind,
    rows: usize,
    cols: usize,
    /// Per panel, per block, the quant groups: 4 (4-bit: byte `4k..4k+4` of
    /// each row's block, low nibbles elements `4k..`, high ones `16 + 4k..`)
    /// or 8 (8-bit: elements `4g..4g+4`, each plus 128).
    qs: Vec<Line>,
    /// Per panel, per block, the 16 rows' scales.
    d: Vec<f16>,
    /// Minimums (Q4_1 only), laid out as `d`.
    m: Vec<f16>,
}

impl QMatrix {
    /// Whether an input width can be multiplied by these kernels (whole blocks).
    pub fn supports(cols: usize) -> bool {
        cols > 0 && cols.is_multiple_of(QK)
    }

    /// Regroups GGUF blocks (`rows × cols / 32` of them, row-major) into panels.
    pub fn from_blocks(kind: BlockKind, rows: usize, cols: usize, data: &[u8]) -> Option<Self> {
        let nb = cols / QK;
        let sb = kind.stored_bytes();
        if !Self::supports(cols) || rows == 0 || data.len() != rows * nb * sb {
            return None;
        }
        let panels = rows.div_ceil(PANEL);
        let groups = kind.qs_bytes() / 4;
        let mut qs = vec![Line([0; GROUP]); panels * nb * groups];
        let mut d = vec![f16::ZERO; panels * nb * PANEL];
        let mut m = match kind {
            BlockKind::Q4_1 => vec![f16::ZERO; panels * nb * PANEL],
            _ => Vec::new(),
        };
        let half = |b: &[u8]| f16::from_le_bytes([b[0], b[1]]);
        for (r, row) in data.chunks_exact(nb * sb).enumerate() {
            let (p, lane) = (r / PANEL, r % PANEL);
            for (b, block) in row.chunks_exact(sb).enumerate() {
                let at = (p * nb + b) * PANEL + lane;
                d[at] = half(&block[0..2]);
                if kind == BlockKind::Q4_1 {
                    m[at] = half(&block[2..4]);
                }
                let quants = &block[kind.qs_offset()..];
                for (g, four) in quants.chunks_exact(4).enumerate() {
                    let line = &mut qs[(p * nb + b) * groups + g].0[4 * lane..4 * lane + 4];
                    for (dst, &q) in line.iter_mut().zip(four) {
                        *dst = match kind.is_q4() {
                            true => q,
                            false => q ^ 0x80,
                        };
                    }
                }
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

    /// Row `r` as the GGUF file stores it.
    fn stored_row(&self, r: usize) -> Vec<u8> {
        let (kind, nb) = (self.kind, self.blocks());
        let (p, lane) = (r / PANEL, r % PANEL);
        let groups = kind.qs_bytes() / 4;
        let mut out = Vec::with_capacity(nb * kind.stored_bytes());
        for b in 0..nb {
            let at = (p * nb + b) * PANEL + lane;
            out.extend_from_slice(&self.d[at].to_le_bytes());
            if kind == BlockKind::Q4_1 {
                out.extend_from_slice(&self.m[at].to_le_bytes());
            }
            for g in 0..groups {
                let line = &self.qs[(p * nb + b) * groups + g].0[4 * lane..4 * lane + 4];
                out.extend(line.iter().map(|&q| match kind.is_q4() {
                    true => q,
                    false => q ^ 0x80,
                }));
            }
        }
        out
    }

    /// Stacks matrices of the same kind and width along the output dimension.
    pub fn concat(parts: Vec<QMatrix>) -> Option<Self> {
        let first = parts.first()?;
        let (kind, cols) = (first.kind, first.cols);
        if parts.iter().any(|p| p.kind != kind || p.cols != cols) {
            return None;
        }
        if parts.len() == 1 {
            return parts.into_iter().next();
        }
        let rows = parts.iter().map(|p| p.rows).sum();
        let data: Vec<u8> = parts
            .iter()
            .flat_map(|p| (0..p.rows).flat_map(|r| p.stored_row(r)))
            .collect();
        Self::from_blocks(kind, rows, cols, &data)
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

    /// Bytes a pass over the matrix reads: the file's blocks (and the last
    /// panel's padding rows).
    pub fn bytes(&self) -> usize {
        self.qs.len() * GROUP + 2 * (self.d.len() + self.m.len())
    }

    #[inline(always)]
    fn blocks(&self) -> usize {
        self.cols / QK
    }

    /// Panel `p`, borrowed.
    #[inline(always)]
    pub(crate) fn panel(&self, p: usize) -> Panel<'_> {
        let nb = self.blocks();
        let groups = self.kind.qs_bytes() / 4;
        let scales = p * nb * PANEL..(p + 1) * nb * PANEL;
        Panel {
            kind: self.kind,
            blocks: nb,
            qs: &self.qs[p * nb * groups..(p + 1) * nb * groups],
            d: &self.d[scales.clone()],
            m: match self.m.is_empty() {
                true => &[],
                false => &self.m[scales],
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
        // Every cell is written by exactly one panel's kernel (each path
        // writes all of its tile's cells): no need to zero them first.
        let mut y: Vec<f32> = Vec::with_capacity(n * self.rows);
        let out = SharedOut::spare(&mut y);
        let panels = self.rows.div_ceil(PANEL);
        let run = |range: std::ops::Range<usize>| {
            for p in range {
                let tile = Tile {
                    w: self.panel(p),
                    act: &act,
                    outs: p * PANEL..((p + 1) * PANEL).min(self.rows),
                    stride: self.rows,
                };
                // SAFETY: each panel writes only its own columns of `y`,
                // panels are distinct, and `y` outlives the pool call.
                unsafe { kernel::run_tile(kernel, &tile, out) };
            }
        };
        // Under 32 panel-rows of work is not worth waking the pool.
        crate::threads::for_ranges(panels, (2 * PANEL).div_ceil(n.max(1)), run);
        // SAFETY: the panels wrote every one of the `n × rows` cells.
        unsafe { y.set_len(n * self.rows) };
        y
    }
}

/// One panel of a matrix: 16 weight rows (the last panel may have fewer
/// real ones), borrowed.
#[derive(Clone, Copy)]
pub(crate) struct Panel<'a> {
    pub kind: BlockKind,
    pub blocks: usize,
    /// Per block, its quant groups.
    pub qs: &'a [Line],
    /// Per block, 16 scales.
    pub d: &'a [f16],
    /// Per block, 16 minimums (Q4_1), else empty.
    pub m: &'a [f16],
}

impl Panel<'_> {
    /// Quant groups per block.
    #[inline(always)]
    pub fn groups(&self) -> usize {
        self.kind.qs_bytes() / 4
    }

    /// Lane `lane`'s signed weight quant for element `e` of block `b`.
    pub fn quant(&self, lane: usize, b: usize, e: usize) -> i32 {
        let (g, shift) = match self.kind.is_q4() {
            true => ((e % 16) / 4, 4 * (e / 16)),
            false => (e / 4, 0),
        };
        let byte = self.qs[b * self.groups() + g].0[4 * lane + e % 4];
        match self.kind.is_q4() {
            true => ((byte >> shift) & 0x0f) as i32 - self.kind.offset(),
            false => byte as i32 - self.kind.offset(),
        }
    }
}

/// Every activation row × one panel's outputs: one call of a kernel path.
pub(crate) struct Tile<'a> {
    pub w: Panel<'a>,
    pub act: &'a QAct,
    /// The panel's real outputs (columns of the result).
    pub outs: std::ops::Range<usize>,
    /// Columns of the result (the matrix's rows).
    pub stride: usize,
}

/// The output that tasks write disjoint columns of.
pub(crate) type SharedOut = crate::threads::Disjoint<f32>;
