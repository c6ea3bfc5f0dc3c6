//! Frame layouts: sizes, field parsing and checksum verification.

use super::types::KvTraceContext;
use super::types::KvTrailer;
use super::{KvDtype, KvHeader, KvWireError, FLAG_TRACE_CONTEXT};
use super::{END_TAG, HEADER_TAG, LAYER_TAG, MAX_REQUEST_ID_LEN, MAX_TOP_LOGPROBS, VERSION};

/// Trailing CRC32C of every frame.
pub(crate) const CRC_LEN: usize = 4;
/// Tag.
pub(crate) const TAG_LEN: usize = 4;
/// Header tag, version, flags and body_len.
pub(crate) const HEADER_PREFIX_LEN: usize = 12;
/// Header body after the request id: fingerprint, dtype, 4 dims, seed.
pub(crate) const HEADER_BODY_FIXED: usize = 8 + 1 + 5 * 4 + 8;
/// The trace context at the end of a header body with [`FLAG_TRACE_CONTEXT`].
pub(crate) const TRACE_CONTEXT_LEN: usize = 16 + 8 + 1;
/// Smallest header body (1-byte request id).
pub(crate) const MIN_HEADER_BODY: usize = 2 + 1 + HEADER_BODY_FIXED;
/// Layer-frame tag and fixed fields, up to the payload.
pub(crate) const LAYER_PREFIX_LEN: usize = 4 + 4 * 4 + 8;
/// End-frame tag, first token, first logprob and n_top.
pub(crate) const END_PREFIX_LEN: usize = 4 + 4 + 4 + 1;
/// One `(token, logprob)` entry of the end frame.
pub(crate) const TOP_ENTRY_LEN: usize = 8;

/// Fixed fields of a layer frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct LayerMeta {
    pub layer_start: u32,
    pub layer_count: u32,
    pub token_start: u32,
    pub token_count: u32,
    pub payload_len: u64,
}

/// A non-panicking little-endian reader over a byte slice.
pub(crate) struct Reader<'a> {
    rest: &'a [u8],
}

impl<'a> Reader<'a> {
    pub fn new(bytes: &'a [u8]) -> Self {
        Self { rest: bytes }
    }

    pub fn array<const N: usize>(&mut self) -> Result<[u8; N], KvWireError> {
        let (head, rest) = self
            .rest
            .split_first_chunk::<N>()
            .ok_or(KvWireError::Truncated)?;
        self.rest = rest;
        Ok(*head)
    }

    pub fn bytes(&mut self, n: usize) -> Result<&'a [u8], KvWireError> {
        let (head, rest) = self
            .rest
            .split_at_checked(n)
            .ok_or(KvWireError::Truncated)?;
        self.rest = rest;
        Ok(head)
    }

    pub fn u8(&mut self) -> Result<u8, KvWireError> {
        Ok(u8::from_le_bytes(self.array()?))
    }

    pub fn u16(&mut self) -> Result<u16, KvWireError> {
        Ok(u16::from_le_bytes(self.array()?))
    }

    pub fn u32(&mut self) -> Result<u32, KvWireError> {
        Ok(u32::from_le_bytes(self.array()?))
    }

    pub fn u64(&mut self) -> Result<u64, KvWireError> {
        Ok(u64::from_le_bytes(self.array()?))
    }

    pub fn f32(&mut self) -> Result<f32, KvWireError> {
        Ok(f32::from_le_bytes(self.array()?))
    }
}

/// Verifies the CRC32C `stored` against the concatenation of `parts`.
pub(crate) fn check_crc(
    frame: &'static str,
    parts: &[&[u8]],
    stored: &[u8],
) -> Result<(), KvWireError> {
    let computed = parts
        .iter()
        .fold(0, |crc, part| crc32c::crc32c_append(crc, part));
    let stored = u32::from_le_bytes(Reader::new(stored).array()?);
    if computed == stored {
        Ok(())
    } else {
        Err(KvWireError::Checksum {
            frame,
            computed,
            stored,
        })
    }
}

/// Verifies a whole frame's trailing CRC and returns the bytes it covers.
pub(crate) fn strip_crc<'a>(frame: &'static str, bytes: &'a [u8]) -> Result<&'a [u8], KvWireError> {
    let (covered, stored) = bytes
        .split_last_chunk::<CRC_LEN>()
        .ok_or(KvWireError::Truncated)?;
    check_crc(frame, &[covered], stored)?;
    Ok(covered)
}

/// The header's body length for a request id of `id_len` bytes and its flags.
pub(crate) fn header_body_len(id_len: usize, flags: u16) -> usize {
    let fixed = if flags & FLAG_TRACE_CONTEXT != 0 {
        2 + HEADER_BODY_FIXED + TRACE_CONTEXT_LEN
    } else {
        2 + HEADER_BODY_FIXED
    };
    id_len.saturating_add(fixed)
}

/// Parses the header prefix and returns the validated `body_len` and flags.
pub(crate) fn parse_header_prefix(bytes: &[u8]) -> Result<(usize, u16), KvWireError> {
    let mut r = Reader::new(bytes);
    let tag = r.array::<TAG_LEN>()?;
    if tag != HEADER_TAG {
        return Err(KvWireError::BadMagic { got: tag });
    }
    let version = r.u16()?;
    if version != VERSION {
        return Err(KvWireError::UnsupportedVersion {
            version,
            supported: VERSION,
        });
    }
    let flags = r.u16()?;
    if flags & !FLAG_TRACE_CONTEXT != 0 {
        return Err(KvWireError::BadFlags { flags });
    }
    let body_len = r.u32()?;
    // The largest body: a 128-byte request id (and the flags' fields).
    let max = header_body_len(MAX_REQUEST_ID_LEN, flags);
    if body_len as usize > max {
        return Err(KvWireError::limit("header body_len", body_len, max as u64));
    }
    if (body_len as usize) < MIN_HEADER_BODY {
        return Err(KvWireError::BadLength {
            field: "header body_len",
            expected: MIN_HEADER_BODY as u64,
            got: u64::from(body_len),
        });
    }
    Ok((body_len as usize, flags))
}

/// Parses a whole header frame (CRC already stripped). Does not apply limits.
pub(crate) fn parse_header(bytes: &[u8]) -> Result<KvHeader, KvWireError> {
    let mut r = Reader::new(bytes);
    let (body_len, flags) = parse_header_prefix(r.bytes(HEADER_PREFIX_LEN)?)?;
    let mut body = Reader::new(r.bytes(body_len)?);
    let id_len = usize::from(body.u16()?);
    let expected = header_body_len(id_len, flags);
    if expected != body_len {
        return Err(KvWireError::BadLength {
            field: "header body_len",
            expected: expected as u64,
            got: body_len as u64,
        });
    }
    let request_id = String::from_utf8(body.bytes(id_len)?.to_vec())
        .map_err(|_| KvWireError::invalid("request_id", "not valid UTF-8"))?;
    Ok(KvHeader {
        request_id,
        model_fingerprint: body.u64()?,
        dtype: KvDtype::from_code(body.u8()?)?,
        n_layers: body.u32()?,
        n_kv_heads: body.u32()?,
        head_dim: body.u32()?,
        n_tokens: body.u32()?,
        start_token: body.u32()?,
        seed: body.u64()?,
        trace: match flags & FLAG_TRACE_CONTEXT {
            0 => None,
            _ => Some(KvTraceContext {
                trace_id: body.array()?,
                span_id: body.array()?,
                trace_flags: body.u8()?,
            }),
        },
    })
}

/// Parses a layer frame's tag and fixed fields.
pub(crate) fn parse_layer_prefix(bytes: &[u8]) -> Result<LayerMeta, KvWireError> {
    let mut r = Reader::new(bytes);
    let tag = r.array::<TAG_LEN>()?;
    if tag != LAYER_TAG {
        return Err(KvWireError::UnexpectedTag {
            expected: "KVLF",
            got: tag,
        });
    }
    Ok(LayerMeta {
        layer_start: r.u32()?,
        layer_count: r.u32()?,
        token_start: r.u32()?,
        token_count: r.u32()?,
        payload_len: r.u64()?,
    })
}

/// Parses an end frame's prefix and returns the validated `n_top`.
pub(crate) fn parse_end_prefix(bytes: &[u8]) -> Result<usize, KvWireError> {
    let mut r = Reader::new(bytes);
    let tag = r.array::<TAG_LEN>()?;
    if tag != END_TAG {
        return Err(KvWireError::UnexpectedTag {
            expected: "KVND",
            got: tag,
        });
    }
    r.bytes(8)?;
    let n_top = r.u8()?;
    if usize::from(n_top) > MAX_TOP_LOGPROBS {
        return Err(KvWireError::limit("n_top", n_top, MAX_TOP_LOGPROBS as u64));
    }
    Ok(usize::from(n_top))
}

/// Parses a whole end frame (CRC already stripped).
pub(crate) fn parse_end(bytes: &[u8]) -> Result<KvTrailer, KvWireError> {
    let n_top = parse_end_prefix(bytes)?;
    let mut r = Reader::new(bytes);
    r.bytes(TAG_LEN)?;
    let first_token = r.u32()?;
    let first_logprob = not_nan("first_logprob", r.f32()?)?;
    r.u8()?;
    let mut top_logprobs = Vec::with_capacity(n_top);
    for _ in 0..n_top {
        let token = r.u32()?;
        top_logprobs.push((token, not_nan("top logprob", r.f32()?)?));
    }
    Ok(KvTrailer {
        first_token,
        first_logprob,
        top_logprobs,
    })
}

/// Rejects NaN logprobs.
pub(crate) fn not_nan(field: &'static str, value: f32) -> Result<f32, KvWireError> {
    if value.is_nan() {
        Err(KvWireError::invalid(field, "logprob is NaN"))
    } else {
        Ok(value)
    }
}
