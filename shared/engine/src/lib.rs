//! The pdserve engine: GGUF Llama loading, the tokenizer and chat template, a
//! batched forward pass over an external KV cache, sampling and incremental
//! detokenization.
//!
//! The model runs on whatever thread calls it; servers put it on dedicated
//! threads (see [`threads::configure`]).

pub mod args;
mod attention;
pub mod chat;
pub mod config;
pub mod detok;
pub mod device;
mod error;
pub mod fingerprint;
pub mod kv;
pub mod model;
pub mod profile;
pub mod sampler;
pub mod simd;
pub mod stop;
pub mod testing;
pub mod threads;
pub mod tokenizer;
mod weights;
mod wire;

pub use chat::{ChatMessage, ChatTemplate};
pub use config::{ModelConfig, PromptError};
pub use error::{EngineError, Result};
pub use kv::{KvDtype, KvError, KvLayout, KvPool, KvUsage, SeqKv};
pub use model::{every_layer, LoadOptions, Logits, Model, OnLayer, Segment};
pub use tokenizer::Tokenizer;
pub use weights::WeightFormat;
