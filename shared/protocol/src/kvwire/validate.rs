//! Header validation: structure, limits, and a decode worker's expectations.

use super::{ExpectedKv, KvHeader, KvLimits, KvWireError, MAX_REQUEST_ID_LEN};

impl KvHeader {
    /// Checks the header's fields against the format and `limits`.
    ///
    /// The request id must be 1..=128 bytes of printable ASCII without
    /// spaces (`0x21..=0x7e`); every dimension and `n_tokens` must be at
    /// least 1 and within its limit; and a frame of one layer and one token
    /// must fit in `limits.max_frame_bytes`, or no valid stream could exist.
    /// A trace context's ids must not be all zeros (W3C's invalid ids).
    pub fn validate(&self, limits: &KvLimits) -> Result<(), KvWireError> {
        validate_request_id(&self.request_id)?;
        let dims = [
            ("n_layers", self.n_layers, limits.max_layers),
            ("n_kv_heads", self.n_kv_heads, limits.max_kv_heads),
            ("head_dim", self.head_dim, limits.max_head_dim),
            ("n_tokens", self.n_tokens, limits.max_tokens),
        ];
        for (field, value, limit) in dims {
            if value == 0 {
                return Err(KvWireError::invalid(field, "must be at least 1"));
            }
            if value > limit {
                return Err(KvWireError::limit(field, value, limit));
            }
        }
        let smallest = self.layer_payload_len(1, 1).ok_or_else(|| {
            KvWireError::invalid("n_kv_heads * head_dim", "K/V size overflows u64")
        })?;
        if self.start_token > self.n_tokens {
            return Err(KvWireError::limit(
                "start_token",
                self.start_token,
                self.n_tokens,
            ));
        }
        if let Some(t) = &self.trace {
            if t.trace_id == [0; 16] || t.span_id == [0; 8] {
                return Err(KvWireError::invalid(
                    "trace context",
                    "trace_id and span_id must not be all zeros",
                ));
            }
        }
        if smallest > limits.max_frame_bytes {
            return Err(KvWireError::limit(
                "payload_len of a 1-layer 1-token frame",
                smallest,
                limits.max_frame_bytes,
            ));
        }
        Ok(())
    }
}

/// Checks a request id: 1..=128 bytes, printable ASCII without spaces.
fn validate_request_id(id: &str) -> Result<(), KvWireError> {
    if id.is_empty() {
        return Err(KvWireError::invalid("request_id", "must not be empty"));
    }
    if id.len() > MAX_REQUEST_ID_LEN {
        return Err(KvWireError::limit(
            "request_id length",
            id.len() as u64,
            MAX_REQUEST_ID_LEN as u64,
        ));
    }
    match id.bytes().enumerate().find(|(_, b)| !b.is_ascii_graphic()) {
        Some((offset, byte)) => Err(KvWireError::invalid(
            "request_id",
            format!("byte {byte:#04x} at offset {offset} is not printable ASCII (0x21..=0x7e)"),
        )),
        None => Ok(()),
    }
}

/// Checks a decoded header against what a decode worker expects: same
/// request, same model and geometry, and no more tokens than reserved.
///
/// A differing field is a [`KvWireError::Mismatch`]; `n_tokens` above
/// `expected.max_tokens` is a [`KvWireError::LimitExceeded`].
pub fn validate_against(header: &KvHeader, expected: &ExpectedKv) -> Result<(), KvWireError> {
    if header.request_id != expected.request_id {
        return Err(mismatch(
            "request_id",
            &expected.request_id,
            &header.request_id,
        ));
    }
    if header.model_fingerprint != expected.model_fingerprint {
        return Err(mismatch(
            "model_fingerprint",
            format!("{:#018x}", expected.model_fingerprint),
            format!("{:#018x}", header.model_fingerprint),
        ));
    }
    let dims = [
        ("start_token", expected.start_token, header.start_token),
        ("n_layers", expected.n_layers, header.n_layers),
        ("n_kv_heads", expected.n_kv_heads, header.n_kv_heads),
        ("head_dim", expected.head_dim, header.head_dim),
    ];
    for (field, want, got) in dims {
        if want != got {
            return Err(mismatch(field, want, got));
        }
    }
    if header.n_tokens > expected.max_tokens {
        return Err(KvWireError::limit(
            "n_tokens (reservation)",
            header.n_tokens,
            expected.max_tokens,
        ));
    }
    Ok(())
}

/// Builds a [`KvWireError::Mismatch`].
fn mismatch(field: &'static str, expected: impl ToString, got: impl ToString) -> KvWireError {
    KvWireError::Mismatch {
        field,
        expected: expected.to_string(),
        got: got.to_string(),
    }
}
