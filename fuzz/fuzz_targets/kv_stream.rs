//! The KV stream decoder (`pdserve_protocol::kvwire`), driven the way a
//! decode worker drives it: bytes in pieces of any size, then the decoded
//! header checked against a reservation.
//!
//! Input layout:
//!
//! ```text
//! byte 0      flags: bits 0-1 pick the decoder limits (0 tight, 1 default,
//!             2 unlimited, 3 tight with 64-byte frames); bit 2 picks the
//!             mode: 0 = raw, 1 = structured
//! byte 1      number of cuts k (low 4 bits), then k cut offsets (u16 LE)
//! rest        raw: the stream's bytes
//!             structured: a description of a valid stream (dimensions,
//!             chunk plan, payload, trailer, then one optional corruption),
//!             encoded with the crate's encoders before decoding
//! ```
//!
//! Checked on every input: no panic; no single allocation above 1 MiB; the
//! decoder's buffer stays within the frame's validated size and twice the
//! bytes received; the result (events and error) does not depend on how the
//! input is cut; re-encoding the decoded frames gives back the input's
//! bytes; a failed or completed decoder stays so; decoded headers pass
//! their own validation and the reservation built from their shape. In
//! structured mode a valid stream decodes to exactly what was encoded, and
//! a corrupted, truncated or extended one is an error.

#![no_main]

use libfuzzer_sys::arbitrary::{Result as ArbResult, Unstructured};
use libfuzzer_sys::fuzz_target;
use pdserve_fuzz::{cap_allocations, pieces, split_cuts};
use pdserve_protocol::kvwire::{
    encode_end, encode_header, encode_layer_parts, encode_layers, validate_against, ExpectedKv,
    KvDtype, KvEvent, KvHeader, KvLimits, KvShape, KvStreamDecoder, KvTraceContext, KvTrailer,
    KvWireError,
    LayerFrame,
};

fuzz_target!(|data: &[u8]| {
    cap_allocations(1 << 20);
    let Some((&flags, rest)) = data.split_first() else {
        return;
    };
    let limits = match flags & 3 {
        0 => tight(),
        1 => KvLimits::default(),
        2 => KvLimits::unlimited(),
        _ => KvLimits {
            max_frame_bytes: 64,
            ..tight()
        },
    };
    let (cuts, rest) = split_cuts(rest);
    if flags & 4 == 0 {
        raw(limits, rest, &cuts);
    } else if let Ok(stream) = structured(&mut Unstructured::new(rest)) {
        check_structured(limits, flags & 3, &stream, &cuts);
    }
});

/// The limits of the crate's property tests: small, as a decode worker's are
/// compared with what an attacker can claim.
fn tight() -> KvLimits {
    KvLimits {
        max_layers: 8,
        max_kv_heads: 8,
        max_head_dim: 8,
        max_tokens: 16,
        max_frame_bytes: 4096,
    }
}

/// The reservation of the seed corpus' streams.
fn fixed_expected() -> ExpectedKv {
    KvShape {
        fingerprint: 0x0123_4567_89ab_cdef,
        n_layers: 2,
        n_kv_heads: 2,
        head_dim: 4,
    }
    .expected("req-0001", (0, 4))
}

/// What decoding an input in given pieces produced.
#[derive(Debug)]
struct Outcome {
    /// Events of the pushes that succeeded.
    events: Vec<KvEvent>,
    /// The first error, or `finish()`'s verdict.
    result: Result<(), KvWireError>,
}

/// Decodes `bytes` cut at `cuts`, checking the decoder's invariants as it goes.
fn decode(limits: KvLimits, bytes: &[u8], cuts: &[usize]) -> Outcome {
    let mut decoder = KvStreamDecoder::new(limits);
    let mut events = Vec::new();
    let mut pushed = 0usize;
    let mut result = Ok(());
    for piece in pieces(bytes, cuts) {
        pushed += piece.len();
        let r = decoder.push(piece);
        let cap = decoder.buffered_capacity();
        assert!(
            cap <= pushed.saturating_mul(2).saturating_add(1024),
            "buffered {cap} bytes after receiving {pushed}"
        );
        if let Ok(frame) = usize::try_from(limits.max_frame_bytes) {
            assert!(
                cap <= frame.saturating_add(1024),
                "buffered {cap} bytes with frames limited to {frame}"
            );
        }
        match r {
            Ok(ev) => {
                for e in &ev {
                    check_event(&limits, e);
                }
                events.extend(ev);
            }
            Err(err) => {
                // A failed decoder stays failed with the same error.
                assert_eq!(decoder.push(b"x").as_ref(), Err(&err));
                assert_eq!(decoder.push(b"").as_ref(), Err(&err));
                assert_eq!(decoder.finish().as_ref(), Err(&err));
                assert!(!decoder.is_complete());
                result = Err(err);
                break;
            }
        }
    }
    if result.is_ok() {
        result = decoder.finish();
        if result.is_ok() {
            assert!(decoder.is_complete());
            assert!(matches!(events.last(), Some(KvEvent::End(_))));
            assert_eq!(decoder.push(b"").map(|e| e.len()), Ok(0));
            assert_eq!(decoder.push(b"\0"), Err(KvWireError::TrailingData));
        }
    }
    // The header, once decoded, is the first event and the decoder's.
    if let Some(KvEvent::Header(h)) = events.first() {
        assert_eq!(decoder.header(), Some(h));
    }
    Outcome { events, result }
}

/// Invariants of one decoded frame.
fn check_event(limits: &KvLimits, event: &KvEvent) {
    match event {
        KvEvent::Header(h) => check_header(limits, h),
        KvEvent::Layers(frame) => {
            let end = frame.layer_start.checked_add(frame.layer_count);
            assert!(end.is_some() && frame.layer_count >= 1 && frame.token_count >= 1);
            let side = frame.payload.len() / frame.layer_count as usize / 2;
            for layer in frame.layer_start..frame.layer_start + frame.layer_count {
                let (k, v) = frame
                    .layer_kv(layer)
                    .expect("every carried layer has K and V");
                assert_eq!((k.len(), v.len()), (side, side));
            }
            assert!(frame
                .layer_kv(frame.layer_start + frame.layer_count)
                .is_none());
            if let Some(before) = frame.layer_start.checked_sub(1) {
                assert!(frame.layer_kv(before).is_none());
            }
        }
        KvEvent::End(t) => {
            assert!(!t.first_logprob.is_nan());
            assert!(t.top_logprobs.len() <= pdserve_protocol::kvwire::MAX_TOP_LOGPROBS);
            assert!(t.top_logprobs.iter().all(|(_, lp)| !lp.is_nan()));
        }
    }
}

/// A decoded header passes validation and the reservation of its own shape,
/// and the fixed reservation exactly when its fields match.
fn check_header(limits: &KvLimits, h: &KvHeader) {
    assert_eq!(h.validate(limits), Ok(()));
    let shape = KvShape {
        fingerprint: h.model_fingerprint,
        n_layers: h.n_layers,
        n_kv_heads: h.n_kv_heads,
        head_dim: h.head_dim,
    };
    let own = shape.expected(&h.request_id, (h.start_token, h.n_tokens));
    assert_eq!(validate_against(h, &own), Ok(()));
    let rebuilt = KvHeader {
        trace: h.trace,
        ..shape.header(&h.request_id, (h.start_token, h.n_tokens), h.seed, h.dtype)
    };
    assert_eq!(&rebuilt, h);
    let smaller = ExpectedKv {
        max_tokens: h.n_tokens - 1,
        ..own
    };
    assert!(matches!(
        validate_against(h, &smaller),
        Err(KvWireError::LimitExceeded { .. })
    ));
    let fixed = fixed_expected();
    let matches = h.request_id == fixed.request_id
        && h.model_fingerprint == fixed.model_fingerprint
        && h.start_token == fixed.start_token
        && (h.n_layers, h.n_kv_heads, h.head_dim)
            == (fixed.n_layers, fixed.n_kv_heads, fixed.head_dim)
        && h.n_tokens <= fixed.max_tokens;
    assert_eq!(validate_against(h, &fixed).is_ok(), matches);
}

/// The bytes of `events`, encoded again.
fn encode(events: &[KvEvent]) -> Vec<u8> {
    let mut out = Vec::new();
    for e in events {
        match e {
            KvEvent::Header(h) => out.extend(encode_header(h).expect("a decoded header encodes")),
            KvEvent::Layers(f) => encode_layers(
                f.layer_start,
                f.layer_count,
                f.token_start,
                f.token_count,
                &f.payload,
                &mut out,
            )
            .expect("a decoded layer frame encodes"),
            KvEvent::End(t) => out.extend(encode_end(t).expect("a decoded trailer encodes")),
        }
    }
    out
}

/// Arbitrary bytes: the outcome does not depend on the cuts, and what
/// decodes is exactly what the input said.
fn raw(limits: KvLimits, bytes: &[u8], cuts: &[usize]) {
    let chunked = decode(limits, bytes, cuts);
    let whole = decode(limits, bytes, &[]);
    let every: Vec<usize> = (0..=bytes.len()).collect();
    let bytewise = decode(limits, bytes, &every);
    assert_eq!(chunked.result, bytewise.result, "cut at {cuts:?}");
    assert_eq!(whole.result, bytewise.result);
    // A failing push drops its events, so smaller pieces see more of them.
    assert!(bytewise.events.starts_with(&chunked.events));
    assert!(chunked.events.starts_with(&whole.events));
    let reencoded = encode(&bytewise.events);
    assert!(
        bytes.starts_with(&reencoded),
        "decoded frames re-encode differently"
    );
    if bytewise.result.is_ok() {
        assert_eq!(chunked.events, bytewise.events);
        assert_eq!(whole.events, bytewise.events);
        assert_eq!(reencoded, bytes);
    }
}

/// A valid stream built from fuzzer input, and one way to damage it.
#[derive(Debug)]
struct Structured {
    bytes: Vec<u8>,
    events: Vec<KvEvent>,
    damage: Damage,
}

#[derive(Debug)]
enum Damage {
    None,
    /// XOR the byte at this index (modulo the length) with a non-zero mask.
    Flip(usize, u8),
    /// Keep only this many bytes (modulo the length).
    Truncate(usize),
    /// Append a byte.
    Extend(u8),
}

/// `0..n` split into runs: a run ends after `i` when bit `i` of `cuts` is set.
fn runs(n: u32, cuts: u64) -> Vec<(u32, u32)> {
    let mut out = Vec::new();
    let mut start = 0;
    for i in 0..n {
        if i + 1 == n || cuts >> (i % 64) & 1 == 1 {
            out.push((start, i + 1 - start));
            start = i + 1;
        }
    }
    out
}

fn structured(u: &mut Unstructured) -> ArbResult<Structured> {
    let header = arbitrary_header(u)?;
    let mut bytes = encode_header(&header).expect("a valid header encodes");
    let mut events = vec![KvEvent::Header(header.clone())];
    layer_frames(u, &header, &mut bytes, &mut events)?;
    let trailer = arbitrary_trailer(u)?;
    bytes.extend(encode_end(&trailer).expect("a valid trailer encodes"));
    events.push(KvEvent::End(trailer));
    let damage = match u.int_in_range(0..=3u8)? {
        0 => Damage::None,
        1 => Damage::Flip(u.arbitrary()?, u.int_in_range(1..=255)?),
        2 => Damage::Truncate(u.arbitrary()?),
        _ => Damage::Extend(u.arbitrary()?),
    };
    Ok(Structured {
        bytes,
        events,
        damage,
    })
}

fn arbitrary_header(u: &mut Unstructured) -> ArbResult<KvHeader> {
    let dtype = if u.arbitrary()? {
        KvDtype::F16
    } else {
        KvDtype::F32
    };
    let n_layers = u.int_in_range(1..=4u32)?;
    let n_kv_heads = u.int_in_range(1..=3u32)?;
    let head_dim = u.int_in_range(1..=4u32)?;
    let n_tokens = u.int_in_range(1..=6u32)?;
    let start_token = u.int_in_range(0..=n_tokens)?;
    let id_len = u.int_in_range(1..=128usize)?;
    let request_id = (0..id_len)
        .map(|_| Ok(char::from(u.int_in_range(0x21..=0x7eu8)?)))
        .collect::<ArbResult<String>>()?;
    Ok(KvHeader {
        request_id,
        model_fingerprint: u.arbitrary()?,
        dtype,
        n_layers,
        n_kv_heads,
        head_dim,
        n_tokens,
        start_token,
        seed: u.arbitrary()?,
        trace: arbitrary_trace(u)?,
    })
}

/// No trace context, or one with ids that are not all zeros.
fn arbitrary_trace(u: &mut Unstructured) -> ArbResult<Option<KvTraceContext>> {
    if !u.arbitrary::<bool>()? {
        return Ok(None);
    }
    let (mut trace_id, mut span_id): ([u8; 16], [u8; 8]) = (u.arbitrary()?, u.arbitrary()?);
    trace_id[0] |= 1;
    span_id[0] |= 1;
    Ok(Some(KvTraceContext {
        trace_id,
        span_id,
        trace_flags: u.arbitrary()?,
    }))
}

/// Layer frames over the header's token range, cut into arbitrary runs of
/// tokens and layers, each encoded by one of the two encoders.
fn layer_frames(
    u: &mut Unstructured,
    h: &KvHeader,
    bytes: &mut Vec<u8>,
    events: &mut Vec<KvEvent>,
) -> ArbResult<()> {
    let side = (h.n_kv_heads * h.head_dim) as usize * h.dtype.size() as usize;
    let (token_cuts, layer_cuts): (u64, u64) = (u.arbitrary()?, u.arbitrary()?);
    for (i, (t0, tc)) in runs(h.n_tokens - h.start_token, token_cuts)
        .into_iter()
        .enumerate()
    {
        let token_start = h.start_token + t0;
        for (layer_start, layer_count) in runs(h.n_layers, layer_cuts.rotate_left(i as u32 * 3)) {
            let len = side * tc as usize;
            let mut kv = Vec::new();
            for _ in 0..layer_count * 2 {
                let mut part = vec![0u8; len];
                u.fill_buffer(&mut part)?;
                kv.push(part);
            }
            let payload: Vec<u8> = kv.concat();
            if u.arbitrary()? {
                encode_layers(layer_start, layer_count, token_start, tc, &payload, bytes)
            } else {
                let parts: Vec<(&[u8], &[u8])> = kv
                    .chunks_exact(2)
                    .map(|p| (p[0].as_slice(), p[1].as_slice()))
                    .collect();
                encode_layer_parts(layer_start, token_start, tc, &parts, bytes)
            }
            .expect("a valid frame encodes");
            events.push(KvEvent::Layers(LayerFrame {
                layer_start,
                layer_count,
                token_start,
                token_count: tc,
                payload,
            }));
        }
    }
    Ok(())
}

fn arbitrary_trailer(u: &mut Unstructured) -> ArbResult<KvTrailer> {
    let not_nan = |x: f32| if x.is_nan() { -1.0 } else { x };
    let n_top = u.int_in_range(0..=20usize)?;
    Ok(KvTrailer {
        first_token: u.arbitrary()?,
        first_logprob: not_nan(u.arbitrary()?),
        top_logprobs: (0..n_top)
            .map(|_| Ok((u.arbitrary()?, not_nan(u.arbitrary()?))))
            .collect::<ArbResult<_>>()?,
    })
}

fn check_structured(limits: KvLimits, which: u8, s: &Structured, cuts: &[usize]) {
    // Every generated stream fits the tight limits; 64-byte frames may not.
    let fits = which != 3;
    let mut bytes = s.bytes.clone();
    match s.damage {
        Damage::None => {
            let out = decode(limits, &bytes, cuts);
            if fits {
                assert_eq!(out.result, Ok(()));
                assert_eq!(out.events, s.events);
            }
            raw(limits, &bytes, cuts);
            return;
        }
        Damage::Flip(at, mask) => {
            let at = at % bytes.len();
            bytes[at] ^= mask;
            let out = decode(limits, &bytes, cuts);
            assert!(out.result.is_err(), "flipping byte {at} went unnoticed");
        }
        Damage::Truncate(len) => {
            bytes.truncate(len % bytes.len());
            let out = decode(limits, &bytes, cuts);
            if fits {
                assert_eq!(out.result, Err(KvWireError::Truncated));
            }
        }
        Damage::Extend(b) => {
            bytes.push(b);
            let out = decode(limits, &bytes, cuts);
            if fits {
                assert_eq!(out.result, Err(KvWireError::TrailingData));
            }
        }
    }
    raw(limits, &bytes, cuts);
}
