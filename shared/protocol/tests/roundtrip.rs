//! Round trips of hand-written streams, decoded in pieces of various sizes.

mod common;

use common::{build, decode_chunked, header, reseal, trailer, Chunk, Stream};
use pdserve_protocol::kvwire::{KvDtype, KvEvent};

/// 10 tokens in 3 chunks over 4 layers, with multi-layer frames.
fn sample(dtype: KvDtype) -> Stream {
    let chunks = vec![
        Chunk {
            token_start: 0,
            token_count: 4,
            groups: vec![(0, 1), (1, 3)],
        },
        Chunk {
            token_start: 4,
            token_count: 1,
            groups: vec![(0, 4)],
        },
        Chunk {
            token_start: 5,
            token_count: 5,
            groups: vec![(0, 1), (1, 1), (2, 2)],
        },
    ];
    build(&header(dtype, 4, 2, 3, 10), &chunks, &trailer(5), 7)
}

#[test]
fn round_trip_in_pieces_of_1_7_and_all() {
    for dtype in [KvDtype::F16, KvDtype::F32] {
        let stream = sample(dtype);
        assert_eq!(stream.events.len(), 8);
        for size in [1, 7, stream.bytes.len()] {
            let events = decode_chunked(&stream.bytes, size).expect("decodes");
            assert_eq!(events, stream.events, "dtype {dtype:?}, pieces of {size}");
        }
    }
}

#[test]
fn layer_kv_slices_match_the_layout() {
    let stream = sample(KvDtype::F16);
    let side = 4 * 2 * 3 * 2; // tokens * heads * head_dim * f16
    let KvEvent::Layers(frame) = &stream.events[2] else {
        panic!("expected layers")
    };
    assert_eq!((frame.layer_start, frame.layer_count), (1, 3));
    for (i, layer) in (1..4).enumerate() {
        let (k, v) = frame.layer_kv(layer).expect("layer in frame");
        assert_eq!(k, &frame.payload[2 * i * side..(2 * i + 1) * side]);
        assert_eq!(v, &frame.payload[(2 * i + 1) * side..(2 * i + 2) * side]);
    }
    assert_eq!(frame.layer_kv(0), None);
    assert_eq!(frame.layer_kv(4), None);
}

#[test]
fn single_chunk_single_frame_stream() {
    let chunks = vec![Chunk {
        token_start: 0,
        token_count: 1,
        groups: vec![(0, 1)],
    }];
    let stream = build(&header(KvDtype::F32, 1, 1, 1, 1), &chunks, &trailer(0), 1);
    assert_eq!(
        decode_chunked(&stream.bytes, 3).expect("decodes"),
        stream.events
    );
}

#[test]
fn header_is_available_before_the_layers_arrive() {
    let stream = sample(KvDtype::F16);
    let mut decoder = pdserve_protocol::kvwire::KvStreamDecoder::new(Default::default());
    let header_len = 12 + 2 + 8 + 37 + 4;
    assert!(decoder
        .push(&stream.bytes[..header_len - 1])
        .expect("ok")
        .is_empty());
    assert!(decoder.header().is_none());
    let events = decoder
        .push(&stream.bytes[header_len - 1..header_len])
        .expect("ok");
    assert_eq!(events, stream.events[..1]);
    assert_eq!(decoder.header().map(|h| h.n_tokens), Some(10));
    assert!(!decoder.is_complete());
    assert_eq!(
        decoder.finish(),
        Err(pdserve_protocol::kvwire::KvWireError::Truncated)
    );
}

/// A delta stream: the receiver holds the first 6 of 10 tokens, so the
/// stream starts at token 6; a chunk from 0 is out of order.
#[test]
fn a_stream_may_start_after_the_tokens_the_receiver_holds() {
    let mut h = header(KvDtype::F32, 2, 1, 2, 10);
    h.start_token = 6;
    let chunk = |token_start, token_count| Chunk {
        token_start,
        token_count,
        groups: vec![(0, 2)],
    };
    let stream = build(&h, &[chunk(6, 3), chunk(9, 1)], &trailer(0), 3);
    let events = decode_chunked(&stream.bytes, 5).expect("decodes");
    assert_eq!(events, stream.events);
    let from_zero = build(&h, &[chunk(0, 10)], &trailer(0), 3);
    let err = decode_chunked(&from_zero.bytes, 5).unwrap_err();
    assert_eq!(err.kind(), "out_of_order", "{err}");
    let short = build(&h, &[chunk(6, 3)], &trailer(0), 3);
    assert!(decode_chunked(&short.bytes, 5).is_err());
    h.start_token = 11;
    assert!(pdserve_protocol::kvwire::encode_header(&h).is_err());
}

/// A header with the sender's trace context carries it through, costs 25
/// bytes and sets flag 1; without one the frame is what it always was.
#[test]
fn a_trace_context_rides_in_the_header() {
    use pdserve_protocol::kvwire::{encode_header, with_trace, KvTraceContext, FLAG_TRACE_CONTEXT};
    let plain = header(KvDtype::F16, 2, 1, 2, 4);
    let plain_bytes = encode_header(&plain).unwrap();
    assert_eq!(&plain_bytes[6..8], &[0, 0], "no flag without a trace");
    let mut traced = plain.clone();
    traced.trace = Some(KvTraceContext {
        trace_id: [0x4b; 16],
        span_id: [0x0f; 8],
        trace_flags: 1,
    });
    let chunks = [Chunk {
        token_start: 0,
        token_count: 4,
        groups: vec![(0, 2)],
    }];
    let stream = build(&traced, &chunks, &trailer(1), 3);
    assert_eq!(
        u16::from_le_bytes([stream.bytes[6], stream.bytes[7]]),
        FLAG_TRACE_CONTEXT
    );
    let traced_bytes = encode_header(&traced).unwrap();
    assert_eq!(traced_bytes.len(), plain_bytes.len() + 25);
    let stamped = with_trace(&plain_bytes, traced.trace.unwrap()).unwrap();
    assert_eq!(stamped, traced_bytes, "added to an encoded header");
    assert!(with_trace(&plain_bytes[..20], traced.trace.unwrap()).is_err());
    let events = decode_chunked(&stream.bytes, 5).expect("decodes");
    assert_eq!(events, stream.events);
    assert_eq!(events[0], KvEvent::Header(traced.clone()));

    // W3C's invalid (all-zero) ids are refused on both sides.
    let mut zero = traced.clone();
    zero.trace.as_mut().unwrap().span_id = [0; 8];
    assert_eq!(encode_header(&zero).unwrap_err().kind(), "invalid_field");
    let mut forged = traced_bytes.clone();
    let at = forged.len() - 4 - 9;
    forged[at..at + 8].fill(0);
    reseal(&mut forged);
    assert_eq!(
        decode_chunked(&forged, 7).unwrap_err().kind(),
        "invalid_field"
    );

    // The flag without the 25 bytes (or the bytes without the flag) is a
    // length error, not a misread body.
    let mut flag_only = plain_bytes.clone();
    flag_only[6] = 1;
    reseal(&mut flag_only);
    assert_eq!(
        decode_chunked(&flag_only, 7).unwrap_err().kind(),
        "bad_length"
    );
    let mut bytes_only = traced_bytes;
    bytes_only[6] = 0;
    reseal(&mut bytes_only);
    assert_eq!(
        decode_chunked(&bytes_only, 7).unwrap_err().kind(),
        "bad_length"
    );
}
