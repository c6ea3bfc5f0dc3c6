//! A tiny random-weight Llama GGUF, written at test time, for fast hermetic
//! tests of every engine path and of the servers built on it, without the
//! real model. Its tokenizer is a real byte-level BPE over all 256 bytes,
//! with SmolLM2's special tokens and a ChatML template. The weights are
//! quantized here (Q8_0, Q4_1 as llama.cpp lays them out), so no tensor
//! library is needed to write it.

use std::path::{Path, PathBuf};

use half::f16;
use pdserve_text::gguf::{self, TensorData, Value, GGML_F32, GGML_Q4_1, GGML_Q8_0};
use pdserve_text::tokenizer::byte_level_chars;

/// Shape and seed of the generated model.
#[derive(Debug, Clone)]
pub struct TinyModelSpec {
    pub n_layers: usize,
    pub hidden: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub ffn: usize,
    pub context_length: usize,
    /// Without `output.weight`, as in SmolLM2.
    pub tied_embeddings: bool,
    pub seed: u64,
}

impl Default for TinyModelSpec {
    fn default() -> Self {
        Self {
            n_layers: 2,
            hidden: 64,
            n_heads: 4,
            n_kv_heads: 2,
            ffn: 96,
            context_length: 512,
            tied_embeddings: true,
            seed: 7,
        }
    }
}

/// The tiny model's special tokens (ids 0, 1, 2), as in SmolLM2.
pub const TINY_SPECIALS: [&str; 3] = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"];
/// Its end-of-sequence id (`<|im_end|>`).
pub const TINY_EOS: u32 = 2;
const MERGES: [(&str, &str); 7] = [
    ("Ġ", "t"),
    ("h", "e"),
    ("Ġt", "he"),
    ("i", "n"),
    ("Ġ", "a"),
    ("e", "r"),
    ("Ġ", "w"),
];
const CHATML: &str = "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

/// The tiny model in a temporary directory, removed when dropped.
pub struct TinyModel {
    pub path: PathBuf,
    _dir: tempfile::TempDir,
}

impl TinyModel {
    /// Writes the default tiny model.
    pub fn new() -> Self {
        Self::with(&TinyModelSpec::default())
    }

    /// Writes a tiny model of `spec`.
    pub fn with(spec: &TinyModelSpec) -> Self {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let path = dir.path().join("tiny.gguf");
        write_tiny_gguf(&path, spec).expect("write the tiny model");
        Self { path, _dir: dir }
    }

    /// The path as a string, for command lines.
    pub fn arg(&self) -> &str {
        self.path.to_str().expect("a UTF-8 temporary path")
    }
}

impl Default for TinyModel {
    fn default() -> Self {
        Self::new()
    }
}

/// Deterministic pseudo-random values in [-1, 1).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> f32 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^= z >> 31;
        (z >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }

    fn values(&mut self, n: usize, scale: f32, offset: f32) -> Vec<f32> {
        (0..n).map(|_| offset + scale * self.next()).collect()
    }
}

/// A tensor to write: its values, GGUF dims (innermost first) and type.
struct Tensor {
    name: String,
    dims: Vec<u64>,
    ggml_type: u32,
    bytes: Vec<u8>,
}

impl Tensor {
    /// A `[rows, cols]` matrix (cols innermost), quantized to `ggml_type`.
    fn matrix(name: String, rows: usize, cols: usize, values: &[f32], ggml_type: u32) -> Self {
        let bytes = match ggml_type {
            GGML_Q8_0 => quantize_q8_0(values),
            GGML_Q4_1 => quantize_q4_1(values),
            _ => values.iter().flat_map(|v| v.to_le_bytes()).collect(),
        };
        let dims = match rows {
            1 => vec![cols as u64],
            _ => vec![cols as u64, rows as u64],
        };
        Self {
            name,
            dims,
            ggml_type,
            bytes,
        }
    }
}

/// Q8_0: blocks of 32 values as an f16 scale and 32 signed bytes.
fn quantize_q8_0(values: &[f32]) -> Vec<u8> {
    let mut out = Vec::with_capacity(values.len() / 32 * 34);
    for block in values.chunks(32) {
        let amax = block.iter().fold(0f32, |m, v| m.max(v.abs()));
        let d = amax / 127.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        out.extend(f16::from_f32(d).to_le_bytes());
        out.extend(block.iter().map(|v| (v * id).round() as i8 as u8));
    }
    out
}

/// Q4_1: blocks of 32 values as f16 scale and minimum, and 32 nibbles
/// (value `j` in the low nibble of byte `j`, value `j + 16` in its high one).
fn quantize_q4_1(values: &[f32]) -> Vec<u8> {
    let mut out = Vec::with_capacity(values.len() / 32 * 20);
    for block in values.chunks(32) {
        let min = block.iter().fold(f32::INFINITY, |m, &v| m.min(v));
        let max = block.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
        let d = (max - min) / 15.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        out.extend(f16::from_f32(d).to_le_bytes());
        out.extend(f16::from_f32(min).to_le_bytes());
        let q = |v: f32| (((v - min) * id + 0.5).min(15.0)) as u8;
        out.extend((0..16).map(|j| q(block[j]) | (q(block[j + 16]) << 4)));
    }
    out
}

fn vocabulary() -> Vec<String> {
    let mut tokens: Vec<String> = TINY_SPECIALS.iter().map(|s| s.to_string()).collect();
    tokens.extend(byte_level_chars().into_iter().map(String::from));
    tokens.extend(MERGES.iter().map(|(a, b)| format!("{a}{b}")));
    tokens
}

/// Writes the tiny model to `path`.
pub fn write_tiny_gguf(path: impl AsRef<Path>, spec: &TinyModelSpec) -> std::io::Result<()> {
    let tokens = vocabulary();
    let tensors = weights(spec, tokens.len());
    let metadata = metadata(spec, &tokens);
    let md: Vec<(&str, &Value)> = metadata.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let ts: Vec<(&str, TensorData<'_>)> = tensors
        .iter()
        .map(|t| {
            let data = TensorData {
                dims: t.dims.clone(),
                ggml_type: t.ggml_type,
                bytes: &t.bytes,
            };
            (t.name.as_str(), data)
        })
        .collect();
    let mut file = std::io::BufWriter::new(std::fs::File::create(path)?);
    gguf::write(&mut file, &md, &ts).map_err(std::io::Error::other)
}

fn weights(spec: &TinyModelSpec, vocab: usize) -> Vec<Tensor> {
    let (h, ffn) = (spec.hidden, spec.ffn);
    let kv_dim = spec.n_kv_heads * (h / spec.n_heads);
    let mut rng = Rng(spec.seed);
    let mut out = Vec::new();
    let mut add = |rng: &mut Rng, name: String, (rows, cols): (usize, usize), scale, ty| {
        let offset = if ty == GGML_F32 { 1.0 } else { 0.0 };
        let values = rng.values(rows * cols, scale, offset);
        out.push(Tensor::matrix(name, rows, cols, &values, ty));
    };
    add(
        &mut rng,
        "token_embd.weight".into(),
        (vocab, h),
        1.0,
        GGML_Q8_0,
    );
    if !spec.tied_embeddings {
        add(&mut rng, "output.weight".into(), (vocab, h), 0.5, GGML_Q4_1);
    }
    add(&mut rng, "output_norm.weight".into(), (1, h), 0.1, GGML_F32);
    for i in 0..spec.n_layers {
        let n = |s: &str| format!("blk.{i}.{s}.weight");
        let w = 0.3;
        add(&mut rng, n("attn_norm"), (1, h), 0.1, GGML_F32);
        add(&mut rng, n("ffn_norm"), (1, h), 0.1, GGML_F32);
        add(&mut rng, n("attn_q"), (h, h), w, GGML_Q4_1);
        add(&mut rng, n("attn_k"), (kv_dim, h), w, GGML_Q4_1);
        add(&mut rng, n("attn_v"), (kv_dim, h), w, GGML_Q4_1);
        add(&mut rng, n("attn_output"), (h, h), w, GGML_Q4_1);
        add(&mut rng, n("ffn_gate"), (ffn, h), w, GGML_Q4_1);
        add(&mut rng, n("ffn_up"), (ffn, h), w, GGML_Q4_1);
        add(&mut rng, n("ffn_down"), (h, ffn), w, GGML_Q4_1);
    }
    out
}

fn metadata(spec: &TinyModelSpec, tokens: &[String]) -> Vec<(String, Value)> {
    let u = |x: usize| Value::U32(x as u32);
    let strs = |v: Vec<String>| Value::Array(v.into_iter().map(Value::String).collect());
    let types = (0..tokens.len())
        .map(|i| Value::I32(if i < TINY_SPECIALS.len() { 3 } else { 1 }))
        .collect();
    let merges = MERGES.iter().map(|(a, b)| format!("{a} {b}")).collect();
    [
        ("general.architecture", Value::String("llama".into())),
        ("general.name", Value::String("tiny-random-llama".into())),
        ("llama.block_count", u(spec.n_layers)),
        ("llama.context_length", u(spec.context_length)),
        ("llama.embedding_length", u(spec.hidden)),
        ("llama.feed_forward_length", u(spec.ffn)),
        ("llama.attention.head_count", u(spec.n_heads)),
        ("llama.attention.head_count_kv", u(spec.n_kv_heads)),
        ("llama.rope.dimension_count", u(spec.hidden / spec.n_heads)),
        ("llama.rope.freq_base", Value::F32(10_000.0)),
        ("llama.attention.layer_norm_rms_epsilon", Value::F32(1e-5)),
        ("tokenizer.ggml.model", Value::String("gpt2".into())),
        ("tokenizer.ggml.pre", Value::String("smollm".into())),
        ("tokenizer.ggml.tokens", strs(tokens.to_vec())),
        ("tokenizer.ggml.token_type", Value::Array(types)),
        ("tokenizer.ggml.merges", strs(merges)),
        ("tokenizer.ggml.bos_token_id", u(1)),
        ("tokenizer.ggml.eos_token_id", u(TINY_EOS as usize)),
        ("tokenizer.ggml.add_bos_token", Value::Bool(false)),
        ("tokenizer.chat_template", Value::String(CHATML.into())),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_model_reads_back_with_its_shape_and_tokenizer() {
        let m = TinyModel::new();
        let cfg = pdserve_text::ModelConfig::from_gguf_file(&m.path).unwrap();
        assert_eq!((cfg.n_layers, cfg.vocab_size, cfg.head_dim), (2, 266, 16));
        let tok = pdserve_text::Tokenizer::from_gguf_file(&m.path).unwrap();
        assert_eq!(tok.eos_token_id(), TINY_EOS);
        let ids = tok.encode("the water", false).unwrap();
        assert_eq!(tok.decode(&ids, false).unwrap(), "the water");
    }

    #[test]
    fn quantized_blocks_decode_close_to_the_values() {
        let values: Vec<f32> = (0..32).map(|i| (i as f32 - 10.0) / 7.0).collect();
        let q8 = quantize_q8_0(&values);
        let d = f16::from_le_bytes([q8[0], q8[1]]).to_f32();
        for (i, v) in values.iter().enumerate() {
            assert!((q8[2 + i] as i8 as f32 * d - v).abs() <= d, "q8_0 {i}");
        }
        let q4 = quantize_q4_1(&values);
        let (d, m) = (
            f16::from_le_bytes([q4[0], q4[1]]).to_f32(),
            f16::from_le_bytes([q4[2], q4[3]]).to_f32(),
        );
        for (i, v) in values.iter().enumerate() {
            let byte = q4[4 + i % 16];
            let q = if i < 16 { byte & 15 } else { byte >> 4 };
            assert!((q as f32 * d + m - v).abs() <= d, "q4_1 {i}");
        }
    }
}
