//! Support shared by the fuzz targets in `fuzz_targets/`:
//!
//! - a global allocator that refuses any single allocation above a cap
//!   ([`cap_allocations`]), so an input that makes the code under test
//!   reserve memory out of proportion to its size aborts (a crash libFuzzer
//!   reports and saves) even without AddressSanitizer;
//! - the router's [`Frontend`] over the tiny test model of
//!   `pdserve-testkit` (a real byte-level BPE tokenizer and a ChatML
//!   template), built once per process;
//! - cutting an input into chunks at fuzzer-chosen offsets.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Once, OnceLock};

use pdserve_router::config::Limits;
use pdserve_router::frontend::Frontend;

/// The system allocator, refusing single allocations above [`CAP`].
struct CappedAlloc;

/// Largest single allocation allowed, in bytes.
static CAP: AtomicUsize = AtomicUsize::new(usize::MAX);

// SAFETY: forwards to `System`; a refused request returns null, as the
// `GlobalAlloc` contract allows (Rust then aborts with "memory allocation
// of N bytes failed", which libFuzzer reports as a crash).
unsafe impl GlobalAlloc for CappedAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if refused(layout.size()) {
            return std::ptr::null_mut();
        }
        System.alloc(layout)
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        if refused(layout.size()) {
            return std::ptr::null_mut();
        }
        System.alloc_zeroed(layout)
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        System.dealloc(ptr, layout)
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if refused(new_size) {
            return std::ptr::null_mut();
        }
        System.realloc(ptr, layout, new_size)
    }
}

/// Whether an allocation of `size` bytes is over the cap. A refusal lifts
/// the cap until the next [`cap_allocations`], so that the report of the
/// failure (message, backtrace) can allocate.
fn refused(size: usize) -> bool {
    let over = size > CAP.load(Ordering::Relaxed);
    if over {
        CAP.store(usize::MAX, Ordering::Relaxed);
    }
    over
}

#[global_allocator]
static ALLOC: CappedAlloc = CappedAlloc;

/// From now on, any single allocation larger than `bytes` aborts the process.
///
/// The cap is lifted when a panic starts, so that the panic hook (which
/// symbolizes a backtrace) can allocate what it needs.
pub fn cap_allocations(bytes: usize) {
    static HOOK: Once = Once::new();
    HOOK.call_once(|| {
        // Wraps the hook libfuzzer-sys installed (print, then abort).
        let inner = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            CAP.store(usize::MAX, Ordering::Relaxed);
            inner(info)
        }));
    });
    CAP.store(bytes, Ordering::Relaxed);
}

/// The model name the fuzzed requests must use (`"model": "tiny"`).
pub const MODEL_NAME: &str = "tiny";

/// The router's limits with the defaults of its flags.
pub fn limits() -> Limits {
    Limits {
        max_body_bytes: 4 << 20,
        max_concurrent_requests: 4096,
        default_max_tokens: 1024,
        max_n: 16,
        sampling: Default::default(),
        tokenizer_cache_bytes: 64 << 20,
    }
}

/// The router's front end over the tiny test model, loaded once: the model
/// is written to a temporary directory, read, and the directory removed.
pub fn frontend() -> &'static Frontend {
    static FRONTEND: OnceLock<Frontend> = OnceLock::new();
    FRONTEND.get_or_init(|| {
        let model = pdserve_testkit::tiny::TinyModel::new();
        Frontend::load(&model.path, MODEL_NAME.to_string(), limits()).expect("the tiny model loads")
    })
}

/// Reads `count` (at most 15) cut offsets, two little-endian bytes each,
/// from the front of `data`; returns them and the rest of `data`.
pub fn split_cuts(data: &[u8]) -> (Vec<usize>, &[u8]) {
    let Some((&count, rest)) = data.split_first() else {
        return (Vec::new(), data);
    };
    let count = usize::from(count & 0x0f).min(rest.len() / 2);
    let (raw, rest) = rest.split_at(count * 2);
    let cuts = raw
        .chunks_exact(2)
        .map(|c| usize::from(u16::from_le_bytes([c[0], c[1]])))
        .collect();
    (cuts, rest)
}

/// `bytes` cut at `cuts` (taken modulo `bytes.len() + 1`, in any order):
/// consecutive pieces that concatenate to `bytes`, some possibly empty.
pub fn pieces<'a>(bytes: &'a [u8], cuts: &[usize]) -> Vec<&'a [u8]> {
    let mut at: Vec<usize> = cuts.iter().map(|c| c % (bytes.len() + 1)).collect();
    at.push(0);
    at.push(bytes.len());
    at.sort_unstable();
    at.windows(2).map(|w| &bytes[w[0]..w[1]]).collect()
}

/// Like [`pieces`] for text: the cuts move back to character boundaries.
pub fn text_pieces<'a>(text: &'a str, cuts: &[usize]) -> Vec<&'a str> {
    let mut at: Vec<usize> = cuts
        .iter()
        .map(|c| {
            let mut i = c % (text.len() + 1);
            while !text.is_char_boundary(i) {
                i -= 1;
            }
            i
        })
        .collect();
    at.push(0);
    at.push(text.len());
    at.sort_unstable();
    at.windows(2).map(|w| &text[w[0]..w[1]]).collect()
}
