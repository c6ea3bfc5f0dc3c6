//! Tests against the real SmolLM2 model. They run whenever its file is
//! present (CI fetches it); otherwise they print a note and pass.

mod common;

use common::*;
use pdserve_engine::{ChatMessage, KvDtype, Model, Tokenizer, WeightFormat};

fn chatml(question: &str) -> String {
    format!("<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n")
}

#[test]
fn tokenizer_matches_llama_cpp_ids() {
    let Some(path) = real_model() else { return };
    let tok = Tokenizer::from_gguf_file(&path).unwrap();
    let ids = tok
        .encode(&chatml("What is the capital of France?"), true)
        .unwrap();
    assert_eq!(
        ids,
        [1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531, 198]
    );
    let ids = tok.encode("naïve café 東京 🦀 1234 x", true).unwrap();
    assert_eq!(
        ids,
        [
            3546, 46494, 37366, 17097, 247, 126, 16736, 122, 15107, 116, 218, 216, 33, 34, 35, 36,
            1792
        ]
    );
}

#[test]
fn tokenizer_round_trips() {
    let Some(path) = real_model() else { return };
    let tok = Tokenizer::from_gguf_file(&path).unwrap();
    for text in [
        chatml("Hi there"),
        "東京タワーは高い。中文也可以。한국어".to_string(),
        "emoji 🦀🎉👍🏽 and ZWJ 👨‍👩‍👧".to_string(),
        "fn main() {\r\n    println!(\"hi\");\r\n}\r\n".to_string(),
        "  leading and trailing spaces  ".to_string(),
        "\ttabs\n\nnewlines \u{a0}nbsp".to_string(),
    ] {
        let ids = tok.encode(&text, false).unwrap();
        assert_eq!(tok.decode(&ids, false).unwrap(), text);
    }
}

#[test]
fn chat_template_renders_the_default_system_prompt() {
    let Some(path) = real_model() else { return };
    let tok = Tokenizer::from_gguf_file(&path).unwrap();
    let text = tok
        .apply_chat_template(&[ChatMessage::new("user", "Hi")], true)
        .unwrap();
    assert!(
        text.starts_with("<|im_start|>system\nYou are a helpful AI assistant"),
        "{text}"
    );
    assert!(
        text.ends_with("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"),
        "{text}"
    );
}

fn answer(model: &Model, tok: &Tokenizer, question: &str, n: usize) -> String {
    let ids = tok.encode(&chatml(question), true).unwrap();
    let pool = pool(model);
    let mut kv = pool.allocate(ids.len() + n).unwrap();
    let logits = model.prefill(&ids, &mut kv).unwrap();
    let out = greedy(model, &mut kv, &logits, n);
    tok.decode(&out, true).unwrap()
}

#[test]
fn greedy_answer_names_paris_in_every_weight_format() {
    let Some(path) = real_model() else { return };
    let tok = Tokenizer::from_gguf_file(&path).unwrap();
    for format in [WeightFormat::Native, WeightFormat::F32, WeightFormat::Q8_0] {
        let model = load(&path, format);
        let text = answer(&model, &tok, "What is the capital of France?", 24);
        assert!(text.contains("Paris"), "{format}: {text}");
    }
}

#[test]
fn every_kernel_path_gives_the_same_logits_bit_for_bit() {
    use pdserve_engine::quant::{set_kernel, Kernel, KernelChoice};
    let Some(path) = real_model() else { return };
    let tok = Tokenizer::from_gguf_file(&path).unwrap();
    let model = load(&path, WeightFormat::Native);
    let ids = tok.encode(&chatml("Name a prime number."), true).unwrap();
    let pool = pool(&model);
    let mut runs = Vec::new();
    for kernel in Kernel::ALL.into_iter().filter(|k| k.available()) {
        set_kernel(KernelChoice::Forced(kernel)).unwrap();
        let mut kv = pool.allocate(ids.len() + 1).unwrap();
        let logits = model.prefill(&ids, &mut kv).unwrap();
        let next = model
            .decode_step(&mut [(&mut kv, argmax(&logits))])
            .unwrap();
        let bits: Vec<u32> = logits
            .iter()
            .chain(next.row(0))
            .map(|v| v.to_bits())
            .collect();
        runs.push((kernel, bits));
    }
    set_kernel(KernelChoice::Auto).unwrap();
    for (kernel, bits) in &runs[1..] {
        assert!(bits == &runs[0].1, "{kernel} differs from {}", runs[0].0);
    }
}

#[test]
fn batched_decode_of_eight_prompts_equals_decoding_each_alone() {
    let Some(path) = real_model() else { return };
    for format in [WeightFormat::Native, WeightFormat::Q8_0] {
        batched_equals_alone(&path, format);
    }
}

fn batched_equals_alone(path: &std::path::Path, format: WeightFormat) {
    let tok = Tokenizer::from_gguf_file(path).unwrap();
    let model = load(path, format);
    let questions = [
        "What is the capital of France?",
        "Name a prime number.",
        "Write a haiku about rust.",
        "What is 2+2?",
        "Who wrote Hamlet?",
        "Describe the color blue in one sentence, please, with some detail.",
        "Hi",
        "List three fruits.",
    ];
    let n = 16;
    let pool = pool(&model);
    let prompts: Vec<Vec<u32>> = questions
        .iter()
        .map(|q| tok.encode(&chatml(q), true).unwrap())
        .collect();
    // Alone.
    let alone: Vec<Vec<u32>> = prompts
        .iter()
        .map(|p| {
            let mut kv = pool.allocate(p.len() + n).unwrap();
            let logits = model.prefill(p, &mut kv).unwrap();
            greedy(&model, &mut kv, &logits, n)
        })
        .collect();
    // Together: each prefilled alone, then every decode step batched.
    let mut kvs = Vec::new();
    let mut outs: Vec<Vec<u32>> = Vec::new();
    for p in &prompts {
        let mut kv = pool.allocate(p.len() + n).unwrap();
        outs.push(vec![argmax(&model.prefill(p, &mut kv).unwrap())]);
        kvs.push(kv);
    }
    for _ in 1..n {
        let mut batch: Vec<_> = kvs
            .iter_mut()
            .zip(&outs)
            .map(|(kv, o)| (kv, *o.last().unwrap()))
            .collect();
        let logits = model.decode_step(&mut batch).unwrap();
        for (i, o) in outs.iter_mut().enumerate() {
            o.push(argmax(logits.row(i)));
        }
    }
    assert_eq!(outs, alone, "{format}");
}

#[test]
fn kv_export_import_then_decode_equals_never_exporting() {
    let Some(path) = real_model() else { return };
    let tok = Tokenizer::from_gguf_file(&path).unwrap();
    let model = load(&path, WeightFormat::F32);
    let ids = tok
        .encode(&chatml("Tell me about the moon."), true)
        .unwrap();
    let n = 20;
    let pool = pool(&model);
    let mut kv = pool.allocate(ids.len() + n).unwrap();
    let logits = model.prefill(&ids, &mut kv).unwrap();
    let mut moved = pool.allocate(ids.len() + n).unwrap();
    for l in 0..model.config().n_layers {
        let mut bytes = Vec::new();
        kv.export_layer(l, KvDtype::F32, &mut bytes);
        moved
            .import_layer(l, KvDtype::F32, ids.len(), &bytes)
            .unwrap();
    }
    moved.finish_import(&ids).unwrap();
    let expected = greedy(&model, &mut kv, &logits, n);
    assert_eq!(greedy(&model, &mut moved, &logits, n), expected);
}

#[test]
fn chunked_prefill_matches_one_shot_on_the_real_model() {
    let Some(path) = real_model() else { return };
    for format in [WeightFormat::Native, WeightFormat::F32] {
        chunked_matches_one_shot(&path, format);
    }
}

fn chunked_matches_one_shot(path: &std::path::Path, format: WeightFormat) {
    let tok = Tokenizer::from_gguf_file(path).unwrap();
    let model = load(path, format);
    let ids = tok
        .encode(
            &chatml(&"The quick brown fox jumps over the lazy dog. ".repeat(6)),
            true,
        )
        .unwrap();
    let pool = pool(&model);
    let mut one = pool.allocate(ids.len()).unwrap();
    let want = model.prefill(&ids, &mut one).unwrap();
    let mut chunked = pool.allocate(ids.len()).unwrap();
    let mut got = Vec::new();
    for chunk in ids.chunks(17) {
        got = model.prefill(chunk, &mut chunked).unwrap();
    }
    assert!(
        max_abs_diff(&got, &want) < 1e-3,
        "{}",
        max_abs_diff(&got, &want)
    );
    for l in 0..model.config().n_layers {
        assert!(max_abs_diff(&kv_layer(&one, l).0, &kv_layer(&chunked, l).0) < 1e-3);
        assert!(max_abs_diff(&kv_layer(&one, l).1, &kv_layer(&chunked, l).1) < 1e-3);
    }
}

#[test]
fn the_candle_free_header_reader_sees_what_candle_sees() {
    use candle_core::quantized::gguf_file::Content;
    let Some(path) = real_model() else { return };
    let ours = pdserve_text::gguf::Header::read_file(&path).unwrap();
    let mut file = std::io::BufReader::new(std::fs::File::open(&path).unwrap());
    let theirs = Content::read(&mut file).unwrap();
    let mut keys: Vec<_> = ours.metadata.keys().collect();
    let mut their_keys: Vec<_> = theirs.metadata.keys().collect();
    keys.sort();
    their_keys.sort();
    assert_eq!(keys, their_keys);
    let tokens = ours.metadata["tokenizer.ggml.tokens"].as_array().unwrap();
    assert_eq!(tokens.len(), 49_152);
    assert_eq!(ours.tensors.len(), theirs.tensor_infos.len());
    for (name, info) in &theirs.tensor_infos {
        let mine = &ours.tensors[name];
        assert_eq!(mine.shape(), info.shape.dims(), "{name}");
        assert_eq!(mine.offset, info.offset, "{name}");
        let dtype = format!("{:?}", info.ggml_dtype).to_lowercase();
        assert_eq!(
            pdserve_text::gguf::type_name(mine.ggml_type),
            dtype,
            "{name}"
        );
    }
    assert_eq!(ours.data_offset, theirs.tensor_data_offset);
}
