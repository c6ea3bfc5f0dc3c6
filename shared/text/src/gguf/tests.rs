//! The reader and writer against each other, and against bad input.

use super::*;
use std::io::Cursor;
use Value::{Array as A, Bool, F32, F64, I16, I32, I64, I8, U16, U32, U64, U8};

fn sample_metadata() -> Vec<(String, Value)> {
    let s = |x: &str| Value::String(x.into());
    let (uni, big, min) = (s("héllo ✓ 日本語 🦀"), u64::MAX, i64::MIN);
    let toks = A(vec![s("a"), s(""), s("Ġ")]);
    let nest = A(vec![A(vec![I32(1)]), A(vec![]), A(vec![A(vec![s("z")])])]);
    let ints = [U8(200), I8(-5), U16(9999), I16(-300), U32(7)];
    let more = [I32(-7000), U64(big), I64(min), F32(1.5), F64(-2.25)];
    let rest = [Bool(true), uni, A(vec![]), toks, nest];
    let all = ints.into_iter().chain(more).chain(rest);
    let key = |(i, v)| (format!("key{i}.✓"), v);
    all.enumerate().map(key).collect()
}

fn td(dims: Vec<u64>, ggml_type: u32, bytes: &[u8]) -> TensorData<'_> {
    TensorData {
        dims,
        ggml_type,
        bytes,
    }
}

/// A valid file, and the position where its tensor directory ends.
fn sample_file() -> (Vec<u8>, usize) {
    let md = sample_metadata();
    let md: Vec<(&str, &Value)> = md.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let f32s: Vec<u8> = (0..6).flat_map(|i| (i as f32).to_le_bytes()).collect();
    let q8: Vec<u8> = (0..33).collect();
    let a = td(vec![2, 3], GGML_F32, &f32s);
    let b = td(vec![32], GGML_Q8_0, &q8);
    let mut file = Vec::new();
    write(&mut file, &md, &[("a", a), ("b", b)]).unwrap();
    let mut cursor = Cursor::new(&file);
    Header::read(&mut cursor).unwrap();
    let end = cursor.position() as usize;
    (file, end)
}

fn read(bytes: &[u8]) -> Result<Header, GgufError> {
    Header::read(&mut Cursor::new(bytes))
}

#[test]
fn round_trip() {
    let (file, _) = sample_file();
    let h = read(&file).unwrap();
    assert_eq!(h.metadata, sample_metadata().into_iter().collect());
    let (a, b) = (&h.tensors["a"], &h.tensors["b"]);
    assert_eq!((&a.dims, a.ggml_type), (&vec![2, 3], GGML_F32));
    assert_eq!((a.shape(), type_name(b.ggml_type)), (vec![3, 2], "q8_0"));
    assert_eq!((h.version, b.offset, h.data_offset % 32), (3, 32, 0));
    let at = |t: &TensorInfo, n| file[(h.data_offset + t.offset) as usize..][..n].to_vec();
    assert_eq!(at(a, 8), [0f32.to_le_bytes(), 1f32.to_le_bytes()].concat());
    assert_eq!(at(b, 33), (0..33).collect::<Vec<u8>>());
    assert_eq!(file.len() as u64, h.data_offset + 96);
    let m = |k: &str| h.metadata[k].clone();
    let (i8, u64, u16) = (m("key1.✓"), m("key6.✓"), m("key2.✓"));
    assert_eq!((i8.as_i64(), i8.as_u64()), (Some(-5), None));
    assert_eq!((u64.as_i64(), u16.as_f64()), (None, Some(9999.0)));
    assert_eq!((type_name(5), type_name(15)), ("unknown", "q8_k"));
}

#[test]
fn every_truncation_is_an_error() {
    let (file, end) = sample_file();
    for n in 0..end {
        let r = read(&file[..n]);
        assert!(matches!(r, Err(GgufError::Truncated)), "{n}");
    }
    assert!(read(&file[..end]).is_ok());
}

/// Reads a v3 header whose only metadata entry "k" has the type and value `kv`.
fn one_kv(kv: &[&[u8]]) -> GgufError {
    let head = [&b"GGUF"[..], &[3, 0, 0, 0], &[0; 8], &[1; 1], &[0; 7]];
    let key: [&[u8]; 3] = [&[1], &[0; 7], b"k"];
    read(&[&head[..], &key, kv].concat().concat()).unwrap_err()
}

fn what(e: GgufError) -> String {
    match e {
        GgufError::TooLarge { what, .. } => what.to_string(),
        other => other.to_string(),
    }
}

#[test]
fn corrupt_inputs() {
    let (file, _) = sample_file();
    let e = read(&[b"XGUF", &file[4..]].concat()).unwrap_err();
    assert!(matches!(e, GgufError::BadMagic(m) if &m == b"XGUF"));
    let e = read(&[&file[..4], &[4], &file[5..]].concat()).unwrap_err();
    assert!(matches!(e, GgufError::UnsupportedVersion(4)));
    let e = one_kv(&[&[13, 0, 0, 0]]);
    assert!(matches!(e, GgufError::UnknownValueType(13)));
    let (string, array) = ([8, 0, 0, 0], [9, 0, 0, 0]);
    assert_eq!(what(one_kv(&[&string, &[0xff; 8]])), "string length");
    let e = one_kv(&[&string, &[2, 0, 0, 0, 0, 0, 0, 0, 0xc3, 0x28]]);
    assert!(matches!(e, GgufError::InvalidUtf8 { offset: 37 }), "{e}");
    let e = one_kv(&[&array, &array, &[0, 0, 0, 0, 0, 1, 0, 0]]);
    assert_eq!(what(e), "array length");
    let nest = [&array[..], &[1, 0, 0, 0, 0, 0, 0, 0]].concat();
    let e = one_kv(&[&array, &nest, &nest, &nest, &nest]);
    assert_eq!(what(e), "array nesting depth");
    let e = one_kv(&[&[7, 0, 0, 0, 2]]);
    assert!(matches!(e, GgufError::InvalidBool(2)));
    let md = [("x", &U8(1)), ("x", &U8(2))];
    let e = write(&mut Vec::new(), &md, &[]).unwrap_err();
    assert!(matches!(e, GgufError::DuplicateKey(k) if k == "x"));
    let x = [1, 0, 0, 0, 0, 0, 0, 0, b'x', 0, 0, 0, 0, 1]; // "x" = U8(1)
    let dup = [&file[..8], &[0; 8], &[2, 0, 0, 0, 0, 0, 0, 0], &x, &x].concat();
    assert!(matches!(read(&dup), Err(GgufError::DuplicateKey(k)) if k == "x"));
}

#[test]
fn custom_alignment_and_version_1() {
    let mut file = Vec::new();
    let md = [(ALIGNMENT_KEY, &U32(64))];
    write(&mut file, &md, &[("t", td(vec![5], 0, &[1; 5]))]).unwrap();
    let h = read(&file).unwrap();
    assert_eq!(h.data_offset % 64, 0);
    assert_eq!(file.len() as u64, h.data_offset + 64);
    // Version 1 stores counts, string lengths and dims as u32.
    let le = |w: &[u32]| w.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
    let (head, kv, t) = (le(&[1, 1, 1, 1]), le(&[8, 1]), le(&[1, 7, 2, 0, 0]));
    let v1 = [b"GGUF", &head[..], b"k", &kv, b"v", &[1, 0, 0, 0], b"t", &t];
    let h = read(&v1.concat()).unwrap();
    assert_eq!((h.version, h.metadata["k"].as_str()), (1, Some("v")));
    let t = &h.tensors["t"];
    assert_eq!((&t.dims, t.ggml_type, t.offset), (&vec![7], 2, 0));
}

#[test]
fn random_corruption_never_panics() {
    let (file, end) = sample_file();
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state as usize
    };
    for _ in 0..5000 {
        let mut bad = file[..end].to_vec();
        for _ in 0..1 + next() % 4 {
            let i = next() % end;
            bad[i] = next() as u8;
        }
        let cut = if next() % 4 == 0 { next() % end } else { end };
        let _ = read(&bad[..cut]);
    }
}
