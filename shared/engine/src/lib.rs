//! The pdserve engine: GGUF Llama loading, a batched forward pass over an
//! external KV cache, and sampling. What needs no tensors (the GGUF header,
//! tokenizer, chat template, detokenizer, stop sequences, model config) is
//! in `pdserve-text`.
//!
//! The model runs on whatever thread calls it; servers put it on dedicated
//! threads (see [`threads::configure`]).

pub mod args;
mod attention;
pub mod device;
mod error;
pub mod fingerprint;
pub mod kv;
pub mod model;
pub mod profile;
pub mod quant;
pub mod sampler;
pub mod simd;
pub mod threads;
mod weights;
mod wire;

pub use error::{EngineError, Result};
pub use kv::{
    BlockCounts, KvConfig, KvDtype, KvError, KvLayout, KvPool, KvUsage, PrefixStats, SeqKv,
    DEFAULT_BLOCK_TOKENS, DEFAULT_KV_DTYPE,
};
pub use model::{every_layer, LoadOptions, Logits, Model, OnLayer, Segment};
pub use pdserve_text::{ChatMessage, ChatTemplate, ModelConfig, PromptError, Tokenizer};
pub use weights::WeightFormat;
