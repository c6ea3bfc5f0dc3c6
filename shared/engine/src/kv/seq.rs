//! One sequence's KV: a table of blocks, the tokens they hold, and the
//! writes of a forward pass in progress.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::blocks::BlockId;
use super::elem::with_elem;
use super::elem::KvElem;
use super::store::Half;
use super::{KvDtype, KvError, KvLayout, PoolInner};

/// One sequence's KV: per layer, K and V rows for every token so far, in
/// the blocks of its table. Dropping it gives the blocks back.
///
/// Invariant that makes the lock-free storage sound: the blocks from
/// `len / block_tokens` on are this sequence's alone (exclusive, not
/// cached), so writes only ever go to them; blocks before may be shared
/// with other sequences or cached, and are only read.
#[derive(Debug)]
pub struct SeqKv {
    pub(super) pool: Arc<PoolInner>,
    blocks: Vec<BlockId>,
    /// Chained hashes of the full blocks entered in the prefix cache.
    hashes: Vec<u64>,
    /// Token ids of the committed rows.
    tokens: Vec<u32>,
    /// Rows written per layer (ahead of `len` while a forward or an import runs).
    pub(super) layer_len: Vec<usize>,
    /// Tokens this sequence may hold (its blocks cover at least this many).
    capacity: usize,
}

impl SeqKv {
    pub(super) fn new(pool: Arc<PoolInner>) -> Self {
        pool.sequences.fetch_add(1, Ordering::Relaxed);
        let n = pool.layout.n_layers;
        Self {
            pool,
            blocks: Vec::new(),
            hashes: Vec::new(),
            tokens: Vec::new(),
            layer_len: vec![0; n],
            capacity: 0,
        }
    }

    pub fn layout(&self) -> KvLayout {
        self.pool.layout
    }

    /// Element type of the stored K and V.
    pub fn dtype(&self) -> KvDtype {
        self.pool.cfg.dtype
    }

    /// Tokens per block.
    pub fn block_tokens(&self) -> usize {
        self.pool.cfg.block_tokens
    }

    /// Tokens committed (fully written in every layer).
    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    /// The committed tokens' ids.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    /// Tokens this sequence may hold without growing.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Blocks in the table.
    pub fn blocks(&self) -> usize {
        self.blocks.len()
    }

    /// Tokens present in `layer` (may run ahead of [`len`](Self::len) during a forward).
    pub fn layer_len(&self, layer: usize) -> usize {
        self.layer_len[layer]
    }

    /// Grows the capacity to `total` tokens, taking blocks from the pool
    /// (all or none): [`KvError::Exhausted`] when it has too few.
    pub fn reserve_to(&mut self, total: usize) -> Result<(), KvError> {
        let need = total
            .div_ceil(self.block_tokens())
            .saturating_sub(self.blocks.len());
        if need > 0 {
            let mut blocks = self.pool.blocks();
            match blocks.allocate(need) {
                Some(new) => self.blocks.extend(new),
                None => return Err(self.pool.exhausted(need, blocks.available())),
            }
        }
        self.capacity = self.capacity.max(total);
        Ok(())
    }

    /// Takes the cached blocks that hold the start of `prompt` (whole
    /// blocks, leaving at least the last token to compute) and makes them
    /// this empty sequence's first tokens; returns how many. Nothing is
    /// taken when the prefix cache is off or the sequence is not empty.
    pub fn attach_prefix(&mut self, prompt: &[u32]) -> usize {
        if !self.pool.cfg.prefix_cache || !self.is_empty() {
            return 0;
        }
        let b = self.block_tokens();
        let usable = prompt.len().saturating_sub(1);
        let mut taken = Vec::new();
        {
            let mut blocks = self.pool.blocks();
            let mut parent = 0;
            for chunk in prompt[..usable].chunks_exact(b) {
                let hash = self.pool.hash(parent, chunk);
                let Some(block) = blocks.lookup(hash, parent, chunk) else {
                    break;
                };
                taken.push(block);
                self.hashes.push(hash);
                parent = hash;
            }
            // The reserved blocks the cached ones replace go back.
            for old in self
                .blocks
                .splice(0..taken.len().min(self.blocks.len()), [])
            {
                blocks.release(old);
            }
        }
        let n = taken.len() * b;
        self.blocks.splice(0..0, taken);
        self.pool
            .queried
            .fetch_add(prompt.len() as u64, Ordering::Relaxed);
        self.pool.hits.fetch_add(n as u64, Ordering::Relaxed);
        self.tokens.extend_from_slice(&prompt[..n]);
        self.layer_len.iter_mut().for_each(|l| *l = n);
        self.pool.stored.fetch_add(n, Ordering::Relaxed);
        self.capacity = self.capacity.max(n);
        n
    }

    /// Checks that `n` more tokens fit in the capacity.
    pub(crate) fn ensure_room(&self, n: usize) -> Result<(), KvError> {
        let needed = self.len() + n;
        match needed <= self.capacity {
            true => Ok(()),
            false => Err(KvError::CapacityExceeded {
                needed,
                capacity: self.capacity,
            }),
        }
    }

    /// Writes `rows` (of `row` floats each) of one half of `layer` from
    /// position `start` on, block by block, in the store's element type.
    pub(super) fn write(&mut self, layer: usize, half: Half, start: usize, rows: &[f32]) {
        let n = rows.len() / self.pool.layout.row();
        with_elem!(self.dtype(), T => {
            let mut at = 0;
            for dst in self.rows_mut::<T>(layer, half, start, n) {
                T::narrow(&rows[at..at + dst.len()], dst);
                at += dst.len();
            }
        })
    }

    /// The rows of positions `start .. start + n` of one half of `layer`,
    /// one slice per block, to write. They must lie past the committed
    /// tokens.
    pub(super) fn rows_mut<T: KvElem>(
        &mut self,
        layer: usize,
        half: Half,
        start: usize,
        n: usize,
    ) -> Vec<&mut [T]> {
        assert!(start >= self.len(), "writes go past the committed tokens");
        let (b, row) = (self.block_tokens(), self.pool.layout.row());
        Chunks::new(n, start, b)
            .map(|c| {
                // SAFETY: positions from `len` on are in this sequence's
                // exclusive blocks (the type's invariant), each chunk is in
                // a different block, and `&mut self` keeps anyone else from
                // writing through this sequence while the slices live.
                let block = unsafe {
                    self.pool
                        .store
                        .block_mut::<T>(layer, half, self.blocks[c.block])
                };
                &mut block[c.slot * row..(c.slot + c.n) * row]
            })
            .collect()
    }

    /// Appends K and V rows for new tokens to one layer (room checked by the caller).
    pub(crate) fn append(&mut self, layer: usize, k_rows: &[f32], v_rows: &[f32]) {
        let start = self.layer_len[layer];
        self.write(layer, Half::K, start, k_rows);
        self.write(layer, Half::V, start, v_rows);
        self.layer_len[layer] += k_rows.len() / self.pool.layout.row();
    }

    /// Makes `tokens`, appended to every layer, part of the sequence; full
    /// blocks enter the prefix cache.
    pub(crate) fn commit(&mut self, tokens: &[u32]) {
        self.tokens.extend_from_slice(tokens);
        self.pool.stored.fetch_add(tokens.len(), Ordering::Relaxed);
        if !self.pool.cfg.prefix_cache {
            return;
        }
        let b = self.block_tokens();
        let mut blocks = self.pool.blocks();
        for i in self.hashes.len()..self.tokens.len() / b {
            let parent = self.hashes.last().copied().unwrap_or(0);
            let chunk = &self.tokens[i * b..(i + 1) * b];
            let hash = self.pool.hash(parent, chunk);
            blocks.register(self.blocks[i], hash, parent, chunk);
            self.hashes.push(hash);
        }
    }

    /// Drops rows appended after the last commit (after a failed forward).
    pub(crate) fn rollback(&mut self) {
        let len = self.len();
        self.layer_len.iter_mut().for_each(|l| *l = len);
    }

    /// Forgets tokens from `len` on (e.g. to re-run the tail of a prompt);
    /// the capacity stays. A shared or cached block that would be written
    /// again is replaced by a copy of this sequence's own.
    pub fn truncate(&mut self, len: usize) {
        if len < self.len() {
            let b = self.block_tokens();
            self.pool
                .stored
                .fetch_sub(self.len() - len, Ordering::Relaxed);
            self.tokens.truncate(len);
            self.hashes.truncate(len / b);
            self.unshare_from(len / b, len % b);
        }
        self.rollback();
    }

    /// Makes the blocks from index `first` on exclusive again, copying the
    /// first `keep` rows of block `first`.
    fn unshare_from(&mut self, first: usize, keep: usize) {
        let pool = self.pool.clone();
        let mut blocks = pool.blocks();
        for i in first..self.blocks.len() {
            let old = self.blocks[i];
            if blocks.is_exclusive(old) {
                continue;
            }
            let Some(new) = blocks.allocate(1).map(|v| v[0]) else {
                // No room for a copy: the table ends here.
                self.release_from(i, &mut blocks);
                self.capacity = self.capacity.min(i * self.block_tokens());
                return;
            };
            if i == first && keep > 0 {
                self.copy_rows(old, new, keep);
            }
            blocks.release(old);
            self.blocks[i] = new;
        }
    }

    fn release_from(&mut self, i: usize, blocks: &mut super::blocks::Blocks) {
        for b in self.blocks.drain(i..) {
            blocks.release(b);
        }
    }

    /// Copies the first `rows` rows of every layer from block `from` to `to`.
    fn copy_rows(&self, from: BlockId, to: BlockId, rows: usize) {
        let n = rows * self.pool.layout.row();
        for layer in 0..self.pool.layout.n_layers {
            for half in [Half::K, Half::V] {
                // SAFETY: `from` is held by this sequence and read-only;
                // `to` was just allocated to it and nobody else holds it.
                unsafe { self.pool.store.copy(layer, half, from, to, n) };
            }
        }
    }

    /// The rows of positions `start .. start + n` of one half of `layer`,
    /// as contiguous slices (one per block they span). `T` is the store's
    /// element type.
    pub(crate) fn rows<T: KvElem>(
        &self,
        layer: usize,
        half: Half,
        start: usize,
        n: usize,
    ) -> Vec<&[T]> {
        let (b, row) = (self.block_tokens(), self.pool.layout.row());
        Chunks::new(n, start, b)
            .map(|c| {
                // SAFETY: the block is held by this sequence; rows before
                // `layer_len` are not written while `&self` is borrowed.
                let block = unsafe { self.pool.store.block(layer, half, self.blocks[c.block]) };
                &block[c.slot * row..(c.slot + c.n) * row]
            })
            .collect()
    }

    /// Every block's rows of one half of `layer` up to its `layer_len`,
    /// one slice per block (for attention).
    pub(crate) fn layer_blocks<T: KvElem>(&self, layer: usize, half: Half) -> Vec<&[T]> {
        self.rows(layer, half, 0, self.layer_len[layer])
    }
}

impl Drop for SeqKv {
    fn drop(&mut self) {
        let pool = self.pool.clone();
        pool.stored.fetch_sub(self.len(), Ordering::Relaxed);
        pool.sequences.fetch_sub(1, Ordering::Relaxed);
        self.release_from(0, &mut pool.blocks());
    }
}

/// A run of rows inside one block.
struct Chunk {
    /// Index in the block table.
    block: usize,
    /// First row inside the block.
    slot: usize,
    n: usize,
}

/// Splits `n` rows from position `start` into runs that stay within blocks
/// of `block_tokens`.
struct Chunks {
    pos: usize,
    end: usize,
    block_tokens: usize,
}

impl Chunks {
    fn new(n: usize, start: usize, block_tokens: usize) -> Self {
        Self {
            pos: start,
            end: start + n,
            block_tokens,
        }
    }
}

impl Iterator for Chunks {
    type Item = Chunk;

    fn next(&mut self) -> Option<Chunk> {
        if self.pos >= self.end {
            return None;
        }
        let (block, slot) = (self.pos / self.block_tokens, self.pos % self.block_tokens);
        let n = (self.block_tokens - slot).min(self.end - self.pos);
        self.pos += n;
        Some(Chunk { block, slot, n })
    }
}
