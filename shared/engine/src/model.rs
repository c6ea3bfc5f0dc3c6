//! A Llama-family transformer whose KV cache lives outside the model.
//!
//! One [`Model::forward`] advances any number of sequences by any number of
//! tokens each: a prompt (prefill, or a chunk of one), one token for each of
//! many sequences (batched decode), or a mix. All rows go through each matmul
//! together; attention is per sequence over its own KV.

use std::fs::File;
use std::io::BufReader;
use std::ops::ControlFlow;
use std::path::Path;

use candle_core::quantized::gguf_file::Content;
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};

use crate::attention::{
    add_rows, attention, rms_norm, swiglu, Heads, Rope, SeqView, PARALLEL_ROWS,
};
use crate::error::{EngineError, Result};
use crate::kv::{with_elem, Half, KvConfig, KvDtype, KvElem, KvLayout, KvPool, SeqKv};
use crate::profile::{Stage, StageClock};
use crate::threads::{for_rows, Disjoint};
use crate::weights::{dequantized, Linear, WeightFormat};
use pdserve_text::ModelConfig;

/// How to load a model.
#[derive(Debug, Clone)]
pub struct LoadOptions {
    pub weights: WeightFormat,
    pub device: Device,
}

impl Default for LoadOptions {
    fn default() -> Self {
        Self {
            weights: WeightFormat::Native,
            device: Device::Cpu,
        }
    }
}

/// Some sequences' new tokens: the work of one forward pass.
pub struct Segment<'a> {
    /// The sequence's KV; the tokens are appended at `kv.len()`.
    pub kv: &'a mut SeqKv,
    pub tokens: &'a [u32],
}

/// Called after each layer of a forward pass; `Break` stops the pass.
pub type OnLayer<'a> = dyn FnMut(usize, &[Segment<'_>]) -> ControlFlow<()> + 'a;

/// A layer callback that lets the forward pass run to the end.
pub fn every_layer(_: usize, _: &[Segment<'_>]) -> ControlFlow<()> {
    ControlFlow::Continue(())
}

/// Logits of the last position of each segment, `[segments, vocab]`.
#[derive(Debug, Clone)]
pub struct Logits {
    data: Vec<f32>,
    vocab: usize,
}

impl Logits {
    pub fn row(&self, i: usize) -> &[f32] {
        &self.data[i * self.vocab..(i + 1) * self.vocab]
    }

    pub fn len(&self) -> usize {
        self.data.len() / self.vocab
    }

    pub fn is_empty(&self) -> bool {
        self.data.is_empty()
    }

    pub fn into_rows(self) -> Vec<Vec<f32>> {
        self.data
            .chunks_exact(self.vocab)
            .map(<[f32]>::to_vec)
            .collect()
    }
}

enum Embedding {
    Quantized(QTensor),
    Dense(Tensor),
}

struct Layer {
    attn_norm: Vec<f32>,
    qkv: Linear,
    wo: Linear,
    ffn_norm: Vec<f32>,
    gate_up: Linear,
    down: Linear,
}

/// A loaded model. Immutable and `Sync`: one forward at a time per caller.
pub struct Model {
    cfg: ModelConfig,
    format: WeightFormat,
    device: Device,
    embed: Embedding,
    layers: Vec<Layer>,
    norm: Vec<f32>,
    lm_head: Linear,
    rope: Rope,
    fingerprint: u64,
    clock: StageClock,
}

struct Loader<'a> {
    content: &'a Content,
    reader: BufReader<File>,
    device: &'a Device,
}

impl Loader<'_> {
    fn qtensor(&mut self, name: &str) -> Result<QTensor> {
        self.content
            .tensor(&mut self.reader, name, self.device)
            .map_err(|e| EngineError::invalid_model(format!("tensor `{name}`: {e}")))
    }

    fn vector(&mut self, name: &str) -> Result<Vec<f32>> {
        let t = self.qtensor(name)?.dequantize(&Device::Cpu)?;
        Ok(t.flatten_all()?.to_vec1::<f32>()?)
    }

    fn linear(&mut self, names: &[String], format: WeightFormat) -> Result<Linear> {
        let parts = names
            .iter()
            .map(|n| self.qtensor(n))
            .collect::<Result<Vec<_>>>()?;
        Linear::new(parts, format, self.device)
    }
}

impl Model {
    /// Loads a Llama-family GGUF file, converting weights to `opts.weights`.
    pub fn load(path: impl AsRef<Path>, opts: &LoadOptions) -> Result<Self> {
        let path = path.as_ref();
        let io = |source| {
            EngineError::Text(pdserve_text::TextError::Io {
                path: path.display().to_string(),
                source,
            })
        };
        let mut reader = BufReader::new(File::open(path).map_err(io)?);
        let content = Content::read(&mut reader)
            .map_err(|e| EngineError::invalid_model(format!("{}: {e}", path.display())))?;
        // The hyper-parameters come from the same header, read without candle.
        let cfg = ModelConfig::from_gguf_file(path)?;
        let fingerprint = crate::fingerprint::of_content(&content, opts.weights);
        let mut ld = Loader {
            content: &content,
            reader,
            device: &opts.device,
        };
        let layers = (0..cfg.n_layers)
            .map(|i| load_layer(&mut ld, i, opts.weights))
            .collect::<Result<Vec<_>>>()?;
        let norm = ld.vector("output_norm.weight")?;
        let (embed, lm_head) = load_embeddings(&mut ld, opts.weights)?;
        check_shapes(&cfg, &layers, &lm_head)?;
        Ok(Self {
            rope: Rope::new(cfg.head_dim, cfg.rope_theta, cfg.context_length),
            cfg,
            format: opts.weights,
            device: opts.device.clone(),
            embed,
            layers,
            norm,
            lm_head,
            fingerprint,
            clock: StageClock::default(),
        })
    }

    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    pub fn weight_format(&self) -> WeightFormat {
        self.format
    }

    /// Identifies the model file's architecture, tensors and weight format: two
    /// processes whose fingerprints match compute the same K and V (which a
    /// cache then stores in its own element type: [`Model::kv_fingerprint`]).
    pub fn fingerprint(&self) -> u64 {
        self.fingerprint
    }

    /// The fingerprint of this model with a KV cache of `cache`: what a
    /// worker registers and streams, and what its block hashes chain from
    /// (see [`crate::fingerprint`]).
    pub fn kv_fingerprint(&self, cache: KvDtype) -> u64 {
        crate::fingerprint::with_kv_cache(self.fingerprint, cache)
    }

    /// Bytes of weights a decode step reads (all matrices; embeddings excluded,
    /// as only one row per token is read).
    pub fn weight_bytes(&self) -> usize {
        let layers: usize = self
            .layers
            .iter()
            .map(|l| l.qkv.bytes() + l.wo.bytes() + l.gate_up.bytes() + l.down.bytes())
            .sum();
        layers + self.lm_head.bytes()
    }

    /// Multiply-adds of the matmuls per token through the layers (the LM
    /// head, run once per sequence, excluded): the work a prefilled token costs.
    pub fn layer_macs_per_token(&self) -> usize {
        let h = self.cfg.hidden_size;
        self.layers
            .iter()
            .map(|l| {
                h * (l.qkv.out_dim() + l.gate_up.out_dim())
                    + l.wo.out_dim() * h
                    + l.down.out_dim() * self.cfg.ffn_size
            })
            .sum()
    }

    /// Time spent per stage of the forward pass since the last reset.
    pub fn stage_clock(&self) -> &StageClock {
        &self.clock
    }

    /// The KV layout this model reads and writes.
    pub fn kv_layout(&self) -> KvLayout {
        KvLayout {
            n_layers: self.cfg.n_layers,
            n_kv_heads: self.cfg.n_kv_heads,
            head_dim: self.cfg.head_dim,
        }
    }

    /// A KV pool for this model of `budget_tokens` in blocks of
    /// `block_tokens` of `dtype`, with or without the prefix cache.
    pub fn kv_pool(
        &self,
        budget_tokens: usize,
        block_tokens: usize,
        prefix_cache: bool,
        dtype: KvDtype,
    ) -> KvPool {
        let cfg = KvConfig {
            budget_tokens,
            block_tokens,
            prefix_cache,
            fingerprint: self.kv_fingerprint(dtype),
            dtype,
        };
        KvPool::with_config(self.kv_layout(), cfg)
    }

    /// Runs `tokens` (a whole prompt, or the next chunk of one) into `kv` and
    /// returns the logits of the last position.
    pub fn prefill(&self, tokens: &[u32], kv: &mut SeqKv) -> Result<Vec<f32>> {
        let logits = self.forward(&mut [Segment { kv, tokens }], &mut every_layer)?;
        Ok(logits.data)
    }

    /// Advances every sequence by one token; returns `[batch, vocab]` logits.
    pub fn decode_step(&self, batch: &mut [(&mut SeqKv, u32)]) -> Result<Logits> {
        let tokens: Vec<[u32; 1]> = batch.iter().map(|(_, t)| [*t]).collect();
        let mut segs: Vec<Segment> = batch
            .iter_mut()
            .zip(&tokens)
            .map(|((kv, _), t)| Segment { kv, tokens: t })
            .collect();
        self.forward(&mut segs, &mut every_layer)
    }

    /// The general forward: appends each segment's tokens to its KV and returns
    /// the last-position logits of every segment. `on_layer(l, segs)` is
    /// called once layer `l`'s KV is written for all segments (read it with
    /// [`SeqKv::export_rows`] to stream it while the forward goes on); when it
    /// returns `Break`, the later layers are not computed and the forward
    /// fails with [`EngineError::Interrupted`]. On error, no segment's KV
    /// changes.
    pub fn forward(&self, segs: &mut [Segment<'_>], on_layer: &mut OnLayer<'_>) -> Result<Logits> {
        let x = self.hidden(segs, on_layer)?;
        self.head(&x, segs)
    }

    /// Runs `tokens` into `kv` like [`Model::prefill`], and returns the
    /// logits of every position, `[tokens, vocab]` (prompt logprobs).
    pub fn prefill_all_logits(&self, tokens: &[u32], kv: &mut SeqKv) -> Result<Logits> {
        let x = self.hidden(&mut [Segment { kv, tokens }], &mut every_layer)?;
        self.lm_head_rows(x)
    }

    /// Every layer over the batch: the last hidden state of every row.
    fn hidden(&self, segs: &mut [Segment<'_>], on_layer: &mut OnLayer<'_>) -> Result<Vec<f32>> {
        let rows = self.plan(segs)?;
        let result = self.run_layers(segs, &rows, on_layer);
        for s in segs.iter_mut() {
            if result.is_ok() {
                s.kv.commit(s.tokens);
            } else {
                s.kv.rollback();
            }
        }
        result
    }

    /// Validates the batch and maps each row to (segment, position).
    fn plan(&self, segs: &[Segment<'_>]) -> Result<Vec<(usize, usize)>> {
        if segs.is_empty() {
            return Err(EngineError::InvalidInput("empty batch".into()));
        }
        let mut rows = Vec::new();
        for (i, s) in segs.iter().enumerate() {
            if s.tokens.is_empty() {
                return Err(EngineError::InvalidInput(format!(
                    "segment {i} has no tokens"
                )));
            }
            if s.kv.dtype() != segs[0].kv.dtype() {
                return Err(EngineError::InvalidInput(format!(
                    "segment {i}: KV of {:?}, segment 0's of {:?}; one batch reads one cache type",
                    s.kv.dtype(),
                    segs[0].kv.dtype()
                )));
            }
            if s.kv.layout() != self.kv_layout() {
                return Err(EngineError::InvalidInput(format!(
                    "segment {i}: KV layout {:?} does not match the model's {:?}",
                    s.kv.layout(),
                    self.kv_layout()
                )));
            }
            if let Some(bad) = s
                .tokens
                .iter()
                .find(|&&t| t as usize >= self.cfg.vocab_size)
            {
                return Err(EngineError::InvalidInput(format!(
                    "token id {bad} is outside the vocabulary of {}",
                    self.cfg.vocab_size
                )));
            }
            let end = s.kv.len() + s.tokens.len();
            if end > self.rope.max_pos() {
                return Err(EngineError::InvalidInput(format!(
                    "sequence of {end} tokens exceeds the context window of {}",
                    self.rope.max_pos()
                )));
            }
            s.kv.ensure_room(s.tokens.len())?;
            rows.extend((s.kv.len()..end).map(|p| (i, p)));
        }
        Ok(rows)
    }

    fn run_layers(
        &self,
        segs: &mut [Segment<'_>],
        rows: &[(usize, usize)],
        on_layer: &mut OnLayer<'_>,
    ) -> Result<Vec<f32>> {
        let tokens: Vec<u32> = segs.iter().flat_map(|s| s.tokens.iter().copied()).collect();
        let mut x = self.clock.time(Stage::Embed, || self.embed(&tokens))?;
        for (l, layer) in self.layers.iter().enumerate() {
            self.attention_block(l, layer, &mut x, segs, rows)?;
            self.ffn_block(layer, &mut x)?;
            if on_layer(l, segs).is_break() {
                return Err(EngineError::Interrupted { after_layer: l });
            }
        }
        Ok(x)
    }

    fn embed(&self, tokens: &[u32]) -> Result<Vec<f32>> {
        let ids = Tensor::new(tokens, &self.device)?;
        let t = match &self.embed {
            Embedding::Quantized(q) => q.embedding(&ids)?,
            Embedding::Dense(w) => w.index_select(&ids, 0)?,
        };
        Ok(t.flatten_all()?.to_vec1::<f32>()?)
    }

    fn heads(&self) -> Heads {
        Heads {
            n_heads: self.cfg.n_heads,
            n_kv_heads: self.cfg.n_kv_heads,
            head_dim: self.cfg.head_dim,
        }
    }

    fn attention_block(
        &self,
        l: usize,
        layer: &Layer,
        x: &mut [f32],
        segs: &mut [Segment<'_>],
        rows: &[(usize, usize)],
    ) -> Result<()> {
        let c = &self.clock;
        let h = c.time(Stage::Elementwise, || {
            rms_norm(x, &layer.attn_norm, self.cfg.rms_eps)
        });
        let qkv = c.time(Stage::QkvMatmul, || layer.qkv.forward(&h, &self.device))?;
        let (q, k, v) = c.time(Stage::Elementwise, || self.split_rope(&qkv, rows));
        let kv_w = self.kv_layout().row();
        let mut offset = 0;
        for s in segs.iter_mut() {
            let n = s.tokens.len() * kv_w;
            s.kv.append(l, &k[offset..offset + n], &v[offset..offset + n]);
            offset += n;
        }
        let mut attn = vec![0f32; q.len()];
        // `plan` checked that every segment's cache holds one element type.
        c.time(Stage::Attention, || {
            with_elem!(segs[0].kv.dtype(), T => attend::<T>(l, &q, segs, rows, self.heads(), &mut attn))
        });
        let o = c.time(Stage::OutMatmul, || layer.wo.forward(&attn, &self.device))?;
        c.time(Stage::Elementwise, || add_rows(x, &o, self.cfg.hidden_size));
        Ok(())
    }

    /// Splits fused QKV rows into Q, K and V and rotates Q and K.
    fn split_rope(&self, qkv: &[f32], rows: &[(usize, usize)]) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
        let (q_w, kv_w) = (self.cfg.n_heads * self.cfg.head_dim, self.kv_layout().row());
        let n = rows.len();
        let (mut q, mut k, mut v) = (
            vec![0f32; n * q_w],
            vec![0f32; n * kv_w],
            vec![0f32; n * kv_w],
        );
        let (kd, vd) = (Disjoint::new(&mut k), Disjoint::new(&mut v));
        for_rows(&mut q, q_w, PARALLEL_ROWS, |r, q_row| {
            let row = &qkv[r * (q_w + 2 * kv_w)..(r + 1) * (q_w + 2 * kv_w)];
            // SAFETY: row `r` of K and V is written by this call alone, and
            // both vectors outlive it.
            let (k_row, v_row) = unsafe { (kd.rows(r, kv_w), vd.rows(r, kv_w)) };
            q_row.copy_from_slice(&row[..q_w]);
            k_row.copy_from_slice(&row[q_w..q_w + kv_w]);
            v_row.copy_from_slice(&row[q_w + kv_w..]);
            let pos = rows[r].1;
            self.rope.apply(q_row, pos);
            self.rope.apply(k_row, pos);
        });
        (q, k, v)
    }

    fn ffn_block(&self, layer: &Layer, x: &mut [f32]) -> Result<()> {
        let c = &self.clock;
        let h = c.time(Stage::Elementwise, || {
            rms_norm(x, &layer.ffn_norm, self.cfg.rms_eps)
        });
        let gate_up = c.time(Stage::GateUpMatmul, || {
            layer.gate_up.forward(&h, &self.device)
        })?;
        let act = c.time(Stage::Elementwise, || swiglu(&gate_up, self.cfg.ffn_size));
        let d = c.time(Stage::DownMatmul, || layer.down.forward(&act, &self.device))?;
        c.time(Stage::Elementwise, || add_rows(x, &d, self.cfg.hidden_size));
        Ok(())
    }

    /// Final norm and LM head on the last row of each segment.
    fn head(&self, x: &[f32], segs: &[Segment<'_>]) -> Result<Logits> {
        let hidden = self.cfg.hidden_size;
        let mut last = Vec::with_capacity(segs.len() * hidden);
        let mut end = 0;
        for s in segs {
            end += s.tokens.len();
            last.extend_from_slice(&x[(end - 1) * hidden..end * hidden]);
        }
        self.lm_head_rows(last)
    }

    /// Final norm and LM head on every row of `x`.
    fn lm_head_rows(&self, x: Vec<f32>) -> Result<Logits> {
        let data = self.clock.time(Stage::LmHead, || {
            let h = rms_norm(&x, &self.norm, self.cfg.rms_eps);
            self.lm_head.forward(&h, &self.device)
        })?;
        Ok(Logits {
            data,
            vocab: self.lm_head.out_dim(),
        })
    }
}

/// Attention of layer `l` over each segment's KV, read as `T` (the
/// store's element type).
fn attend<T: KvElem>(
    l: usize,
    q: &[f32],
    segs: &[Segment<'_>],
    rows: &[(usize, usize)],
    heads: Heads,
    out: &mut [f32],
) {
    let views: Vec<SeqView<T>> = segs
        .iter()
        .map(|s| SeqView {
            k: s.kv.layer_blocks(l, Half::K),
            v: s.kv.layer_blocks(l, Half::V),
            block_tokens: s.kv.block_tokens(),
        })
        .collect();
    attention(q, &views, rows, heads, out)
}

fn load_layer(ld: &mut Loader<'_>, i: usize, format: WeightFormat) -> Result<Layer> {
    let n = |s: &str| format!("blk.{i}.{s}.weight");
    Ok(Layer {
        attn_norm: ld.vector(&n("attn_norm"))?,
        qkv: ld.linear(&[n("attn_q"), n("attn_k"), n("attn_v")], format)?,
        wo: ld.linear(&[n("attn_output")], format)?,
        ffn_norm: ld.vector(&n("ffn_norm"))?,
        gate_up: ld.linear(&[n("ffn_gate"), n("ffn_up")], format)?,
        down: ld.linear(&[n("ffn_down")], format)?,
    })
}

/// Token embeddings and the LM head, which is tied to them when the file has no `output.weight`.
fn load_embeddings(ld: &mut Loader<'_>, format: WeightFormat) -> Result<(Embedding, Linear)> {
    let has_output = ld.content.tensor_infos.contains_key("output.weight");
    let table = ld.qtensor("token_embd.weight")?;
    if format == WeightFormat::F32 {
        let candle_core::quantized::QMatMul::Tensor(dense) = dequantized(&[table], ld.device)?
        else {
            unreachable!("dequantized always yields an f32 tensor")
        };
        let head = match has_output {
            true => ld.linear(&["output.weight".to_string()], format)?,
            false => Linear::from_f32(dense.clone())?,
        };
        return Ok((Embedding::Dense(dense), head));
    }
    let head = match has_output {
        true => ld.linear(&["output.weight".to_string()], format)?,
        false => Linear::new(vec![ld.qtensor("token_embd.weight")?], format, ld.device)?,
    };
    let embed = match table.dtype() {
        GgmlDType::F32 | GgmlDType::F16 | GgmlDType::BF16 => {
            Embedding::Dense(table.dequantize(ld.device)?)
        }
        _ => Embedding::Quantized(table),
    };
    Ok((embed, head))
}

fn check_shapes(cfg: &ModelConfig, layers: &[Layer], lm_head: &Linear) -> Result<()> {
    let qkv = (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim;
    let bad = layers.iter().any(|l| {
        l.qkv.out_dim() != qkv
            || l.gate_up.out_dim() != 2 * cfg.ffn_size
            || l.wo.out_dim() != cfg.hidden_size
    });
    if bad || lm_head.out_dim() != cfg.vocab_size {
        return Err(EngineError::invalid_model(
            "tensor shapes do not match the metadata's hyper-parameters",
        ));
    }
    Ok(())
}
