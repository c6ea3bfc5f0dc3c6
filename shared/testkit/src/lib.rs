//! Test support for pdserve's test suites, written once: a dev-dependency
//! only, never linked into a binary. No tensor library: the router's and the
//! mock worker's tests use it too.
//!
//! - [`tiny`]: a tiny random-weight Llama GGUF with a real tokenizer;
//! - [`http`]: serving an app on loopback, JSON requests, `/load`,
//!   `/metrics`, bounded waits;
//! - [`ndjson`] and [`sse`]: reading workers' and the router's streams;
//! - [`process`]: binaries as child processes.

pub mod http;
pub mod ndjson;
pub mod process;
pub mod sse;
pub mod tiny;

use std::path::PathBuf;

/// The default model's file name.
pub const REAL_MODEL_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";

/// The real model, when its file is present: `$PDSERVE_MODEL`, else
/// `$PDSERVE_MODEL_DIR/<file>`, else `models/<file>` at the workspace root.
/// Tests on the real model run whenever it is there (CI fetches it).
pub fn real_model() -> Option<PathBuf> {
    let candidates = [
        std::env::var_os("PDSERVE_MODEL").map(PathBuf::from),
        std::env::var_os("PDSERVE_MODEL_DIR").map(|d| PathBuf::from(d).join(REAL_MODEL_FILE)),
        Some(
            PathBuf::from(env!("CARGO_MANIFEST_DIR"))
                .join("../../models")
                .join(REAL_MODEL_FILE),
        ),
    ];
    let found = candidates.into_iter().flatten().find(|p| p.is_file());
    if found.is_none() {
        eprintln!("real model not found: skipping (run deploy/local/fetch-model.sh)");
    }
    found
}
