//! Encoders: each function produces one complete frame.

use super::frame::{header_body_len, HEADER_PREFIX_LEN, LAYER_PREFIX_LEN};
use super::frame::{not_nan, parse_header, strip_crc, CRC_LEN, END_PREFIX_LEN, TOP_ENTRY_LEN};
use super::{KvHeader, KvLimits, KvTraceContext, KvTrailer, KvWireError};
use super::{END_TAG, FLAG_TRACE_CONTEXT, HEADER_TAG, LAYER_TAG, MAX_TOP_LOGPROBS, VERSION};

/// Appends a frame's bytes to a buffer while computing its CRC32C.
struct FrameWriter<'a> {
    out: &'a mut Vec<u8>,
    crc: u32,
}

impl<'a> FrameWriter<'a> {
    fn new(out: &'a mut Vec<u8>, tag: &[u8; 4]) -> Self {
        let mut writer = Self { out, crc: 0 };
        writer.put(tag);
        writer
    }

    fn put(&mut self, bytes: &[u8]) {
        self.crc = crc32c::crc32c_append(self.crc, bytes);
        self.out.extend_from_slice(bytes);
    }

    fn finish(self) {
        self.out.extend_from_slice(&self.crc.to_le_bytes());
    }
}

/// Encodes the header frame after checking it with [`KvHeader::validate`]
/// (structure only: [`KvLimits::unlimited`]; the decoder applies its limits).
pub fn encode_header(header: &KvHeader) -> Result<Vec<u8>, KvWireError> {
    header.validate(&KvLimits::unlimited())?;
    let id = header.request_id.as_bytes();
    let id_len = u16::try_from(id.len())
        .map_err(|_| KvWireError::limit("request_id length", id.len() as u64, u16::MAX))?;
    let flags = match header.trace {
        Some(_) => FLAG_TRACE_CONTEXT,
        None => 0,
    };
    let body_len = header_body_len(usize::from(id_len), flags);
    let body_len_u32 = u32::try_from(body_len)
        .map_err(|_| KvWireError::limit("header body_len", body_len as u64, u32::MAX))?;
    let mut out = Vec::with_capacity(body_len.saturating_add(HEADER_PREFIX_LEN + CRC_LEN));
    let mut w = FrameWriter::new(&mut out, &HEADER_TAG);
    w.put(&VERSION.to_le_bytes());
    w.put(&flags.to_le_bytes());
    w.put(&body_len_u32.to_le_bytes());
    w.put(&id_len.to_le_bytes());
    w.put(id);
    w.put(&header.model_fingerprint.to_le_bytes());
    w.put(&[header.dtype.code()]);
    for dim in [
        header.n_layers,
        header.n_kv_heads,
        header.head_dim,
        header.n_tokens,
        header.start_token,
    ] {
        w.put(&dim.to_le_bytes());
    }
    w.put(&header.seed.to_le_bytes());
    if let Some(t) = &header.trace {
        w.put(&t.trace_id);
        w.put(&t.span_id);
        w.put(&[t.trace_flags]);
    }
    w.finish();
    Ok(out)
}

/// Re-encodes one whole header frame with `trace` as its trace context: the
/// transport adds its own span to the header an engine wrote.
pub fn with_trace(header_frame: &[u8], trace: KvTraceContext) -> Result<Vec<u8>, KvWireError> {
    let mut header = parse_header(strip_crc("header", header_frame)?)?;
    header.trace = Some(trace);
    encode_header(&header)
}

/// Appends a layer frame whose payload is already laid out: for each layer
/// in order, its K bytes then its V bytes.
///
/// Checks that both counts are at least 1, that the ranges fit in `u32`, and
/// that the payload splits evenly into `layer_count * 2 * token_count`
/// parts. Whether the size matches the header's geometry is checked by the
/// decoder. On error `out` is left unchanged.
pub fn encode_layers(
    layer_start: u32,
    layer_count: u32,
    token_start: u32,
    token_count: u32,
    payload: &[u8],
    out: &mut Vec<u8>,
) -> Result<(), KvWireError> {
    check_ranges(layer_start, layer_count, token_start, token_count)?;
    let parts = u64::from(layer_count)
        .saturating_mul(2)
        .saturating_mul(u64::from(token_count));
    let len = payload.len() as u64;
    if len == 0 || len.checked_rem(parts) != Some(0) {
        return Err(KvWireError::invalid(
            "payload",
            format!(
                "{len} bytes is not a positive multiple of 2 * layer_count * token_count = {parts}"
            ),
        ));
    }
    write_layer_frame(
        [layer_start, layer_count, token_start, token_count],
        len,
        std::iter::once(payload),
        out,
    );
    Ok(())
}

/// Appends a layer frame from per-layer `(K, V)` byte slices, without
/// first copying them into one payload. `layer_count` is `parts.len()`.
///
/// Every K and V slice must have the same, non-zero length, a multiple of
/// `token_count`. On error `out` is left unchanged.
pub fn encode_layer_parts(
    layer_start: u32,
    token_start: u32,
    token_count: u32,
    parts: &[(&[u8], &[u8])],
    out: &mut Vec<u8>,
) -> Result<(), KvWireError> {
    let layer_count = u32::try_from(parts.len())
        .map_err(|_| KvWireError::limit("layer_count", parts.len() as u64, u32::MAX))?;
    check_ranges(layer_start, layer_count, token_start, token_count)?;
    let side = parts.first().map_or(0, |(k, _)| k.len());
    if side == 0 || side.checked_rem(token_count as usize) != Some(0) {
        return Err(KvWireError::invalid(
            "K/V parts",
            format!("{side} bytes per K is not a positive multiple of token_count = {token_count}"),
        ));
    }
    for (k, v) in parts {
        for got in [k.len(), v.len()] {
            if got != side {
                return Err(KvWireError::BadLength {
                    field: "K/V bytes of a layer",
                    expected: side as u64,
                    got: got as u64,
                });
            }
        }
    }
    let len = (side as u64)
        .saturating_mul(2)
        .saturating_mul(u64::from(layer_count));
    let pieces = parts.iter().flat_map(|(k, v)| [*k, *v]);
    write_layer_frame(
        [layer_start, layer_count, token_start, token_count],
        len,
        pieces,
        out,
    );
    Ok(())
}

/// Checks that both counts are at least 1 and both ranges end within `u32`.
fn check_ranges(
    layer_start: u32,
    layer_count: u32,
    token_start: u32,
    token_count: u32,
) -> Result<(), KvWireError> {
    for (field, count) in [("layer_count", layer_count), ("token_count", token_count)] {
        if count == 0 {
            return Err(KvWireError::invalid(field, "must be at least 1"));
        }
    }
    let ranges = [
        ("layer_start + layer_count", layer_start, layer_count),
        ("token_start + token_count", token_start, token_count),
    ];
    for (field, start, count) in ranges {
        if start.checked_add(count).is_none() {
            let end = u64::from(start).saturating_add(u64::from(count));
            return Err(KvWireError::limit(field, end, u32::MAX));
        }
    }
    Ok(())
}

/// Writes a layer frame: `fields` are layer_start, layer_count,
/// token_start, token_count; `pieces` concatenate to `payload_len` bytes.
fn write_layer_frame<'p>(
    fields: [u32; 4],
    payload_len: u64,
    pieces: impl Iterator<Item = &'p [u8]>,
    out: &mut Vec<u8>,
) {
    let total = usize::try_from(payload_len)
        .unwrap_or(0)
        .saturating_add(LAYER_PREFIX_LEN + CRC_LEN);
    out.reserve(total);
    let mut w = FrameWriter::new(out, &LAYER_TAG);
    for field in fields {
        w.put(&field.to_le_bytes());
    }
    w.put(&payload_len.to_le_bytes());
    for piece in pieces {
        w.put(piece);
    }
    w.finish();
}

/// Encodes the end frame. At most 20 top logprobs; no logprob may be NaN.
pub fn encode_end(trailer: &KvTrailer) -> Result<Vec<u8>, KvWireError> {
    let n_top = trailer.top_logprobs.len();
    if n_top > MAX_TOP_LOGPROBS {
        return Err(KvWireError::limit(
            "n_top",
            n_top as u64,
            MAX_TOP_LOGPROBS as u64,
        ));
    }
    not_nan("first_logprob", trailer.first_logprob)?;
    for &(_, logprob) in &trailer.top_logprobs {
        not_nan("top logprob", logprob)?;
    }
    let mut out = Vec::with_capacity(
        n_top
            .saturating_mul(TOP_ENTRY_LEN)
            .saturating_add(END_PREFIX_LEN + CRC_LEN),
    );
    let mut w = FrameWriter::new(&mut out, &END_TAG);
    w.put(&trailer.first_token.to_le_bytes());
    w.put(&trailer.first_logprob.to_le_bytes());
    w.put(&[n_top as u8]);
    for &(token, logprob) in &trailer.top_logprobs {
        w.put(&token.to_le_bytes());
        w.put(&logprob.to_le_bytes());
    }
    w.finish();
    Ok(out)
}
