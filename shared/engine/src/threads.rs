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
