//! The KV memory: for every layer, K and V of every block, `block_tokens`
//! rows of `n_kv_heads * head_dim` f32 each. One allocation for the pool;
//! pages are touched only when written, so an unused budget costs no memory.
//!
//! Blocks are read and written without a lock. What keeps that sound is who
//! may touch a block, which [`super::SeqKv`] upholds: only the one holder of
//! an exclusive block writes it; a shared or cached block is never written;
//! a block is read only by its holders, and it keeps its contents while it
//! is held.

use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::ptr::NonNull;

use super::blocks::BlockId;
use super::KvLayout;

/// Floats between two (layer, half) regions: an odd number of cache lines,
/// so that the same block of every layer does not fall on the same cache
/// sets (regions of a power-of-two size would alias).
const REGION_PAD: usize = 16 * 7;

/// K or V.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Half {
    K = 0,
    V = 1,
}

#[derive(Debug)]
pub(crate) struct Store {
    ptr: NonNull<f32>,
    alloc: Layout,
    n_blocks: usize,
    /// Floats of one block in one layer, K or V.
    block_floats: usize,
}

// SAFETY: the store is plain memory; which threads touch which blocks is
// governed by the ownership rules above, which make every access either
// shared reads or one writer.
unsafe impl Send for Store {}
unsafe impl Sync for Store {}

impl Store {
    /// Zeroed memory for `n_blocks` blocks of `block_tokens` tokens.
    pub fn new(layout: KvLayout, n_blocks: usize, block_tokens: usize) -> Self {
        let block_floats = block_tokens * layout.row();
        let region = n_blocks * block_floats + REGION_PAD;
        let floats = (layout.n_layers * 2 * region).max(1);
        let alloc = Layout::array::<f32>(floats).expect("the KV budget fits in memory");
        // SAFETY: `alloc` has a non-zero size.
        let raw = unsafe { alloc_zeroed(alloc) }.cast::<f32>();
        let ptr = NonNull::new(raw).unwrap_or_else(|| std::alloc::handle_alloc_error(alloc));
        Self {
            ptr,
            alloc,
            n_blocks,
            block_floats,
        }
    }

    fn offset(&self, layer: usize, half: Half, block: BlockId) -> usize {
        assert!(
            (block as usize) < self.n_blocks,
            "block {block} out of range"
        );
        let region = self.n_blocks * self.block_floats + REGION_PAD;
        (layer * 2 + half as usize) * region + block as usize * self.block_floats
    }

    /// One block's rows of one layer.
    ///
    /// # Safety
    /// The caller holds `block`, and nobody writes it meanwhile.
    pub unsafe fn block(&self, layer: usize, half: Half, block: BlockId) -> &[f32] {
        let at = self.offset(layer, half, block);
        // SAFETY: `at .. at + block_floats` is inside the allocation
        // (`offset` checks the block, layers come from the layout).
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr().add(at), self.block_floats) }
    }

    /// One block's rows of one layer, to write.
    ///
    /// # Safety
    /// The caller is the only holder of `block`, which is not cached, and
    /// nothing else reads or writes it meanwhile.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn block_mut(&self, layer: usize, half: Half, block: BlockId) -> &mut [f32] {
        let at = self.offset(layer, half, block);
        // SAFETY: in bounds as in `block`; exclusive by the caller's contract.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr().add(at), self.block_floats) }
    }
}

impl Drop for Store {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this layout.
        unsafe { dealloc(self.ptr.as_ptr().cast(), self.alloc) }
    }
}
