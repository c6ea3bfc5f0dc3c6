//! Stop-sequence matching over streamed text.
//!
//! [`StopMatcher`] receives decoded text chunk by chunk and releases only the
//! text that can no longer be part of a stop string: the longest suffix of
//! the pending text that is a prefix of some stop string is held back, so a
//! stop split across chunks is still matched and never emitted.
//!
//! The match reported is the first one to *complete* in the stream (smallest
//! end offset; among those the earliest start, then the lowest stop index).
//! This makes the result independent of how the text was chunked.

/// Maximum number of (non-empty) stop strings.
pub const MAX_STOPS: usize = 16;
/// Maximum length of one stop string, in bytes.
pub const MAX_STOP_BYTES: usize = 256;

/// Errors reported by [`StopMatcher::new`].
#[derive(thiserror::Error, Debug, Clone, PartialEq, Eq)]
pub enum StopError {
    /// More non-empty stop strings than [`MAX_STOPS`].
    #[error("at most {max} stop strings are allowed, got {count}")]
    TooManyStops {
        /// Number of non-empty stop strings given.
        count: usize,
        /// The limit.
        max: usize,
    },
    /// A stop string longer than [`MAX_STOP_BYTES`].
    #[error("stop string {index} is {len} bytes long; at most {max} bytes are allowed")]
    StopTooLong {
        /// Index of the offending stop in the input list.
        index: usize,
        /// Its length in bytes.
        len: usize,
        /// The limit.
        max: usize,
    },
}

/// The result of [`StopMatcher::push`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StopOutput {
    /// No stop string yet; the text is safe to emit now.
    Continue(String),
    /// A stop string matched; `text` is what remains to emit before it (the
    /// stop itself excluded) and `stop_index` its index in the input list.
    Stopped {
        /// Text preceding the match that was not emitted before.
        text: String,
        /// Index of the matched stop in the list given to [`StopMatcher::new`].
        stop_index: usize,
    },
}

/// Streaming matcher for a small set of stop strings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StopMatcher {
    /// Non-empty stops with their index in the original list.
    stops: Vec<(usize, String)>,
    /// Longest stop length in bytes.
    max_len: usize,
    /// Held-back text: always shorter than `max_len`.
    pending: String,
    /// Index of the matched stop once stopped.
    stopped: Option<usize>,
}

impl StopMatcher {
    /// Builds a matcher; empty strings are ignored but keep their index slot.
    pub fn new(stops: Vec<String>) -> Result<Self, StopError> {
        let stops: Vec<(usize, String)> = stops
            .into_iter()
            .enumerate()
            .filter(|(_, s)| !s.is_empty())
            .collect();
        if stops.len() > MAX_STOPS {
            return Err(StopError::TooManyStops {
                count: stops.len(),
                max: MAX_STOPS,
            });
        }
        if let Some((index, s)) = stops.iter().find(|(_, s)| s.len() > MAX_STOP_BYTES) {
            return Err(StopError::StopTooLong {
                index: *index,
                len: s.len(),
                max: MAX_STOP_BYTES,
            });
        }
        let max_len = stops.iter().map(|(_, s)| s.len()).max().unwrap_or(0);
        Ok(Self {
            stops,
            max_len,
            pending: String::new(),
            stopped: None,
        })
    }

    /// Feeds the next chunk of text and returns what can be emitted now.
    ///
    /// Once a stop has matched, every further call returns `Stopped` with
    /// empty text and the same index.
    pub fn push(&mut self, text: &str) -> StopOutput {
        if let Some(stop_index) = self.stopped {
            return StopOutput::Stopped {
                text: String::new(),
                stop_index,
            };
        }
        self.pending.push_str(text);
        if let Some((start, stop_index)) = self.first_match() {
            self.pending.truncate(start);
            self.stopped = Some(stop_index);
            return StopOutput::Stopped {
                text: std::mem::take(&mut self.pending),
                stop_index,
            };
        }
        let hold_from = self.hold_from();
        let held = self.pending.split_off(hold_from);
        StopOutput::Continue(std::mem::replace(&mut self.pending, held))
    }

    /// Ends the stream: returns the held-back text (empty once stopped).
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.pending)
    }

    /// True once a stop string has matched.
    pub fn is_stopped(&self) -> bool {
        self.stopped.is_some()
    }

    /// Index (in the input list) of the matched stop, if any.
    pub fn stop_index(&self) -> Option<usize> {
        self.stopped
    }

    /// The match in `pending` that ends first, as `(start, stop_index)`.
    ///
    /// Only the held tail plus the newest chunk is ever in `pending`, so this
    /// never rescans the stream's history.
    fn first_match(&self) -> Option<(usize, usize)> {
        self.stops
            .iter()
            .filter_map(|(index, stop)| {
                // The first occurrence of a stop is also its earliest-ending one.
                self.pending
                    .find(stop.as_str())
                    .map(|start| (start + stop.len(), start, *index))
            })
            .min()
            .map(|(_, start, index)| (start, index))
    }

    /// Start of the longest suffix of `pending` that is a proper prefix of a
    /// stop string (`pending.len()` when there is none).
    fn hold_from(&self) -> usize {
        let bytes = self.pending.as_bytes();
        let lowest = bytes.len().saturating_sub(self.max_len.saturating_sub(1));
        (lowest..bytes.len())
            .filter(|&i| self.pending.is_char_boundary(i))
            .find(|&i| {
                let suffix = &bytes[i..];
                self.stops
                    .iter()
                    .any(|(_, stop)| stop.as_bytes().starts_with(suffix))
            })
            .unwrap_or(bytes.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn matcher(stops: &[&str]) -> StopMatcher {
        let stops = stops.iter().map(|s| s.to_string()).collect();
        match StopMatcher::new(stops) {
            Ok(m) => m,
            Err(e) => panic!("bad stops: {e}"),
        }
    }

    /// Feeds `chunks`, returning everything emitted and the stop index.
    fn run(stops: &[&str], chunks: &[&str]) -> (String, Option<usize>) {
        let mut m = matcher(stops);
        let mut out = String::new();
        for c in chunks {
            match m.push(c) {
                StopOutput::Continue(t) => out.push_str(&t),
                StopOutput::Stopped { text, stop_index } => {
                    out.push_str(&text);
                    return (out, Some(stop_index));
                }
            }
        }
        out.push_str(&m.finish());
        (out, None)
    }

    fn cont(s: &str) -> StopOutput {
        StopOutput::Continue(s.to_string())
    }

    fn stopped(s: &str, stop_index: usize) -> StopOutput {
        StopOutput::Stopped {
            text: s.to_string(),
            stop_index,
        }
    }

    #[test]
    fn stop_inside_one_chunk() {
        let mut m = matcher(&["END"]);
        assert_eq!(m.push("abc END def"), stopped("abc ", 0));
        assert!(m.is_stopped());
        assert_eq!(m.push("more"), stopped("", 0));
        assert_eq!(m.push(""), stopped("", 0));
        assert_eq!(m.finish(), "");
    }

    #[test]
    fn stop_split_across_two_and_three_chunks() {
        let mut m = matcher(&["</s>"]);
        assert_eq!(m.push("hi </"), cont("hi "));
        assert_eq!(m.push("s> bye"), stopped("", 0));

        let mut m = matcher(&["</s>"]);
        assert_eq!(m.push("a<"), cont("a"));
        assert_eq!(m.push("/s"), cont(""));
        assert_eq!(m.push(">b"), stopped("", 0));
    }

    #[test]
    fn false_partial_match_is_released_in_order() {
        let mut m = matcher(&["STOP"]);
        assert_eq!(m.push("x ST"), cont("x "));
        assert_eq!(m.push("O"), cont(""));
        assert_eq!(m.push("RM y"), cont("STORM y"));
        // Released text can itself start a new partial match.
        assert_eq!(m.push("SSTO"), cont("S"));
        assert_eq!(m.finish(), "STO");
    }

    #[test]
    fn earliest_completed_match_wins() {
        // One stop is a prefix of another: the shorter completes first.
        assert_eq!(run(&["ab", "abc"], &["xabc"]), ("x".into(), Some(0)));
        assert_eq!(run(&["abc", "ab"], &["xa", "bc"]), ("x".into(), Some(1)));
        // Overlapping stops: "bcd" would end later than "abc".
        assert_eq!(run(&["bcd", "abc"], &["zabcd"]), ("z".into(), Some(1)));
        // Same end: the longer (earlier starting) match wins.
        assert_eq!(run(&["c", "abc"], &["ab", "c"]), ("".into(), Some(1)));
        // Two occurrences: the earlier one wins regardless of list order.
        assert_eq!(run(&["yy", "xx"], &["a xx b yy"]), ("a ".into(), Some(1)));
    }

    #[test]
    fn multi_byte_chars_in_stop_and_text() {
        let mut m = matcher(&["終わり"]);
        assert_eq!(m.push("日本語終"), cont("日本語"));
        assert_eq!(m.push("わ"), cont(""));
        assert_eq!(m.push("り!"), stopped("", 0));
        assert_eq!(
            run(&["é!"], &["café", "?é", "!x"]),
            ("café?".into(), Some(0))
        );
        // A shared leading byte is not a shared prefix of characters.
        assert_eq!(run(&["é"], &["è", "ê"]), ("èê".into(), None));
    }

    #[test]
    fn no_stops_is_passthrough() {
        let mut m = matcher(&[]);
        assert_eq!(m.push("anything </s>"), cont("anything </s>"));
        assert_eq!(m.finish(), "");
        let mut m = matcher(&["", ""]);
        assert_eq!(m.push("a"), cont("a"));
    }

    #[test]
    fn finish_returns_held_text() {
        let mut m = matcher(&["###"]);
        assert_eq!(m.push("done ##"), cont("done "));
        assert_eq!(m.finish(), "##");
        assert_eq!(m.finish(), "");
    }

    #[test]
    fn empty_stops_keep_their_index() {
        assert_eq!(run(&["", "Q"], &["aQ"]), ("a".into(), Some(1)));
    }

    #[test]
    fn limits_are_enforced() {
        let many: Vec<String> = (0..17).map(|i| format!("s{i}")).collect();
        assert_eq!(
            StopMatcher::new(many).err(),
            Some(StopError::TooManyStops { count: 17, max: 16 })
        );
        let mut sixteen: Vec<String> = (0..16).map(|i| format!("s{i}")).collect();
        sixteen.push(String::new());
        assert!(StopMatcher::new(sixteen).is_ok());
        let long = vec!["ok".to_string(), "x".repeat(257)];
        assert_eq!(
            StopMatcher::new(long).err(),
            Some(StopError::StopTooLong {
                index: 1,
                len: 257,
                max: 256
            })
        );
        assert!(StopMatcher::new(vec!["x".repeat(256)]).is_ok());
    }

    #[test]
    fn every_chunking_gives_the_truncated_input() {
        let stops = ["</s>", "stop", "终止", "ab", "abab"];
        // (input, expected emitted text, expected stop index)
        let cases: [(&str, &str, Option<usize>); 7] = [
            ("hello </s> world", "hello ", Some(0)),
            ("no stop here", "no ", Some(1)),
            ("plain text only", "plain text only", None),
            ("好的终止了", "好的", Some(2)),
            ("xa aba", "xa ", Some(3)),
            ("</ s> sto 终", "</ s> sto 终", None),
            ("a</st</s>", "a</st", Some(0)),
        ];
        for (input, want_text, want_stop) in cases {
            let bounds: Vec<usize> = (0..=input.len())
                .filter(|&i| input.is_char_boundary(i))
                .collect();
            for &i in &bounds {
                for &j in bounds.iter().filter(|&&j| j >= i) {
                    let chunks = [&input[..i], &input[i..j], &input[j..]];
                    for n in 1..=3 {
                        let pick: Vec<&str> = match n {
                            1 => vec![input],
                            2 => vec![chunks[0], &input[i..]],
                            _ => chunks.to_vec(),
                        };
                        let got = run(&stops, &pick);
                        assert_eq!(got, (want_text.to_string(), want_stop), "{pick:?}");
                    }
                }
            }
        }
    }
}
