//! Typed access to GGUF metadata, with errors that name the key.

use std::collections::HashMap;

use crate::error::{Result, TextError};
use crate::gguf::Value;

pub(crate) struct Metadata<'a>(pub &'a HashMap<String, Value>);

impl Metadata<'_> {
    fn get(&self, key: &str) -> Result<&Value> {
        self.0
            .get(key)
            .ok_or_else(|| TextError::InvalidModel(format!("missing metadata key `{key}`")))
    }

    fn wrong(key: &str, what: &str, v: &Value) -> TextError {
        TextError::InvalidModel(format!("metadata key `{key}` is not {what}: {v:?}"))
    }

    pub fn string(&self, key: &str) -> Result<String> {
        let v = self.get(key)?;
        v.as_str()
            .map(str::to_string)
            .ok_or_else(|| Self::wrong(key, "a string", v))
    }

    pub fn opt_string(&self, key: &str) -> Option<String> {
        self.0.get(key).and_then(|v| v.as_str()).map(str::to_string)
    }

    /// Any integer type, as `usize`.
    pub fn usize(&self, key: &str) -> Result<usize> {
        let v = self.get(key)?;
        let n = v
            .as_u64()
            .ok_or_else(|| Self::wrong(key, "a non-negative integer", v))?;
        usize::try_from(n).map_err(|_| TextError::InvalidModel(format!("`{key}` is too large")))
    }

    pub fn opt_usize(&self, key: &str) -> Result<Option<usize>> {
        match self.0.contains_key(key) {
            true => self.usize(key).map(Some),
            false => Ok(None),
        }
    }

    pub fn opt_f32(&self, key: &str) -> Result<Option<f32>> {
        match self.0.get(key) {
            None => Ok(None),
            Some(v) => match v.as_f64() {
                Some(x) => Ok(Some(x as f32)),
                None => Err(Self::wrong(key, "a number", v)),
            },
        }
    }

    pub fn opt_bool(&self, key: &str) -> Option<bool> {
        self.0.get(key).and_then(Value::as_bool)
    }

    pub fn array(&self, key: &str) -> Result<&[Value]> {
        let v = self.get(key)?;
        v.as_array().ok_or_else(|| Self::wrong(key, "an array", v))
    }
}
