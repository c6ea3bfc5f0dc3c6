//! Tool calls out of generated text, incrementally: the grammar fixes
//! their layout (`structured`), so a call's name is known once its header
//! is out, and its arguments stream as they are generated. Text held back
//! is only what may still turn out to be part of a call's frame.

use std::hash::{BuildHasher, Hasher};

use pdserve_protocol::openai::{FunctionCall, ToolCall};

use crate::structured::{ARGS_PREFIX, CALL_CLOSE, CALL_OPEN, NAME_PREFIX};

/// One piece of a choice's output.
#[derive(Debug, Clone, PartialEq)]
pub enum Piece {
    /// Plain text.
    Text(String),
    /// A call starts: its index among the choice's calls, id and name.
    Call {
        index: u32,
        id: String,
        name: String,
    },
    /// More of call `index`'s arguments.
    Args { index: u32, text: String },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Nothing decided: the output may still open a call.
    Start,
    /// Plain text to the end.
    Text,
    /// Inside a call's frame, before its arguments.
    Header,
    /// Inside a call's arguments.
    Args,
    /// After a call: another may follow.
    Between,
}

/// Splits one choice's output into text and calls.
#[derive(Debug)]
pub struct CallParser {
    buf: String,
    state: State,
    calls: u32,
}

impl Default for CallParser {
    fn default() -> Self {
        Self {
            buf: String::new(),
            state: State::Start,
            calls: 0,
        }
    }
}

/// A fresh call id.
fn call_id() -> String {
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(0);
    format!("call_{:016x}", h.finish())
}

/// The largest char boundary of `s` at or below `at`.
fn floor_boundary(s: &str, at: usize) -> usize {
    (0..=at.min(s.len()))
        .rev()
        .find(|&i| s.is_char_boundary(i))
        .unwrap_or(0)
}

impl CallParser {
    /// Calls seen so far.
    pub fn calls(&self) -> u32 {
        self.calls
    }

    /// Takes more output; returns what it decides.
    pub fn push(&mut self, text: &str) -> Vec<Piece> {
        self.buf.push_str(text);
        let mut out = Vec::new();
        while self.step(&mut out) {}
        out
    }

    /// The output ended: whatever is held back is released as it stands.
    pub fn finish(&mut self) -> Vec<Piece> {
        let rest = std::mem::take(&mut self.buf);
        match self.state {
            _ if rest.is_empty() => vec![],
            State::Args => {
                // Cut inside the close frame: its `}` and what follows are
                // not the arguments' (compact JSON has no raw newline).
                let text = match rest.find('\n') {
                    Some(at) => rest[..at.saturating_sub(1)].to_string(),
                    None => rest,
                };
                let index = self.calls - 1;
                match text.is_empty() {
                    true => vec![],
                    false => vec![Piece::Args { index, text }],
                }
            }
            _ => vec![Piece::Text(rest)],
        }
    }

    /// One decision; false when more output is needed.
    fn step(&mut self, out: &mut Vec<Piece>) -> bool {
        match self.state {
            State::Start | State::Between => {
                if self.state == State::Between {
                    let trimmed = self.buf.trim_start_matches('\n').len();
                    self.buf.drain(..self.buf.len() - trimmed);
                }
                if self.buf.starts_with(CALL_OPEN) {
                    self.buf.drain(..CALL_OPEN.len());
                    self.state = State::Header;
                    true
                } else if CALL_OPEN.starts_with(self.buf.as_str()) {
                    false
                } else {
                    self.state = State::Text;
                    true
                }
            }
            State::Text => {
                if !self.buf.is_empty() {
                    out.push(Piece::Text(std::mem::take(&mut self.buf)));
                }
                false
            }
            State::Header => self.header(out),
            State::Args => self.args(out),
        }
    }

    fn header(&mut self, out: &mut Vec<Piece>) -> bool {
        let Some(rest) = self.buf.strip_prefix(NAME_PREFIX) else {
            if !NAME_PREFIX.starts_with(self.buf.as_str()) {
                // Not the frame the grammar writes: plain text after all.
                self.buf.insert_str(0, CALL_OPEN);
                self.state = State::Text;
                return true;
            }
            return false;
        };
        let Some(end) = rest.find(ARGS_PREFIX) else {
            return false;
        };
        let name = rest[..end].to_string();
        let consumed = NAME_PREFIX.len() + end + ARGS_PREFIX.len();
        self.buf.drain(..consumed);
        out.push(Piece::Call {
            index: self.calls,
            id: call_id(),
            name,
        });
        self.calls += 1;
        self.state = State::Args;
        true
    }

    fn args(&mut self, out: &mut Vec<Piece>) -> bool {
        let index = self.calls - 1;
        // Compact JSON has no raw newline: the first one starts the close.
        let close = &CALL_CLOSE[1..];
        if let Some(at) = self.buf.find(close) {
            // The frame's `}` just before the newline is not the arguments'.
            let text = self.buf[..at.saturating_sub(1)].to_string();
            self.buf.drain(..at + close.len());
            if !text.is_empty() {
                out.push(Piece::Args { index, text });
            }
            self.state = State::Between;
            return true;
        }
        let keep = floor_boundary(&self.buf, self.buf.len().saturating_sub(CALL_CLOSE.len()));
        if keep > 0 {
            let text: String = self.buf.drain(..keep).collect();
            out.push(Piece::Args { index, text });
        }
        false
    }
}

/// A whole output: its text (`None` when it is only calls) and its calls.
pub fn split(text: &str) -> (Option<String>, Vec<ToolCall>) {
    let mut p = CallParser::default();
    let mut pieces = p.push(text);
    pieces.extend(p.finish());
    let (mut content, mut calls) = (String::new(), Vec::<ToolCall>::new());
    for piece in pieces {
        match piece {
            Piece::Text(t) => content.push_str(&t),
            Piece::Call { id, name, .. } => calls.push(ToolCall {
                id,
                kind: "function".into(),
                function: FunctionCall {
                    name,
                    arguments: String::new(),
                },
            }),
            Piece::Args { index, text } => {
                if let Some(c) = calls.get_mut(index as usize) {
                    c.function.arguments.push_str(&text);
                }
            }
        }
    }
    // Only calls: `content` is null, as OpenAI sends it.
    let content = (!content.is_empty() || calls.is_empty()).then_some(content);
    (content, calls)
}

#[cfg(test)]
mod tests {
    use super::*;

    const TWO: &str = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call>";

    #[test]
    fn whole_outputs_split_into_calls() {
        let (content, calls) = split(TWO);
        assert_eq!(content, None);
        assert_eq!(calls.len(), 2);
        assert_eq!(calls[0].function.name, "get_weather");
        assert_eq!(calls[0].function.arguments, r#"{"city": "Paris"}"#);
        assert_eq!(calls[1].function.arguments, "{}");
        assert_ne!(calls[0].id, calls[1].id);
        assert_eq!(split("Hello <b>"), (Some("Hello <b>".into()), vec![]));
        assert_eq!(split("<tool"), (Some("<tool".into()), vec![]));
        // Cut by max_tokens inside the close frame: the arguments stay whole.
        let (_, cut) = split(&TWO[..TWO.find("</tool_call>").unwrap() + 2]);
        assert_eq!(cut[0].function.arguments, r#"{"city": "Paris"}"#);
        assert_eq!(split(""), (Some(String::new()), vec![]));
    }

    #[test]
    fn any_chunking_streams_the_same_calls() {
        for size in [1, 2, 3, 5, 7, 13, 64] {
            let mut p = CallParser::default();
            let mut pieces = Vec::new();
            let chars: Vec<char> = TWO.chars().collect();
            for chunk in chars.chunks(size) {
                pieces.extend(p.push(&chunk.iter().collect::<String>()));
            }
            pieces.extend(p.finish());
            let mut args = vec![String::new(); 2];
            let mut names = vec![];
            for piece in pieces {
                match piece {
                    Piece::Call { index, name, .. } => {
                        assert_eq!(index as usize, names.len());
                        names.push(name);
                    }
                    Piece::Args { index, text } => args[index as usize] += &text,
                    Piece::Text(t) => panic!("text {t:?} at chunk size {size}"),
                }
            }
            assert_eq!(names, ["get_weather", "f"]);
            assert_eq!(args, [r#"{"city": "Paris"}"#, "{}"]);
        }
    }
}
