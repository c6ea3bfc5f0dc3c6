//! Model hyper-parameters, read from GGUF metadata (nothing is hard-coded per model).

use crate::error::{Result, TextError};
use crate::gguf::Header;
use crate::metadata::Metadata;

/// Architectures whose tensors follow the Llama layout in GGUF.
const LLAMA_FAMILY: &[&str] = &["llama", "mistral"];

/// Hyper-parameters of a Llama-family transformer.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    /// `general.architecture`, e.g. `llama`.
    pub architecture: String,
    /// `general.name`, when present.
    pub name: Option<String>,
    pub n_layers: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub hidden_size: usize,
    pub ffn_size: usize,
    pub vocab_size: usize,
    /// Trained context window in tokens.
    pub context_length: usize,
    pub rope_theta: f32,
    pub rms_eps: f64,
}

impl ModelConfig {
    /// Reads the configuration from a parsed GGUF header.
    pub fn from_gguf(content: &Header) -> Result<Self> {
        let md = Metadata(&content.metadata);
        let architecture = md.string("general.architecture")?;
        if !LLAMA_FAMILY.contains(&architecture.as_str()) {
            return Err(TextError::Unsupported(format!(
                "architecture `{architecture}` (supported: {})",
                LLAMA_FAMILY.join(", ")
            )));
        }
        let key = |k: &str| format!("{architecture}.{k}");
        let hidden_size = md.usize(&key("embedding_length"))?;
        let n_heads = md.usize(&key("attention.head_count"))?;
        let n_kv_heads = md
            .opt_usize(&key("attention.head_count_kv"))?
            .unwrap_or(n_heads);
        let head_dim = match md.opt_usize(&key("rope.dimension_count"))? {
            Some(d) => d,
            None => hidden_size / n_heads.max(1),
        };
        let vocab_size = match content.tensors.get("token_embd.weight") {
            Some(info) => info.shape().first().copied().unwrap_or(0),
            None => return Err(TextError::InvalidModel("no token_embd.weight".into())),
        };
        let cfg = Self {
            name: md.opt_string("general.name"),
            n_layers: md.usize(&key("block_count"))?,
            ffn_size: md.usize(&key("feed_forward_length"))?,
            context_length: md.usize(&key("context_length"))?,
            rope_theta: md.opt_f32(&key("rope.freq_base"))?.unwrap_or(10_000.0),
            rms_eps: md
                .opt_f32(&key("attention.layer_norm_rms_epsilon"))?
                .unwrap_or(1e-5) as f64,
            architecture,
            n_heads,
            n_kv_heads,
            head_dim,
            hidden_size,
            vocab_size,
        };
        cfg.validate()?;
        Ok(cfg)
    }

    /// Reads the configuration from a GGUF file's header (no tensor data).
    pub fn from_gguf_file(path: impl AsRef<std::path::Path>) -> Result<Self> {
        let path = path.as_ref();
        let header = Header::read_file(path).map_err(|e| TextError::reading(path, e))?;
        Self::from_gguf(&header)
    }

    fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(TextError::InvalidModel(m));
        if self.n_layers == 0 || self.n_heads == 0 || self.n_kv_heads == 0 || self.head_dim == 0 {
            return bad(format!("degenerate shape: {self:?}"));
        }
        if !self.n_heads.is_multiple_of(self.n_kv_heads) {
            return bad(format!(
                "{} heads is not a multiple of {} KV heads",
                self.n_heads, self.n_kv_heads
            ));
        }
        if !self.head_dim.is_multiple_of(2) {
            return bad(format!(
                "head_dim {} is odd; rope needs pairs",
                self.head_dim
            ));
        }
        if self.context_length == 0 || self.vocab_size == 0 {
            return bad("context length and vocabulary must be non-empty".into());
        }
        Ok(())
    }

    /// Checks a prompt and its generation budget against the vocabulary and
    /// the context window; the error names what is wrong and has a stable kind.
    pub fn check_prompt(
        &self,
        tokens: &[u32],
        max_new_tokens: usize,
    ) -> std::result::Result<(), PromptError> {
        if tokens.is_empty() {
            return Err(PromptError::Empty);
        }
        if let Some(&t) = tokens.iter().find(|&&t| t as usize >= self.vocab_size) {
            return Err(PromptError::OutOfVocabulary {
                token: t,
                vocab: self.vocab_size,
            });
        }
        let total = tokens.len() + max_new_tokens;
        match total > self.context_length {
            true => Err(PromptError::TooLong {
                total,
                context: self.context_length,
            }),
            false => Ok(()),
        }
    }

    /// Query heads per KV head.
    pub fn gqa_group(&self) -> usize {
        self.n_heads / self.n_kv_heads
    }

    /// f32 values of K plus V per token, over all layers.
    pub fn kv_values_per_token(&self) -> usize {
        2 * self.n_layers * self.n_kv_heads * self.head_dim
    }

    /// Multiply-accumulates per token in the matmuls (≈ FLOPs / 2), attention excluded.
    pub fn matmul_macs_per_token(&self) -> usize {
        let h = self.hidden_size;
        let qkv = h * (self.n_heads + 2 * self.n_kv_heads) * self.head_dim;
        let o = self.n_heads * self.head_dim * h;
        let ffn = 3 * h * self.ffn_size;
        self.n_layers * (qkv + o + ffn) + h * self.vocab_size
    }
}

/// Why a prompt cannot run.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PromptError {
    #[error("the prompt is empty")]
    Empty,
    #[error("token id {token} is outside the vocabulary of {vocab}")]
    OutOfVocabulary { token: u32, vocab: usize },
    #[error("prompt plus generated tokens is {total} tokens; the context window is {context}")]
    TooLong { total: usize, context: usize },
}

impl PromptError {
    /// A stable name for error codes and metric labels.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::TooLong { .. } => "context_length_exceeded",
            _ => "invalid_request",
        }
    }
}

impl From<PromptError> for pdserve_protocol::internal::ErrorBody {
    fn from(e: PromptError) -> Self {
        use pdserve_protocol::internal::ErrorKind;
        let kind = match e {
            PromptError::TooLong { .. } => ErrorKind::ContextLengthExceeded,
            _ => ErrorKind::InvalidRequest,
        };
        Self::fatal(kind, e.to_string())
    }
}
