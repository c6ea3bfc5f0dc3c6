//! Errors of the KV wire format.

/// Everything that can go wrong encoding or decoding a KV stream.
///
/// Messages name the field, the offending value and the limit or expected
/// value; [`KvWireError::kind`] gives a stable name for metrics.
#[derive(thiserror::Error, Debug, Clone, PartialEq)]
pub enum KvWireError {
    /// The stream does not start with the header tag `PDKV`.
    #[error("bad magic: expected header tag \"PDKV\", got \"{}\"", show_tag(got))]
    BadMagic {
        /// The four bytes found instead.
        got: [u8; 4],
    },
    /// A frame tag that is not allowed at this point of the stream.
    #[error("unexpected frame tag \"{}\" (expected {expected})", show_tag(got))]
    UnexpectedTag {
        /// What the decoder expected here.
        expected: &'static str,
        /// The four bytes found.
        got: [u8; 4],
    },
    /// The header's version is not one this crate reads.
    #[error("unsupported KV wire version {version} (supported: {supported})")]
    UnsupportedVersion {
        /// Version found in the header.
        version: u16,
        /// The version this crate supports.
        supported: u16,
    },
    /// The header sets a flag this version does not know.
    #[error("bad header flags {flags:#06x} (only 0x0001, trace context, is known)")]
    BadFlags {
        /// Flags found in the header.
        flags: u16,
    },
    /// A frame's CRC32C does not match its bytes.
    #[error("checksum mismatch in {frame} frame: computed {computed:#010x}, frame carries {stored:#010x}")]
    Checksum {
        /// Which frame: `header`, `layer` or `end`.
        frame: &'static str,
        /// CRC32C computed over the received bytes.
        computed: u32,
        /// CRC32C carried by the frame.
        stored: u32,
    },
    /// A value is larger than the limit allowed for it.
    #[error("{field} = {value} exceeds the limit {limit}")]
    LimitExceeded {
        /// The field (or derived quantity) that is too large.
        field: &'static str,
        /// Its value.
        value: u64,
        /// The largest allowed value.
        limit: u64,
    },
    /// A length does not match the length implied by other fields.
    #[error("bad length: {field} is {got}, expected {expected}")]
    BadLength {
        /// The length field in question.
        field: &'static str,
        /// The length implied by the header and the frame's other fields.
        expected: u64,
        /// The length found.
        got: u64,
    },
    /// A frame does not continue the stream in order.
    #[error("out-of-order frame: {what} should be {expected}, got {got}")]
    OutOfOrder {
        /// What was out of order.
        what: &'static str,
        /// The value the ordering rule requires.
        expected: u64,
        /// The value found.
        got: u64,
    },
    /// The stream ended before its end frame.
    #[error("KV stream truncated: it ended before its end frame")]
    Truncated,
    /// Bytes followed the end frame.
    #[error("trailing data after the end frame")]
    TrailingData,
    /// A field has a value the format does not allow.
    #[error("invalid {field}: {reason}")]
    InvalidField {
        /// The field in question.
        field: &'static str,
        /// Why its value is not allowed.
        reason: String,
    },
    /// A header field differs from what the decode worker expected.
    #[error("{field} mismatch: expected {expected}, got {got}")]
    Mismatch {
        /// The header field in question.
        field: &'static str,
        /// The value the decode worker expected.
        expected: String,
        /// The value the stream carries.
        got: String,
    },
}

impl KvWireError {
    /// A stable snake_case name of the error's kind, for metrics labels.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::BadMagic { .. } => "bad_magic",
            Self::UnexpectedTag { .. } => "unexpected_tag",
            Self::UnsupportedVersion { .. } => "unsupported_version",
            Self::BadFlags { .. } => "bad_flags",
            Self::Checksum { .. } => "checksum",
            Self::LimitExceeded { .. } => "limit_exceeded",
            Self::BadLength { .. } => "bad_length",
            Self::OutOfOrder { .. } => "out_of_order",
            Self::Truncated => "truncated",
            Self::TrailingData => "trailing_data",
            Self::InvalidField { .. } => "invalid_field",
            Self::Mismatch { .. } => "mismatch",
        }
    }

    /// The kind as it crosses the wire in an `ErrorBody`.
    pub fn error_kind(&self) -> crate::error::ErrorKind {
        crate::error::ErrorKind::from_name(self.kind())
    }

    /// Shorthand for [`KvWireError::InvalidField`].
    pub(crate) fn invalid(field: &'static str, reason: impl Into<String>) -> Self {
        Self::InvalidField {
            field,
            reason: reason.into(),
        }
    }

    /// Shorthand for [`KvWireError::LimitExceeded`].
    pub(crate) fn limit(field: &'static str, value: impl Into<u64>, limit: impl Into<u64>) -> Self {
        Self::LimitExceeded {
            field,
            value: value.into(),
            limit: limit.into(),
        }
    }
}

/// The error as it crosses the wire: a stream cut short means its sender
/// died, so another prefill worker may succeed (retryable); anything else is
/// a malformed stream, or a frame that could not be encoded (fatal).
impl From<KvWireError> for crate::internal::ErrorBody {
    fn from(e: KvWireError) -> Self {
        match e {
            KvWireError::Truncated => Self::retryable(e.error_kind(), e.to_string()),
            _ => Self::fatal(e.error_kind(), e.to_string()),
        }
    }
}

/// Renders a tag with non-printable bytes escaped.
fn show_tag(tag: &[u8; 4]) -> String {
    tag.iter()
        .flat_map(|b| std::ascii::escape_default(*b))
        .map(char::from)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::internal::{ErrorBody, ErrorClass};

    #[test]
    fn only_a_truncated_stream_is_retryable() {
        let cut = ErrorBody::from(KvWireError::Truncated);
        assert_eq!(
            (cut.class, cut.kind.as_str()),
            (ErrorClass::Retryable, "truncated")
        );
        let bad = ErrorBody::from(KvWireError::invalid("dtype", "unknown"));
        assert_eq!(
            (bad.class, bad.kind.as_str()),
            (ErrorClass::Fatal, "invalid_field")
        );
    }
}
