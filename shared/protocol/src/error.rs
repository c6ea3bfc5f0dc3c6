//! Errors that cross the wire between the router and the workers: a class
//! (retryable or fatal) that retries branch on, and a typed kind that
//! metrics and the router's error mapping match on. On the wire the kind is
//! the stable snake_case string it always was (`"kv_exhausted"`); a kind
//! this build does not know travels as [`ErrorKind::Other`], unchanged.

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// Whether the same request may succeed if sent again (elsewhere or later).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorClass {
    /// Capacity, a lost peer, a deadline: retry on another worker.
    Retryable,
    /// The request itself is at fault: retrying cannot help.
    Fatal,
}

macro_rules! error_kinds {
    ($($(#[$doc:meta])* $variant:ident => $name:literal,)*) => {
        /// What went wrong, by name. Serialized as the name string.
        #[derive(Debug, Clone, PartialEq, Eq, Hash)]
        pub enum ErrorKind {
            $($(#[$doc])* $variant,)*
            /// A kind this build does not know (a newer peer), kept as sent.
            Other(String),
        }

        impl ErrorKind {
            /// The stable wire name, e.g. `kv_exhausted`.
            pub fn as_str(&self) -> &str {
                match self {
                    $(Self::$variant => $name,)*
                    Self::Other(name) => name,
                }
            }

            /// The kind named `name`; an unknown name is [`ErrorKind::Other`].
            pub fn from_name(name: &str) -> Self {
                match name {
                    $($name => Self::$variant,)*
                    other => Self::Other(other.to_string()),
                }
            }
        }
    };
}

error_kinds! {
    // The request: fatal, retrying cannot help.
    /// The body is not the JSON the endpoint takes.
    InvalidJson => "invalid_json",
    /// A field out of range or missing; an empty prompt; a bad URL.
    InvalidRequest => "invalid_request",
    InvalidRequestId => "invalid_request_id",
    InvalidSampling => "invalid_sampling",
    /// Prompt plus `max_tokens` over the model's context window.
    ContextLengthExceeded => "context_length_exceeded",
    DuplicateRequestId => "duplicate_request_id",
    /// An internal call without the right `Authorization: Bearer` token.
    Unauthorized => "unauthorized",
    /// A prefill job's `kv_destination` is not the reservation URL of a
    /// known decode worker.
    KvDestinationRefused => "kv_destination_refused",
    /// The caller cancelled the job (`DELETE`, or it went away).
    Cancelled => "cancelled",
    /// The sampler refused the logits.
    Sampling => "sampling",
    // Capacity: retry elsewhere or later.
    /// The worker is loading or draining.
    NotReady => "not_ready",
    /// The worker's queue is full.
    Overloaded => "overloaded",
    /// A draining decode worker hands a stream back, unfinished, for the
    /// router to continue on another worker.
    HandedBack => "handed_back",
    /// Not enough free KV now.
    KvExhausted => "kv_exhausted",
    /// More KV than the worker's whole budget: no retry can help.
    KvCapacityExceeded => "kv_capacity_exceeded",
    // The KV transfer between a prefill and a decode worker.
    KvLeaseExpired => "kv_lease_expired",
    UnknownReservation => "unknown_reservation",
    KvUploadFailed => "kv_upload_failed",
    KvStreamBroken => "kv_stream_broken",
    KvStreamTruncated => "kv_stream_truncated",
    KvMismatch => "kv_mismatch",
    KvBadFrame => "kv_bad_frame",
    KvBadFirstToken => "kv_bad_first_token",
    KvBadImport => "kv_bad_import",
    KvLayoutMismatch => "kv_layout_mismatch",
    KvOutOfRange => "kv_out_of_range",
    // A malformed KV stream (`kvwire::KvWireError`).
    BadMagic => "bad_magic",
    UnexpectedTag => "unexpected_tag",
    UnsupportedVersion => "unsupported_version",
    BadFlags => "bad_flags",
    Checksum => "checksum",
    LimitExceeded => "limit_exceeded",
    BadLength => "bad_length",
    OutOfOrder => "out_of_order",
    Truncated => "truncated",
    TrailingData => "trailing_data",
    InvalidField => "invalid_field",
    Mismatch => "mismatch",
    // The worker's engine.
    EngineStopped => "engine_stopped",
    EnginePanic => "engine_panic",
    EngineFailed => "engine_failed",
    DeadlineExceeded => "deadline_exceeded",
    Io => "io",
    InvalidModel => "invalid_model",
    UnsupportedModel => "unsupported_model",
    Tensor => "tensor",
    Tokenizer => "tokenizer",
    ChatTemplate => "chat_template",
    InvalidInput => "invalid_input",
    Interrupted => "interrupted",
}

impl std::fmt::Display for ErrorKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl Serialize for ErrorKind {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.as_str())
    }
}

impl<'de> Deserialize<'de> for ErrorKind {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let name = std::borrow::Cow::<'de, str>::deserialize(d)?;
        Ok(Self::from_name(&name))
    }
}

/// An error that crosses the wire. Retries branch on `class`, metrics and
/// the router's mapping on `kind`, never on `message`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
#[error("{kind}: {message}")]
pub struct ErrorBody {
    pub class: ErrorClass,
    pub kind: ErrorKind,
    pub message: String,
}

impl ErrorBody {
    pub fn retryable(kind: ErrorKind, message: impl Into<String>) -> Self {
        Self {
            class: ErrorClass::Retryable,
            kind,
            message: message.into(),
        }
    }

    pub fn fatal(kind: ErrorKind, message: impl Into<String>) -> Self {
        Self {
            class: ErrorClass::Fatal,
            kind,
            message: message.into(),
        }
    }

    pub fn is_retryable(&self) -> bool {
        self.class == ErrorClass::Retryable
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kinds_travel_as_their_names_and_unknown_ones_survive() {
        let e = ErrorBody::retryable(ErrorKind::KvExhausted, "full");
        let json = serde_json::to_string(&e).unwrap();
        assert_eq!(
            json,
            r#"{"class":"retryable","kind":"kv_exhausted","message":"full"}"#
        );
        assert_eq!(serde_json::from_str::<ErrorBody>(&json).unwrap(), e);
        let newer = r#"{"class":"fatal","kind":"from_the_future","message":"x"}"#;
        let e: ErrorBody = serde_json::from_str(newer).unwrap();
        assert_eq!(e.kind, ErrorKind::Other("from_the_future".into()));
        assert_eq!(serde_json::to_string(&e).unwrap(), newer);
    }

    #[test]
    fn every_name_maps_back_to_its_kind() {
        for kind in [
            ErrorKind::InvalidJson,
            ErrorKind::NotReady,
            ErrorKind::KvLeaseExpired,
            ErrorKind::Truncated,
            ErrorKind::Interrupted,
        ] {
            assert_eq!(ErrorKind::from_name(kind.as_str()), kind);
        }
    }
}
