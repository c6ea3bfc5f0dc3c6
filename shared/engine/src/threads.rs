//! Thread pools for the model.
//!
//! candle's quantized matmuls run on candle's own pool (`CANDLE_NUM_THREADS`);
//! f32 GEMM, attention and everything else run on rayon's global pool
//! (`RAYON_NUM_THREADS`). Both are sized once, at first use, so a process must
//! call [`configure`] before it loads a model.

fn count(threads: usize) -> usize {
    match threads {
        0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
        n => n,
    }
}

/// Sets `RAYON_NUM_THREADS` and `CANDLE_NUM_THREADS` to `threads` (0 = one
/// per core) where the environment does not already. A binary calls it
/// first thing in `main`, before its async runtime or any other thread
/// exists (setting the environment is only sound then).
pub fn set_env(threads: usize) {
    let n = count(threads);
    for var in ["RAYON_NUM_THREADS", "CANDLE_NUM_THREADS"] {
        if std::env::var_os(var).is_none() {
            std::env::set_var(var, n.to_string());
        }
    }
}

/// Sizes rayon's pool to `threads` (0 = one per available core), or to
/// `RAYON_NUM_THREADS` when set; candle's pool reads `CANDLE_NUM_THREADS`
/// ([`set_env`]) at first use. Returns the thread count in effect.
pub fn configure(threads: usize) -> usize {
    let n = count(threads);
    let rayon_n = std::env::var("RAYON_NUM_THREADS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(n);
    // Fails only if the global pool was already built; its size is then fixed.
    let _ = rayon::ThreadPoolBuilder::new()
        .num_threads(rayon_n)
        .build_global();
    rayon::current_num_threads()
}

/// A buffer that pool workers fill in disjoint pieces (rows, chunks or
/// single cells), each piece written by exactly one worker.
pub(crate) struct Disjoint<T>(*mut T);

impl<T> Clone for Disjoint<T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for Disjoint<T> {}

// SAFETY: workers write disjoint elements (each user's contract), and the
// buffer outlives the pool call that shares this pointer.
unsafe impl<T: Send> Send for Disjoint<T> {}
unsafe impl<T: Send> Sync for Disjoint<T> {}

impl<T> Disjoint<T> {
    pub fn new(buf: &mut [T]) -> Self {
        Self(buf.as_mut_ptr())
    }

    /// Over the spare capacity of `buf`, for workers that write every
    /// element before the owner sets the length.
    pub fn spare(buf: &mut Vec<T>) -> Self {
        Self(buf.spare_capacity_mut().as_mut_ptr().cast())
    }

    /// Piece `r` of width `w`: elements `r·w .. (r+1)·w`.
    ///
    /// # Safety
    /// In bounds of the buffer, which is alive, and no other live
    /// reference to these elements.
    #[allow(clippy::mut_from_ref)]
    #[inline(always)]
    pub unsafe fn rows<'a>(self, r: usize, w: usize) -> &'a mut [T] {
        unsafe { std::slice::from_raw_parts_mut(self.0.add(r * w), w) }
    }

    /// Element `i`'s address, for a kernel that stores several at once.
    ///
    /// # Safety
    /// As [`Self::rows`], for every element written through it.
    #[inline(always)]
    pub unsafe fn at(self, i: usize) -> *mut T {
        unsafe { self.0.add(i) }
    }

    /// Writes element `i`.
    ///
    /// # Safety
    /// As [`Self::rows`], for the one element.
    #[inline(always)]
    pub unsafe fn put(self, i: usize, v: T) {
        unsafe { *self.0.add(i) = v };
    }
}

/// Calls `f` on ranges covering `0..n`: on candle's pool (the threads the
/// matmuls use) when `n >= min_parallel`, else inline on this thread.
pub(crate) fn for_ranges(n: usize, min_parallel: usize, f: impl Fn(std::ops::Range<usize>) + Sync) {
    match n >= min_parallel.max(2) {
        true => candle_core::utils::barrier_pool().execute_chunked(n, f),
        false => f(0..n),
    }
}

/// Calls `f(row, out_row)` for each `w`-wide row of `out`, the rows shared
/// out as [`for_ranges`] does.
pub(crate) fn for_rows<T: Send>(
    out: &mut [T],
    w: usize,
    min_parallel: usize,
    f: impl Fn(usize, &mut [T]) + Sync,
) {
    let n = out.len() / w;
    let buf = Disjoint::new(out);
    for_ranges(n, min_parallel, |range| {
        for r in range {
            // SAFETY: row `r` lies inside `out`, which outlives the call, and
            // each row index is handed to exactly one range.
            f(r, unsafe { buf.rows(r, w) });
        }
    });
}
