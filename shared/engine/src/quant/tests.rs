use candle_core::quantized::{GgmlDType, QStorage, QTensor};
use candle_core::Device;
use half::f16;

use super::*;

/// A small deterministic generator (xorshift).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn byte(&mut self) -> u8 {
        (self.next() >> 24) as u8
    }

    /// Uniform in [-1, 1).
    fn unit(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
}

fn ggml(kind: BlockKind) -> GgmlDType {
    match kind {
        BlockKind::Q4_0 => GgmlDType::Q4_0,
        BlockKind::Q4_1 => GgmlDType::Q4_1,
        BlockKind::Q8_0 => GgmlDType::Q8_0,
    }
}

/// Random blocks as a GGUF file stores them.
fn random_blocks(kind: BlockKind, rows: usize, cols: usize, rng: &mut Rng) -> Vec<u8> {
    let mut out = Vec::new();
    for _ in 0..rows * cols / QK {
        out.extend_from_slice(&f16::from_f32(0.02 * rng.unit()).to_le_bytes());
        if kind == BlockKind::Q4_1 {
            out.extend_from_slice(&f16::from_f32(0.1 * rng.unit()).to_le_bytes());
        }
        // Include Q8_0's −128, which the file format allows.
        out.extend((0..kind.qs_bytes()).map(|_| rng.byte()));
    }
    out
}

fn random_x(n: usize, cols: usize, rng: &mut Rng) -> Vec<f32> {
    (0..n * cols).map(|_| 3.0 * rng.unit()).collect()
}

/// candle's own dequantization of the same bytes: the format's meaning.
fn dequantized(kind: BlockKind, rows: usize, cols: usize, data: &[u8]) -> Vec<f32> {
    let storage = QStorage::from_data(data.to_vec().into(), &Device::Cpu, ggml(kind)).unwrap();
    let t = QTensor::new(storage, (rows, cols)).unwrap();
    let d = t.dequantize(&Device::Cpu).unwrap();
    d.flatten_all().unwrap().to_vec1::<f32>().unwrap()
}

const KINDS: [BlockKind; 3] = [BlockKind::Q4_0, BlockKind::Q4_1, BlockKind::Q8_0];

#[test]
fn scalar_path_matches_the_dequantized_product() {
    let mut rng = Rng(0x9e3779b97f4a7c15);
    let (rows, cols, n) = (24, 576, 3);
    for kind in KINDS {
        let data = random_blocks(kind, rows, cols, &mut rng);
        let w = QMatrix::from_blocks(kind, rows, cols, &data).unwrap();
        let wd = dequantized(kind, rows, cols, &data);
        let x = random_x(n, cols, &mut rng);
        let y = w.matmul_with(Kernel::Scalar, &x);
        for r in 0..n {
            let xr = &x[r * cols..(r + 1) * cols];
            for o in 0..rows {
                let exact: f32 = wd[o * cols..(o + 1) * cols]
                    .iter()
                    .zip(xr)
                    .map(|(a, b)| a * b)
                    .sum();
                let scale: f32 = wd[o * cols..(o + 1) * cols]
                    .iter()
                    .zip(xr)
                    .map(|(a, b)| (a * b).abs())
                    .sum();
                let got = y[r * rows + o];
                // 8-bit activations: about 1/254 of each block's largest value.
                assert!(
                    (got - exact).abs() <= 0.01 * scale + 1e-5,
                    "{kind:?} row {r} out {o}: {got} vs {exact} (scale {scale})"
                );
            }
        }
    }
}

#[test]
fn every_available_path_equals_the_scalar_path_bit_for_bit() {
    let mut rng = Rng(0x2545f4914f6cdd1d);
    let paths: Vec<Kernel> = Kernel::ALL.into_iter().filter(|k| k.available()).collect();
    eprintln!("kernel paths on this CPU: {paths:?}");
    for kind in KINDS {
        for (rows, cols) in [(1, 64), (17, 576), (40, 1536), (33, 320), (16, 32), (5, 96)] {
            let data = random_blocks(kind, rows, cols, &mut rng);
            let w = QMatrix::from_blocks(kind, rows, cols, &data).unwrap();
            for n in [1, 2, 3, 4, 5, 7, 8, 9, 13, 40] {
                let x = random_x(n, cols, &mut rng);
                let want = w.matmul_with(Kernel::Scalar, &x);
                for &k in &paths {
                    let got = w.matmul_with(k, &x);
                    let same = got
                        .iter()
                        .zip(&want)
                        .all(|(a, b)| a.to_bits() == b.to_bits());
                    assert!(
                        same,
                        "{k} differs from scalar: {kind:?} {rows}x{cols}, n={n}"
                    );
                }
            }
        }
    }
}

/// The integer sums' worst case: every quant at its largest magnitude
/// (4-bit 15, 8-bit −128) against activations of ±127, where a 16-bit sum
/// that overflowed or saturated would show.
#[test]
fn extreme_quants_give_the_same_bits_on_every_path() {
    let (rows, cols) = (8, 576);
    let paths: Vec<Kernel> = Kernel::ALL.into_iter().filter(|k| k.available()).collect();
    for kind in KINDS {
        let mut data = Vec::new();
        for _ in 0..rows * cols / QK {
            data.extend_from_slice(&f16::from_f32(0.01).to_le_bytes());
            if kind == BlockKind::Q4_1 {
                data.extend_from_slice(&f16::from_f32(-0.05).to_le_bytes());
            }
            let q = match kind.is_q4() {
                true => 0xff,
                false => 0x80,
            };
            data.extend(std::iter::repeat_n(q, kind.qs_bytes()));
        }
        let w = QMatrix::from_blocks(kind, rows, cols, &data).unwrap();
        for sign in [1.0f32, -1.0] {
            // Each block's largest value is its every value: all quantize to ±127.
            let x = vec![sign * 2.5; 5 * cols];
            let want = w.matmul_with(Kernel::Scalar, &x);
            let wd = dequantized(kind, rows, cols, &data);
            let exact: f32 = wd[..cols].iter().map(|v| v * sign * 2.5).sum();
            assert!(
                (want[0] - exact).abs() <= 1e-3 * exact.abs().max(1.0),
                "{kind:?}: scalar {} vs exact {exact}",
                want[0]
            );
            for &k in &paths {
                let got = w.matmul_with(k, &x);
                assert!(
                    got.iter()
                        .zip(&want)
                        .all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{k} differs from scalar at the extremes: {kind:?}, sign {sign}"
                );
            }
        }
    }
}

#[test]
fn a_row_gives_the_same_bits_alone_or_in_any_batch() {
    let mut rng = Rng(7);
    let (rows, cols) = (70, 576);
    for kind in KINDS {
        let data = random_blocks(kind, rows, cols, &mut rng);
        let w = QMatrix::from_blocks(kind, rows, cols, &data).unwrap();
        let x = random_x(37, cols, &mut rng);
        let batched = w.matmul(&x);
        for r in [0, 5, 36] {
            let alone = w.matmul(&x[r * cols..(r + 1) * cols]);
            assert_eq!(alone, batched[r * rows..(r + 1) * rows], "{kind:?} row {r}");
        }
    }
}

#[test]
fn fused_rows_equal_their_parts() {
    let mut rng = Rng(99);
    let cols = 128;
    let a = random_blocks(BlockKind::Q4_1, 5, cols, &mut rng);
    let b = random_blocks(BlockKind::Q4_1, 3, cols, &mut rng);
    let ma = QMatrix::from_blocks(BlockKind::Q4_1, 5, cols, &a).unwrap();
    let mb = QMatrix::from_blocks(BlockKind::Q4_1, 3, cols, &b).unwrap();
    let fused = QMatrix::concat(vec![ma.clone(), mb.clone()]).unwrap();
    let x = random_x(2, cols, &mut rng);
    let (ya, yb, yf) = (ma.matmul(&x), mb.matmul(&x), fused.matmul(&x));
    for r in 0..2 {
        assert_eq!(yf[r * 8..r * 8 + 5], ya[r * 5..(r + 1) * 5]);
        assert_eq!(yf[r * 8 + 5..(r + 1) * 8], yb[r * 3..(r + 1) * 3]);
    }
    assert_eq!(fused.bytes(), 16 * (a.len() + b.len()) / 8);
}

#[test]
fn unsupported_shapes_are_refused() {
    assert!(!QMatrix::supports(48));
    assert!(!QMatrix::supports(0));
    assert!(QMatrix::from_blocks(BlockKind::Q8_0, 2, 64, &[0u8; 10]).is_none());
    let short = vec![0u8; 2 * 3 * 34 - 1];
    assert!(QMatrix::from_blocks(BlockKind::Q8_0, 2, 96, &short).is_none());
    assert!(QMatrix::from_blocks(BlockKind::Q8_0, 0, 96, &[]).is_none());
}

#[test]
fn panels_give_back_the_stored_rows() {
    let mut rng = Rng(5);
    for kind in KINDS {
        let (rows, cols) = (37, 96);
        let data = random_blocks(kind, rows, cols, &mut rng);
        let w = QMatrix::from_blocks(kind, rows, cols, &data).unwrap();
        let row_bytes = cols / QK * kind.stored_bytes();
        for r in [0, 15, 16, 36] {
            assert_eq!(
                w.stored_row(r),
                data[r * row_bytes..(r + 1) * row_bytes],
                "{kind:?} row {r}"
            );
        }
        // Three panels, the last padded: the file's bytes and 11 empty rows.
        assert_eq!(w.bytes(), (rows + 11) * row_bytes);
    }
}

#[test]
fn kernel_names_parse() {
    assert_eq!("auto".parse::<KernelChoice>(), Ok(KernelChoice::Auto));
    assert_eq!(
        "AVX2".parse::<KernelChoice>(),
        Ok(KernelChoice::Forced(Kernel::Avx2))
    );
    assert!("sse".parse::<KernelChoice>().is_err());
}

#[test]
#[ignore = "a measurement, not a check: cargo test --release -p pdserve-engine quant_bandwidth -- --ignored --nocapture"]
fn quant_bandwidth() {
    let mut rng = Rng(1);
    for (kind, rows, cols) in [
        (BlockKind::Q4_1, 3072, 576),
        (BlockKind::Q8_0, 49152, 576),
        (BlockKind::Q4_1, 576, 1536),
    ] {
        let data = random_blocks(kind, rows, cols, &mut rng);
        let w = QMatrix::from_blocks(kind, rows, cols, &data).unwrap();
        for n in [1, 16] {
            let x = random_x(n, cols, &mut rng);
            for k in Kernel::ALL
                .into_iter()
                .filter(|k| k.available() && *k != Kernel::Scalar)
            {
                let _ = w.matmul_with(k, &x);
                let reps = 200;
                let t = std::time::Instant::now();
                for _ in 0..reps {
                    std::hint::black_box(w.matmul_with(k, &x));
                }
                let s = t.elapsed().as_secs_f64() / reps as f64;
                eprintln!(
                    "{kind:?} {rows}x{cols} n={n} {k}: {:.1} us, {:.1} GB/s, {:.1} GMAC/s",
                    s * 1e6,
                    w.bytes() as f64 / s / 1e9,
                    (rows * cols * n) as f64 / s / 1e9
                );
            }
        }
    }
}

#[test]
fn activations_quantize_to_the_same_bits_on_every_path() {
    let mut rng = Rng(11);
    for cols in [64, 576, 1536] {
        let mut x = random_x(1, cols, &mut rng);
        // Values on rounding ties, a zero block, and the largest magnitudes.
        x[..QK].fill(0.0);
        x[QK] = 127.0;
        x[QK + 1] = 0.5;
        x[QK + 2] = -2.5;
        x[QK + 3] = -127.0;
        let [simd, portable] = super::act::quantize_both(&x);
        assert_eq!(simd, portable, "{cols} columns");
    }
}
