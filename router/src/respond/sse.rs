//! Streaming responses: SSE chunks as tokens arrive, ending with
//! `data: [DONE]`. An error after the first chunk becomes a final
//! `data: {"error": …}` event.

use std::convert::Infallible;
use std::pin::Pin;

use axum::body::Body;
use axum::http::header;
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use futures_util::stream::{self, select_all, BoxStream, StreamExt};
use pdserve_protocol::openai::{Delta, FunctionCallDelta, ToolCallDelta, Usage};
use serde::Serialize;

use super::choice::{Choice, Update};
use super::render::{finish_with_calls, Format, PromptLps};
use super::tools::{CallParser, Piece};
use super::{cached_usage, prompt_usage, Ctx};
use crate::error::ApiError;
use crate::frontend::Prepared;
use crate::params::LogprobMode;

type Updates = BoxStream<'static, Result<Update, ApiError>>;

fn updates(c: Choice) -> Updates {
    stream::unfold(c, |mut c| async move { c.next().await.map(|u| (u, c)) }).boxed()
}

/// Streams SSE chunks. Waits for the first update so that a failure before
/// any token is still a plain HTTP error.
pub(super) async fn stream(ctx: Ctx, prepared: &Prepared, choices: Vec<Choice>) -> Response {
    let cached = cached_usage(prepared, &choices);
    let mut merged = select_all(choices.into_iter().map(updates));
    let first = match merged.next().await {
        Some(Ok(u)) => u,
        Some(Err(e)) => return ctx.request.refuse(e),
        None => return ctx.request.refuse(ApiError::Internal("no choices".into())),
    };
    let n = prepared.params.n as usize;
    let echoes: Vec<Option<String>> = (0..prepared.prompts.len() * n)
        .map(|i| prepared.prompts.get(i / n).and_then(|p| p.echo.clone()))
        .collect();
    let writer = SseWriter {
        parsers: (0..echoes.len())
            .map(|_| prepared.parse_calls.then(CallParser::default))
            .collect(),
        prompt_ids: (0..echoes.len())
            .map(|i| match prepared.params.sampling.prompt_logprobs {
                true => prepared.prompts.get(i / n).map(|p| p.tokens.clone()),
                false => None,
            })
            .collect(),
        started: vec![false; echoes.len()],
        offsets: vec![0; echoes.len()],
        echoes,
        usage: Usage::new(prompt_usage(prepared), 0).with_cached(cached),
        ttft: false,
        finish_reasons: Vec::new(),
        ctx,
    };
    let events: Pin<Box<dyn futures_util::Stream<Item = Result<Update, ApiError>> + Send>> =
        Box::pin(stream::once(async { Ok(first) }).chain(merged));
    let body = stream::unfold((events, Some(writer)), |(mut events, writer)| async move {
        let mut w = writer?;
        match events.next().await {
            Some(Ok(u)) => Some((w.on_update(u), (events, Some(w)))),
            Some(Err(e)) => Some((w.on_error(e), (events, None))),
            None => Some((w.end(), (events, None))),
        }
    })
    .map(Ok::<Bytes, Infallible>);
    Response::builder()
        .header(header::CONTENT_TYPE, "text/event-stream")
        .header(header::CACHE_CONTROL, "no-cache")
        .body(Body::from_stream(body))
        .unwrap_or_else(|_| ApiError::Internal("response".into()).into_response())
}

struct SseWriter {
    ctx: Ctx,
    /// Per choice, when tool calls are parsed out of the text.
    parsers: Vec<Option<CallParser>>,
    /// Per choice, its prompt's tokens when prompt logprobs are asked for.
    prompt_ids: Vec<Option<Vec<u32>>>,
    started: Vec<bool>,
    offsets: Vec<u32>,
    echoes: Vec<Option<String>>,
    usage: Usage,
    ttft: bool,
    /// Each finished choice's reason, as sent.
    finish_reasons: Vec<String>,
}

fn sse(value: &impl Serialize, out: &mut Vec<u8>) {
    out.extend_from_slice(b"data: ");
    let start = out.len();
    if serde_json::to_writer(&mut *out, value).is_err() {
        out.truncate(start);
        out.extend_from_slice(b"null");
    }
    out.extend_from_slice(b"\n\n");
}

impl SseWriter {
    /// The role chunk (chat) or echoed prompt (completions, with the
    /// prompt's logprobs when they came first) opening a choice.
    fn open(&mut self, index: u32, out: &mut Vec<u8>, prompt: Option<PromptLps>) {
        let i = index as usize;
        if self.started.get(i).copied().unwrap_or(true) {
            return;
        }
        self.started[i] = true;
        let h = &self.ctx.header;
        let delta = match h.format {
            Format::Chat => Delta {
                role: Some("assistant".into()),
                content: Some(String::new()),
                tool_calls: None,
            },
            Format::Completion => {
                let Some(echo) = self.echoes[i].take() else {
                    return;
                };
                self.offsets[i] += echo.len() as u32;
                let chunk = h.echo_chunk(&self.ctx.tokenizer, index, echo, prompt.as_ref());
                return sse(&chunk, out);
            }
        };
        self.offsets[i] += delta.content.as_ref().map_or(0, |c| c.len() as u32);
        sse(
            &h.chunk(&self.ctx.tokenizer, index, delta, &[], None, 0),
            out,
        );
    }

    /// With tool calls parsed (chat with tools): writes the calls' deltas of
    /// this piece of output, and returns the text that is not a call and the
    /// finish reason (`tool_calls` once the choice made calls).
    fn split_calls(
        &mut self,
        index: u32,
        text: String,
        finish: Option<String>,
        out: &mut Vec<u8>,
    ) -> (String, Option<String>) {
        let Some(Some(parser)) = self.parsers.get_mut(index as usize) else {
            return (text, finish);
        };
        let mut pieces = parser.push(&text);
        let mut finish = finish;
        if finish.is_some() {
            pieces.extend(parser.finish());
            finish = finish_with_calls(finish.as_deref(), parser.calls());
        }
        let mut text = String::new();
        for piece in pieces {
            let call = match piece {
                Piece::Text(t) => {
                    text.push_str(&t);
                    continue;
                }
                Piece::Call { index, id, name } => {
                    call_delta(index, Some((id, name)), String::new())
                }
                Piece::Args { index, text } => call_delta(index, None, text),
            };
            let delta = Delta {
                tool_calls: Some(vec![call]),
                ..Delta::default()
            };
            let chunk = self
                .ctx
                .header
                .chunk(&self.ctx.tokenizer, index, delta, &[], None, 0);
            sse(&chunk, out);
        }
        (text, finish)
    }

    fn on_update(&mut self, u: Update) -> Bytes {
        let mut out = Vec::new();
        let (index, text, tokens, finish) = match u {
            Update::Prompt { index, entries } => {
                let ids = self.prompt_ids.get(index as usize).cloned().flatten();
                let prompt = ids.map(|ids| PromptLps { ids, entries });
                self.open(index, &mut out, prompt);
                return Bytes::from(out);
            }
            Update::Token { index, text, token } => {
                if !std::mem::replace(&mut self.ttft, true) {
                    self.ctx.request.observe_ttft();
                }
                (index, text, vec![token], None)
            }
            Update::Finish {
                index,
                text,
                reason,
                completion_tokens,
            } => {
                self.usage = Usage {
                    completion_tokens: self.usage.completion_tokens + completion_tokens,
                    total_tokens: self.usage.total_tokens + completion_tokens,
                    ..self.usage
                };
                (index, text, vec![], Some(reason))
            }
        };
        self.open(index, &mut out, None);
        let i = index as usize;
        let (text, finish) = self.split_calls(index, text, finish.map(str::to_string), &mut out);
        if let Some(reason) = &finish {
            self.finish_reasons.push(reason.clone());
        }
        let wants_logprobs = !matches!(self.ctx.header.logprobs, LogprobMode::None);
        if text.is_empty() && finish.is_none() && !wants_logprobs {
            return Bytes::from(out);
        }
        let offset = self.offsets.get(i).copied().unwrap_or(0);
        if let Some(o) = self.offsets.get_mut(i) {
            *o += text.len() as u32;
        }
        let delta = Delta {
            role: None,
            content: (!text.is_empty() || self.ctx.header.format == Format::Completion)
                .then_some(text),
            tool_calls: None,
        };
        let chunk = self.ctx.header.chunk(
            &self.ctx.tokenizer,
            index,
            delta,
            &tokens,
            finish.as_deref(),
            offset,
        );
        sse(&chunk, &mut out);
        Bytes::from(out)
    }

    fn on_error(&mut self, e: ApiError) -> Bytes {
        tracing::warn!(request_id = %self.ctx.header.id, "stream failed: {e}");
        self.ctx.request.fail(&e);
        let mut out = Vec::new();
        sse(&e.body(), &mut out);
        out.extend_from_slice(b"data: [DONE]\n\n");
        Bytes::from(out)
    }

    fn end(&mut self) -> Bytes {
        let mut out = Vec::new();
        if self.ctx.header.include_usage {
            sse(&self.ctx.header.usage_chunk(self.usage), &mut out);
        }
        out.extend_from_slice(b"data: [DONE]\n\n");
        self.ctx.request.count_tokens(self.usage);
        self.ctx.request.record_finish_reasons(&self.finish_reasons);
        self.ctx.request.succeed();
        Bytes::from(out)
    }
}

/// One streamed piece of a call: the first carries its id, type and name.
fn call_delta(index: u32, start: Option<(String, String)>, arguments: String) -> ToolCallDelta {
    let (id, name) = start.unzip();
    ToolCallDelta {
        index,
        kind: id.as_ref().map(|_| "function".to_string()),
        id,
        function: FunctionCallDelta { name, arguments },
    }
}
