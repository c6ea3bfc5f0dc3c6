//! Our forward (f32 weights, f32 KV) against candle's own `quantized_llama`
//! on the real model, with every weight dequantized on both sides; and how
//! far the default f16 KV moves the logits from it.
//!
//! Its own test binary: `CANDLE_DEQUANTIZE_ALL` is read by candle once per
//! thread and must not leak into other tests.

mod common;

use candle_core::quantized::gguf_file;
use candle_core::{Device, Tensor};
use candle_transformers::models::quantized_llama::ModelWeights;
use common::*;
use pdserve_engine::{KvDtype, Tokenizer, WeightFormat};

#[test]
fn logits_match_candle_quantized_llama_with_dequantized_weights() {
    let Some(path) = real_model() else { return };
    std::env::set_var("CANDLE_DEQUANTIZE_ALL", "1");
    let tok = Tokenizer::from_gguf_file(&path).unwrap();
    let ours = load(&path, WeightFormat::F32);
    let mut file = std::fs::File::open(&path).unwrap();
    let content = gguf_file::Content::read(&mut file).unwrap();
    let mut theirs = ModelWeights::from_gguf(content, &mut file, &Device::Cpu).unwrap();
    let pool = ours.kv_pool(1 << 14, 16, false, KvDtype::F32);
    let half = ours.kv_pool(1 << 14, 16, false, KvDtype::F16);
    for prompt in [
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
        "Once upon a time",
        "fn fibonacci(n: u64) -> u64 {",
        "東京 🦀",
    ] {
        let ids = tok.encode(prompt, false).unwrap();
        let mut kv = pool.allocate(ids.len() + 1).unwrap();
        let got = ours.prefill(&ids, &mut kv).unwrap();
        let mut theirs_logits = |tokens: &[u32], pos: usize| -> Vec<f32> {
            let input = Tensor::new(tokens, &Device::Cpu)
                .unwrap()
                .unsqueeze(0)
                .unwrap();
            let logits = theirs.forward(&input, pos).unwrap();
            logits.flatten_all().unwrap().to_vec1().unwrap()
        };
        let want = theirs_logits(&ids, 0);
        let diff = max_abs_diff(&got, &want);
        assert!(diff < 1e-3, "{prompt:?}: max |Δlogit| = {diff}");
        let mut kv16 = half.allocate(ids.len()).unwrap();
        let diff = max_abs_diff(&ours.prefill(&ids, &mut kv16).unwrap(), &want);
        assert!(diff < 0.1, "{prompt:?}, f16 KV: max |Δlogit| = {diff}");
        // And one decode step on top, against theirs at index_pos = len.
        let next = argmax(&got);
        let got = ours
            .decode_step(&mut [(&mut kv, next)])
            .unwrap()
            .into_rows()
            .remove(0);
        let diff = max_abs_diff(&got, &theirs_logits(&[next], ids.len()));
        assert!(diff < 1e-3, "{prompt:?} decode: max |Δlogit| = {diff}");
    }
}
