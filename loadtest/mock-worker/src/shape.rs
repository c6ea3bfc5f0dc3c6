//! What the mock knows of the model: its shape, read from the GGUF header
//! (no weights), and a fingerprint of its own.

use pdserve_engine::fingerprint::Fnv64;
use pdserve_engine::ModelConfig;
use pdserve_protocol::kvwire::{ExpectedKv, KvDtype, KvHeader};

use crate::tokens::FIRST_ID;

/// The model's shape as the KV stream and validation see it.
#[derive(Debug, Clone)]
pub struct MockShape {
    pub config: ModelConfig,
    pub n_layers: u32,
    pub n_kv_heads: u32,
    pub head_dim: u32,
    pub vocab: u32,
    /// Shared by mock prefill and mock decode workers of one shape, and
    /// never equal to a real worker's: KV only flows between mocks.
    pub fingerprint: u64,
}

/// Why a GGUF's shape cannot drive the mock.
#[derive(Debug, thiserror::Error)]
pub enum ShapeError {
    #[error("{field} = {value} does not fit the KV wire format")]
    TooLarge { field: &'static str, value: usize },
    #[error("a vocabulary of {0} tokens leaves no ids to generate beyond the special ones")]
    TinyVocabulary(usize),
}

impl ShapeError {
    pub fn kind(&self) -> &'static str {
        match self {
            Self::TooLarge { .. } => "shape_too_large",
            Self::TinyVocabulary(_) => "tiny_vocabulary",
        }
    }
}

fn to_u32(field: &'static str, value: usize) -> Result<u32, ShapeError> {
    u32::try_from(value).map_err(|_| ShapeError::TooLarge { field, value })
}

impl MockShape {
    pub fn new(config: ModelConfig) -> Result<Self, ShapeError> {
        let vocab = to_u32("vocab_size", config.vocab_size)?;
        if vocab <= FIRST_ID {
            return Err(ShapeError::TinyVocabulary(config.vocab_size));
        }
        let mut shape = Self {
            n_layers: to_u32("n_layers", config.n_layers)?,
            n_kv_heads: to_u32("n_kv_heads", config.n_kv_heads)?,
            head_dim: to_u32("head_dim", config.head_dim)?,
            vocab,
            fingerprint: 0,
            config,
        };
        let mut h = Fnv64::default();
        h.write(b"pdserve-mock-worker/1");
        let c = &shape.config;
        for dim in [
            c.n_layers,
            c.n_kv_heads,
            c.head_dim,
            c.vocab_size,
            c.context_length,
        ] {
            h.write(&(dim as u64).to_le_bytes());
        }
        shape.fingerprint = h.finish();
        Ok(shape)
    }

    /// The header of a KV stream of `n_tokens` tokens.
    pub fn header(&self, request_id: &str, n_tokens: u32, seed: u64, dtype: KvDtype) -> KvHeader {
        KvHeader {
            request_id: request_id.to_string(),
            model_fingerprint: self.fingerprint,
            dtype,
            n_layers: self.n_layers,
            n_kv_heads: self.n_kv_heads,
            head_dim: self.head_dim,
            n_tokens,
            seed,
        }
    }

    /// What a decode reservation for a prompt of `n_tokens` accepts.
    pub fn expected(&self, request_id: &str, n_tokens: u32) -> ExpectedKv {
        ExpectedKv {
            request_id: request_id.to_string(),
            model_fingerprint: self.fingerprint,
            n_layers: self.n_layers,
            n_kv_heads: self.n_kv_heads,
            head_dim: self.head_dim,
            max_tokens: n_tokens,
        }
    }
}
