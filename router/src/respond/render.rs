//! The OpenAI object shapes, per endpoint: chunks of a stream and the
//! final object of a non-streaming response.

use pdserve_protocol::internal::PromptLogprob;
use pdserve_protocol::openai::{
    ChatChoice, ChatChunkChoice, ChatCompletion, ChatCompletionChunk, ChatLogprobs, Completion,
    CompletionChoice, CompletionLogprobs, Delta, ResponseMessage, TokenLogprob, TopLogprob, Usage,
    UsageField,
};
use pdserve_text::Tokenizer;
use serde::Serialize;
use serde_json::Value;

use super::choice::{token_text, TokenLp};
use crate::params::LogprobMode;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    Chat,
    Completion,
}

/// Identity shared by every object of one response.
#[derive(Debug, Clone)]
pub struct Header {
    pub id: String,
    pub created: u64,
    pub model: String,
    pub fingerprint: String,
    pub format: Format,
    pub logprobs: LogprobMode,
    /// Whether streamed chunks carry `usage` (null until the last one).
    pub include_usage: bool,
    /// Whether tool calls are parsed out of the text (chat with tools).
    pub parse_calls: bool,
}

/// One chunk of a stream, serialized straight from its typed shape (no
/// intermediate `Value`: a chunk goes out for every token).
#[derive(Debug, Serialize)]
#[serde(untagged)]
pub enum Chunk {
    Chat(ChatCompletionChunk),
    Completion(Completion),
}

/// What one choice produced, for the non-streaming object.
#[derive(Debug, Clone, Default)]
pub struct ChoiceResult {
    pub text: String,
    pub tokens: Vec<TokenLp>,
    pub finish_reason: Option<String>,
    pub completion_tokens: u32,
    /// Bytes of echoed prompt at the start of `text`.
    pub echo_len: u32,
    /// The echoed prompt's logprobs, when the worker computed them.
    pub prompt: Option<PromptLps>,
}

/// An echoed prompt's tokens and the logprobs of each after the first.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PromptLps {
    pub ids: Vec<u32>,
    pub entries: Vec<PromptLogprob>,
}

fn chat_logprobs(tok: &Tokenizer, tokens: &[TokenLp]) -> ChatLogprobs {
    let entry = |id: u32, logprob: f32| {
        let (token, bytes) = token_text(tok, id);
        (token, bytes, logprob)
    };
    ChatLogprobs {
        content: tokens
            .iter()
            .map(|t| {
                let (token, bytes, logprob) = entry(t.id, t.logprob);
                TokenLogprob {
                    token,
                    logprob,
                    bytes,
                    top_logprobs: t
                        .top
                        .iter()
                        .map(|&(id, lp)| {
                            let (token, bytes, logprob) = entry(id, lp);
                            TopLogprob {
                                token,
                                logprob,
                                bytes,
                            }
                        })
                        .collect(),
                }
            })
            .collect(),
    }
}

/// Completions' logprobs: the echoed prompt's tokens first when there are
/// prompt logprobs (the first token's `null`: nothing precedes it), then the
/// generated `tokens`, whose text starts at byte `offset`.
fn completion_logprobs(
    tok: &Tokenizer,
    prompt: Option<&PromptLps>,
    tokens: &[TokenLp],
    offset: u32,
) -> CompletionLogprobs {
    let mut out = CompletionLogprobs::default();
    if let Some(p) = prompt {
        let mut at = 0;
        for (k, &id) in p.ids.iter().enumerate() {
            let entry = k.checked_sub(1).and_then(|k| p.entries.get(k));
            let lp = entry.map(|e| (e.logprob, e.top_logprobs.as_slice()));
            at = push_logprob(&mut out, tok, id, at, lp);
        }
    }
    let mut at = offset;
    for t in tokens {
        at = push_logprob(&mut out, tok, t.id, at, Some((t.logprob, t.top.as_slice())));
    }
    out
}

/// One token of completions' logprobs at byte `at`; returns where the next
/// one starts.
fn push_logprob(
    out: &mut CompletionLogprobs,
    tok: &Tokenizer,
    id: u32,
    at: u32,
    lp: Option<(f32, &[(u32, f32)])>,
) -> u32 {
    let (text, _) = token_text(tok, id);
    out.text_offset.push(at);
    let next = at + text.len() as u32;
    out.tokens.push(text);
    out.token_logprobs.push(lp.map(|(logprob, _)| logprob));
    out.top_logprobs.push(lp.map(|(_, top)| {
        top.iter()
            .map(|&(id, lp)| (token_text(tok, id).0, Value::from(lp)))
            .collect()
    }));
    next
}

/// `stop` becomes `tool_calls` once the choice made calls.
pub fn finish_with_calls(reason: Option<&str>, calls: u32) -> Option<String> {
    match (reason, calls) {
        (Some("stop"), 1..) => Some("tool_calls".into()),
        (r, _) => r.map(str::to_string),
    }
}

impl Header {
    /// A chat turn's message: its text, and its calls when they are parsed.
    fn message(&self, text: String) -> ResponseMessage {
        let (content, calls) = match self.parse_calls {
            true => super::tools::split(&text),
            false => (Some(text), vec![]),
        };
        ResponseMessage {
            role: "assistant".into(),
            content,
            tool_calls: (!calls.is_empty()).then_some(calls),
        }
    }

    fn usage_field(&self) -> UsageField {
        match self.include_usage {
            true => UsageField::Null,
            false => UsageField::Absent,
        }
    }

    /// One streamed chunk for one choice.
    pub fn chunk(
        &self,
        tok: &Tokenizer,
        index: u32,
        delta: Delta,
        tokens: &[TokenLp],
        finish_reason: Option<&str>,
        text_offset: u32,
    ) -> Chunk {
        let finish_reason = finish_reason.map(str::to_string);
        match self.format {
            Format::Chat => Chunk::Chat(self.chat_chunk(
                vec![ChatChunkChoice {
                    index,
                    logprobs: matches!(self.logprobs, LogprobMode::Chat(_))
                        .then(|| chat_logprobs(tok, tokens)),
                    delta,
                    finish_reason,
                }],
                self.usage_field(),
            )),
            Format::Completion => Chunk::Completion(self.completion(
                vec![CompletionChoice {
                    index,
                    text: delta.content.unwrap_or_default(),
                    logprobs: matches!(self.logprobs, LogprobMode::Completion(_))
                        .then(|| completion_logprobs(tok, None, tokens, text_offset)),
                    finish_reason,
                }],
                self.usage_field(),
            )),
        }
    }

    /// A completion stream's echo chunk, with the prompt's logprobs when
    /// the worker computed them.
    pub fn echo_chunk(
        &self,
        tok: &Tokenizer,
        index: u32,
        echo: String,
        prompt: Option<&PromptLps>,
    ) -> Chunk {
        let logprobs = matches!(self.logprobs, LogprobMode::Completion(_))
            .then(|| completion_logprobs(tok, prompt, &[], 0));
        let choice = CompletionChoice {
            index,
            text: echo,
            logprobs,
            finish_reason: None,
        };
        Chunk::Completion(self.completion(vec![choice], self.usage_field()))
    }

    /// The last chunk of a stream with `include_usage`: no choices, the totals.
    pub fn usage_chunk(&self, usage: Usage) -> Chunk {
        match self.format {
            Format::Chat => Chunk::Chat(self.chat_chunk(vec![], UsageField::Some(usage))),
            Format::Completion => {
                Chunk::Completion(self.completion(vec![], UsageField::Some(usage)))
            }
        }
    }

    fn chat_chunk(&self, choices: Vec<ChatChunkChoice>, usage: UsageField) -> ChatCompletionChunk {
        ChatCompletionChunk {
            id: self.id.clone(),
            object: "chat.completion.chunk".into(),
            created: self.created,
            model: self.model.clone(),
            system_fingerprint: self.fingerprint.clone(),
            choices,
            usage,
        }
    }

    fn completion(&self, choices: Vec<CompletionChoice>, usage: UsageField) -> Completion {
        Completion {
            id: self.id.clone(),
            object: "text_completion".into(),
            created: self.created,
            model: self.model.clone(),
            system_fingerprint: self.fingerprint.clone(),
            choices,
            usage,
        }
    }

    /// The non-streaming response.
    pub fn complete(&self, tok: &Tokenizer, results: Vec<ChoiceResult>, usage: Usage) -> Value {
        let value = match self.format {
            Format::Chat => serde_json::to_value(ChatCompletion {
                id: self.id.clone(),
                object: "chat.completion".into(),
                created: self.created,
                model: self.model.clone(),
                system_fingerprint: self.fingerprint.clone(),
                choices: results
                    .into_iter()
                    .enumerate()
                    .map(|(i, r)| ChatChoice {
                        index: i as u32,
                        logprobs: matches!(self.logprobs, LogprobMode::Chat(_))
                            .then(|| chat_logprobs(tok, &r.tokens)),
                        finish_reason: r.finish_reason.clone(),
                        message: self.message(r.text),
                    })
                    .map(|mut c| {
                        if c.message.tool_calls.is_some() {
                            c.finish_reason = finish_with_calls(c.finish_reason.as_deref(), 1);
                        }
                        c
                    })
                    .collect(),
                usage,
            }),
            Format::Completion => {
                let choices = results
                    .into_iter()
                    .enumerate()
                    .map(|(i, r)| CompletionChoice {
                        index: i as u32,
                        logprobs: matches!(self.logprobs, LogprobMode::Completion(_)).then(|| {
                            completion_logprobs(tok, r.prompt.as_ref(), &r.tokens, r.echo_len)
                        }),
                        text: r.text,
                        finish_reason: r.finish_reason,
                    })
                    .collect();
                serde_json::to_value(self.completion(choices, UsageField::Some(usage)))
            }
        };
        value.unwrap_or(Value::Null)
    }
}
