//! The engine's error type: one enum for everything the engine can report.

use pdserve_protocol::internal::{ErrorBody, ErrorClass, ErrorKind};

use pdserve_text::TextError;

use crate::kv::KvError;

/// Errors raised by model loading, the forward pass, tokenization and templating.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// A tensor operation failed inside candle.
    #[error("tensor operation failed: {0}")]
    Candle(#[from] candle_core::Error),
    /// The KV cache refused an operation (budget exhausted, capacity exceeded, bad import).
    #[error(transparent)]
    Kv(#[from] KvError),
    /// The model file could not be read, is malformed or is not supported
    /// (`TextError::{Io, InvalidModel, Unsupported}`); or tokenizing or
    /// templating failed.
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
    /// The model file is malformed or lacks something the engine needs.
    pub fn invalid_model(message: impl Into<String>) -> Self {
        Self::Text(TextError::InvalidModel(message.into()))
    }

    /// The model's architecture, tensor layout or device is not supported.
    pub fn unsupported(message: impl Into<String>) -> Self {
        Self::Text(TextError::Unsupported(message.into()))
    }

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
