//! A sequence's KV as bytes: the rows of a layer exported for the KV
//! stream, and imported from it, in f32 or f16. Either is exact when it is
//! at least the store's own element type.

use half::f16;
use half::slice::HalfFloatSliceExt;

use super::elem::KvElem;
use super::store::Half;
use super::{KvDtype, KvError, SeqKv};

impl SeqKv {
    /// Appends the committed K then V of `layer` to `out` as little-endian bytes.
    pub fn export_layer(&self, layer: usize, dtype: KvDtype, out: &mut Vec<u8>) {
        for half in [Half::K, Half::V] {
            self.put_rows(layer, half, 0, self.len(), dtype, out);
        }
    }

    /// Appends the rows of positions `start .. start + n` of one half of
    /// `layer` to `out` as `dtype` bytes.
    fn put_rows(
        &self,
        layer: usize,
        half: Half,
        start: usize,
        n: usize,
        dtype: KvDtype,
        out: &mut Vec<u8>,
    ) {
        match self.dtype() {
            KvDtype::F32 => self.put_rows_as::<f32>(layer, half, start, n, dtype, out),
            KvDtype::F16 => self.put_rows_as::<f16>(layer, half, start, n, dtype, out),
        }
    }

    fn put_rows_as<T: KvElem>(
        &self,
        layer: usize,
        half: Half,
        start: usize,
        n: usize,
        dtype: KvDtype,
        out: &mut Vec<u8>,
    ) {
        let mut wide = Vec::new();
        for rows in self.rows::<T>(layer, half, start, n) {
            wide.resize(rows.len(), 0.0);
            T::widen(rows, &mut wide);
            write_values(&wide, dtype, out);
        }
    }

    /// Appends K then V of tokens `token_start..token_start + tokens` of `layer`
    /// to `k_out` and `v_out`, including rows written by a forward still in
    /// progress (to stream a layer as soon as it is computed).
    pub fn export_rows(
        &self,
        layer: usize,
        dtype: KvDtype,
        token_start: usize,
        tokens: usize,
        k_out: &mut Vec<u8>,
        v_out: &mut Vec<u8>,
    ) -> Result<(), KvError> {
        let end = token_start + tokens;
        if layer >= self.layout().n_layers || end > self.layer_len(layer) {
            return Err(KvError::OutOfRange(format!(
                "layer {layer} holds no tokens {token_start}..{end}"
            )));
        }
        for (half, out) in [(Half::K, k_out), (Half::V, v_out)] {
            self.put_rows(layer, half, token_start, tokens, dtype, out);
        }
        Ok(())
    }

    /// Imports one layer of `tokens` tokens into an empty sequence from bytes
    /// made by [`export_layer`](Self::export_layer). Layers may arrive in any
    /// order; call [`finish_import`](Self::finish_import) after the last.
    pub fn import_layer(
        &mut self,
        layer: usize,
        dtype: KvDtype,
        tokens: usize,
        bytes: &[u8],
    ) -> Result<(), KvError> {
        let expected = self.layout().layer_bytes(tokens, dtype);
        if bytes.len() != expected {
            return Err(KvError::BadImport(format!(
                "layer {layer}: {} bytes, expected {expected} for {tokens} tokens",
                bytes.len()
            )));
        }
        let (k, v) = bytes.split_at(expected / 2);
        self.import_rows(layer, dtype, 0, tokens, k, v)
    }

    /// Writes K and V rows of tokens `token_start..token_start + tokens` to
    /// one layer, which must hold exactly `token_start` tokens so far (chunks
    /// arrive in order per layer; the first starts after the committed
    /// tokens, e.g. an attached cached prefix). Nothing is committed until
    /// [`finish_import`](Self::finish_import).
    pub fn import_rows(
        &mut self,
        layer: usize,
        dtype: KvDtype,
        token_start: usize,
        tokens: usize,
        k: &[u8],
        v: &[u8],
    ) -> Result<(), KvError> {
        let layout = self.layout();
        if layer >= layout.n_layers {
            return Err(KvError::BadImport(format!(
                "layer {layer} out of range (model has {})",
                layout.n_layers
            )));
        }
        if token_start < self.len() || self.layer_len(layer) != token_start {
            return Err(KvError::BadImport(format!(
                "layer {layer} holds {} tokens, chunk starts at {token_start}",
                self.layer_len(layer)
            )));
        }
        if token_start + tokens > self.capacity() {
            return Err(KvError::CapacityExceeded {
                needed: token_start + tokens,
                capacity: self.capacity(),
            });
        }
        let expected = tokens * layout.row() * dtype.size();
        if k.len() != expected || v.len() != expected {
            return Err(KvError::BadImport(format!(
                "layer {layer}: K {} and V {} bytes, expected {expected} each for {tokens} tokens",
                k.len(),
                v.len()
            )));
        }
        self.write(layer, Half::K, token_start, &read_values(k, dtype));
        self.write(layer, Half::V, token_start, &read_values(v, dtype));
        self.layer_len[layer] += tokens;
        Ok(())
    }

    /// Commits an import once every layer holds all of `tokens` (the
    /// sequence's whole prompt, its committed prefix included).
    pub fn finish_import(&mut self, tokens: &[u32]) -> Result<(), KvError> {
        let n = tokens.len();
        let short = (0..self.layout().n_layers).find(|&l| self.layer_len(l) != n);
        let err = match short {
            Some(l) => format!("layer {l} holds {} tokens, expected {n}", self.layer_len(l)),
            None if n < self.len() || tokens[..self.len()] != *self.tokens() => {
                "the tokens do not continue the committed prefix".to_string()
            }
            None => {
                let from = self.len();
                self.commit(&tokens[from..]);
                return Ok(());
            }
        };
        self.rollback();
        Err(KvError::BadImport(err))
    }
}

pub(super) fn write_values(src: &[f32], dtype: KvDtype, out: &mut Vec<u8>) {
    out.reserve(src.len() * dtype.size());
    match dtype {
        KvDtype::F32 => src
            .iter()
            .for_each(|x| out.extend_from_slice(&x.to_le_bytes())),
        KvDtype::F16 => {
            let mut half = vec![f16::ZERO; src.len()];
            half.convert_from_f32_slice(src);
            half.iter()
                .for_each(|x| out.extend_from_slice(&x.to_le_bytes()));
        }
    }
}

pub(super) fn read_values(bytes: &[u8], dtype: KvDtype) -> Vec<f32> {
    match dtype {
        KvDtype::F32 => bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
        KvDtype::F16 => {
            let half: Vec<f16> = bytes
                .chunks_exact(2)
                .map(|c| f16::from_le_bytes([c[0], c[1]]))
                .collect();
            let mut out = vec![0f32; half.len()];
            half.convert_to_f32_slice(&mut out);
            out
        }
    }
}
