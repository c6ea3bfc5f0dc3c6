//! Constrained decoding against a real vocabulary: the tiny model's
//! byte-level one always, SmolLM2's whenever its file is present. A walk
//! that takes the allowed token a seeded generator prefers (a stand-in for
//! a model) must end in output that the grammar accepts.

use std::sync::Arc;

use pdserve_testkit::tiny::{TinyModel, TINY_EOS};
use pdserve_text::grammar::{Constraint, GrammarError, Grammars};
use pdserve_text::Tokenizer;
use serde_json::Value;

fn grammars(path: &std::path::Path) -> (Grammars, Arc<Tokenizer>) {
    let tok = Arc::new(Tokenizer::from_gguf_file(path).unwrap());
    let n = tok.vocab_size();
    (Grammars::new(tok.clone(), n).unwrap(), tok)
}

/// Walks the grammar with pseudo-random logits until end-of-sequence or
/// `limit` tokens; returns the tokens before EOS.
fn walk(c: &mut Constraint, vocab: usize, eos: u32, seed: u64, limit: usize) -> Vec<u32> {
    let mut state = seed | 1;
    let mut out = Vec::new();
    for _ in 0..limit {
        let mut logits: Vec<f32> = (0..vocab)
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                (state % 1000) as f32 / 100.0
            })
            .collect();
        // Favour end-of-sequence once allowed, so walks stay short.
        logits[eos as usize] = 100.0;
        c.mask(&mut logits).unwrap();
        let best = (0..vocab)
            .max_by(|&a, &b| logits[a].total_cmp(&logits[b]))
            .unwrap() as u32;
        assert!(logits[best as usize].is_finite(), "some token is allowed");
        if best == eos {
            return out;
        }
        c.accept(best).unwrap();
        out.push(best);
    }
    panic!("no end-of-sequence within {limit} tokens: {out:?}");
}

const SCHEMA: &str = r#"start: %json {"x-guidance": {"whitespace_flexible": false, "key_separator": ": ", "item_separator": ", "}, "type": "object", "properties": {"name": {"type": "string", "maxLength": 5}, "age": {"type": "integer", "minimum": 0, "maximum": 120}, "pet": {"enum": ["cat", "dog"]}}, "required": ["name", "age", "pet"], "additionalProperties": false}"#;

fn check_schema_walks(path: &std::path::Path, eos: u32) {
    let (g, tok) = grammars(path);
    for seed in 1..=8 {
        let mut c = g.compile(SCHEMA).unwrap();
        let ids = walk(&mut c, tok.vocab_size(), eos, seed, 400);
        let text = tok.decode(&ids, false).unwrap();
        let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"));
        assert!(v["name"].as_str().unwrap().chars().count() <= 5, "{text}");
        assert!((0..=120).contains(&v["age"].as_i64().unwrap()), "{text}");
        assert!(
            ["cat", "dog"].contains(&v["pet"].as_str().unwrap()),
            "{text}"
        );
    }
}

#[test]
fn json_schema_walks_end_in_valid_json_on_the_tiny_vocabulary() {
    let model = TinyModel::new();
    check_schema_walks(&model.path, TINY_EOS);
}

#[test]
fn json_schema_walks_end_in_valid_json_on_the_real_vocabulary() {
    let Some(path) = pdserve_testkit::real_model() else {
        eprintln!("skipped: the real model is not present");
        return;
    };
    let eos = Tokenizer::from_gguf_file(&path).unwrap().eos_token_id();
    check_schema_walks(&path, eos);
}

#[test]
fn a_literal_grammar_forces_its_text_and_then_end_of_sequence() {
    let model = TinyModel::new();
    let (g, tok) = grammars(&model.path);
    let mut c = g.compile(r#"start: "the answer""#).unwrap();
    let ids = walk(&mut c, tok.vocab_size(), TINY_EOS, 3, 50);
    assert_eq!(tok.decode(&ids, false).unwrap(), "the answer");
    assert!(c.is_accepting());
}

#[test]
fn special_tokens_never_match_text() {
    let model = TinyModel::new();
    let (g, tok) = grammars(&model.path);
    let mut c = g.compile(r#"start: /[<|a-z>]+/"#).unwrap();
    let mut logits = vec![0.0f32; tok.vocab_size()];
    c.mask(&mut logits).unwrap();
    // `<|im_start|>` (id 1) is one token, not the text it spells.
    assert_eq!(logits[1], f32::NEG_INFINITY);
    assert!(logits.iter().any(|l| l.is_finite()));
}

#[test]
fn bad_grammars_and_schemas_are_refused() {
    let model = TinyModel::new();
    let (g, _) = grammars(&model.path);
    for bad in [
        "start: (",
        r#"start: %json {"type": 5}"#,
        r#"start: %json {"type": "no-such-type"}"#,
        "start: undefined_rule",
    ] {
        match g.check(bad) {
            Err(GrammarError::Invalid(_)) => {}
            other => panic!("{bad}: {other:?}"),
        }
    }
}

#[test]
fn replaying_generated_tokens_resumes_the_same_state() {
    let model = TinyModel::new();
    let (g, tok) = grammars(&model.path);
    let mut a = g.compile(SCHEMA).unwrap();
    let ids = walk(&mut a, tok.vocab_size(), TINY_EOS, 5, 400);
    // A new matcher fed half the tokens allows exactly what the first one did there.
    let half = ids.len() / 2;
    let mut b = g.compile(SCHEMA).unwrap();
    let mut c = g.compile(SCHEMA).unwrap();
    for &t in &ids[..half] {
        b.accept(t).unwrap();
        c.accept(t).unwrap();
    }
    let (mut lb, mut lc) = (
        vec![0.0f32; tok.vocab_size()],
        vec![0.0f32; tok.vocab_size()],
    );
    b.mask(&mut lb).unwrap();
    c.mask(&mut lc).unwrap();
    assert_eq!(lb, lc);
    assert!(lb[ids[half] as usize].is_finite());
    // A token the grammar forbids is an error, not a silent skip.
    let forbidden = (0..tok.vocab_size())
        .find(|&i| lb[i].is_infinite())
        .unwrap();
    assert!(b.accept(forbidden as u32).is_err());
}
