//! A sequence's stream back to its client, as every decode engine keeps it:
//! what was generated, when it ends, and the events that say so.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use pdserve_protocol::internal::{
    ErrorBody, ErrorKind, FinishReason, GenerateEvent, PromptLogprob, SamplingSpec,
};
use pdserve_runtime::metrics::labels;
use pdserve_text::Sampled;
use tokio::sync::mpsc;

use super::DecodeMetrics;
use crate::queue::EngineStats;

/// What happened to a sequence after a token.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    Continue,
    Done,
}

/// The bookkeeping of one sequence's output.
pub struct SeqStream {
    pub request_id: String,
    pub prompt_len: u32,
    pub spec: SamplingSpec,
    /// Tokens sampled so far.
    pub generated: u32,
    events: mpsc::UnboundedSender<GenerateEvent>,
}

impl SeqStream {
    pub fn new(
        request_id: String,
        prompt_len: u32,
        spec: SamplingSpec,
        events: mpsc::UnboundedSender<GenerateEvent>,
    ) -> Self {
        Self {
            request_id,
            prompt_len,
            spec,
            generated: 0,
            events,
        }
    }

    /// The client went away: the sequence can be dropped.
    pub fn is_closed(&self) -> bool {
        self.events.is_closed()
    }

    /// The position of the next token: the tokens before it.
    pub fn position(&self) -> u64 {
        u64::from(self.prompt_len) + u64::from(self.generated)
    }

    /// Streams a sampled token and decides whether the sequence goes on:
    /// `eos` (unless `ignore_eos`) or a stop token ends it without being
    /// streamed, as does reaching `max_tokens` after it.
    pub fn emit(&mut self, s: Sampled, eos: Option<u32>, metrics: &DecodeMetrics) -> Outcome {
        self.generated += 1;
        metrics.generation_tokens.inc();
        let stop = (!self.spec.ignore_eos && Some(s.token) == eos)
            || self.spec.stop_token_ids.contains(&s.token);
        if !stop {
            let event = GenerateEvent::Token {
                id: s.token,
                logprob: s.logprob,
                top_logprobs: s.top_logprobs,
            };
            if self.events.send(event).is_err() {
                metrics.finished(labels::STATUS_CANCELLED, 1);
                return Outcome::Done;
            }
        }
        let reason = match (stop, self.generated >= self.spec.max_tokens) {
            (true, _) => FinishReason::Stop,
            (false, true) => FinishReason::Length,
            (false, false) => return Outcome::Continue,
        };
        let _ = self.events.send(GenerateEvent::Finished {
            reason,
            prompt_tokens: self.prompt_len,
            completion_tokens: self.generated,
        });
        metrics.finished(labels::STATUS_OK, 1);
        tracing::debug!(request_id = %self.request_id, ?reason, tokens = self.generated, "sequence finished");
        Outcome::Done
    }

    /// Gives the unfinished sequence back to the router, which continues
    /// it on another worker (the worker is draining).
    pub fn hand_back(&self, metrics: &DecodeMetrics) {
        tracing::info!(request_id = %self.request_id, generated = self.generated, "draining: stream handed back");
        metrics.finished(labels::STATUS_HANDED_BACK, 1);
        let err = ErrorBody::retryable(
            ErrorKind::HandedBack,
            "the decode worker is draining: continue the stream elsewhere",
        );
        let _ = self.events.send(GenerateEvent::Error(err));
    }

    /// Ends the sequence with `err`.
    /// Sends the prompt's logprobs, before the first token.
    pub fn prompt_logprobs(&self, entries: Vec<PromptLogprob>) {
        let _ = self.events.send(GenerateEvent::PromptLogprobs { entries });
    }

    pub fn fail(&self, err: ErrorBody, metrics: &DecodeMetrics) {
        tracing::warn!(request_id = %self.request_id, "sequence failed: {err}");
        metrics.finished(labels::STATUS_ERROR, 1);
        let _ = self.events.send(GenerateEvent::Error(err));
    }
}

/// Between two steps: drops the sequences whose client went away and, while
/// the worker drains (see [`EngineStats::start_drain`]), hands back those
/// that cannot finish in time at `step_secs` a token.
pub fn retire<S>(
    (active, waiting): (&mut Vec<S>, &mut VecDeque<S>),
    stream: impl Fn(&S) -> &SeqStream + Copy,
    (stats, step_secs): (&EngineStats, f64),
    metrics: &DecodeMetrics,
) {
    retire_closed(active, waiting, stream, metrics);
    if let Some(deadline) = stats.drain_deadline() {
        hand_back((active, waiting), stream, (deadline, step_secs), metrics);
    }
}

/// Drops the sequences of `active` and `waiting` whose client went away,
/// counting them `cancelled` (dropping a sequence frees its KV).
fn retire_closed<S>(
    active: &mut Vec<S>,
    waiting: &mut VecDeque<S>,
    stream: impl Fn(&S) -> &SeqStream,
    metrics: &DecodeMetrics,
) {
    let before = active.len() + waiting.len();
    active.retain(|s| !stream(s).is_closed());
    waiting.retain(|s| !stream(s).is_closed());
    let gone = before - active.len() - waiting.len();
    metrics.finished(labels::STATUS_CANCELLED, gone as u64);
}

/// How long before the drain deadline the last streams are handed back, so
/// that the router has them before the worker closes their connections.
pub const HANDBACK_MARGIN: Duration = Duration::from_millis(500);

/// While draining to `deadline`: hands back every sequence that would not
/// reach `max_tokens` before the deadline (less [`HANDBACK_MARGIN`]) at
/// `step_secs` a token (the rest finish here), and at the margin whatever
/// still runs or waits.
fn hand_back<S>(
    (active, waiting): (&mut Vec<S>, &mut VecDeque<S>),
    stream: impl Fn(&S) -> &SeqStream,
    (deadline, step_secs): (Instant, f64),
    metrics: &DecodeMetrics,
) {
    let cutoff = deadline.checked_sub(HANDBACK_MARGIN).unwrap_or(deadline);
    let now = Instant::now();
    let keep = |s: &S| {
        let s = stream(s);
        let left = s.spec.max_tokens.saturating_sub(s.generated);
        let secs = f64::from(left) * step_secs.max(0.0);
        let in_time = now < cutoff && now + Duration::from_secs_f64(secs.min(1e6)) < cutoff;
        if !in_time {
            s.hand_back(metrics);
        }
        in_time
    };
    waiting.retain(&keep);
    active.retain(keep);
}
