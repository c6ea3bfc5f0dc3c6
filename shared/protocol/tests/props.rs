//! Property tests: exact round trips, corruption and truncation detection,
//! and bounded memory on arbitrary input.

mod common;

use common::{build, decode_cuts, header, plan, Stream};
use pdserve_protocol::kvwire::{
    encode_header, KvDtype, KvLimits, KvStreamDecoder, KvTrailer, KvWireError,
};
use proptest::prelude::*;
use proptest::sample::Index;

/// Arbitrary valid streams with small dimensions.
fn stream() -> impl Strategy<Value = Stream> {
    let dims = (any::<bool>(), 1..=4u32, 1..=3u32, 1..=4u32, 1..=6u32);
    let cuts = (any::<u64>(), any::<u64>(), any::<u64>());
    let logprob = -100.0f32..=0.0;
    let top = prop::collection::vec((any::<u32>(), logprob.clone()), 0..=20);
    let end = (any::<u32>(), logprob, top);
    (dims, cuts, end, "[!-~]{1,128}").prop_map(
        |((f16, layers, heads, head_dim, tokens), (tc, lc, seed), (tok, lp, top), id)| {
            let dtype = if f16 { KvDtype::F16 } else { KvDtype::F32 };
            let mut h = header(dtype, layers, heads, head_dim, tokens);
            h.request_id = id;
            h.seed = seed;
            let trailer = KvTrailer {
                first_token: tok,
                first_logprob: lp,
                top_logprobs: top,
            };
            build(&h, &plan(tokens, layers, tc, lc), &trailer, seed)
        },
    )
}

/// Limits small enough for `stream()` to fit but tight for random input.
fn tight() -> KvLimits {
    KvLimits {
        max_layers: 8,
        max_kv_heads: 8,
        max_head_dim: 8,
        max_tokens: 16,
        max_frame_bytes: 4096,
    }
}

/// Pushes `bytes` cut at `cuts`, checking memory stays bounded; returns the
/// first error, or `finish`'s verdict.
fn feed(limits: KvLimits, bytes: &[u8], cuts: &[usize]) -> Result<(), KvWireError> {
    let mut cuts: Vec<usize> = cuts.iter().map(|&c| c.min(bytes.len())).collect();
    cuts.extend([0, bytes.len()]);
    cuts.sort_unstable();
    let mut decoder = KvStreamDecoder::new(limits);
    for pair in cuts.windows(2) {
        let result = decoder.push(&bytes[pair[0]..pair[1]]);
        let bound = usize::try_from(limits.max_frame_bytes).unwrap() + 256;
        assert!(
            decoder.buffered_capacity() <= bound,
            "{} > {bound}",
            decoder.buffered_capacity()
        );
        result?;
    }
    decoder.finish()
}

proptest! {
    #[test]
    fn valid_streams_round_trip_at_any_split(
        s in stream(),
        cuts in prop::collection::vec(any::<Index>(), 0..12),
    ) {
        let cuts: Vec<usize> = cuts.iter().map(|i| i.index(s.bytes.len() + 1)).collect();
        prop_assert_eq!(decode_cuts(tight(), &s.bytes, &cuts)?, s.events);
    }

    #[test]
    fn flipping_any_byte_is_an_error(s in stream(), at in any::<Index>(), mask in 1..=255u8, cut in any::<Index>()) {
        let mut bytes = s.bytes.clone();
        let at = at.index(bytes.len());
        bytes[at] ^= mask;
        let err = feed(KvLimits::default(), &bytes, &[cut.index(bytes.len())]);
        prop_assert!(err.is_err(), "flip at {} went unnoticed", at);
    }

    #[test]
    fn truncating_anywhere_is_truncated(s in stream(), end in any::<Index>(), cut in any::<Index>()) {
        let end = end.index(s.bytes.len());
        let bytes = &s.bytes[..end];
        prop_assert_eq!(feed(tight(), bytes, &[cut.index(end + 1)]), Err(KvWireError::Truncated));
    }

    #[test]
    fn random_bytes_never_panic_or_overallocate(
        bytes in prop::collection::vec(any::<u8>(), 0..600),
        cuts in prop::collection::vec(any::<usize>(), 0..8),
        valid_header in any::<bool>(),
    ) {
        let mut input = Vec::new();
        if valid_header {
            input = encode_header(&header(KvDtype::F32, 4, 4, 8, 16)).unwrap();
            // Often start the tail with a plausible frame tag.
            if bytes.first().is_some_and(|b| b % 2 == 0) {
                input.extend(b"KVLF");
            }
        }
        input.extend(&bytes);
        let cuts: Vec<usize> = cuts.iter().map(|c| c % (input.len() + 1)).collect();
        let _ = feed(tight(), &input, &cuts);
    }

    #[test]
    fn mutated_streams_never_panic_or_overallocate(
        s in stream(),
        edits in prop::collection::vec((any::<Index>(), any::<u8>()), 1..6),
        cuts in prop::collection::vec(any::<Index>(), 0..6),
    ) {
        let mut bytes = s.bytes.clone();
        for (at, value) in &edits {
            let at = at.index(bytes.len());
            bytes[at] = *value;
        }
        let cuts: Vec<usize> = cuts.iter().map(|i| i.index(bytes.len() + 1)).collect();
        if let Ok(events) = decode_cuts(tight(), &bytes, &cuts) {
            // Only edits that wrote the same bytes back can decode.
            prop_assert_eq!(&bytes, &s.bytes);
            prop_assert_eq!(events, s.events);
        }
        let _ = feed(tight(), &bytes, &cuts);
    }
}

proptest! {
    #[test]
    fn frame_claims_reserve_nothing_before_the_payload_arrives(
        layer_count in 0..6u32,
        token_count in 0..20u32,
        claim in prop_oneof![any::<u64>(), Just(u64::MAX), 0..5000u64],
        exact in any::<bool>(),
        tail in prop::collection::vec(any::<u8>(), 0..300),
    ) {
        let h = header(KvDtype::F32, 4, 4, 8, 16);
        let payload_len = if exact {
            h.layer_payload_len(layer_count, token_count).unwrap()
        } else {
            claim
        };
        let mut decoder = KvStreamDecoder::new(tight());
        decoder.push(&encode_header(&h).unwrap()).unwrap();
        let prefix = common::layer_prefix([0, layer_count, 0, token_count], payload_len);
        let valid = (1..=4).contains(&layer_count)
            && (1..=16).contains(&token_count)
            && payload_len == h.layer_payload_len(layer_count, token_count).unwrap()
            && payload_len <= tight().max_frame_bytes;
        let pushed = decoder.push(&prefix);
        prop_assert_eq!(pushed.is_ok(), valid, "{:?}", pushed);
        prop_assert!(decoder.buffered_capacity() <= 64);
        if decoder.push(&tail).is_ok() {
            let bound = usize::try_from(payload_len).unwrap() + 64;
            prop_assert!(decoder.buffered_capacity() <= bound);
        }
    }
}
