//! A sequence's stream back to its client, as every decode engine keeps it:
//! what was generated, when it ends, and the events that say so.

use std::collections::VecDeque;

use pdserve_protocol::internal::{ErrorBody, FinishReason, GenerateEvent, SamplingSpec};
use pdserve_runtime::metrics::labels;
use pdserve_text::Sampled;
use tokio::sync::mpsc;

use super::DecodeMetrics;

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

    /// Ends the sequence with `err`.
    pub fn fail(&self, err: ErrorBody, metrics: &DecodeMetrics) {
        tracing::warn!(request_id = %self.request_id, "sequence failed: {err}");
        metrics.finished(labels::STATUS_ERROR, 1);
        let _ = self.events.send(GenerateEvent::Error(err));
    }
}

/// Drops the sequences of `active` and `waiting` whose client went away,
/// counting them `cancelled` (dropping a sequence frees its KV).
pub fn retire_closed<S>(
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
