//! The text crate's error type.

/// Errors raised reading a model file's metadata, tokenizing and templating.
#[derive(Debug, thiserror::Error)]
pub enum TextError {
    /// The model file could not be opened or read.
    #[error("cannot read model file {path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
    /// The GGUF file is malformed or lacks something that is needed.
    #[error("invalid model file: {0}")]
    InvalidModel(String),
    /// The model's architecture or tokenizer is not supported.
    #[error("unsupported model: {0}")]
    Unsupported(String),
    /// Tokenization or detokenization failed.
    #[error("tokenizer error: {0}")]
    Tokenizer(String),
    /// The chat template could not be compiled or rendered for these messages.
    #[error("chat template error: {0}")]
    ChatTemplate(String),
    /// The caller passed something that cannot be processed (a bad token id, ...).
    #[error("invalid input: {0}")]
    InvalidInput(String),
}

impl TextError {
    /// A short stable name, for metric labels and error codes.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Io { .. } => "io",
            Self::InvalidModel(_) => "invalid_model",
            Self::Unsupported(_) => "unsupported_model",
            Self::Tokenizer(_) => "tokenizer",
            Self::ChatTemplate(_) => "chat_template",
            Self::InvalidInput(_) => "invalid_input",
        }
    }

    /// Reading `path` failed: an I/O error, or a malformed GGUF header.
    pub(crate) fn reading(path: &std::path::Path, e: crate::gguf::GgufError) -> Self {
        match e {
            crate::gguf::GgufError::Io(source) => Self::Io {
                path: path.display().to_string(),
                source,
            },
            other => Self::InvalidModel(format!("{}: {other}", path.display())),
        }
    }
}

/// Result alias for the text crate.
pub type Result<T> = std::result::Result<T, TextError>;
