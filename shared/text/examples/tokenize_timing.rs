//! Times `Tokenizer::encode` on chat prompts, with and without the segment
//! cache: a short chat, and a 1,000-word system prompt that every request
//! shares followed by a question of its own.
//!
//!     cargo run --release -p pdserve-text --example tokenize_timing -- MODEL.gguf

use std::time::Instant;

use pdserve_text::{ChatMessage, Tokenizer};

fn main() {
    let Some(path) = std::env::args().nth(1) else {
        eprintln!("usage: tokenize_timing MODEL.gguf");
        std::process::exit(2);
    };
    let words = [
        "the", "model", "answers", "briefly,", "citing", "rule", "42;", "never",
    ];
    let system: Vec<&str> = (0..1000).map(|i| words[i * 7 % words.len()]).collect();
    let system = system.join(" ");
    let short = "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima";
    for cache_mb in [0, 64] {
        let tok = Tokenizer::from_gguf_file(&path)
            .and_then(|t| t.with_segment_cache(cache_mb << 20))
            .unwrap_or_else(|e| panic!("{path}: {e}"));
        let chats = [
            ("short chat", None),
            (
                "1,000-word shared system prompt + question",
                Some(system.as_str()),
            ),
        ];
        for (name, system) in chats {
            let n = 300;
            let mut tokens = 0;
            let t = Instant::now();
            for i in 0..n {
                let mut messages = Vec::new();
                if let Some(s) = system {
                    messages.push(ChatMessage::new("system", s.to_string()));
                }
                messages.push(ChatMessage::new("user", format!("{short} {i}?")));
                let text = tok.apply_chat_template(&messages, true).unwrap();
                tokens = tok.encode(&text, false).unwrap().len();
            }
            let us = t.elapsed().as_secs_f64() / n as f64 * 1e6;
            println!("cache {cache_mb} MiB, {name}: {tokens} tokens, {us:.0} µs per prompt (template + encode)");
        }
    }
}
