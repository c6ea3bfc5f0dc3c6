//! Writing a GGUF v3 file.

use std::collections::HashSet;
use std::io::{BufWriter, Read, Write};

use super::{
    align_up, alignment_of, too_large, GgufError, Value, ALIGNMENT_KEY, EMPTY_ARRAY_TYPE, MAGIC,
    MAX_DEPTH, MAX_DIMS,
};

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
