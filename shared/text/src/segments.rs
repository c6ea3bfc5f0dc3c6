//! Reusing the tokens of long pieces of prompt text that come back: a
//! system prompt that many requests share, the earlier turns of a chat.
//!
//! The tokenizer splits text at control tokens (`<|im_start|>`,
//! `<|im_end|>`, …) before anything else, so the text between two of them
//! (a *segment*) tokenizes the same wherever it appears. A segment of at
//! least `min_bytes` that has been seen before is looked up here instead of
//! being tokenized again; a chat template puts every message in its own
//! segment. Tokenizing costs about a microsecond per token, so a
//! 1,000-token system prompt is a millisecond of the router's time on every
//! request without this.
//!
//! A segment is kept on its second sighting (the first only leaves its
//! hash), so unique text (most user messages) costs nothing to keep and
//! does not push out what recurs. Kept segments are dropped oldest first
//! once their text and tokens exceed the budget.

use std::collections::hash_map::DefaultHasher;
use std::collections::{HashMap, HashSet, VecDeque};
use std::hash::{Hash, Hasher};
use std::sync::{Arc, Mutex, MutexGuard};

use aho_corasick::{AhoCorasick, AhoCorasickBuilder, MatchKind};

use crate::error::{Result, TextError};

/// Segments shorter than this are tokenized every time: below it the
/// lookup saves little, and short text (a role name, a short question) is
/// the common case.
pub const MIN_SEGMENT_BYTES: usize = 256;

/// How many once-seen segment hashes are remembered before they are
/// forgotten all at once.
const SEEN_LIMIT: usize = 1 << 16;

/// Tokens of recurring segments, bounded in bytes.
pub struct SegmentCache {
    /// The control tokens, matched as the tokenizer matches them (leftmost,
    /// longest first).
    boundaries: AhoCorasick,
    min_bytes: usize,
    budget: usize,
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    kept: HashMap<Arc<str>, Arc<[u32]>>,
    /// Kept segments, oldest first.
    order: VecDeque<Arc<str>>,
    /// Bytes of text and tokens kept.
    bytes: usize,
    /// Hashes of segments seen once.
    seen: HashSet<u64>,
    hits: u64,
    misses: u64,
}

enum Found {
    Kept(Arc<[u32]>),
    Again,
    No,
}

/// How often kept segments were found.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SegmentStats {
    pub hits: u64,
    pub misses: u64,
    /// Bytes of text and tokens kept.
    pub bytes: usize,
}

impl SegmentCache {
    /// A cache of at most `budget` bytes for text split at `boundaries`.
    pub fn new(boundaries: &[String], budget: usize, min_bytes: usize) -> Result<Self> {
        let boundaries = AhoCorasickBuilder::new()
            .match_kind(MatchKind::LeftmostLongest)
            .build(boundaries)
            .map_err(|e| TextError::InvalidModel(format!("control tokens: {e}")))?;
        Ok(Self {
            boundaries,
            min_bytes: min_bytes.max(1),
            budget,
            state: Mutex::default(),
        })
    }

    /// Tokens of `text`: `encode` tokenizes what is not kept, in as few
    /// calls as the kept segments allow (each call's text starts and ends
    /// at a boundary, or at the text's ends).
    pub fn encode(
        &self,
        text: &str,
        encode: impl Fn(&str) -> Result<Vec<u32>>,
    ) -> Result<Vec<u32>> {
        let mut out = Vec::new();
        // Text before `done` has its tokens in `out`.
        let mut done = 0;
        let mut start = 0;
        let ends = self
            .boundaries
            .find_iter(text)
            .map(|m| (m.start(), m.end()));
        for (end, next) in ends.chain(std::iter::once((text.len(), text.len()))) {
            let segment = &text[start..end];
            let found = match segment.len() >= self.min_bytes {
                true => self.find(segment),
                false => Found::No,
            };
            if !matches!(found, Found::No) {
                if done < start {
                    out.extend(encode(&text[done..start])?);
                }
                match found {
                    Found::Kept(tokens) => out.extend_from_slice(&tokens),
                    _ => {
                        let tokens = encode(segment)?;
                        out.extend_from_slice(&tokens);
                        self.keep(segment, tokens);
                    }
                }
                done = end;
            }
            start = next;
        }
        if done < text.len() {
            out.extend(encode(&text[done..])?);
        }
        Ok(out)
    }

    /// Whether a segment is kept, seen for the second time (to be kept), or
    /// neither (its hash is noted).
    fn find(&self, segment: &str) -> Found {
        let mut s = self.lock();
        if let Some(tokens) = s.kept.get(segment) {
            let tokens = tokens.clone();
            s.hits += 1;
            return Found::Kept(tokens);
        }
        s.misses += 1;
        let mut h = DefaultHasher::new();
        segment.hash(&mut h);
        let hash = h.finish();
        if s.seen.remove(&hash) {
            return Found::Again;
        }
        if s.seen.len() >= SEEN_LIMIT {
            s.seen.clear();
        }
        s.seen.insert(hash);
        Found::No
    }

    /// Keeps a segment's tokens, dropping the oldest kept segments while
    /// over the budget (one larger than the budget is not kept).
    fn keep(&self, segment: &str, tokens: Vec<u32>) {
        let size = segment.len() + tokens.len() * std::mem::size_of::<u32>();
        if size > self.budget {
            return;
        }
        let mut s = self.lock();
        let text: Arc<str> = segment.into();
        if s.kept.insert(text.clone(), tokens.into()).is_some() {
            // Another request kept it meanwhile.
            return;
        }
        s.order.push_back(text);
        s.bytes += size;
        while s.bytes > self.budget {
            let Some(old) = s.order.pop_front() else {
                break;
            };
            if let Some(t) = s.kept.remove(&old) {
                s.bytes -= old.len() + t.len() * std::mem::size_of::<u32>();
            }
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock leaves consistent maps behind.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn stats(&self) -> SegmentStats {
        let s = self.lock();
        SegmentStats {
            hits: s.hits,
            misses: s.misses,
            bytes: s.bytes,
        }
    }
}

#[cfg(test)]
mod tests {
    use std::cell::RefCell;

    use super::*;

    /// A stand-in tokenizer: one token per byte, recording each call's text.
    fn encoder(calls: &RefCell<Vec<String>>) -> impl Fn(&str) -> Result<Vec<u32>> + '_ {
        move |t: &str| {
            calls.borrow_mut().push(t.to_string());
            Ok(t.bytes().map(u32::from).collect())
        }
    }

    fn cache(budget: usize) -> SegmentCache {
        SegmentCache::new(&["<s>".into(), "<e>".into()], budget, 8).unwrap()
    }

    #[test]
    fn a_segment_is_kept_on_its_second_sighting_and_found_on_its_third() {
        let c = cache(1 << 20);
        let calls = RefCell::new(Vec::new());
        let text = "<s>system prompt here<e><s>hi<e>";
        let want: Vec<u32> = text.bytes().map(u32::from).collect();
        for _ in 0..3 {
            assert_eq!(c.encode(text, encoder(&calls)).unwrap(), want);
        }
        let calls = calls.into_inner();
        // First: one call over everything. Second: around the segment, the
        // segment alone (kept), the rest. Third: around it only.
        assert_eq!(calls[0], text);
        assert_eq!(calls[1..4], ["<s>", "system prompt here", "<e><s>hi<e>"]);
        assert_eq!(calls[4..], ["<s>", "<e><s>hi<e>"]);
        let s = c.stats();
        assert_eq!((s.hits, s.misses), (1, 2));
        assert_eq!(s.bytes, 18 + 18 * 4);
    }

    #[test]
    fn short_segments_and_text_without_boundaries_pass_through() {
        let c = cache(1 << 20);
        let calls = RefCell::new(Vec::new());
        for text in ["<s>short<e>", "", "no boundary at all, long enough"] {
            for _ in 0..3 {
                let want: Vec<u32> = text.bytes().map(u32::from).collect();
                assert_eq!(c.encode(text, encoder(&calls)).unwrap(), want);
            }
        }
        // The boundary-free text is one long segment: kept like any other.
        assert_eq!(c.stats().hits, 1);
        assert!(calls.borrow().iter().all(|t| !t.is_empty()));
    }

    #[test]
    fn the_oldest_segments_go_first_when_over_the_budget() {
        // Each kept segment: 9 bytes of text and 36 of tokens.
        let c = cache(120);
        let calls = RefCell::new(Vec::new());
        let seg = |i: usize| format!("<s>segment{i:02}<e>");
        for i in 0..3 {
            for _ in 0..2 {
                c.encode(&seg(i), encoder(&calls)).unwrap();
            }
        }
        assert_eq!(c.stats().bytes, 90, "two of three fit");
        let hits = c.stats().hits;
        c.encode(&seg(0), encoder(&calls)).unwrap();
        assert_eq!(c.stats().hits, hits, "the oldest was dropped");
        c.encode(&seg(2), encoder(&calls)).unwrap();
        assert_eq!(c.stats().hits, hits + 1, "the newest is kept");
    }

    #[test]
    fn an_encoding_error_is_returned() {
        let c = cache(1 << 20);
        let fail = |_: &str| Err(TextError::Tokenizer("no".into()));
        assert!(c.encode("<s>a long enough segment<e>", fail).is_err());
    }
}
