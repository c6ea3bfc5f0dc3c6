//! Helpers shared by the integration tests: building valid streams and
//! decoding them in pieces.
#![allow(dead_code)]

use pdserve_protocol::kvwire::{
    encode_end, encode_header, encode_layer_parts, encode_layers, KvDtype, KvEvent, KvHeader,
    KvLimits, KvStreamDecoder, KvTrailer, KvWireError, LayerFrame,
};

/// One chunk of tokens and how its layers are grouped into frames.
#[derive(Debug, Clone)]
pub struct Chunk {
    pub token_start: u32,
    pub token_count: u32,
    /// `(layer_start, layer_count)` of each frame, in order.
    pub groups: Vec<(u32, u32)>,
}

/// An encoded stream and the events decoding it must yield.
#[derive(Debug, Clone)]
pub struct Stream {
    pub bytes: Vec<u8>,
    pub events: Vec<KvEvent>,
}

pub fn header(dtype: KvDtype, n_layers: u32, heads: u32, head_dim: u32, n_tokens: u32) -> KvHeader {
    KvHeader {
        request_id: "req-0001".to_string(),
        model_fingerprint: 0x0123_4567_89ab_cdef,
        dtype,
        n_layers,
        n_kv_heads: heads,
        head_dim,
        n_tokens,
        start_token: 0,
        seed: 42,
        trace: None,
    }
}

pub fn trailer(n_top: usize) -> KvTrailer {
    KvTrailer {
        first_token: 1234,
        first_logprob: -0.25,
        top_logprobs: (0..n_top).map(|i| (i as u32 * 7, -(i as f32))).collect(),
    }
}

/// Splits `0..n` into runs: a run ends after `i` when bit `i` of `cuts` is set.
pub fn runs(n: u32, cuts: u64) -> Vec<(u32, u32)> {
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

/// Chunks of `n_tokens` (cut by `token_cuts`), each with its layers grouped
/// by `layer_cuts` rotated per chunk.
pub fn plan(n_tokens: u32, n_layers: u32, token_cuts: u64, layer_cuts: u64) -> Vec<Chunk> {
    runs(n_tokens, token_cuts)
        .into_iter()
        .enumerate()
        .map(|(i, (token_start, token_count))| Chunk {
            token_start,
            token_count,
            groups: runs(n_layers, layer_cuts.rotate_left(i as u32 * 3)),
        })
        .collect()
}

/// Deterministic pseudo-random bytes (splitmix64).
pub fn noise(state: &mut u64, len: usize) -> Vec<u8> {
    (0..len)
        .map(|_| {
            *state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = *state;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            (z ^ (z >> 31)) as u8
        })
        .collect()
}

/// Encodes a stream; frames alternate between `encode_layers` and
/// `encode_layer_parts`.
pub fn build(header: &KvHeader, chunks: &[Chunk], trailer: &KvTrailer, seed: u64) -> Stream {
    let mut state = seed;
    let mut bytes = encode_header(header).expect("valid header");
    let mut events = vec![KvEvent::Header(header.clone())];
    let mut frame_no = 0;
    for chunk in chunks {
        let side = chunk.token_count as usize
            * header.n_kv_heads as usize
            * header.head_dim as usize
            * header.dtype.size() as usize;
        for &(layer_start, layer_count) in &chunk.groups {
            let kv: Vec<(Vec<u8>, Vec<u8>)> = (0..layer_count)
                .map(|_| (noise(&mut state, side), noise(&mut state, side)))
                .collect();
            let payload: Vec<u8> = kv
                .iter()
                .flat_map(|(k, v)| [k, v])
                .flatten()
                .copied()
                .collect();
            if frame_no % 2 == 0 {
                encode_layers(
                    layer_start,
                    layer_count,
                    chunk.token_start,
                    chunk.token_count,
                    &payload,
                    &mut bytes,
                )
                .expect("valid frame");
            } else {
                let parts: Vec<(&[u8], &[u8])> = kv.iter().map(|(k, v)| (&k[..], &v[..])).collect();
                encode_layer_parts(
                    layer_start,
                    chunk.token_start,
                    chunk.token_count,
                    &parts,
                    &mut bytes,
                )
                .expect("valid frame");
            }
            frame_no += 1;
            events.push(KvEvent::Layers(LayerFrame {
                layer_start,
                layer_count,
                token_start: chunk.token_start,
                token_count: chunk.token_count,
                payload,
            }));
        }
    }
    bytes.extend(encode_end(trailer).expect("valid trailer"));
    events.push(KvEvent::End(trailer.clone()));
    Stream { bytes, events }
}

/// Decodes `bytes` cut at `cuts` (positions, any order, clamped), then
/// calls `finish`.
pub fn decode_cuts(
    limits: KvLimits,
    bytes: &[u8],
    cuts: &[usize],
) -> Result<Vec<KvEvent>, KvWireError> {
    let mut cuts: Vec<usize> = cuts.iter().map(|&c| c.min(bytes.len())).collect();
    cuts.push(0);
    cuts.push(bytes.len());
    cuts.sort_unstable();
    let mut decoder = KvStreamDecoder::new(limits);
    let mut events = Vec::new();
    for pair in cuts.windows(2) {
        events.extend(decoder.push(&bytes[pair[0]..pair[1]])?);
    }
    decoder.finish()?;
    assert!(decoder.is_complete());
    Ok(events)
}

/// Decodes `bytes` in pieces of `size` bytes.
pub fn decode_chunked(bytes: &[u8], size: usize) -> Result<Vec<KvEvent>, KvWireError> {
    let cuts: Vec<usize> = (size..bytes.len()).step_by(size).collect();
    decode_cuts(KvLimits::default(), bytes, &cuts)
}

/// Recomputes the trailing CRC32C of a whole frame.
pub fn reseal(frame: &mut [u8]) {
    let n = frame.len() - 4;
    let crc = crc32c::crc32c(&frame[..n]);
    frame[n..].copy_from_slice(&crc.to_le_bytes());
}

/// A header frame written field by field (for fields the encoder refuses).
pub fn raw_header(id: &[u8], dtype: u8, dims: [u32; 4]) -> Vec<u8> {
    let mut f = b"PDKV".to_vec();
    f.extend(2u16.to_le_bytes());
    f.extend(0u16.to_le_bytes());
    f.extend((2 + id.len() as u32 + 37).to_le_bytes());
    f.extend((id.len() as u16).to_le_bytes());
    f.extend(id);
    f.extend(7u64.to_le_bytes());
    f.push(dtype);
    for d in dims {
        f.extend(d.to_le_bytes());
    }
    f.extend(0u32.to_le_bytes()); // start_token
    f.extend(9u64.to_le_bytes());
    f.extend([0; 4]);
    reseal(&mut f);
    f
}

/// A layer frame with an arbitrary `payload_len` field and no payload yet.
pub fn layer_prefix(fields: [u32; 4], payload_len: u64) -> Vec<u8> {
    let mut f = b"KVLF".to_vec();
    for x in fields {
        f.extend(x.to_le_bytes());
    }
    f.extend(payload_len.to_le_bytes());
    f
}
