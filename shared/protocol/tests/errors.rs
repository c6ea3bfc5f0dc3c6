//! One test (at least) per error the format defines.

mod common;

use common::{build, header, layer_prefix, plan, raw_header, reseal, trailer};
use pdserve_protocol::kvwire::{
    encode_end, encode_header, encode_layers, KvDtype, KvHeader, KvLimits, KvStreamDecoder,
    KvTrailer, KvWireError,
};

/// Pushes `bytes` at once into a decoder with `limits`; returns the first error.
fn decode_err(limits: KvLimits, bytes: &[u8]) -> KvWireError {
    let mut decoder = KvStreamDecoder::new(limits);
    match decoder.push(bytes) {
        Err(err) => err,
        Ok(_) => decoder.finish().expect_err("stream should be rejected"),
    }
}

fn small() -> KvHeader {
    header(KvDtype::F16, 2, 1, 2, 4)
}

/// Header bytes of `small()` plus frames built from `frames` (fields, payload bytes).
fn with_frames(frames: &[([u32; 4], usize)]) -> Vec<u8> {
    let mut bytes = encode_header(&small()).unwrap();
    for &(f, len) in frames {
        encode_layers(f[0], f[1], f[2], f[3], &vec![1; len], &mut bytes).unwrap();
    }
    bytes
}

/// Payload bytes of a `small()` frame: layers * 2 * tokens * 1 head * 2 dims * 2 bytes.
fn len(layers: usize, tokens: usize) -> usize {
    layers * 2 * tokens * 4
}

/// Sets one dimension of a header.
type SetDim = fn(&mut KvHeader, u32);

#[test]
fn bad_magic() {
    let mut bytes = encode_header(&small()).unwrap();
    bytes[..4].copy_from_slice(b"HTTP");
    assert_eq!(
        decode_err(KvLimits::default(), &bytes),
        KvWireError::BadMagic { got: *b"HTTP" }
    );
}

#[test]
fn version_3_is_unsupported() {
    let mut bytes = encode_header(&small()).unwrap();
    bytes[4] = 3;
    reseal(&mut bytes);
    let err = decode_err(KvLimits::default(), &bytes);
    assert_eq!(
        err,
        KvWireError::UnsupportedVersion {
            version: 3,
            supported: 2
        }
    );
    assert_eq!(err.kind(), "unsupported_version");
}

#[test]
fn nonzero_flags() {
    let mut bytes = encode_header(&small()).unwrap();
    bytes[7] = 0x80;
    reseal(&mut bytes);
    assert_eq!(
        decode_err(KvLimits::default(), &bytes),
        KvWireError::BadFlags { flags: 0x8000 }
    );
}

#[test]
fn header_checksum() {
    let mut bytes = encode_header(&small()).unwrap();
    bytes[20] ^= 1;
    assert!(matches!(
        decode_err(KvLimits::default(), &bytes),
        KvWireError::Checksum {
            frame: "header",
            ..
        }
    ));
}

#[test]
fn header_fields_over_each_limit() {
    let limits = KvLimits::default();
    let cases: [(&str, SetDim, u32); 4] = [
        ("n_layers", |h, v| h.n_layers = v, limits.max_layers),
        ("n_kv_heads", |h, v| h.n_kv_heads = v, limits.max_kv_heads),
        ("head_dim", |h, v| h.head_dim = v, limits.max_head_dim),
        ("n_tokens", |h, v| h.n_tokens = v, limits.max_tokens),
    ];
    for (field, set, limit) in cases {
        let mut h = small();
        set(&mut h, limit);
        let at_limit = encode_header(&h).unwrap();
        let mut decoder = KvStreamDecoder::new(limits);
        assert_eq!(
            decoder.push(&at_limit).unwrap().len(),
            1,
            "{field} at its limit is fine"
        );
        set(&mut h, limit + 1);
        let err = decode_err(limits, &encode_header(&h).unwrap());
        let want = KvWireError::LimitExceeded {
            field,
            value: u64::from(limit) + 1,
            limit: u64::from(limit),
        };
        assert_eq!(err, want);
        assert!(err.to_string().contains(field), "{err}");
        assert!(err.to_string().contains(&(limit + 1).to_string()), "{err}");
    }
}

#[test]
fn header_whose_smallest_frame_exceeds_max_frame_bytes() {
    let limits = KvLimits {
        max_frame_bytes: 1000,
        ..KvLimits::default()
    };
    let h = header(KvDtype::F32, 1, 16, 16, 1); // one layer, one token: 2 * 16 * 16 * 4 = 2048
    assert_eq!(
        decode_err(limits, &encode_header(&h).unwrap()),
        KvWireError::LimitExceeded {
            field: "payload_len of a 1-layer 1-token frame",
            value: 2048,
            limit: 1000
        }
    );
}

#[test]
fn header_body_len_over_limit_is_rejected_from_the_prefix() {
    let mut bytes = encode_header(&small()).unwrap();
    bytes[8..12].copy_from_slice(&u32::MAX.to_le_bytes());
    let mut decoder = KvStreamDecoder::new(KvLimits::default());
    let err = decoder.push(&bytes[..12]).unwrap_err();
    assert_eq!(
        err,
        KvWireError::LimitExceeded {
            field: "header body_len",
            value: u64::from(u32::MAX),
            limit: 167
        }
    );
}

#[test]
fn zero_dimensions_and_zero_tokens() {
    for i in 0..4 {
        let mut dims = [2, 1, 2, 4];
        dims[i] = 0;
        let err = decode_err(KvLimits::default(), &raw_header(b"r", 0, dims));
        assert_eq!(err.kind(), "invalid_field", "{err}");
    }
    let mut h = small();
    h.n_tokens = 0;
    assert!(matches!(
        encode_header(&h),
        Err(KvWireError::InvalidField {
            field: "n_tokens",
            ..
        })
    ));
}

#[test]
fn dtype_7() {
    let err = decode_err(KvLimits::default(), &raw_header(b"r", 7, [2, 1, 2, 4]));
    assert!(
        matches!(&err, KvWireError::InvalidField { field: "dtype", reason } if reason.contains('7')),
        "{err}"
    );
}

#[test]
fn request_id_too_long() {
    let mut h = small();
    h.request_id = "x".repeat(129);
    assert_eq!(
        encode_header(&h),
        Err(KvWireError::LimitExceeded {
            field: "request_id length",
            value: 129,
            limit: 128
        })
    );
    h.request_id = "x".repeat(128);
    assert!(encode_header(&h).is_ok());
    let err = decode_err(
        KvLimits::default(),
        &raw_header(&[b'x'; 129], 0, [2, 1, 2, 4]),
    );
    assert_eq!(err.kind(), "limit_exceeded", "{err}");
}

#[test]
fn request_id_not_printable() {
    for id in ["a\u{1}b", "with space", "tab\t", "é", ""] {
        let mut h = small();
        h.request_id = id.to_string();
        assert!(
            matches!(
                encode_header(&h),
                Err(KvWireError::InvalidField {
                    field: "request_id",
                    ..
                })
            ),
            "{id:?}"
        );
    }
    for id in [&b"a\x01b"[..], b"a b", b"\xff\xfe", b"\x7f"] {
        let err = decode_err(KvLimits::default(), &raw_header(id, 0, [2, 1, 2, 4]));
        assert!(
            matches!(
                err,
                KvWireError::InvalidField {
                    field: "request_id",
                    ..
                }
            ),
            "{id:?}: {err}"
        );
    }
}

#[test]
fn payload_len_mismatch_is_rejected_before_the_payload() {
    let mut bytes = encode_header(&small()).unwrap();
    bytes.extend(layer_prefix([0, 1, 0, 2], 15));
    let mut decoder = KvStreamDecoder::new(KvLimits::default());
    let err = decoder.push(&bytes).unwrap_err();
    assert_eq!(
        err,
        KvWireError::BadLength {
            field: "payload_len",
            expected: 16,
            got: 15
        }
    );
    // Through the encoder: a payload laid out for 1 token, framed as 2 tokens.
    let bytes = with_frames(&[([0, 1, 0, 2], len(1, 1))]);
    assert_eq!(
        decode_err(KvLimits::default(), &bytes),
        KvWireError::BadLength {
            field: "payload_len",
            expected: 16,
            got: 8
        }
    );
}

#[test]
fn huge_frame_claim_fails_before_any_payload_arrives() {
    let limits = KvLimits::default();
    let h = header(KvDtype::F32, 1024, 1024, 1024, 1 << 20);
    for payload_len in [1u64 << 43, u64::MAX, limits.max_frame_bytes + 1] {
        let mut decoder = KvStreamDecoder::new(limits);
        decoder.push(&encode_header(&h).unwrap()).unwrap();
        let err = decoder
            .push(&layer_prefix([0, 1024, 0, 1 << 20], payload_len))
            .unwrap_err();
        assert_eq!(
            err,
            KvWireError::LimitExceeded {
                field: "payload_len",
                value: payload_len,
                limit: limits.max_frame_bytes
            }
        );
        assert!(decoder.buffered_capacity() < 1024);
    }
    // The right length for the frame, but more than the limit.
    let limits = KvLimits {
        max_frame_bytes: 40,
        ..KvLimits::default()
    };
    let mut decoder = KvStreamDecoder::new(limits);
    decoder.push(&encode_header(&small()).unwrap()).unwrap();
    let err = decoder
        .push(&layer_prefix([0, 2, 0, 4], len(2, 4) as u64))
        .unwrap_err();
    assert_eq!(
        err,
        KvWireError::LimitExceeded {
            field: "payload_len",
            value: 64,
            limit: 40
        }
    );
}

#[test]
fn layer_checksum() {
    let mut bytes = with_frames(&[([0, 2, 0, 4], len(2, 4))]);
    let n = bytes.len();
    bytes[n - 10] ^= 0x40;
    assert!(matches!(
        decode_err(KvLimits::default(), &bytes),
        KvWireError::Checksum { frame: "layer", .. }
    ));
}

#[test]
fn zero_counts() {
    let mut bytes = encode_header(&small()).unwrap();
    bytes.extend(layer_prefix([0, 0, 0, 1], 0));
    assert!(matches!(
        decode_err(KvLimits::default(), &bytes),
        KvWireError::InvalidField {
            field: "layer_count",
            ..
        }
    ));
    let mut bytes = encode_header(&small()).unwrap();
    bytes.extend(layer_prefix([0, 1, 0, 0], 0));
    assert!(matches!(
        decode_err(KvLimits::default(), &bytes),
        KvWireError::InvalidField {
            field: "token_count",
            ..
        }
    ));
}

#[test]
fn out_of_order_layer() {
    // Layer 1 skipped within a chunk.
    let bytes = with_frames(&[([0, 1, 0, 4], len(1, 4)), ([2, 1, 0, 4], len(1, 4))]);
    let err = decode_err(KvLimits::default(), &bytes);
    assert!(
        matches!(
            err,
            KvWireError::OutOfOrder {
                expected: 1,
                got: 2,
                ..
            }
        ),
        "{err}"
    );
    assert_eq!(err.kind(), "out_of_order");
    // Layer 0 repeated.
    let bytes = with_frames(&[([0, 1, 0, 4], len(1, 4)), ([0, 1, 0, 4], len(1, 4))]);
    assert!(matches!(
        decode_err(KvLimits::default(), &bytes),
        KvWireError::OutOfOrder {
            expected: 1,
            got: 0,
            ..
        }
    ));
    // A new chunk that does not start at layer 0.
    let bytes = with_frames(&[([1, 1, 0, 4], len(1, 4))]);
    assert!(matches!(
        decode_err(KvLimits::default(), &bytes),
        KvWireError::OutOfOrder {
            expected: 0,
            got: 1,
            ..
        }
    ));
    // Layers past n_layers.
    let bytes = with_frames(&[([0, 3, 0, 4], len(3, 4))]);
    assert_eq!(
        decode_err(KvLimits::default(), &bytes),
        KvWireError::LimitExceeded {
            field: "layer_start + layer_count",
            value: 3,
            limit: 2
        }
    );
}

#[test]
fn chunks_that_overlap_skip_or_change_size() {
    let first = ([0, 2, 0, 2], len(2, 2));
    // Overlap: the second chunk starts at token 1 instead of 2.
    let bytes = with_frames(&[first, ([0, 2, 1, 2], len(2, 2))]);
    assert!(matches!(
        decode_err(KvLimits::default(), &bytes),
        KvWireError::OutOfOrder {
            expected: 2,
            got: 1,
            ..
        }
    ));
    // Skip: the second chunk starts at token 3.
    let bytes = with_frames(&[first, ([0, 2, 3, 1], len(2, 1))]);
    assert!(matches!(
        decode_err(KvLimits::default(), &bytes),
        KvWireError::OutOfOrder {
            expected: 2,
            got: 3,
            ..
        }
    ));
    // Token range changes within a chunk.
    let bytes = with_frames(&[([0, 1, 0, 2], len(1, 2)), ([1, 1, 0, 3], len(1, 3))]);
    assert!(matches!(
        decode_err(KvLimits::default(), &bytes),
        KvWireError::OutOfOrder {
            expected: 2,
            got: 3,
            ..
        }
    ));
    // A chunk past n_tokens.
    let bytes = with_frames(&[first, ([0, 2, 2, 3], len(2, 3))]);
    assert_eq!(
        decode_err(KvLimits::default(), &bytes),
        KvWireError::LimitExceeded {
            field: "token_start + token_count",
            value: 5,
            limit: 4
        }
    );
}

#[test]
fn end_before_full_coverage() {
    let end = encode_end(&trailer(1)).unwrap();
    let cases: [&[([u32; 4], usize)]; 3] = [
        &[],
        &[([0, 2, 0, 2], len(2, 2))],
        &[([0, 2, 0, 2], len(2, 2)), ([0, 1, 2, 2], len(1, 2))],
    ];
    for frames in cases {
        let mut bytes = with_frames(frames);
        bytes.extend(&end);
        let err = decode_err(KvLimits::default(), &bytes);
        assert!(
            matches!(err, KvWireError::OutOfOrder { expected: 4, .. }),
            "{err}"
        );
    }
}

#[test]
fn layer_frame_after_full_coverage() {
    let bytes = with_frames(&[([0, 2, 0, 4], len(2, 4)), ([0, 2, 4, 1], len(2, 1))]);
    assert!(matches!(
        decode_err(KvLimits::default(), &bytes),
        KvWireError::UnexpectedTag {
            got: [b'K', b'V', b'L', b'F'],
            ..
        }
    ));
}

#[test]
fn unknown_tag_and_second_header() {
    let mut bytes = encode_header(&small()).unwrap();
    bytes.extend(encode_header(&small()).unwrap());
    let err = decode_err(KvLimits::default(), &bytes);
    assert_eq!(
        err,
        KvWireError::UnexpectedTag {
            expected: "KVLF or KVND",
            got: *b"PDKV"
        }
    );
    assert!(err.to_string().contains("PDKV"), "{err}");
}

#[test]
fn data_after_the_end() {
    let stream = build(&small(), &plan(4, 2, 0b10, 0), &trailer(3), 5);
    let mut bytes = stream.bytes.clone();
    bytes.push(0);
    assert_eq!(
        decode_err(KvLimits::default(), &bytes),
        KvWireError::TrailingData
    );
    // In a later push, too, and the decoder stays failed.
    let mut decoder = KvStreamDecoder::new(KvLimits::default());
    assert_eq!(
        decoder.push(&stream.bytes).unwrap().len(),
        stream.events.len()
    );
    assert!(decoder.is_complete());
    assert_eq!(decoder.push(&[]).unwrap(), vec![]);
    assert_eq!(decoder.push(b"x"), Err(KvWireError::TrailingData));
    assert_eq!(decoder.push(&[]), Err(KvWireError::TrailingData));
    assert_eq!(decoder.finish(), Err(KvWireError::TrailingData));
}

#[test]
fn failed_decoder_stays_failed() {
    let stream = build(&small(), &plan(4, 2, 0, 0), &trailer(0), 5);
    let mut decoder = KvStreamDecoder::new(KvLimits::default());
    let err = decoder.push(b"GET / HTTP/1.1\r\n").unwrap_err();
    assert_eq!(err.kind(), "bad_magic");
    for _ in 0..2 {
        assert_eq!(decoder.push(&stream.bytes), Err(err.clone()));
    }
    assert_eq!(decoder.finish(), Err(err));
    assert_eq!(decoder.buffered_capacity(), 0);
}

#[test]
fn truncated_stream() {
    let stream = build(&small(), &plan(4, 2, 0, 0), &trailer(0), 5);
    let mut decoder = KvStreamDecoder::new(KvLimits::default());
    decoder
        .push(&stream.bytes[..stream.bytes.len() - 1])
        .unwrap();
    assert_eq!(decoder.finish(), Err(KvWireError::Truncated));
    assert_eq!(KvWireError::Truncated.kind(), "truncated");
}

#[test]
fn n_top_over_20() {
    assert_eq!(
        encode_end(&trailer(21)),
        Err(KvWireError::LimitExceeded {
            field: "n_top",
            value: 21,
            limit: 20
        })
    );
    let mut end = encode_end(&trailer(20)).unwrap();
    end[12] = 21;
    end.extend([0; 8]);
    reseal(&mut end);
    let mut bytes = with_frames(&[([0, 2, 0, 4], len(2, 4))]);
    bytes.extend(&end);
    assert_eq!(
        decode_err(KvLimits::default(), &bytes),
        KvWireError::LimitExceeded {
            field: "n_top",
            value: 21,
            limit: 20
        }
    );
}

#[test]
fn nan_logprobs() {
    let mut t = trailer(2);
    t.first_logprob = f32::NAN;
    assert!(matches!(
        encode_end(&t),
        Err(KvWireError::InvalidField {
            field: "first_logprob",
            ..
        })
    ));
    let t = KvTrailer {
        top_logprobs: vec![(1, f32::NAN)],
        ..trailer(0)
    };
    assert!(matches!(
        encode_end(&t),
        Err(KvWireError::InvalidField {
            field: "top logprob",
            ..
        })
    ));
    let mut end = encode_end(&trailer(0)).unwrap();
    end[8..12].copy_from_slice(&f32::NAN.to_le_bytes());
    reseal(&mut end);
    let mut bytes = with_frames(&[([0, 2, 0, 4], len(2, 4))]);
    bytes.extend(&end);
    assert!(matches!(
        decode_err(KvLimits::default(), &bytes),
        KvWireError::InvalidField {
            field: "first_logprob",
            ..
        }
    ));
}
