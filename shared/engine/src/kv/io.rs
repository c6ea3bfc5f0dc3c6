//! A sequence's KV as bytes: the rows of a layer exported for the KV
//! stream, and imported from it, in f32 or f16. Either is exact when it is
//! at least the store's own element type, and a copy of the stored bytes
//! when it is that type.

use super::elem::{with_elem, KvElem};
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
    /// `layer` to `out` as `dtype` bytes: copied as they are when `dtype` is
    /// the store's own type, converted otherwise.
    fn put_rows(
        &self,
        layer: usize,
        half: Half,
        start: usize,
        n: usize,
        dtype: KvDtype,
        out: &mut Vec<u8>,
    ) {
        with_elem!(self.dtype(), T => {
            let mut wide = Vec::new();
            for rows in self.rows::<T>(layer, half, start, n) {
                if dtype == T::DTYPE {
                    T::put_le(rows, out);
                } else {
                    wide.resize(rows.len(), 0.0);
                    T::widen(rows, &mut wide);
                    write_values(&wide, dtype, out);
                }
            }
        })
    }

    /// Writes `dtype` bytes as the rows of one half of `layer` from position
    /// `start` on: copied as they are when `dtype` is the store's own type,
    /// converted otherwise.
    fn put_bytes(&mut self, layer: usize, half: Half, start: usize, bytes: &[u8], dtype: KvDtype) {
        with_elem!(self.dtype(), T => {
            if dtype != T::DTYPE {
                return self.write(layer, half, start, &read_values(bytes, dtype));
            }
            let n = bytes.len() / (self.layout().row() * dtype.size());
            let mut at = 0;
            for dst in self.rows_mut::<T>(layer, half, start, n) {
                let len = dst.len() * dtype.size();
                T::get_le(&bytes[at..at + len], dst);
                at += len;
            }
        })
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
        self.put_bytes(layer, Half::K, token_start, k, dtype);
        self.put_bytes(layer, Half::V, token_start, v, dtype);
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

fn write_values(src: &[f32], dtype: KvDtype, out: &mut Vec<u8>) {
    with_elem!(dtype, T => {
        let mut narrow = vec![T::default(); src.len()];
        T::narrow(src, &mut narrow);
        T::put_le(&narrow, out);
    })
}

fn read_values(bytes: &[u8], dtype: KvDtype) -> Vec<f32> {
    with_elem!(dtype, T => {
        let mut narrow = vec![T::default(); bytes.len() / dtype.size()];
        T::get_le(bytes, &mut narrow);
        let mut out = vec![0f32; narrow.len()];
        T::widen(&narrow, &mut out);
        out
    })
}
