//! Incremental detokenization: turning a stream of token byte strings into
//! text that is only ever emitted at valid UTF-8 boundaries.
//!
//! Tokens of byte-level BPE vocabularies often split a multi-byte character
//! across several tokens. [`IncrementalDecoder`] holds back an incomplete
//! trailing sequence until it is completed, and replaces bytes that can never
//! form valid UTF-8 with U+FFFD exactly like [`String::from_utf8_lossy`]
//! would on the whole stream.

/// Maps a token id to the raw bytes it stands for.
///
/// Implemented elsewhere (e.g. on top of a tokenizer vocabulary); this module
/// does not depend on any tokenizer crate.
pub trait TokenBytes {
    /// The bytes of token `id`, or `None` when the id is unknown.
    fn token_bytes(&self, id: u32) -> Option<Vec<u8>>;
}

/// Errors reported by [`IncrementalDecoder::push_token`].
#[derive(thiserror::Error, Debug, Clone, PartialEq, Eq)]
pub enum DetokError {
    /// The vocabulary has no bytes for this token id.
    #[error("unknown token id {0}")]
    UnknownToken(u32),
}

/// Streaming UTF-8 decoder over token byte strings.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct IncrementalDecoder {
    /// An incomplete (but still possibly valid) UTF-8 sequence: at most 3 bytes.
    pending: Vec<u8>,
}

impl IncrementalDecoder {
    /// Creates a decoder with nothing held back.
    pub fn new() -> Self {
        Self::default()
    }

    /// Appends a token's bytes and returns the newly completed text.
    ///
    /// An incomplete multi-byte sequence at the end is held back until a later
    /// push completes it. Every maximal invalid subpart becomes one U+FFFD.
    pub fn push(&mut self, bytes: &[u8]) -> String {
        let mut input = std::mem::take(&mut self.pending);
        input.extend_from_slice(bytes);
        let mut out = String::with_capacity(input.len());
        let mut rest: &[u8] = &input;
        loop {
            match std::str::from_utf8(rest) {
                Ok(text) => {
                    out.push_str(text);
                    break;
                }
                Err(err) => {
                    let (valid, after) = rest.split_at(err.valid_up_to());
                    // `valid` was just checked, so this never substitutes.
                    out.push_str(&String::from_utf8_lossy(valid));
                    match err.error_len() {
                        Some(len) => {
                            out.push(char::REPLACEMENT_CHARACTER);
                            rest = after.get(len..).unwrap_or_default();
                        }
                        None => {
                            // Incomplete sequence at the very end: hold it.
                            self.pending = after.to_vec();
                            break;
                        }
                    }
                }
            }
        }
        out
    }

    /// Looks up token `id` in `vocab` and pushes its bytes.
    pub fn push_token(&mut self, vocab: &impl TokenBytes, id: u32) -> Result<String, DetokError> {
        let bytes = vocab.token_bytes(id).ok_or(DetokError::UnknownToken(id))?;
        Ok(self.push(&bytes))
    }

    /// Flushes held-back bytes at the end of the stream (an incomplete
    /// sequence becomes one U+FFFD) and resets the decoder.
    pub fn finish(&mut self) -> String {
        let pending = std::mem::take(&mut self.pending);
        String::from_utf8_lossy(&pending).into_owned()
    }

    /// Number of bytes currently held back waiting for completion.
    pub fn pending_len(&self) -> usize {
        self.pending.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    const FFFD: char = char::REPLACEMENT_CHARACTER;

    fn feed(chunks: &[&[u8]]) -> (Vec<String>, String) {
        let mut dec = IncrementalDecoder::new();
        let outs: Vec<String> = chunks.iter().map(|c| dec.push(c)).collect();
        let tail = dec.finish();
        (outs, tail)
    }

    #[test]
    fn emoji_split_across_pushes_is_emitted_once() {
        let emoji = "😀".as_bytes();
        assert_eq!(emoji.len(), 4);
        let splits: [&[&[u8]]; 3] = [
            &[&emoji[..2], &emoji[2..]],
            &[&emoji[..1], &emoji[1..3], &emoji[3..]],
            &[&emoji[..1], &emoji[1..2], &emoji[2..3], &emoji[3..]],
        ];
        for chunks in splits {
            let (outs, tail) = feed(chunks);
            let last = outs.len() - 1;
            assert!(outs[..last].iter().all(String::is_empty));
            assert_eq!(outs[last], "😀");
            assert_eq!(tail, "");
        }
    }

    #[test]
    fn cjk_split_with_ascii_around() {
        let text = "a中文b";
        let b = text.as_bytes();
        let (outs, tail) = feed(&[&b[..2], &b[2..5], &b[5..]]);
        assert_eq!(outs, vec!["a", "中", "文b"]);
        assert_eq!(tail, "");
    }

    #[test]
    fn invalid_byte_becomes_one_replacement_and_decoding_continues() {
        let (outs, tail) = feed(&[b"ab\xFFc", "é".as_bytes()]);
        assert_eq!(outs, vec![format!("ab{FFFD}c"), "é".to_string()]);
        assert_eq!(tail, "");
        let (outs, _) = feed(&[b"\xFF\xFF"]);
        assert_eq!(outs, vec![format!("{FFFD}{FFFD}")]);
    }

    #[test]
    fn incomplete_sequence_then_ascii() {
        let mut dec = IncrementalDecoder::new();
        assert_eq!(dec.push(b"x\xE4\xB8"), "x");
        assert_eq!(dec.pending_len(), 2);
        assert_eq!(dec.push(b"A"), format!("{FFFD}A"));
        assert_eq!(dec.pending_len(), 0);
        assert_eq!(dec.finish(), "");
    }

    #[test]
    fn finish_flushes_incomplete_tail() {
        let mut dec = IncrementalDecoder::new();
        assert_eq!(dec.push(b"ok\xF0\x9F\x98"), "ok");
        assert_eq!(dec.finish(), FFFD.to_string());
        assert_eq!(dec.finish(), "");
        assert_eq!(dec.push(b"z"), "z");
    }

    #[test]
    fn matches_lossy_decoding_of_the_whole_stream() {
        let streams: [&[u8]; 4] = [
            b"\xE4\xB8\xE4\xB8\xAD",
            b"\xF0\x9F\x98\x80\xF0\x9F",
            b"\xC0\x80a\xED\xA0\x80b",
            b"\x80\xE2\x82\xACz\xF4\x90\x80\x80",
        ];
        for s in streams {
            let want = String::from_utf8_lossy(s).into_owned();
            for cut in 0..=s.len() {
                let (outs, tail) = feed(&[&s[..cut], &s[cut..]]);
                assert_eq!(outs.concat() + &tail, want, "stream {s:?} cut {cut}");
            }
        }
    }

    #[test]
    fn all_split_points_reassemble_valid_strings() {
        let samples = [
            "hello",
            "héllo wörld",
            "日本語テキスト",
            "a😀b🎉c",
            "Ω≈ç√∫ 𝄞",
        ];
        for s in samples {
            let b = s.as_bytes();
            for i in 0..=b.len() {
                for j in i..=b.len() {
                    let (outs, tail) = feed(&[&b[..i], &b[i..j], &b[j..]]);
                    let joined = outs.concat();
                    assert!(!joined.contains(FFFD));
                    assert_eq!(joined, s, "split {i},{j}");
                    assert_eq!(tail, "");
                }
            }
        }
    }

    struct MapVocab(HashMap<u32, Vec<u8>>);

    impl TokenBytes for MapVocab {
        fn token_bytes(&self, id: u32) -> Option<Vec<u8>> {
            self.0.get(&id).cloned()
        }
    }

    #[test]
    fn push_token_uses_the_vocabulary() {
        let emoji = "😀".as_bytes();
        let vocab = MapVocab(HashMap::from([
            (0, emoji[..2].to_vec()),
            (1, emoji[2..].to_vec()),
            (2, b" hi".to_vec()),
        ]));
        let mut dec = IncrementalDecoder::new();
        assert_eq!(dec.push_token(&vocab, 0), Ok(String::new()));
        assert_eq!(dec.push_token(&vocab, 1), Ok("😀".to_string()));
        assert_eq!(dec.push_token(&vocab, 9), Err(DetokError::UnknownToken(9)));
        assert_eq!(dec.push_token(&vocab, 2), Ok(" hi".to_string()));
    }
}
