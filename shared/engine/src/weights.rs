//! Weight formats and linear layers.
//!
//! `native` keeps the file's blocks and multiplies Q4_0, Q4_1 and Q8_0 on the
//! engine's own kernels ([`crate::quant`]); other block formats fall back to
//! candle. `q8_0` requantizes to Q8_0 for candle's tiled int8 kernels, `f32`
//! dequantizes for candle's GEMM. Projections that read the same input
//! (Q|K|V, gate|up) are fused into one matrix.

use std::str::FromStr;
use std::sync::Arc;

use candle_core::quantized::{GgmlDType, QMatMul, QStorage, QTensor};
use candle_core::{Device, Module, Tensor};

use crate::error::{EngineError, Result};
use crate::quant::{BlockKind, QMatrix};

/// How weights are held in memory, chosen at load time.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum WeightFormat {
    /// As stored in the file, on the engine's block kernels: the default, and
    /// the fastest decode (it reads the fewest bytes).
    Native,
    /// Requantized to Q8_0, on candle's tiled int8 kernels.
    Q8_0,
    /// Dequantized to f32, on candle's GEMM.
    F32,
}

impl WeightFormat {
    pub fn as_str(&self) -> &'static str {
        match self {
            Self::Native => "native",
            Self::Q8_0 => "q8_0",
            Self::F32 => "f32",
        }
    }
}

impl std::fmt::Display for WeightFormat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for WeightFormat {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s.to_ascii_lowercase().as_str() {
            "native" => Ok(Self::Native),
            "q8_0" | "q8" => Ok(Self::Q8_0),
            "f32" => Ok(Self::F32),
            other => Err(format!(
                "unknown weight format `{other}` (expected native, q8_0 or f32)"
            )),
        }
    }
}

/// candle's tiled int8 kernels (AVX512-VNNI or AVX-VNNI) multiply Q8_0 weights
/// several times faster than its generic kernel, but only when the input size
/// is a multiple of this. Narrower inputs are zero-padded up to it.
const TILED_K: usize = 256;
/// ... and the output size a multiple of this.
const TILED_N: usize = 16;

/// A linear layer `y = x · Wᵀ`, possibly several fused along the output dimension.
#[derive(Debug)]
pub(crate) struct Linear {
    weights: Weights,
    in_dim: usize,
    out_dim: usize,
}

#[derive(Debug)]
enum Weights {
    /// GGUF blocks (Q4_0, Q4_1, Q8_0) on the engine's own kernels.
    Blocks(QMatrix),
    /// candle's matmul: f32, Q8_0 on candle's tiled int8 kernels, and block
    /// formats the engine has no kernel for. Several parts when they could
    /// not be fused (mixed types); inputs zero-padded to `padded_in` columns.
    Candle {
        parts: Vec<(QMatMul, usize)>,
        padded_in: usize,
    },
}

impl Linear {
    /// Builds one layer from `parts` (each `[out_i, in]`), converted to `format`.
    pub fn new(parts: Vec<QTensor>, format: WeightFormat, device: &Device) -> Result<Self> {
        let first = parts
            .first()
            .ok_or_else(|| EngineError::invalid_model("linear layer without weights"))?;
        let in_dim = dims2(first)?.1;
        let mut out_dim = 0;
        for p in &parts {
            let (o, i) = dims2(p)?;
            if i != in_dim {
                return Err(EngineError::invalid_model(format!(
                    "fused weights disagree on input size: {i} vs {in_dim}"
                )));
            }
            out_dim += o;
        }
        // Padding pays while it adds at most half the work (576 → 768 does; 64 → 256 does not).
        let padded = in_dim.next_multiple_of(TILED_K);
        let tiled =
            out_dim % TILED_N == 0 && 2 * padded <= 3 * in_dim && tiled_int8_kernels(device);
        let padded_in = match format == WeightFormat::Q8_0 && tiled {
            true => padded,
            false => in_dim,
        };
        let candle = |parts| Weights::Candle { parts, padded_in };
        let weights = match format {
            WeightFormat::F32 => candle(vec![(dequantized(&parts, device)?, out_dim)]),
            WeightFormat::Q8_0 => candle(vec![(q8_0(parts, padded_in, device)?, out_dim)]),
            WeightFormat::Native => match blocks(&parts, device)? {
                Some(m) => Weights::Blocks(m),
                None => candle(native(parts, device)?),
            },
        };
        Ok(Self {
            weights,
            in_dim,
            out_dim,
        })
    }

    /// A layer that shares an already-dequantized f32 matrix.
    pub fn from_f32(w: Tensor) -> Result<Self> {
        let (out_dim, in_dim) = w.dims2()?;
        Ok(Self {
            weights: Weights::Candle {
                parts: vec![(QMatMul::Tensor(w), out_dim)],
                padded_in: in_dim,
            },
            in_dim,
            out_dim,
        })
    }

    pub fn out_dim(&self) -> usize {
        self.out_dim
    }

    /// Bytes of weights one forward pass reads.
    pub fn bytes(&self) -> usize {
        let parts = match &self.weights {
            Weights::Blocks(m) => return m.bytes(),
            Weights::Candle { parts, .. } => parts,
        };
        parts
            .iter()
            .map(|(w, _)| match w {
                QMatMul::QTensor(t) => t.storage_size_in_bytes(),
                QMatMul::Tensor(t) | QMatMul::TensorF16(t) => {
                    t.elem_count() * t.dtype().size_in_bytes()
                }
            })
            .sum()
    }

    /// `x` is `[rows, in]`, row-major; returns `[rows, out]`.
    pub fn forward(&self, x: &[f32], device: &Device) -> Result<Vec<f32>> {
        let (parts, padded_in) = match &self.weights {
            Weights::Blocks(m) => return Ok(m.matmul(x)),
            Weights::Candle { parts, padded_in } => (parts, *padded_in),
        };
        let rows = x.len() / self.in_dim;
        let xt = match padded_in == self.in_dim {
            true => Tensor::from_slice(x, (rows, self.in_dim), device)?,
            false => {
                let mut padded = vec![0f32; rows * padded_in];
                for (dst, src) in padded
                    .chunks_exact_mut(padded_in)
                    .zip(x.chunks_exact(self.in_dim))
                {
                    dst[..self.in_dim].copy_from_slice(src);
                }
                Tensor::from_vec(padded, (rows, padded_in), device)?
            }
        };
        if let [(w, _)] = parts.as_slice() {
            return Ok(w.forward(&xt)?.flatten_all()?.to_vec1::<f32>()?);
        }
        let mut out = vec![0f32; rows * self.out_dim];
        let mut col = 0;
        for (w, width) in parts {
            let part = w.forward(&xt)?.flatten_all()?.to_vec1::<f32>()?;
            for (dst, src) in out
                .chunks_exact_mut(self.out_dim)
                .zip(part.chunks_exact(*width))
            {
                dst[col..col + width].copy_from_slice(src);
            }
            col += width;
        }
        Ok(out)
    }
}

/// The parts as one [`QMatrix`] on the CPU; `None` when the engine's
/// kernels cannot take them (another device, a format without a kernel,
/// mixed formats, a width that is not whole blocks).
fn blocks(parts: &[QTensor], device: &Device) -> Result<Option<QMatrix>> {
    let in_dim = dims2(&parts[0])?.1;
    if !device.is_cpu() || !QMatrix::supports(in_dim) {
        return Ok(None);
    }
    let mut mats = Vec::with_capacity(parts.len());
    for p in parts {
        let Some(kind) = BlockKind::from_ggml(p.dtype()) else {
            return Ok(None);
        };
        let (rows, cols) = dims2(p)?;
        match QMatrix::from_blocks(kind, rows, cols, &p.data()?) {
            Some(m) => mats.push(m),
            None => return Ok(None),
        }
    }
    Ok(QMatrix::concat(mats))
}

fn dims2(t: &QTensor) -> Result<(usize, usize)> {
    Ok(t.shape().dims2()?)
}

/// Dequantizes and concatenates along the output dimension.
pub(crate) fn dequantized(parts: &[QTensor], device: &Device) -> Result<QMatMul> {
    let ts = parts
        .iter()
        .map(|p| p.dequantize(device))
        .collect::<candle_core::Result<Vec<_>>>()?;
    Ok(QMatMul::Tensor(Tensor::cat(&ts, 0)?))
}

/// Requantizes to Q8_0 (Q8_0 parts are kept bit for bit), then zero-pads each
/// row's input dimension to `padded_in` with empty blocks, which is exact.
fn q8_0(parts: Vec<QTensor>, padded_in: usize, device: &Device) -> Result<QMatMul> {
    let dtype = GgmlDType::Q8_0;
    let (in_dim, block) = (dims2(&parts[0])?.1, dtype.block_size());
    if in_dim % block != 0 || !padded_in.is_multiple_of(block) {
        return Err(EngineError::unsupported(format!(
            "input size {in_dim} is not a multiple of the Q8_0 block size"
        )));
    }
    let fused = match parts.iter().all(|p| p.dtype() == dtype) {
        true => concat_rows(&parts, device)?,
        false => {
            let QMatMul::Tensor(t) = dequantized(&parts, device)? else {
                unreachable!("dequantized always yields an f32 tensor")
            };
            QTensor::quantize(&t, dtype)?
        }
    };
    if padded_in == in_dim {
        return Ok(QMatMul::QTensor(Arc::new(fused)));
    }
    let rows = dims2(&fused)?.0;
    let row_bytes = in_dim / block * dtype.type_size();
    let pad = vec![0u8; (padded_in - in_dim) / block * dtype.type_size()];
    let data = fused.data()?;
    let mut bytes = Vec::with_capacity(rows * (row_bytes + pad.len()));
    for row in data.chunks_exact(row_bytes) {
        bytes.extend_from_slice(row);
        bytes.extend_from_slice(&pad);
    }
    let storage = QStorage::from_data(bytes.into(), device, dtype)?;
    Ok(QMatMul::QTensor(Arc::new(QTensor::new(
        storage,
        (rows, padded_in),
    )?)))
}

/// Concatenates same-typed quantized matrices along the output dimension.
fn concat_rows(parts: &[QTensor], device: &Device) -> Result<QTensor> {
    let (dtype, in_dim) = (parts[0].dtype(), dims2(&parts[0])?.1);
    let (mut bytes, mut rows) = (Vec::new(), 0);
    for p in parts {
        bytes.extend_from_slice(&p.data()?);
        rows += dims2(p)?.0;
    }
    let storage = QStorage::from_data(bytes.into(), device, dtype)?;
    Ok(QTensor::new(storage, (rows, in_dim))?)
}

/// Whether candle will run Q8_0 matmuls on its tiled int8 (VNNI) kernels here.
fn tiled_int8_kernels(device: &Device) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        let avx512 = is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512vnni");
        let avx = is_x86_feature_detected!("avxvnni") && is_x86_feature_detected!("avx2");
        device.is_cpu() && (avx512 || avx)
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = device;
        false
    }
}

/// Keeps the stored type; fuses by concatenating raw blocks when the parts agree.
fn native(parts: Vec<QTensor>, device: &Device) -> Result<Vec<(QMatMul, usize)>> {
    let dtype = parts[0].dtype();
    if matches!(dtype, GgmlDType::F32 | GgmlDType::F16 | GgmlDType::BF16) {
        let out: usize = parts.iter().map(|p| p.shape().dims()[0]).sum();
        return Ok(vec![(dequantized(&parts, device)?, out)]);
    }
    if parts.len() > 1 && parts.iter().all(|p| p.dtype() == dtype) {
        let fused = concat_rows(&parts, device)?;
        let rows = dims2(&fused)?.0;
        return Ok(vec![(QMatMul::QTensor(Arc::new(fused)), rows)]);
    }
    parts
        .into_iter()
        .map(|p| {
            let rows = dims2(&p)?.0;
            Ok((QMatMul::QTensor(Arc::new(p)), rows))
        })
        .collect()
}
