//! The KV cache, owned outside the model.
//!
//! A [`KvPool`] holds a memory budget counted in tokens. Each sequence gets a
//! [`SeqKv`] that reserves its capacity from the pool up front and gives it back
//! when dropped, so a cancelled or finished request can never leak budget.
//! Storage is token-major per layer (`[tokens, kv_heads, head_dim]` of f32), so
//! attention reads raw contiguous slices and export is a straight copy.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use half::f16;
use half::slice::HalfFloatSliceExt;

/// Shape of one token's KV in one layer, and the layer count.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvLayout {
    pub n_layers: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
}

impl KvLayout {
    /// Values of K (or of V) per token in one layer.
    pub fn row(&self) -> usize {
        self.n_kv_heads * self.head_dim
    }

    /// Bytes of K plus V for `tokens` tokens in one layer, in `dtype`.
    pub fn layer_bytes(&self, tokens: usize, dtype: KvDtype) -> usize {
        2 * tokens * self.row() * dtype.size()
    }

    /// Bytes of K plus V for one token across all layers, as stored (f32).
    pub fn bytes_per_token(&self) -> usize {
        self.n_layers * self.layer_bytes(1, KvDtype::F32)
    }
}

/// Element type of exported KV bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum KvDtype {
    F32,
    F16,
}

impl KvDtype {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            Self::F32 => 4,
            Self::F16 => 2,
        }
    }
}

/// Errors of the KV cache.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KvError {
    #[error("KV cache budget exhausted: {requested} tokens requested, {free} of {budget} free")]
    Exhausted {
        requested: usize,
        free: usize,
        budget: usize,
    },
    #[error("sequence KV capacity exceeded: {needed} tokens needed, capacity is {capacity}")]
    CapacityExceeded { needed: usize, capacity: usize },
    #[error("KV layout mismatch: {0}")]
    LayoutMismatch(String),
    #[error("invalid KV import: {0}")]
    BadImport(String),
    #[error("KV rows out of range: {0}")]
    OutOfRange(String),
}

impl KvError {
    /// A short stable name, for metric labels and error codes.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Exhausted { .. } => "kv_exhausted",
            Self::CapacityExceeded { .. } => "kv_capacity_exceeded",
            Self::LayoutMismatch(_) => "kv_layout_mismatch",
            Self::BadImport(_) => "kv_bad_import",
            Self::OutOfRange(_) => "kv_out_of_range",
        }
    }
}

/// A snapshot of the pool's usage.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvUsage {
    /// Tokens reserved by live sequences (what admission control counts).
    pub reserved_tokens: usize,
    /// Tokens actually written into live sequences.
    pub stored_tokens: usize,
    pub budget_tokens: usize,
    pub sequences: usize,
}

impl KvUsage {
    /// Tokens still free for new reservations.
    pub fn free_tokens(&self) -> usize {
        self.budget_tokens.saturating_sub(self.reserved_tokens)
    }

    /// Reserved share of the budget, in [0, 1].
    pub fn usage_ratio(&self) -> f64 {
        match self.budget_tokens {
            0 => 1.0,
            b => self.reserved_tokens as f64 / b as f64,
        }
    }
}

#[derive(Debug)]
struct PoolState {
    layout: KvLayout,
    budget: usize,
    /// (reserved tokens, live sequences) under one lock.
    reserved: Mutex<(usize, usize)>,
    stored: AtomicUsize,
}

impl PoolState {
    fn lock(&self) -> std::sync::MutexGuard<'_, (usize, usize)> {
        // The guarded data is two counters that are always left consistent.
        self.reserved.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// A KV memory budget shared by many sequences. Cheap to clone.
#[derive(Debug, Clone)]
pub struct KvPool {
    state: Arc<PoolState>,
}

impl KvPool {
    /// A pool for `layout` that admits at most `budget_tokens` reserved tokens.
    pub fn new(layout: KvLayout, budget_tokens: usize) -> Self {
        let state = PoolState {
            layout,
            budget: budget_tokens,
            reserved: Mutex::new((0, 0)),
            stored: AtomicUsize::new(0),
        };
        Self {
            state: Arc::new(state),
        }
    }

    pub fn layout(&self) -> KvLayout {
        self.state.layout
    }

    /// Reserves room for `capacity` tokens and returns an empty sequence,
    /// or [`KvError::Exhausted`] when the budget cannot cover it.
    pub fn allocate(&self, capacity: usize) -> Result<SeqKv, KvError> {
        let mut guard = self.state.lock();
        let free = self.state.budget.saturating_sub(guard.0);
        if capacity > free {
            return Err(KvError::Exhausted {
                requested: capacity,
                free,
                budget: self.state.budget,
            });
        }
        guard.0 += capacity;
        guard.1 += 1;
        drop(guard);
        Ok(SeqKv::new(self.state.clone(), capacity))
    }

    pub fn usage(&self) -> KvUsage {
        let guard = self.state.lock();
        KvUsage {
            reserved_tokens: guard.0,
            stored_tokens: self.state.stored.load(Ordering::Relaxed),
            budget_tokens: self.state.budget,
            sequences: guard.1,
        }
    }
}

/// One sequence's KV: per layer, K and V rows for every token so far.
#[derive(Debug)]
pub struct SeqKv {
    pool: Arc<PoolState>,
    capacity: usize,
    len: usize,
    k: Vec<Vec<f32>>,
    v: Vec<Vec<f32>>,
}

impl SeqKv {
    fn new(pool: Arc<PoolState>, capacity: usize) -> Self {
        let n = pool.layout.n_layers;
        Self {
            pool,
            capacity,
            len: 0,
            k: vec![Vec::new(); n],
            v: vec![Vec::new(); n],
        }
    }

    pub fn layout(&self) -> KvLayout {
        self.pool.layout
    }

    /// Tokens committed (fully written in every layer).
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Tokens reserved for this sequence.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// K and V of `layer`, including rows appended by a forward still in progress.
    pub fn layer(&self, layer: usize) -> (&[f32], &[f32]) {
        (&self.k[layer], &self.v[layer])
    }

    /// Tokens present in `layer` (may run ahead of [`len`](Self::len) during a forward).
    pub fn layer_len(&self, layer: usize) -> usize {
        self.k[layer].len() / self.pool.layout.row()
    }

    /// Checks that `n` more tokens fit in the reservation.
    pub(crate) fn ensure_room(&self, n: usize) -> Result<(), KvError> {
        let needed = self.len + n;
        match needed <= self.capacity {
            true => Ok(()),
            false => Err(KvError::CapacityExceeded {
                needed,
                capacity: self.capacity,
            }),
        }
    }

    /// Appends K and V rows for new tokens to one layer (room checked by the caller).
    pub(crate) fn append(&mut self, layer: usize, k_rows: &[f32], v_rows: &[f32]) {
        let reserve = self.capacity * self.pool.layout.row();
        for (buf, rows) in [(&mut self.k[layer], k_rows), (&mut self.v[layer], v_rows)] {
            // One reservation for the whole capacity: pages are only touched when written.
            if buf.capacity() == 0 {
                buf.reserve_exact(reserve);
            }
            buf.extend_from_slice(rows);
        }
    }

    /// Makes `n` tokens appended to every layer part of the sequence.
    pub(crate) fn commit(&mut self, n: usize) {
        self.len += n;
        self.pool.stored.fetch_add(n, Ordering::Relaxed);
    }

    /// Drops rows appended after the last commit (after a failed forward).
    pub(crate) fn rollback(&mut self) {
        let keep = self.len * self.pool.layout.row();
        for buf in self.k.iter_mut().chain(self.v.iter_mut()) {
            buf.truncate(keep);
        }
    }

    /// Forgets tokens from `len` on (e.g. to re-run the tail of a prompt).
    pub fn truncate(&mut self, len: usize) {
        if len < self.len {
            self.pool
                .stored
                .fetch_sub(self.len - len, Ordering::Relaxed);
            self.len = len;
        }
        self.rollback();
    }

    /// Appends the committed K then V of `layer` to `out` as little-endian bytes.
    pub fn export_layer(&self, layer: usize, dtype: KvDtype, out: &mut Vec<u8>) {
        let n = self.len * self.pool.layout.row();
        for src in [&self.k[layer][..n], &self.v[layer][..n]] {
            write_values(src, dtype, out);
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
        let row = self.pool.layout.row();
        let end = token_start + tokens;
        if layer >= self.k.len() || end > self.layer_len(layer) {
            return Err(KvError::OutOfRange(format!(
                "layer {layer} holds no tokens {token_start}..{end}"
            )));
        }
        write_values(&self.k[layer][token_start * row..end * row], dtype, k_out);
        write_values(&self.v[layer][token_start * row..end * row], dtype, v_out);
        Ok(())
    }

    /// Imports one layer of `tokens` tokens from bytes made by [`export_layer`](Self::export_layer).
    /// Layers may arrive in any order; call [`finish_import`](Self::finish_import) after the last.
    pub fn import_layer(
        &mut self,
        layer: usize,
        dtype: KvDtype,
        tokens: usize,
        bytes: &[u8],
    ) -> Result<(), KvError> {
        let expected = self.pool.layout.layer_bytes(tokens, dtype);
        if bytes.len() != expected {
            return Err(KvError::BadImport(format!(
                "layer {layer}: {} bytes, expected {expected} for {tokens} tokens",
                bytes.len()
            )));
        }
        let (k, v) = bytes.split_at(expected / 2);
        self.import_rows(layer, dtype, 0, tokens, k, v)
    }

    /// Appends K and V rows of tokens `token_start..token_start + tokens` to one
    /// layer, which must hold exactly `token_start` tokens so far (chunks arrive
    /// in order per layer). Nothing is committed until [`finish_import`](Self::finish_import).
    pub fn import_rows(
        &mut self,
        layer: usize,
        dtype: KvDtype,
        token_start: usize,
        tokens: usize,
        k: &[u8],
        v: &[u8],
    ) -> Result<(), KvError> {
        let layout = self.pool.layout;
        if layer >= layout.n_layers {
            return Err(KvError::BadImport(format!(
                "layer {layer} out of range (model has {})",
                layout.n_layers
            )));
        }
        if self.len != 0 || self.layer_len(layer) != token_start {
            return Err(KvError::BadImport(format!(
                "layer {layer} holds {} tokens, chunk starts at {token_start}",
                self.layer_len(layer)
            )));
        }
        self.ensure_room(token_start + tokens)?;
        let expected = tokens * layout.row() * dtype.size();
        if k.len() != expected || v.len() != expected {
            return Err(KvError::BadImport(format!(
                "layer {layer}: K {} and V {} bytes, expected {expected} each for {tokens} tokens",
                k.len(),
                v.len()
            )));
        }
        let (k, v) = (read_values(k, dtype), read_values(v, dtype));
        self.append(layer, &k, &v);
        Ok(())
    }

    /// Commits an import once every layer holds `tokens` tokens.
    pub fn finish_import(&mut self, tokens: usize) -> Result<(), KvError> {
        if self.len != 0 {
            return Err(KvError::BadImport("sequence already holds KV".into()));
        }
        if let Some(l) = (0..self.k.len()).find(|&l| self.layer_len(l) != tokens) {
            self.rollback();
            return Err(KvError::BadImport(format!(
                "layer {l} holds {} tokens, expected {tokens}",
                self.layer_len(l)
            )));
        }
        self.commit(tokens);
        Ok(())
    }
}

impl Drop for SeqKv {
    fn drop(&mut self) {
        self.pool.stored.fetch_sub(self.len, Ordering::Relaxed);
        let mut guard = self.pool.lock();
        guard.0 -= self.capacity;
        guard.1 -= 1;
    }
}

fn write_values(src: &[f32], dtype: KvDtype, out: &mut Vec<u8>) {
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

fn read_values(bytes: &[u8], dtype: KvDtype) -> Vec<f32> {
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

#[cfg(test)]
mod tests {
    use super::*;

    fn layout() -> KvLayout {
        KvLayout {
            n_layers: 2,
            n_kv_heads: 2,
            head_dim: 4,
        }
    }

    fn filled(pool: &KvPool, tokens: usize) -> SeqKv {
        let mut s = pool.allocate(tokens).unwrap();
        let row = layout().row();
        for l in 0..2 {
            let k: Vec<f32> = (0..tokens * row).map(|i| (i + l) as f32 * 0.37).collect();
            let v: Vec<f32> = k.iter().map(|x| -x).collect();
            s.append(l, &k, &v);
        }
        s.commit(tokens);
        s
    }

    #[test]
    fn budget_is_enforced_and_returned_on_drop() {
        let pool = KvPool::new(layout(), 10);
        let a = pool.allocate(6).unwrap();
        let err = pool.allocate(5).unwrap_err();
        assert_eq!(
            err,
            KvError::Exhausted {
                requested: 5,
                free: 4,
                budget: 10
            }
        );
        assert_eq!(pool.usage().reserved_tokens, 6);
        assert_eq!(pool.usage().sequences, 1);
        drop(a);
        assert_eq!(pool.usage().reserved_tokens, 0);
        assert!(pool.allocate(10).is_ok());
    }

    #[test]
    fn capacity_is_checked_and_stored_tokens_tracked() {
        let pool = KvPool::new(layout(), 100);
        let s = filled(&pool, 3);
        assert_eq!(pool.usage().stored_tokens, 3);
        assert!(matches!(
            s.ensure_room(1),
            Err(KvError::CapacityExceeded {
                needed: 4,
                capacity: 3
            })
        ));
        drop(s);
        assert_eq!(pool.usage().stored_tokens, 0);
    }

    #[test]
    fn f32_export_import_is_bit_exact() {
        let pool = KvPool::new(layout(), 100);
        let src = filled(&pool, 5);
        let mut dst = pool.allocate(8).unwrap();
        for l in (0..2).rev() {
            let mut bytes = Vec::new();
            src.export_layer(l, KvDtype::F32, &mut bytes);
            assert_eq!(bytes.len(), layout().layer_bytes(5, KvDtype::F32));
            dst.import_layer(l, KvDtype::F32, 5, &bytes).unwrap();
        }
        dst.finish_import(5).unwrap();
        for l in 0..2 {
            assert_eq!(src.layer(l), dst.layer(l));
        }
    }

    #[test]
    fn f16_export_import_is_close() {
        let pool = KvPool::new(layout(), 100);
        let src = filled(&pool, 4);
        let mut dst = pool.allocate(4).unwrap();
        for l in 0..2 {
            let mut bytes = Vec::new();
            src.export_layer(l, KvDtype::F16, &mut bytes);
            dst.import_layer(l, KvDtype::F16, 4, &bytes).unwrap();
        }
        dst.finish_import(4).unwrap();
        let (a, b) = (src.layer(1).0, dst.layer(1).0);
        assert!(a
            .iter()
            .zip(b)
            .all(|(x, y)| (x - y).abs() <= 1e-3 * x.abs().max(1.0)));
    }

    #[test]
    fn bad_imports_are_rejected() {
        let pool = KvPool::new(layout(), 100);
        let src = filled(&pool, 2);
        let mut bytes = Vec::new();
        src.export_layer(0, KvDtype::F32, &mut bytes);
        let mut dst = pool.allocate(2).unwrap();
        assert!(dst.import_layer(0, KvDtype::F32, 2, &bytes[1..]).is_err());
        assert!(dst.import_layer(7, KvDtype::F32, 2, &bytes).is_err());
        assert!(dst.import_layer(0, KvDtype::F32, 3, &bytes).is_err());
        dst.import_layer(0, KvDtype::F32, 2, &bytes).unwrap();
        assert!(dst.import_layer(0, KvDtype::F32, 2, &bytes).is_err());
        // Layer 1 never arrived.
        assert!(dst.finish_import(2).is_err());
        assert_eq!(dst.len(), 0);
    }

    #[test]
    fn chunked_import_in_order_equals_whole_import() {
        let pool = KvPool::new(layout(), 100);
        let src = filled(&pool, 5);
        let row_bytes = layout().row() * 4;
        let mut dst = pool.allocate(5).unwrap();
        for (start, n) in [(0usize, 2usize), (2, 3)] {
            for l in 0..2 {
                let mut bytes = Vec::new();
                src.export_layer(l, KvDtype::F32, &mut bytes);
                let (k, v) = bytes.split_at(bytes.len() / 2);
                let range = start * row_bytes..(start + n) * row_bytes;
                dst.import_rows(l, KvDtype::F32, start, n, &k[range.clone()], &v[range])
                    .unwrap();
            }
        }
        // A chunk out of order is refused.
        assert!(dst
            .import_rows(0, KvDtype::F32, 1, 1, &[0; 32], &[0; 32])
            .is_err());
        dst.finish_import(5).unwrap();
        assert_eq!(src.layer(1), dst.layer(1));
    }

    #[test]
    fn truncate_forgets_the_tail() {
        let pool = KvPool::new(layout(), 100);
        let mut s = filled(&pool, 5);
        s.truncate(2);
        assert_eq!(s.len(), 2);
        assert_eq!(s.layer_len(1), 2);
        assert_eq!(pool.usage().stored_tokens, 2);
    }
}
