//! A candle-free reader (and small writer) for GGUF files, llama.cpp's model
//! format: the metadata and the tensor directory, never the tensor data.
//!
//! The reader treats its input as untrusted: every length is bounded before
//! anything is allocated, a cut file is [`GgufError::Truncated`], and no input
//! makes it panic.

use std::collections::hash_map::Entry;
use std::collections::HashMap;
use std::io::{BufReader, Read};
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

mod write;

pub use write::{write, TensorData};

#[cfg(test)]
mod tests;
