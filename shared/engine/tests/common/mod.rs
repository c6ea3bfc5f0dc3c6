//! Shared helpers for the engine's integration tests.
#![allow(dead_code)]

use std::path::PathBuf;

use pdserve_engine::sampler::{sample, SamplingParams, TokenCounts};
use pdserve_engine::testing::{write_tiny_gguf, TinyModelSpec};
use pdserve_engine::{KvPool, LoadOptions, Model, SeqKv, WeightFormat};

pub const REAL_MODEL_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";

/// The real model, when its file is present: `$PDSERVE_MODEL`, else
/// `$PDSERVE_MODEL_DIR/<file>`, else `models/<file>` at the workspace root.
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

/// Writes the tiny random model into a fresh temp dir; keep the dir alive.
pub fn tiny_model(spec: &TinyModelSpec) -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("tiny.gguf");
    write_tiny_gguf(&path, spec).expect("write tiny model");
    (dir, path)
}

pub fn load(path: &std::path::Path, weights: WeightFormat) -> Model {
    Model::load(
        path,
        &LoadOptions {
            weights,
            ..Default::default()
        },
    )
    .expect("load model")
}

pub fn pool(model: &Model) -> KvPool {
    KvPool::new(model.kv_layout(), 1 << 16)
}

pub fn argmax(logits: &[f32]) -> u32 {
    let greedy = SamplingParams {
        temperature: 0.0,
        ..Default::default()
    };
    sample(logits, &greedy, 0, &TokenCounts::default())
        .expect("sample")
        .token
}

/// Greedy continuation of a sequence whose last logits are `logits`.
pub fn greedy(model: &Model, kv: &mut SeqKv, logits: &[f32], n: usize) -> Vec<u32> {
    let mut out = vec![argmax(logits)];
    while out.len() < n {
        let last = *out.last().expect("non-empty");
        let l = model.decode_step(&mut [(&mut *kv, last)]).expect("decode");
        out.push(argmax(l.row(0)));
    }
    out
}

pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}
