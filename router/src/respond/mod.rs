//! From prepared prompts to an HTTP response: start every choice's sequence,
//! then either collect them into one JSON object or stream SSE chunks as
//! tokens arrive. Errors before the first token get a real HTTP status;
//! later ones become an SSE error event.

pub mod choice;
pub mod render;

use std::convert::Infallible;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Instant;

use axum::body::Body;
use axum::http::header;
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use futures_util::stream::{self, select_all, BoxStream, StreamExt};
use pdserve_engine::stop::StopMatcher;
use pdserve_engine::Tokenizer;
use pdserve_protocol::openai::{Delta, Usage};
use pdserve_runtime::metrics::labels;
use serde_json::Value;

use crate::dispatch::{Dispatcher, SequenceRequest};
use crate::error::ApiError;
use crate::frontend::Prepared;
use crate::metrics::RouterMetrics;
use choice::{Choice, Update};
use render::{ChoiceResult, Format, Header};

/// One request's context on the way back.
pub struct Ctx {
    pub header: Header,
    pub endpoint: &'static str,
    pub started: Instant,
    pub tokenizer: Arc<Tokenizer>,
    pub metrics: Arc<RouterMetrics>,
    /// Counts the request in flight until the response is finished.
    pub permit: crate::http::InFlight,
}

/// Starts `n` sequences per prompt; all or none (a failure cancels the rest).
pub async fn start_choices(
    dispatcher: &Arc<Dispatcher>,
    ctx: &Ctx,
    prepared: &Prepared,
) -> Result<Vec<Choice>, ApiError> {
    let n = prepared.params.n;
    let mut starts = Vec::new();
    for (p, plan) in prepared.prompts.iter().enumerate() {
        for i in 0..n {
            let index = p as u32 * n + i;
            let req = SequenceRequest {
                request_id: format!("{}-{index}", ctx.header.id),
                prompt: plan.tokens.clone(),
                sampling: prepared.params.for_choice(i, plan.max_tokens),
            };
            starts.push(async move { (index, dispatcher.start(req).await) });
        }
    }
    let mut choices = Vec::with_capacity(starts.len());
    for (index, seq) in futures_util::future::join_all(starts).await {
        let stop = StopMatcher::new(prepared.params.stop.clone())
            .map_err(|e| ApiError::invalid("stop", e.to_string()))?;
        choices.push(Choice::new(
            index,
            seq?,
            stop,
            ctx.tokenizer.clone(),
            ctx.metrics.clone(),
        ));
    }
    Ok(choices)
}

fn prompt_usage(prepared: &Prepared) -> u32 {
    prepared.prompts.iter().map(|p| p.tokens.len() as u32).sum()
}

/// Collects every choice, then answers with one JSON object.
pub async fn complete(
    ctx: Ctx,
    prepared: &Prepared,
    choices: Vec<Choice>,
) -> Result<Response, ApiError> {
    let n = prepared.params.n as usize;
    let ttft = Arc::new(std::sync::Once::new());
    let runs = choices.into_iter().map(|mut c| {
        let (ttft, ctx) = (ttft.clone(), &ctx);
        async move {
            let mut r = ChoiceResult::default();
            while let Some(update) = c.next().await {
                match update? {
                    Update::Token { text, token, .. } => {
                        ttft.call_once(|| ctx.observe_ttft());
                        r.text.push_str(&text);
                        r.tokens.push(token);
                    }
                    Update::Finish {
                        text,
                        reason,
                        completion_tokens,
                        ..
                    } => {
                        r.text.push_str(&text);
                        r.finish_reason = Some(reason.to_string());
                        r.completion_tokens = completion_tokens;
                    }
                }
            }
            Ok::<_, ApiError>(r)
        }
    });
    let mut results = futures_util::future::try_join_all(runs).await?;
    for (i, r) in results.iter_mut().enumerate() {
        if let Some(echo) = prepared.prompts.get(i / n).and_then(|p| p.echo.as_ref()) {
            r.echo_len = echo.len() as u32;
            r.text.insert_str(0, echo);
        }
    }
    let completion: u32 = results.iter().map(|r| r.completion_tokens).sum();
    let usage = Usage::new(prompt_usage(prepared), completion);
    ctx.count_tokens(usage);
    let body = ctx.header.complete(&ctx.tokenizer, results, usage);
    Ok(axum::Json(body).into_response())
}

impl Ctx {
    fn observe_ttft(&self) {
        self.metrics
            .ttft
            .with_label_values(&[self.endpoint])
            .observe(self.started.elapsed().as_secs_f64());
    }

    fn count_tokens(&self, usage: Usage) {
        self.metrics
            .prompt_tokens
            .inc_by(usage.prompt_tokens as u64);
        self.metrics
            .generation_tokens
            .inc_by(usage.completion_tokens as u64);
    }
}

type Updates = BoxStream<'static, Result<Update, ApiError>>;

fn updates(c: Choice) -> Updates {
    stream::unfold(c, |mut c| async move { c.next().await.map(|u| (u, c)) }).boxed()
}

/// Streams SSE chunks. Waits for the first update so that a failure before
/// any token is still a plain HTTP error.
pub async fn stream(
    ctx: Ctx,
    prepared: &Prepared,
    choices: Vec<Choice>,
) -> Result<Response, ApiError> {
    let mut merged = select_all(choices.into_iter().map(updates));
    let first = match merged.next().await {
        Some(Ok(u)) => u,
        Some(Err(e)) => return Err(e),
        None => return Err(ApiError::Internal("no choices".into())),
    };
    let n = prepared.params.n as usize;
    let echoes: Vec<Option<String>> = (0..prepared.prompts.len() * n)
        .map(|i| prepared.prompts.get(i / n).and_then(|p| p.echo.clone()))
        .collect();
    let writer = SseWriter {
        started: vec![false; echoes.len()],
        offsets: vec![0; echoes.len()],
        echoes,
        usage: Usage::new(prompt_usage(prepared), 0),
        ttft: false,
        done: false,
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
    Ok(Response::builder()
        .header(header::CONTENT_TYPE, "text/event-stream")
        .header(header::CACHE_CONTROL, "no-cache")
        .body(Body::from_stream(body))
        .unwrap_or_else(|_| ApiError::Internal("response".into()).into_response()))
}

struct SseWriter {
    ctx: Ctx,
    started: Vec<bool>,
    offsets: Vec<u32>,
    echoes: Vec<Option<String>>,
    usage: Usage,
    ttft: bool,
    done: bool,
}

impl Drop for SseWriter {
    /// A stream dropped before its end: the client went away.
    fn drop(&mut self) {
        if !self.done {
            let m = &self.ctx.metrics;
            m.requests
                .with_label_values(&[self.ctx.endpoint, labels::STATUS_CANCELLED])
                .inc();
        }
    }
}

fn sse(value: &Value, out: &mut Vec<u8>) {
    out.extend_from_slice(b"data: ");
    out.extend_from_slice(value.to_string().as_bytes());
    out.extend_from_slice(b"\n\n");
}

impl SseWriter {
    /// The role chunk (chat) or echoed prompt (completions) opening a choice.
    fn open(&mut self, index: u32, out: &mut Vec<u8>) {
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
            },
            Format::Completion => match self.echoes[i].take() {
                Some(echo) => Delta {
                    role: None,
                    content: Some(echo),
                },
                None => return,
            },
        };
        self.offsets[i] += delta.content.as_ref().map_or(0, |c| c.len() as u32);
        sse(
            &h.chunk(&self.ctx.tokenizer, index, delta, &[], None, 0),
            out,
        );
    }

    fn on_update(&mut self, u: Update) -> Bytes {
        let mut out = Vec::new();
        let (index, text, tokens, finish) = match u {
            Update::Token { index, text, token } => {
                if !std::mem::replace(&mut self.ttft, true) {
                    self.ctx.observe_ttft();
                }
                (index, text, vec![token], None)
            }
            Update::Finish {
                index,
                text,
                reason,
                completion_tokens,
            } => {
                self.usage = Usage::new(
                    self.usage.prompt_tokens,
                    self.usage.completion_tokens + completion_tokens,
                );
                (index, text, vec![], Some(reason))
            }
        };
        self.open(index, &mut out);
        let wants_logprobs = !matches!(self.ctx.header.logprobs, crate::params::LogprobMode::None);
        if text.is_empty() && finish.is_none() && !wants_logprobs {
            return Bytes::from(out);
        }
        let i = index as usize;
        let offset = self.offsets.get(i).copied().unwrap_or(0);
        if let Some(o) = self.offsets.get_mut(i) {
            *o += text.len() as u32;
        }
        let delta = Delta {
            role: None,
            content: (!text.is_empty() || self.ctx.header.format == Format::Completion)
                .then_some(text),
        };
        let chunk =
            self.ctx
                .header
                .chunk(&self.ctx.tokenizer, index, delta, &tokens, finish, offset);
        sse(&chunk, &mut out);
        Bytes::from(out)
    }

    fn on_error(&mut self, e: ApiError) -> Bytes {
        tracing::warn!(request_id = %self.ctx.header.id, "stream failed: {e}");
        self.done = true;
        self.ctx
            .metrics
            .requests
            .with_label_values(&[self.ctx.endpoint, e.kind()])
            .inc();
        let mut out = Vec::new();
        sse(
            &serde_json::to_value(e.body()).unwrap_or(Value::Null),
            &mut out,
        );
        out.extend_from_slice(b"data: [DONE]\n\n");
        Bytes::from(out)
    }

    fn end(&mut self) -> Bytes {
        self.done = true;
        let mut out = Vec::new();
        if self.ctx.header.include_usage {
            sse(&self.ctx.header.usage_chunk(self.usage), &mut out);
        }
        out.extend_from_slice(b"data: [DONE]\n\n");
        self.ctx.count_tokens(self.usage);
        self.ctx
            .metrics
            .requests
            .with_label_values(&[self.ctx.endpoint, labels::STATUS_OK])
            .inc();
        self.ctx
            .metrics
            .duration
            .with_label_values(&[self.ctx.endpoint])
            .observe(self.ctx.started.elapsed().as_secs_f64());
        Bytes::from(out)
    }
}
