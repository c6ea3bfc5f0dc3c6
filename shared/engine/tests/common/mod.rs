//! Shared helpers for the engine's integration tests.
#![allow(dead_code)]

use std::path::PathBuf;

use pdserve_engine::sampler::{sample, SamplingParams, TokenCounts};
use pdserve_engine::{KvPool, LoadOptions, Model, SeqKv, WeightFormat};
use pdserve_testkit::tiny::{write_tiny_gguf, TinyModelSpec};

#[allow(unused_imports)]
pub use pdserve_testkit::real_model;

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

/// K and V of one layer of `kv`, as f32 values.
pub fn kv_layer(kv: &SeqKv, l: usize) -> (Vec<f32>, Vec<f32>) {
    let mut bytes = Vec::new();
    kv.export_layer(l, pdserve_engine::KvDtype::F32, &mut bytes);
    let vals: Vec<f32> = bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    let (k, v) = vals.split_at(vals.len() / 2);
    (k.to_vec(), v.to_vec())
}
