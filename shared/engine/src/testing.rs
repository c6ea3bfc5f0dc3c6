//! A tiny random-weight Llama GGUF, written at test time, for fast hermetic
//! tests of every engine path (and of the servers built on it) without the
//! real model. Its tokenizer is a real byte-level BPE over all 256 bytes.

use std::fs::File;
use std::io::BufWriter;
use std::path::Path;

use candle_core::quantized::gguf_file::{self, Value};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};

use crate::error::{EngineError, Result};
use crate::tokenizer::byte_level_chars;

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

    fn tensor(&mut self, shape: (usize, usize), scale: f32, offset: f32) -> Result<Tensor> {
        let data: Vec<f32> = (0..shape.0 * shape.1)
            .map(|_| offset + scale * self.next())
            .collect();
        Ok(Tensor::from_vec(data, shape, &Device::Cpu)?)
    }
}

fn vocabulary() -> Vec<String> {
    let mut tokens: Vec<String> = TINY_SPECIALS.iter().map(|s| s.to_string()).collect();
    tokens.extend(byte_level_chars().into_iter().map(String::from));
    tokens.extend(MERGES.iter().map(|(a, b)| format!("{a}{b}")));
    tokens
}

/// Writes the tiny model to `path`.
pub fn write_tiny_gguf(path: impl AsRef<Path>, spec: &TinyModelSpec) -> Result<()> {
    let tokens = vocabulary();
    let head_dim = spec.hidden / spec.n_heads;
    let kv_dim = spec.n_kv_heads * head_dim;
    let mut rng = Rng(spec.seed);
    let mut tensors: Vec<(String, QTensor)> = Vec::new();
    let mut add = |name: String, t: Tensor, dtype: GgmlDType| -> Result<()> {
        tensors.push((name, QTensor::quantize(&t, dtype)?));
        Ok(())
    };
    let h = spec.hidden;
    add(
        "token_embd.weight".into(),
        rng.tensor((tokens.len(), h), 1.0, 0.0)?,
        GgmlDType::Q8_0,
    )?;
    if !spec.tied_embeddings {
        add(
            "output.weight".into(),
            rng.tensor((tokens.len(), h), 0.5, 0.0)?,
            GgmlDType::Q4_1,
        )?;
    }
    let norm = |rng: &mut Rng| {
        rng.tensor((1, h), 0.1, 1.0)
            .and_then(|t| Ok(t.flatten_all()?))
    };
    add("output_norm.weight".into(), norm(&mut rng)?, GgmlDType::F32)?;
    for i in 0..spec.n_layers {
        let n = |s: &str| format!("blk.{i}.{s}.weight");
        let w = 0.3;
        add(n("attn_norm"), norm(&mut rng)?, GgmlDType::F32)?;
        add(n("ffn_norm"), norm(&mut rng)?, GgmlDType::F32)?;
        add(n("attn_q"), rng.tensor((h, h), w, 0.0)?, GgmlDType::Q4_1)?;
        add(
            n("attn_k"),
            rng.tensor((kv_dim, h), w, 0.0)?,
            GgmlDType::Q4_1,
        )?;
        add(
            n("attn_v"),
            rng.tensor((kv_dim, h), w, 0.0)?,
            GgmlDType::Q4_1,
        )?;
        add(
            n("attn_output"),
            rng.tensor((h, h), w, 0.0)?,
            GgmlDType::Q4_1,
        )?;
        add(
            n("ffn_gate"),
            rng.tensor((spec.ffn, h), w, 0.0)?,
            GgmlDType::Q4_1,
        )?;
        add(
            n("ffn_up"),
            rng.tensor((spec.ffn, h), w, 0.0)?,
            GgmlDType::Q4_1,
        )?;
        add(
            n("ffn_down"),
            rng.tensor((h, spec.ffn), w, 0.0)?,
            GgmlDType::Q4_1,
        )?;
    }
    let metadata = metadata(spec, &tokens, head_dim);
    let md: Vec<(&str, &Value)> = metadata.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let ts: Vec<(&str, &QTensor)> = tensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let path = path.as_ref();
    let file = File::create(path).map_err(|source| EngineError::Io {
        path: path.display().to_string(),
        source,
    })?;
    gguf_file::write(&mut BufWriter::new(file), &md, &ts)?;
    Ok(())
}

fn metadata(spec: &TinyModelSpec, tokens: &[String], head_dim: usize) -> Vec<(String, Value)> {
    let u = |x: usize| Value::U32(x as u32);
    let strs = |v: Vec<String>| Value::Array(v.into_iter().map(Value::String).collect());
    let types = tokens
        .iter()
        .enumerate()
        .map(|(i, _)| Value::I32(if i < TINY_SPECIALS.len() { 3 } else { 1 }))
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
        ("llama.rope.dimension_count", u(head_dim)),
        ("llama.rope.freq_base", Value::F32(10_000.0)),
        ("llama.attention.layer_norm_rms_epsilon", Value::F32(1e-5)),
        ("tokenizer.ggml.model", Value::String("gpt2".into())),
        ("tokenizer.ggml.pre", Value::String("smollm".into())),
        ("tokenizer.ggml.tokens", strs(tokens.to_vec())),
        ("tokenizer.ggml.token_type", Value::Array(types)),
        ("tokenizer.ggml.merges", strs(merges)),
        ("tokenizer.ggml.bos_token_id", u(1)),
        ("tokenizer.ggml.eos_token_id", u(2)),
        ("tokenizer.ggml.add_bos_token", Value::Bool(false)),
        ("tokenizer.chat_template", Value::String(CHATML.into())),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect()
}
