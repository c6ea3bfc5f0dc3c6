//! What the mock knows of the model: its shape, read from the GGUF header
//! (no weights), and a fingerprint of its own.

use pdserve_protocol::kvwire::KvShape;
use pdserve_text::hash::Fnv64;
use pdserve_text::ModelConfig;

use crate::tokens::FIRST_ID;

/// The model's shape as the KV stream and validation see it.
#[derive(Debug, Clone)]
pub struct MockShape {
    pub config: ModelConfig,
    /// Its fingerprint is shared by mock prefill and mock decode workers of
    /// one shape, and never equal to a real worker's: KV only flows between
    /// mocks.
    pub kv: KvShape,
    pub vocab: u32,
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
        let mut h = Fnv64::default();
        h.write(b"pdserve-mock-worker/1");
        let c = &config;
        for dim in [
            c.n_layers,
            c.n_kv_heads,
            c.head_dim,
            c.vocab_size,
            c.context_length,
        ] {
            h.write(&(dim as u64).to_le_bytes());
        }
        let kv = KvShape {
            fingerprint: h.finish(),
            n_layers: to_u32("n_layers", config.n_layers)?,
            n_kv_heads: to_u32("n_kv_heads", config.n_kv_heads)?,
            head_dim: to_u32("head_dim", config.head_dim)?,
        };
        Ok(Self { config, kv, vocab })
    }
}
