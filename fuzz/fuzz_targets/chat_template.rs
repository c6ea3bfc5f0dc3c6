//! The text path of `pdserve-text` over the tiny test model's tokenizer and
//! chat template: messages rendered with the template and tokenized; token
//! ids turned back into text by the tokenizer and by the incremental
//! detokenizer; that text run through the stop-sequence matcher.
//!
//! Input layout:
//!
//! ```text
//! byte 0      flags: bit 0 add_generation_prompt, bit 1 skip special tokens
//! rest        up to four sections separated by 0xFF (never in UTF-8):
//!   0  messages separated by 0xFE, each `role:content` (no `:` = a user
//!      message); invalid UTF-8 is replaced
//!   1  token ids, u16 LE each, modulo the vocabulary size + 8 (so a few are
//!      unknown)
//!   2  stop strings separated by 0xFE (empty ones keep their index)
//!   3  cut offsets (u16 LE) that chunk the text fed to the stop matcher
//! ```
//!
//! Checked on every input: no panic; no single allocation above 64 MiB; the
//! template renders every message's role and content, in order; the
//! tokenizer's ids are in the vocabulary and decode back to the exact text;
//! the incremental detokenizer, fed token by token, produces exactly the
//! tokenizer's (lossy UTF-8) decoding and never holds back more than 3
//! bytes; the stop matcher accepts exactly the stop lists within its limits,
//! and its output is the same for every chunking of the text and equal to
//! the first stop to complete in the whole text.

#![no_main]

use libfuzzer_sys::fuzz_target;
use pdserve_fuzz::{cap_allocations, frontend, text_pieces};
use pdserve_text::detok::{DetokError, IncrementalDecoder};
use pdserve_text::stop::{StopMatcher, StopOutput, MAX_STOPS, MAX_STOP_BYTES};
use pdserve_text::{ChatMessage, Tokenizer};

fuzz_target!(|data: &[u8]| {
    let tokenizer: &Tokenizer = &frontend().tokenizer;
    cap_allocations(64 << 20);
    let Some((&flags, rest)) = data.split_first() else {
        return;
    };
    let add_generation_prompt = flags & 1 != 0;
    let skip_special = flags & 2 != 0;
    let mut sections = rest.splitn(4, |&b| b == 0xff);
    let messages = messages(sections.next().unwrap_or_default());
    let ids = u16s(sections.next().unwrap_or_default())
        .map(|v| u32::from(v) % (tokenizer.vocab_size() as u32 + 8))
        .collect::<Vec<_>>();
    let stops: Vec<String> = sections
        .next()
        .unwrap_or_default()
        .split(|&b| b == 0xfe)
        .map(|s| String::from_utf8_lossy(s).into_owned())
        .collect();
    let cuts: Vec<usize> = u16s(sections.next().unwrap_or_default())
        .map(usize::from)
        .collect();

    // The chat template, then the tokenizer, and back.
    let text = tokenizer
        .apply_chat_template(&messages, add_generation_prompt)
        .expect("the ChatML template renders any messages");
    let mut from = 0;
    for m in &messages {
        for part in [&m.role, &m.content] {
            let at = text[from..]
                .find(part.as_str())
                .unwrap_or_else(|| panic!("{part:?} missing from the rendered {text:?}"));
            from += at + part.len();
        }
    }
    let tokens = round_trip(tokenizer, &text);
    for m in &messages {
        round_trip(tokenizer, &m.content);
    }

    // Token ids back to text, at once and token by token.
    let (pieces, decoded) = detokenize(tokenizer, &ids, skip_special);
    let (rendered_pieces, rendered) = detokenize(tokenizer, &tokens, false);
    assert_eq!(rendered.as_deref(), Some(text.as_str()));
    assert_eq!(rendered_pieces.concat(), text);

    // Stop sequences over the decoded ids (or, with none or an unknown
    // one, over the prompt).
    let (pieces, stream) = match decoded {
        Some(d) if !ids.is_empty() => (pieces, d),
        _ => (rendered_pieces, text),
    };
    let non_empty = stops.iter().filter(|s| !s.is_empty()).count();
    let within = non_empty <= MAX_STOPS && stops.iter().all(|s| s.len() <= MAX_STOP_BYTES);
    let matcher = match StopMatcher::new(stops.clone()) {
        Ok(m) => m,
        Err(e) => {
            assert!(!within, "{e}");
            return;
        }
    };
    assert!(within, "the stop list exceeds the limits but was accepted");
    let expected = first_stop(&stream, &stops);
    let by_token: Vec<&str> = pieces.iter().map(String::as_str).collect();
    for chunks in [by_token, text_pieces(&stream, &cuts), vec![stream.as_str()]] {
        assert_eq!(run_stops(matcher.clone(), &chunks), expected, "{chunks:?}");
    }
});

/// `role:content` messages separated by 0xFE.
fn messages(section: &[u8]) -> Vec<ChatMessage> {
    if section.is_empty() {
        return Vec::new();
    }
    section
        .split(|&b| b == 0xfe)
        .map(|m| {
            let m = String::from_utf8_lossy(m);
            match m.split_once(':') {
                Some((role, content)) => ChatMessage::new(role, content),
                None => ChatMessage::new("user", m),
            }
        })
        .collect()
}

fn u16s(bytes: &[u8]) -> impl Iterator<Item = u16> + '_ {
    bytes
        .chunks_exact(2)
        .map(|c| u16::from_le_bytes([c[0], c[1]]))
}

/// Tokenizes `text`, checks the ids decode back to it, and returns them.
fn round_trip(tokenizer: &Tokenizer, text: &str) -> Vec<u32> {
    let ids = tokenizer.encode(text, false).expect("any text tokenizes");
    assert!(ids.iter().all(|&id| (id as usize) < tokenizer.vocab_size()));
    assert_eq!(tokenizer.decode(&ids, false).expect("known ids"), text);
    let with_special = tokenizer.encode(text, true).expect("any text tokenizes");
    match tokenizer.adds_bos() {
        true => assert_eq!(with_special[1..], ids[..]),
        false => assert_eq!(with_special, ids),
    }
    ids
}

/// The incremental detokenizer's output for `ids`, piece by piece, and the
/// tokenizer's decoding (`None` when an id is unknown); checks they agree.
fn detokenize(
    tokenizer: &Tokenizer,
    ids: &[u32],
    skip_special: bool,
) -> (Vec<String>, Option<String>) {
    let whole = tokenizer.decode(ids, skip_special).ok();
    let mut dec = IncrementalDecoder::new();
    let mut pieces = Vec::new();
    let mut unknown = false;
    for &id in ids {
        if skip_special && tokenizer.is_special(id) {
            continue;
        }
        match dec.push_token(tokenizer, id) {
            Ok(piece) => pieces.push(piece),
            Err(DetokError::UnknownToken(bad)) => {
                assert_eq!(bad, id);
                assert!(id as usize >= tokenizer.vocab_size());
                unknown = true;
            }
        }
        assert!(
            dec.pending_len() <= 3,
            "{} bytes held back",
            dec.pending_len()
        );
    }
    pieces.push(dec.finish());
    assert_eq!(dec.pending_len(), 0);
    assert_eq!(whole.is_none(), unknown);
    if let Some(w) = &whole {
        assert_eq!(&pieces.concat(), w, "incremental and whole decoding differ");
    }
    (pieces, whole)
}

/// What a stop matcher emits for `chunks`, and the index of the stop it matched.
fn run_stops(mut m: StopMatcher, chunks: &[&str]) -> (String, Option<usize>) {
    let mut out = String::new();
    for c in chunks {
        match m.push(c) {
            StopOutput::Continue(t) => out.push_str(&t),
            StopOutput::Stopped { text, stop_index } => {
                out.push_str(&text);
                assert!(m.is_stopped());
                assert_eq!(m.stop_index(), Some(stop_index));
                assert_eq!(
                    m.push("more"),
                    StopOutput::Stopped {
                        text: String::new(),
                        stop_index
                    }
                );
                assert_eq!(m.finish(), "");
                return (out, Some(stop_index));
            }
        }
    }
    assert!(!m.is_stopped());
    out.push_str(&m.finish());
    (out, None)
}

/// The specification: the stop that completes first in the whole text
/// (smallest end, then earliest start, then lowest index), and the text
/// before it; or all the text.
fn first_stop(text: &str, stops: &[String]) -> (String, Option<usize>) {
    let best = stops
        .iter()
        .enumerate()
        .filter(|(_, s)| !s.is_empty())
        .filter_map(|(i, s)| text.find(s.as_str()).map(|at| (at + s.len(), at, i)))
        .min();
    match best {
        Some((_, at, i)) => (text[..at].to_string(), Some(i)),
        None => (text.to_string(), None),
    }
}
