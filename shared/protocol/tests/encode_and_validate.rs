//! Encoder-side errors, `validate_against`, and the stability of error kinds
//! and messages. (Decoder errors are in `errors.rs`.)

mod common;

use common::header;
use pdserve_protocol::kvwire::{
    encode_layer_parts, encode_layers, validate_against, ExpectedKv, KvDtype, KvHeader, KvWireError,
};

fn small() -> KvHeader {
    header(KvDtype::F16, 2, 1, 2, 4)
}

/// Changes one field of an expectation.
type Change = fn(&mut ExpectedKv);

#[test]
fn encoder_rejects_inconsistent_payloads() {
    let mut out = Vec::new();
    assert_eq!(
        encode_layers(0, 2, 0, 3, &[0; 10], &mut out)
            .unwrap_err()
            .kind(),
        "invalid_field"
    );
    assert_eq!(
        encode_layers(0, 0, 0, 3, &[0; 12], &mut out)
            .unwrap_err()
            .kind(),
        "invalid_field"
    );
    assert_eq!(
        encode_layers(0, 1, 0, 0, &[0; 12], &mut out)
            .unwrap_err()
            .kind(),
        "invalid_field"
    );
    assert_eq!(
        encode_layers(u32::MAX, 1, 0, 1, &[0; 2], &mut out)
            .unwrap_err()
            .kind(),
        "limit_exceeded"
    );
    assert_eq!(
        encode_layers(0, 1, 0, 1, &[], &mut out).unwrap_err().kind(),
        "invalid_field"
    );
    let (k, v, short) = ([1u8; 4], [2u8; 4], [3u8; 2]);
    assert_eq!(
        encode_layer_parts(0, 0, 2, &[(&k, &v), (&k, &short)], &mut out),
        Err(KvWireError::BadLength {
            field: "K/V bytes of a layer",
            expected: 4,
            got: 2
        })
    );
    assert_eq!(
        encode_layer_parts(0, 0, 3, &[(&k, &v)], &mut out)
            .unwrap_err()
            .kind(),
        "invalid_field"
    );
    assert_eq!(
        encode_layer_parts(0, 0, 1, &[], &mut out)
            .unwrap_err()
            .kind(),
        "invalid_field"
    );
    assert!(out.is_empty(), "failed encodes leave the output untouched");
}

#[test]
fn both_layer_encoders_agree() {
    let (k, v) = ([1u8; 4], [2u8; 4]);
    let mut out = Vec::new();
    // Both encoders produce the same bytes for the same layout.
    encode_layer_parts(3, 5, 2, &[(&k, &v), (&v, &k)], &mut out).unwrap();
    let mut other = Vec::new();
    let payload: Vec<u8> = [k, v, v, k].concat();
    encode_layers(3, 2, 5, 2, &payload, &mut other).unwrap();
    assert_eq!(out, other);
}

fn expected() -> ExpectedKv {
    let h = small();
    ExpectedKv {
        request_id: h.request_id,
        model_fingerprint: h.model_fingerprint,
        n_layers: h.n_layers,
        n_kv_heads: h.n_kv_heads,
        head_dim: h.head_dim,
        max_tokens: h.n_tokens,
        start_token: h.start_token,
    }
}

#[test]
fn validate_against_mismatches() {
    assert_eq!(validate_against(&small(), &expected()), Ok(()));
    let cases: [(&str, Change); 6] = [
        ("request_id", |e| e.request_id = "other".into()),
        ("start_token", |e| e.start_token = 2),
        ("model_fingerprint", |e| e.model_fingerprint ^= 1),
        ("n_layers", |e| e.n_layers += 1),
        ("n_kv_heads", |e| e.n_kv_heads += 1),
        ("head_dim", |e| e.head_dim -= 1),
    ];
    for (field, change) in cases {
        let mut e = expected();
        change(&mut e);
        let err = validate_against(&small(), &e).unwrap_err();
        assert!(
            matches!(&err, KvWireError::Mismatch { field: f, .. } if *f == field),
            "{err}"
        );
        assert_eq!(err.kind(), "mismatch");
        assert!(err.to_string().contains(field), "{err}");
    }
    let e = ExpectedKv {
        max_tokens: 3,
        ..expected()
    };
    assert_eq!(
        validate_against(&small(), &e),
        Err(KvWireError::LimitExceeded {
            field: "n_tokens (reservation)",
            value: 4,
            limit: 3
        })
    );
    let err = validate_against(
        &small(),
        &ExpectedKv {
            request_id: "r-2".into(),
            ..expected()
        },
    )
    .unwrap_err();
    assert_eq!(
        err.to_string(),
        "request_id mismatch: expected r-2, got req-0001"
    );
}

#[test]
fn kinds_of_framing_errors_are_stable() {
    let errors = [
        (KvWireError::BadMagic { got: *b"abcd" }, "bad_magic"),
        (
            KvWireError::UnexpectedTag {
                expected: "x",
                got: *b"abcd",
            },
            "unexpected_tag",
        ),
        (
            KvWireError::UnsupportedVersion {
                version: 2,
                supported: 1,
            },
            "unsupported_version",
        ),
        (KvWireError::BadFlags { flags: 2 }, "bad_flags"),
    ];
    for (err, kind) in errors {
        assert_eq!(err.kind(), kind);
    }
}

#[test]
fn kinds_of_content_errors_are_stable() {
    let errors = [
        (
            KvWireError::Checksum {
                frame: "end",
                computed: 1,
                stored: 2,
            },
            "checksum",
        ),
        (
            KvWireError::LimitExceeded {
                field: "f",
                value: 2,
                limit: 1,
            },
            "limit_exceeded",
        ),
        (
            KvWireError::BadLength {
                field: "f",
                expected: 1,
                got: 2,
            },
            "bad_length",
        ),
        (
            KvWireError::OutOfOrder {
                what: "w",
                expected: 1,
                got: 2,
            },
            "out_of_order",
        ),
        (KvWireError::Truncated, "truncated"),
        (KvWireError::TrailingData, "trailing_data"),
        (
            KvWireError::InvalidField {
                field: "f",
                reason: "r".into(),
            },
            "invalid_field",
        ),
        (
            KvWireError::Mismatch {
                field: "f",
                expected: "a".into(),
                got: "b".into(),
            },
            "mismatch",
        ),
    ];
    for (err, kind) in errors {
        assert_eq!(err.kind(), kind);
    }
}

#[test]
fn messages_name_field_value_and_limit() {
    let err = KvWireError::LimitExceeded {
        field: "n_layers",
        value: 2000,
        limit: 1024,
    };
    assert_eq!(err.to_string(), "n_layers = 2000 exceeds the limit 1024");
    let err = KvWireError::BadMagic {
        got: [0, b'P', b'D', 0xff],
    };
    assert_eq!(
        err.to_string(),
        "bad magic: expected header tag \"PDKV\", got \"\\x00PD\\xff\""
    );
}
