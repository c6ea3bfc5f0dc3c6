//! The engine's error type: one enum for everything the engine can report.

use pdserve_protocol::internal::{ErrorBody, ErrorClass, ErrorKind};

use crate::kv::KvError;

/// Errors raised by model loading, the forward pass, tokenization and templating.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// The model file could not be opened or read.
    #[error("cannot read model file {path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
    /// The GGUF file is malformed or lacks something the engine needs.
    #[error("invalid model file: {0}")]
    InvalidModel(String),
    /// The model's architecture or tensor layout is not supported.
    #[error("unsupported model: {0}")]
    Unsupported(String),
    /// A tensor operation failed inside candle.
    #[error("tensor operation failed: {0}")]
    Candle(#[from] candle_core::Error),
    /// The KV cache refused an operation (budget exhausted, capacity exceeded, bad import).
    #[error(transparent)]
    Kv(#[from] KvError),
    /// Reading the model's metadata, tokenizing or templating failed.
    #[error(transparent)]
    Text(#[from] pdserve_text::TextError),
    /// The caller passed something the engine cannot process (empty prompt, bad token id, ...).
    #[error("invalid input: {0}")]
    InvalidInput(String),
    /// The layer callback stopped the forward pass (cancelled, or nobody
    /// wants the result any more); the segments' KV is unchanged.
    #[error("the forward pass was stopped after layer {after_layer}")]
    Interrupted { after_layer: usize },
}

impl EngineError {
    /// The error as it crosses the wire, with `class`.
    pub fn to_wire(&self, class: ErrorClass) -> ErrorBody {
        ErrorBody {
            class,
            kind: ErrorKind::from_name(self.kind()),
            message: self.to_string(),
        }
    }

    /// A short stable name, for metric labels and error codes.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Io { .. } => "io",
            Self::InvalidModel(_) => "invalid_model",
            Self::Unsupported(_) => "unsupported_model",
            Self::Candle(_) => "tensor",
            Self::Kv(e) => e.kind(),
            Self::Text(e) => e.kind(),
            Self::InvalidInput(_) => "invalid_input",
            Self::Interrupted { .. } => "interrupted",
        }
    }
}

/// Result alias for the engine.
pub type Result<T> = std::result::Result<T, EngineError>;
