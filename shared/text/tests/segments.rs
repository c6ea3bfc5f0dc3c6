//! The segment cache against the tokenizer itself: with the cache on, every
//! text tokenizes to exactly the ids it gets without it, on its first,
//! second (the segment is kept) and third sighting (the segment is found).
//! The tiny model's vocabulary always, SmolLM2's whenever its file is
//! present.

use std::path::Path;

use pdserve_testkit::tiny::TinyModel;
use pdserve_text::{ChatMessage, Tokenizer};

/// A long system prompt: words, digits, punctuation, runs of spaces and
/// newlines, and text that is not ASCII.
fn system_prompt() -> String {
    let mut s = String::from("You are a careful assistant.  Answer in 3 sentences;\n\n");
    for i in 0..40 {
        s += &format!("Rule {i}: cite the 2,048-token limit — «précis», 東京, naïve.\t ");
    }
    s + "   \n"
}

fn texts(tok: &Tokenizer) -> Vec<String> {
    let sys = system_prompt();
    let turn = |role: &str, text: &str| ChatMessage::new(role, text.to_string());
    let chats = [
        vec![turn("system", &sys), turn("user", "What is 12345 + 678?")],
        vec![
            turn("system", &sys),
            turn("user", "first question"),
            turn("assistant", &sys[..300]),
            turn("user", "and then?"),
        ],
        vec![turn("user", &format!("{sys}{sys}"))],
    ];
    let mut out: Vec<String> = chats
        .iter()
        .map(|m| tok.apply_chat_template(m, true).unwrap())
        .collect();
    // Control tokens inside words and next to spaces, and none at all.
    out.push(format!("{sys}<|im_end|>x{sys}<|im_start|> {sys}<|im_end|>"));
    out.push(format!("x<|im_start|><|im_end|>{sys}<|endoftext|>"));
    out.push(sys.clone());
    out.push(format!("{sys}<|im_start|"));
    out
}

fn same_ids_with_and_without_the_cache(path: &Path) {
    let plain = Tokenizer::from_gguf_file(path).unwrap();
    let cached = Tokenizer::from_gguf_file(path)
        .unwrap()
        .with_segment_cache(1 << 20)
        .unwrap();
    for text in texts(&plain) {
        let want = plain.encode(&text, true).unwrap();
        for sighting in 1..=3 {
            let got = cached.encode(&text, true).unwrap();
            assert_eq!(got, want, "sighting {sighting} of {text:?}");
        }
    }
    let stats = cached.segment_stats().unwrap();
    assert!(stats.hits > 0 && stats.bytes > 0, "{stats:?}");
}

#[test]
fn the_tiny_vocabulary_tokenizes_the_same_with_the_cache() {
    same_ids_with_and_without_the_cache(&TinyModel::new().path);
}

#[test]
fn smollm2_tokenizes_the_same_with_the_cache() {
    let Some(path) = pdserve_testkit::real_model() else {
        eprintln!("SmolLM2 is not present: skipped");
        return;
    };
    same_ids_with_and_without_the_cache(&path);
}

#[test]
fn no_budget_means_no_cache() {
    let model = TinyModel::new();
    let tok = Tokenizer::from_gguf_file(&model.path)
        .unwrap()
        .with_segment_cache(0)
        .unwrap();
    assert!(tok.segment_stats().is_none());
}
