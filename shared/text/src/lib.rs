//! Everything pdserve knows about a model except its weights: the GGUF
//! header (metadata and tensor directory, never tensor data), the model's
//! hyper-parameters, the tokenizer and chat template, the incremental
//! detokenizer, the stop-sequence matcher and the sampling parameters.
//!
//! It has no tensor library: the router and the mock worker use it without
//! linking candle; the engine builds on it.

pub mod chat;
pub mod config;
pub mod detok;
mod error;
pub mod generation;
pub mod gguf;
pub mod grammar;
pub use pdserve_protocol::hash;
mod metadata;
pub mod sampling;
pub mod segments;
pub mod stop;
pub mod tokenizer;

pub use chat::{ChatMessage, ChatTemplate};
pub use config::{ModelConfig, PromptError};
pub use error::{Result, TextError};
pub use sampling::{Sampled, SamplingError, SamplingParams, TokenCounts};
pub use tokenizer::Tokenizer;
