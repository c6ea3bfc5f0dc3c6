//! A candle-free reader (and small writer) for GGUF files, llama.cpp's model
//! format: the metadata and the tensor directory, never the tensor data.
//!
//! The reader treats its input as untrusted: every length is bounded before
//! anything is allocated, a cut file is [`GgufError::Truncated`], and no input
//! makes it panic.

use std::collections::hash_map::Entry;
use std::collections::{HashMap, HashSet};
use std::io::{BufReader, BufWriter, Read, Write};
use std::path::Path;

pub const GGML_F32: u32 = 0;
pub const GGML_F16: u32 = 1;
pub const GGML_Q4_0: u32 = 2;
pub const GGML_Q4_1: u32 = 3;
pub const GGML_Q8_0: u32 = 8;

/// The metadata key that sets the data section's alignment (a `U32`).
pub const ALIGNMENT_KEY: &str = "general.alignment";
/// The alignment used when the file does not set `general.alignment`.
pub const DEFAULT_ALIGNMENT: u64 = 32;

const MAGIC: [u8; 4] = *b"GGUF";
const MAX_STRING_LEN: u64 = 64 << 20;
/// Bounds one array's length, and also all arrays' lengths added up.
const MAX_ARRAY_LEN: u64 = 16 << 20;
const MAX_DEPTH: u32 = 4;
const MAX_KEYS: u64 = 1 << 20;
const MAX_TENSORS: u64 = 1 << 20;
const MAX_DIMS: u32 = 8;
/// Element type written for an empty array (a [`Value`] does not keep it).
const EMPTY_ARRAY_TYPE: u32 = 0;

/// The lower-case name of a ggml tensor type id ("q8_0"), or "unknown".
pub fn type_name(t: u32) -> &'static str {
    const NAMES: [&str; 16] = [
        "f32", "f16", "q4_0", "q4_1", "", "", "q5_0", "q5_1", "q8_0", "q8_1", "q2_k", "q3_k",
        "q4_k", "q5_k", "q6_k", "q8_k",
    ];
    let name = usize::try_from(t).ok().and_then(|i| NAMES.get(i));
    name.copied().filter(|n| !n.is_empty()).unwrap_or("unknown")
}

/// Errors reading or writing a GGUF file.
#[derive(Debug, thiserror::Error)]
pub enum GgufError {
    #[error("GGUF I/O error: {0}")]
    Io(#[from] std::io::Error),
    #[error("not a GGUF file: magic is {0:02x?}, expected \"GGUF\"")]
    BadMagic([u8; 4]),
    #[error("unsupported GGUF version {0} (supported: 1, 2, 3)")]
    UnsupportedVersion(u32),
    #[error("unknown GGUF metadata value type {0}")]
    UnknownValueType(u32),
    #[error("GGUF string at byte {offset} is not valid UTF-8")]
    InvalidUtf8 { offset: u64 },
    #[error("invalid GGUF bool byte {0} (expected 0 or 1)")]
    InvalidBool(u8),
    #[error("GGUF {what} too large: {value}")]
    TooLarge { what: &'static str, value: u64 },
    #[error("GGUF file truncated")]
    Truncated,
    #[error("duplicate GGUF metadata key {0:?}")]
    DuplicateKey(String),
    #[error("duplicate GGUF tensor name {0:?}")]
    DuplicateTensor(String),
    #[error("invalid general.alignment {0} (expected a U32 power of two)")]
    BadAlignment(String),
    #[error("GGUF array under key {0:?} mixes element types")]
    MixedArray(String),
}

fn too_large(what: &'static str, value: impl Into<u64>) -> GgufError {
    let value = value.into();
    GgufError::TooLarge { what, value }
}

/// A metadata value.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    U64(u64),
    I64(i64),
    F32(f32),
    F64(f64),
    Bool(bool),
    String(String),
    Array(Vec<Value>),
}

impl Value {
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::String(s) => Some(s),
            _ => None,
        }
    }

    /// Any integer that is non-negative.
    pub fn as_u64(&self) -> Option<u64> {
        self.as_i128().and_then(|x| u64::try_from(x).ok())
    }

    /// Any integer that fits in an `i64`.
    pub fn as_i64(&self) -> Option<i64> {
        self.as_i128().and_then(|x| i64::try_from(x).ok())
    }

    /// A float, or an integer converted to one.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Value::F32(x) => Some(x.into()),
            Value::F64(x) => Some(x),
            _ => self.as_i128().map(|x| x as f64),
        }
    }

    pub fn as_bool(&self) -> Option<bool> {
        match self {
            Value::Bool(b) => Some(*b),
            _ => None,
        }
    }

    pub fn as_array(&self) -> Option<&[Value]> {
        match self {
            Value::Array(a) => Some(a),
            _ => None,
        }
    }

    fn as_i128(&self) -> Option<i128> {
        match *self {
            Value::U8(x) => Some(x.into()),
            Value::I8(x) => Some(x.into()),
            Value::U16(x) => Some(x.into()),
            Value::I16(x) => Some(x.into()),
            Value::U32(x) => Some(x.into()),
            Value::I32(x) => Some(x.into()),
            Value::U64(x) => Some(x.into()),
            Value::I64(x) => Some(x.into()),
            _ => None,
        }
    }

    /// The GGUF value type id (0 U8 ... 12 F64).
    pub fn gguf_type(&self) -> u32 {
        match self {
            Value::U8(_) => 0,
            Value::I8(_) => 1,
            Value::U16(_) => 2,
            Value::I16(_) => 3,
            Value::U32(_) => 4,
            Value::I32(_) => 5,
            Value::F32(_) => 6,
            Value::Bool(_) => 7,
            Value::String(_) => 8,
            Value::Array(_) => 9,
            Value::U64(_) => 10,
            Value::I64(_) => 11,
            Value::F64(_) => 12,
        }
    }
}

/// One entry of the tensor directory.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorInfo {
    /// GGUF order: innermost first (`dims[0]` is the row length).
    pub dims: Vec<u64>,
    pub ggml_type: u32,
    /// Relative to [`Header::data_offset`].
    pub offset: u64,
}

impl TensorInfo {
    /// Dims in the order candle reports them (outermost first, i.e. GGUF's
    /// order reversed), as usize.
    pub fn shape(&self) -> Vec<usize> {
        let dim = |d: &u64| usize::try_from(*d).unwrap_or(usize::MAX);
        self.dims.iter().rev().map(dim).collect()
    }
}

/// A GGUF file's header: metadata and tensor directory.
#[derive(Debug, Clone, PartialEq)]
pub struct Header {
    pub version: u32,
    pub metadata: HashMap<String, Value>,
    pub tensors: HashMap<String, TensorInfo>,
    /// Byte offset in the file where the tensor data section starts (after
    /// alignment padding).
    pub data_offset: u64,
}

impl Header {
    /// Reads a header from the start of a GGUF file (versions 1 to 3). It
    /// reads exactly through the end of the tensor directory, not the padding
    /// after it, in small reads: pass a buffered reader, or use
    /// [`Header::read_file`].
    pub fn read<R: Read>(r: &mut R) -> Result<Header, GgufError> {
        let mut src = Src {
            r,
            pos: 0,
            v1: false,
            budget: MAX_ARRAY_LEN,
        };
        let magic: [u8; 4] = src.bytes()?;
        if magic != MAGIC {
            return Err(GgufError::BadMagic(magic));
        }
        let version = src.u32()?;
        match version {
            1 => src.v1 = true,
            2 | 3 => {}
            v => return Err(GgufError::UnsupportedVersion(v)),
        }
        let n_tensors = src.len("tensor count", MAX_TENSORS)?;
        let n_kv = src.len("metadata key count", MAX_KEYS)?;
        let metadata = src.metadata(n_kv)?;
        let alignment = alignment_of(metadata.get(ALIGNMENT_KEY))?;
        let tensors = src.tensors(n_tensors)?;
        let data_offset = align_up(src.pos, alignment).ok_or(too_large("data offset", src.pos))?;
        Ok(Header {
            version,
            metadata,
            tensors,
            data_offset,
        })
    }

    /// Opens `path` and reads its header through a buffer.
    pub fn read_file(path: &Path) -> Result<Header, GgufError> {
        let file = std::fs::File::open(path)?;
        Header::read(&mut BufReader::with_capacity(1 << 16, file))
    }
}

/// The alignment a `general.alignment` value (or its absence) gives.
fn alignment_of(v: Option<&Value>) -> Result<u64, GgufError> {
    match v {
        None => Ok(DEFAULT_ALIGNMENT),
        Some(Value::U32(a)) if a.is_power_of_two() => Ok(u64::from(*a)),
        Some(other) => Err(GgufError::BadAlignment(format!("{other:?}"))),
    }
}

fn align_up(pos: u64, alignment: u64) -> Option<u64> {
    Some(pos.checked_add(alignment - 1)? / alignment * alignment)
}

fn eof(e: std::io::Error) -> GgufError {
    if e.kind() == std::io::ErrorKind::UnexpectedEof {
        GgufError::Truncated
    } else {
        GgufError::Io(e)
    }
}

/// A reader that counts the bytes it has consumed.
struct Src<'a, R> {
    r: &'a mut R,
    pos: u64,
    /// Version 1 stores counts, lengths and dims as u32.
    v1: bool,
    /// Array elements still allowed in this header.
    budget: u64,
}

impl<R: Read> Src<'_, R> {
    fn bytes<const N: usize>(&mut self) -> Result<[u8; N], GgufError> {
        let mut b = [0u8; N];
        self.r.read_exact(&mut b).map_err(eof)?;
        self.pos += N as u64;
        Ok(b)
    }

    fn u32(&mut self) -> Result<u32, GgufError> {
        Ok(u32::from_le_bytes(self.bytes()?))
    }

    fn u64(&mut self) -> Result<u64, GgufError> {
        Ok(u64::from_le_bytes(self.bytes()?))
    }

    /// A count, length or dim: u64, or u32 in version 1.
    fn len(&mut self, what: &'static str, max: u64) -> Result<u64, GgufError> {
        let n = if self.v1 {
            self.u32()?.into()
        } else {
            self.u64()?
        };
        if n > max {
            return Err(too_large(what, n));
        }
        Ok(n)
    }

    fn string(&mut self) -> Result<String, GgufError> {
        let start = self.pos;
        let n = self.len("string length", MAX_STRING_LEN)?;
        // Grows as it reads: a lying length costs at most the file's bytes.
        let mut buf = Vec::with_capacity(n.min(1 << 16) as usize);
        (&mut *self.r).take(n).read_to_end(&mut buf).map_err(eof)?;
        if buf.len() as u64 != n {
            return Err(GgufError::Truncated);
        }
        self.pos += n;
        String::from_utf8(buf).map_err(|_| GgufError::InvalidUtf8 { offset: start })
    }

    fn value(&mut self, ty: u32, depth: u32) -> Result<Value, GgufError> {
        Ok(match ty {
            0 => Value::U8(u8::from_le_bytes(self.bytes()?)),
            1 => Value::I8(i8::from_le_bytes(self.bytes()?)),
            2 => Value::U16(u16::from_le_bytes(self.bytes()?)),
            3 => Value::I16(i16::from_le_bytes(self.bytes()?)),
            4 => Value::U32(self.u32()?),
            5 => Value::I32(i32::from_le_bytes(self.bytes()?)),
            6 => Value::F32(f32::from_le_bytes(self.bytes()?)),
            7 => match u8::from_le_bytes(self.bytes()?) {
                0 => Value::Bool(false),
                1 => Value::Bool(true),
                b => return Err(GgufError::InvalidBool(b)),
            },
            8 => Value::String(self.string()?),
            9 => self.array(depth + 1)?,
            10 => Value::U64(self.u64()?),
            11 => Value::I64(i64::from_le_bytes(self.bytes()?)),
            12 => Value::F64(f64::from_le_bytes(self.bytes()?)),
            t => return Err(GgufError::UnknownValueType(t)),
        })
    }

    fn array(&mut self, depth: u32) -> Result<Value, GgufError> {
        if depth > MAX_DEPTH {
            return Err(too_large("array nesting depth", depth));
        }
        let ty = self.u32()?;
        if ty > 12 {
            return Err(GgufError::UnknownValueType(ty));
        }
        let n = self.len("array length", MAX_ARRAY_LEN)?;
        let budget = self.budget.checked_sub(n);
        self.budget = budget.ok_or(too_large("total of array lengths", n))?;
        let mut items = Vec::with_capacity(n.min(4096) as usize);
        for _ in 0..n {
            items.push(self.value(ty, depth)?);
        }
        Ok(Value::Array(items))
    }

    fn metadata(&mut self, n_kv: u64) -> Result<HashMap<String, Value>, GgufError> {
        let mut metadata = HashMap::with_capacity(n_kv.min(1024) as usize);
        for _ in 0..n_kv {
            let key = self.string()?;
            let ty = self.u32()?;
            let value = self.value(ty, 0)?;
            match metadata.entry(key) {
                Entry::Occupied(e) => return Err(GgufError::DuplicateKey(e.key().clone())),
                Entry::Vacant(e) => e.insert(value),
            };
        }
        Ok(metadata)
    }

    fn tensors(&mut self, n: u64) -> Result<HashMap<String, TensorInfo>, GgufError> {
        let mut tensors = HashMap::with_capacity(n.min(1024) as usize);
        for _ in 0..n {
            let name = self.string()?;
            let n_dims = self.u32()?;
            if n_dims > MAX_DIMS {
                return Err(too_large("tensor dimension count", n_dims));
            }
            let dims = (0..n_dims)
                .map(|_| self.len("tensor dimension", u64::MAX))
                .collect::<Result<Vec<u64>, _>>()?;
            let ggml_type = self.u32()?;
            let offset = self.u64()?;
            match tensors.entry(name) {
                Entry::Occupied(e) => return Err(GgufError::DuplicateTensor(e.key().clone())),
                Entry::Vacant(e) => e.insert(TensorInfo {
                    dims,
                    ggml_type,
                    offset,
                }),
            };
        }
        Ok(tensors)
    }
}

/// One tensor to write.
#[derive(Debug, Clone)]
pub struct TensorData<'a> {
    /// GGUF order: innermost first.
    pub dims: Vec<u64>,
    pub ggml_type: u32,
    pub bytes: &'a [u8],
}

/// Writes a GGUF v3 file: the metadata (in the given order), the tensor
/// directory, alignment padding (32 bytes, or `general.alignment` if present
/// as a U32), then each tensor's bytes padded to the alignment. Offsets are
/// computed here. Writes go through a buffer, flushed before returning.
pub fn write<W: Write>(
    w: &mut W,
    metadata: &[(&str, &Value)],
    tensors: &[(&str, TensorData<'_>)],
) -> Result<(), GgufError> {
    let align = metadata.iter().find(|kv| kv.0 == ALIGNMENT_KEY);
    let alignment = alignment_of(align.map(|kv| kv.1))?;
    if let Some(key) = first_duplicate(metadata) {
        return Err(GgufError::DuplicateKey(key.to_string()));
    }
    if let Some(name) = first_duplicate(tensors) {
        return Err(GgufError::DuplicateTensor(name.to_string()));
    }
    let mut out = Sink {
        w: BufWriter::new(w),
        pos: 0,
    };
    out.put(&MAGIC)?;
    out.put(&3u32.to_le_bytes())?;
    out.put(&(tensors.len() as u64).to_le_bytes())?;
    out.put(&(metadata.len() as u64).to_le_bytes())?;
    for (key, value) in metadata {
        out.string(key)?;
        out.put(&value.gguf_type().to_le_bytes())?;
        out.value(key, value, 0)?;
    }
    let mut offset = 0u64;
    for (name, t) in tensors {
        let n_dims = u32::try_from(t.dims.len()).unwrap_or(u32::MAX);
        if n_dims > MAX_DIMS {
            return Err(too_large("tensor dimension count", n_dims));
        }
        out.string(name)?;
        out.put(&n_dims.to_le_bytes())?;
        t.dims.iter().try_for_each(|d| out.put(&d.to_le_bytes()))?;
        out.put(&t.ggml_type.to_le_bytes())?;
        out.put(&offset.to_le_bytes())?;
        let end = offset.checked_add(t.bytes.len() as u64);
        let next = end.and_then(|e| align_up(e, alignment));
        offset = next.ok_or(too_large("tensor data size", offset))?;
    }
    out.pad(alignment)?;
    for (_, t) in tensors {
        out.put(t.bytes)?;
        out.pad(alignment)?;
    }
    out.w.flush()?;
    Ok(())
}

fn first_duplicate<'a, T>(items: &[(&'a str, T)]) -> Option<&'a str> {
    let mut seen = HashSet::new();
    items.iter().map(|t| t.0).find(|name| !seen.insert(*name))
}

/// A writer that counts the bytes it has written.
struct Sink<W: Write> {
    w: BufWriter<W>,
    pos: u64,
}

impl<W: Write> Sink<W> {
    fn put(&mut self, b: &[u8]) -> Result<(), GgufError> {
        self.w.write_all(b)?;
        self.pos += b.len() as u64;
        Ok(())
    }

    fn string(&mut self, s: &str) -> Result<(), GgufError> {
        self.put(&(s.len() as u64).to_le_bytes())?;
        self.put(s.as_bytes())
    }

    fn pad(&mut self, alignment: u64) -> Result<(), GgufError> {
        let n = (alignment - self.pos % alignment) % alignment;
        std::io::copy(&mut std::io::repeat(0).take(n), &mut self.w)?;
        self.pos += n;
        Ok(())
    }

    fn value(&mut self, key: &str, v: &Value, depth: u32) -> Result<(), GgufError> {
        match v {
            Value::U8(x) => self.put(&x.to_le_bytes()),
            Value::I8(x) => self.put(&x.to_le_bytes()),
            Value::U16(x) => self.put(&x.to_le_bytes()),
            Value::I16(x) => self.put(&x.to_le_bytes()),
            Value::U32(x) => self.put(&x.to_le_bytes()),
            Value::I32(x) => self.put(&x.to_le_bytes()),
            Value::U64(x) => self.put(&x.to_le_bytes()),
            Value::I64(x) => self.put(&x.to_le_bytes()),
            Value::F32(x) => self.put(&x.to_le_bytes()),
            Value::F64(x) => self.put(&x.to_le_bytes()),
            Value::Bool(b) => self.put(&[u8::from(*b)]),
            Value::String(s) => self.string(s),
            Value::Array(items) => {
                if depth >= MAX_DEPTH {
                    return Err(too_large("array nesting depth", depth + 1));
                }
                let ty = items.first().map_or(EMPTY_ARRAY_TYPE, Value::gguf_type);
                if items.iter().any(|v| v.gguf_type() != ty) {
                    return Err(GgufError::MixedArray(key.to_string()));
                }
                self.put(&ty.to_le_bytes())?;
                self.put(&(items.len() as u64).to_le_bytes())?;
                items.iter().try_for_each(|v| self.value(key, v, depth + 1))
            }
        }
    }
}

#[cfg(test)]
mod tests {
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
}
