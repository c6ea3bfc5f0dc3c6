//! The KV memory: for every layer, K and V of every block, `block_tokens`
//! rows of `n_kv_heads * head_dim` elements each, all of the pool's element
//! type ([`KvDtype`]). One allocation for the pool; pages are touched only
//! when written, so an unused budget costs no memory.
//!
//! Blocks are read and written without a lock. What keeps that sound is who
//! may touch a block, which [`super::SeqKv`] upholds: only the one holder of
//! an exclusive block writes it; a shared or cached block is never written;
//! a block is read only by its holders, and it keeps its contents while it
//! is held.

use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::ptr::NonNull;

use super::blocks::BlockId;
use super::elem::KvElem;
use super::{KvDtype, KvLayout};

/// Bytes between two (layer, half) regions: an odd number of cache lines,
/// so that the same block of every layer does not fall on the same cache
/// sets (regions of a power-of-two size would alias).
const REGION_PAD_BYTES: usize = 64 * 7;
/// Alignment of the allocation: a cache line.
const ALIGN: usize = 64;

/// K or V.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Half {
    K = 0,
    V = 1,
}

#[derive(Debug)]
pub(crate) struct Store {
    ptr: NonNull<u8>,
    alloc: Layout,
    n_blocks: usize,
    /// Elements of one block in one layer, K or V.
    block_elems: usize,
    /// Elements between the starts of two (layer, half) regions.
    region: usize,
    dtype: KvDtype,
}

// SAFETY: the store is plain memory; which threads touch which blocks is
// governed by the ownership rules above, which make every access either
// shared reads or one writer.
unsafe impl Send for Store {}
unsafe impl Sync for Store {}

impl Store {
    /// Zeroed memory for `n_blocks` blocks of `block_tokens` tokens of `dtype`.
    pub fn new(layout: KvLayout, n_blocks: usize, block_tokens: usize, dtype: KvDtype) -> Self {
        let block_elems = block_tokens * layout.row();
        let region = n_blocks * block_elems + REGION_PAD_BYTES / dtype.size();
        let bytes = (layout.n_layers * 2 * region * dtype.size()).max(1);
        let alloc = Layout::from_size_align(bytes, ALIGN).expect("the KV budget fits in memory");
        // SAFETY: `alloc` has a non-zero size.
        let raw = unsafe { alloc_zeroed(alloc) };
        let ptr = NonNull::new(raw).unwrap_or_else(|| std::alloc::handle_alloc_error(alloc));
        Self {
            ptr,
            alloc,
            n_blocks,
            block_elems,
            region,
            dtype,
        }
    }

    /// Where one block's rows of one layer start, in elements.
    fn offset(&self, layer: usize, half: Half, block: BlockId) -> usize {
        assert!(
            (block as usize) < self.n_blocks,
            "block {block} out of range"
        );
        (layer * 2 + half as usize) * self.region + block as usize * self.block_elems
    }

    fn start<T: KvElem>(&self, layer: usize, half: Half, block: BlockId) -> *mut T {
        assert_eq!(T::DTYPE, self.dtype, "the KV store holds {:?}", self.dtype);
        let at = self.offset(layer, half, block);
        // SAFETY: `at` is inside the allocation (`offset` checks the block,
        // layers come from the layout), and the allocation is aligned for
        // every element type.
        unsafe { self.ptr.as_ptr().cast::<T>().add(at) }
    }

    /// One block's rows of one layer.
    ///
    /// # Safety
    /// The caller holds `block`, and nobody writes it meanwhile.
    pub unsafe fn block<T: KvElem>(&self, layer: usize, half: Half, block: BlockId) -> &[T] {
        // SAFETY: `start .. start + block_elems` is inside the allocation.
        unsafe { std::slice::from_raw_parts(self.start(layer, half, block), self.block_elems) }
    }

    /// One block's rows of one layer, to write.
    ///
    /// # Safety
    /// The caller is the only holder of `block`, which is not cached, and
    /// nothing else reads or writes it meanwhile.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn block_mut<T: KvElem>(
        &self,
        layer: usize,
        half: Half,
        block: BlockId,
    ) -> &mut [T] {
        // SAFETY: in bounds as in `block`; exclusive by the caller's contract.
        unsafe { std::slice::from_raw_parts_mut(self.start(layer, half, block), self.block_elems) }
    }

    /// Copies the first `elems` elements of block `from` to block `to`, in
    /// one half of one layer.
    ///
    /// # Safety
    /// As [`block`](Self::block) for `from` and [`block_mut`](Self::block_mut)
    /// for `to`, which differ.
    pub unsafe fn copy(&self, layer: usize, half: Half, from: BlockId, to: BlockId, elems: usize) {
        assert!(elems <= self.block_elems && from != to);
        let size = self.dtype.size();
        let (src, dst) = (
            self.offset(layer, half, from) * size,
            self.offset(layer, half, to) * size,
        );
        // SAFETY: both ranges are inside the allocation and do not overlap
        // (distinct blocks); access rights by the caller's contract.
        unsafe {
            let base = self.ptr.as_ptr();
            std::ptr::copy_nonoverlapping(base.add(src), base.add(dst), elems * size);
        }
    }
}

impl Drop for Store {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this layout.
        unsafe { dealloc(self.ptr.as_ptr().cast(), self.alloc) }
    }
}
