//! From prepared prompts to an HTTP response: start every choice's sequence,
//! then either collect them into one JSON object or stream SSE chunks as
//! tokens arrive ([`sse`]). Errors before the first token get a real HTTP
//! status; later ones become an SSE error event. The [`Request`] travels
//! with the response and counts its outcome.

pub mod choice;
pub mod render;
mod sse;
pub mod tools;

use std::sync::Arc;

use axum::response::{IntoResponse, Response};
use pdserve_protocol::openai::Usage;
use pdserve_text::Tokenizer;

use crate::dispatch::{Dispatcher, Sequence, SequenceRequest};
use crate::error::ApiError;
use crate::frontend::Prepared;
use crate::request::Request;
use choice::{Choice, Update};
use render::{ChoiceResult, Header, PromptLps};

/// One request's context on the way back.
pub struct Ctx {
    pub header: Header,
    pub tokenizer: Arc<Tokenizer>,
    /// Counts the request in flight, and its outcome, until the response ends.
    pub request: Request,
}

/// Serves a prepared request: starts its choices, then answers with one
/// JSON object or a stream.
pub async fn respond(dispatcher: &Arc<Dispatcher>, ctx: Ctx, prepared: Prepared) -> Response {
    let choices = match start_choices(dispatcher, &ctx, &prepared).await {
        Ok(c) => c,
        Err(e) => return ctx.request.refuse(e),
    };
    match prepared.params.stream {
        true => sse::stream(ctx, &prepared, choices).await,
        false => complete(ctx, &prepared, choices).await,
    }
}

/// Starts `n` sequences per prompt; all or none (a failure cancels the rest).
async fn start_choices(
    dispatcher: &Arc<Dispatcher>,
    ctx: &Ctx,
    prepared: &Prepared,
) -> Result<Vec<Choice>, ApiError> {
    let starts = (0..prepared.prompts.len()).map(|p| start_prompt(dispatcher, ctx, prepared, p));
    let mut choices = Vec::new();
    for (index, seq) in futures_util::future::join_all(starts)
        .await
        .into_iter()
        .flatten()
    {
        choices.push(Choice::new(
            index,
            seq?,
            prepared.params.stop.clone(),
            ctx.tokenizer.clone(),
            ctx.request.metrics().clone(),
        ));
    }
    Ok(choices)
}

/// Starts the `n` choices of prompt `p`. With `n > 1` the prompt is
/// prefilled once: the first choice starts alone, and the others start on
/// its decode worker once its first token is out, taking the prompt's
/// blocks from that worker's prefix cache.
async fn start_prompt(
    dispatcher: &Arc<Dispatcher>,
    ctx: &Ctx,
    prepared: &Prepared,
    p: usize,
) -> Vec<(u32, Result<Sequence, ApiError>)> {
    let (n, plan) = (prepared.params.n, &prepared.prompts[p]);
    let req = |i: u32, prefer_decode: Option<String>| SequenceRequest {
        request_id: format!("{}-{}", ctx.header.id, p as u32 * n + i),
        prompt: plan.tokens.clone(),
        sampling: prepared.params.for_choice(i, plan.max_tokens),
        prefer_decode,
        avoid_decode: None,
    };
    let mut first = dispatcher.start(req(0, None)).await;
    let prefer = match &mut first {
        Ok(seq) if n > 1 => {
            seq.started().await;
            seq.decode_url().to_string()
        }
        _ => return vec![(p as u32 * n, first)],
    };
    let rest = (1..n).map(|i| {
        let r = req(i, Some(prefer.clone()));
        async move { (p as u32 * n + i, dispatcher.start(r).await) }
    });
    let mut all = vec![(p as u32 * n, first)];
    all.extend(futures_util::future::join_all(rest).await);
    all
}

fn prompt_usage(prepared: &Prepared) -> u32 {
    prepared.prompts.iter().map(|p| p.tokens.len() as u32).sum()
}

/// Prompt tokens served from a prefix cache: the first choice of each
/// prompt (the prompt counts once, as in `prompt_tokens`).
fn cached_usage(prepared: &Prepared, choices: &[Choice]) -> u32 {
    let n = prepared.params.n as usize;
    choices
        .iter()
        .step_by(n.max(1))
        .map(Choice::cached_tokens)
        .sum()
}

/// Collects every choice, then answers with one JSON object.
async fn complete(mut ctx: Ctx, prepared: &Prepared, choices: Vec<Choice>) -> Response {
    let cached = cached_usage(prepared, &choices);
    let ttft = std::sync::Once::new();
    let request = &ctx.request;
    let runs = choices.into_iter().map(|mut c| {
        let ttft = &ttft;
        async move {
            let mut r = ChoiceResult::default();
            while let Some(update) = c.next().await {
                match update? {
                    Update::Prompt { entries, .. } => {
                        let ids = Vec::new(); // The plan's, below.
                        r.prompt = Some(PromptLps { ids, entries });
                    }
                    Update::Token { text, token, .. } => {
                        ttft.call_once(|| request.observe_ttft());
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
    let mut results = match futures_util::future::try_join_all(runs).await {
        Ok(r) => r,
        Err(e) => return ctx.request.refuse(e),
    };
    let n = prepared.params.n as usize;
    for (i, r) in results.iter_mut().enumerate() {
        let Some(plan) = prepared.prompts.get(i / n) else {
            continue;
        };
        if let Some(echo) = &plan.echo {
            r.echo_len = echo.len() as u32;
            r.text.insert_str(0, echo);
        }
        if let Some(p) = &mut r.prompt {
            p.ids = plan.tokens.clone();
        }
    }
    let completion: u32 = results.iter().map(|r| r.completion_tokens).sum();
    let reasons: Vec<&str> = results
        .iter()
        .filter_map(|r| r.finish_reason.as_deref())
        .collect();
    ctx.request.record_finish_reasons(&reasons);
    let usage = Usage::new(prompt_usage(prepared), completion).with_cached(cached);
    ctx.request.count_tokens(usage);
    ctx.request.succeed();
    let body = ctx.header.complete(&ctx.tokenizer, results, usage);
    axum::Json(body).into_response()
}
