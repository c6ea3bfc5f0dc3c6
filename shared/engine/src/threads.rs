//! Thread pools for the model.
//!
//! candle's quantized matmuls run on candle's own pool (`CANDLE_NUM_THREADS`);
//! f32 GEMM, attention and everything else run on rayon's global pool
//! (`RAYON_NUM_THREADS`). Both are sized once, at first use, so a process must
//! call [`configure`] before it loads a model.

/// Sizes both pools to `threads` (0 = one per available core). Values already
/// set in the environment win. Returns the thread count in effect.
pub fn configure(threads: usize) -> usize {
    let n = match threads {
        0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
        n => n,
    };
    for var in ["RAYON_NUM_THREADS", "CANDLE_NUM_THREADS"] {
        if std::env::var_os(var).is_none() {
            // Called at start-up, before any pool or model thread exists.
            std::env::set_var(var, n.to_string());
        }
    }
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
