//! One choice on its way back to the client: token ids become text
//! (incrementally, never splitting UTF-8, special tokens skipped), stop
//! sequences are cut out even across token boundaries, and a matched stop
//! ends the sequence at once (dropping it cancels the decode).

use std::sync::Arc;
use std::time::Instant;

use pdserve_protocol::internal::{FinishReason, PromptLogprob};
use pdserve_text::detok::{IncrementalDecoder, TokenBytes};
use pdserve_text::stop::{StopMatcher, StopOutput};
use pdserve_text::Tokenizer;

use crate::dispatch::{SeqEvent, Sequence};
use crate::error::ApiError;
use crate::metrics::RouterMetrics;

/// A generated token with its log-probability and alternatives.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLp {
    pub id: u32,
    pub logprob: f32,
    pub top: Vec<(u32, f32)>,
}

/// What a choice contributes to the response.
#[derive(Debug, Clone, PartialEq)]
pub enum Update {
    /// The prompt's logprobs (completions' `echo` with `logprobs`), before
    /// the first token.
    Prompt {
        index: u32,
        entries: Vec<PromptLogprob>,
    },
    /// One token: the text it released (possibly empty) and its logprob.
    Token {
        index: u32,
        text: String,
        token: TokenLp,
    },
    /// The end of the choice, with the last held-back text.
    Finish {
        index: u32,
        text: String,
        reason: &'static str,
        completion_tokens: u32,
    },
}

pub fn finish_label(reason: FinishReason) -> &'static str {
    match reason {
        FinishReason::Stop => "stop",
        FinishReason::Length => "length",
    }
}

/// Text of one token for logprobs: its bytes, lossily decoded.
pub fn token_text(tokenizer: &Tokenizer, id: u32) -> (String, Vec<u8>) {
    let bytes = tokenizer.token_bytes(id).unwrap_or_default();
    (String::from_utf8_lossy(&bytes).into_owned(), bytes)
}

pub struct Choice {
    index: u32,
    seq: Option<Sequence>,
    tokenizer: Arc<Tokenizer>,
    metrics: Arc<RouterMetrics>,
    detok: IncrementalDecoder,
    stop: StopMatcher,
    tokens: u32,
    last_token: Option<Instant>,
}

impl Choice {
    pub fn new(
        index: u32,
        seq: Sequence,
        stop: StopMatcher,
        tokenizer: Arc<Tokenizer>,
        metrics: Arc<RouterMetrics>,
    ) -> Self {
        Self {
            index,
            seq: Some(seq),
            tokenizer,
            metrics,
            detok: IncrementalDecoder::new(),
            stop,
            tokens: 0,
            last_token: None,
        }
    }

    /// Leading prompt tokens its decode worker had cached (0 once finished).
    pub fn cached_tokens(&self) -> u32 {
        self.seq.as_ref().map_or(0, Sequence::cached_tokens)
    }

    /// The next update; `None` after the finish (or an error).
    pub async fn next(&mut self) -> Option<Result<Update, ApiError>> {
        let event = self.seq.as_mut()?.next().await;
        let update = match event {
            Some(Ok(SeqEvent::PromptLogprobs(entries))) => {
                return Some(Ok(Update::Prompt {
                    index: self.index,
                    entries,
                }))
            }
            Some(Ok(SeqEvent::Token {
                id,
                logprob,
                top_logprobs,
            })) => {
                let token = TokenLp {
                    id,
                    logprob,
                    top: top_logprobs,
                };
                Ok(self.on_token(token))
            }
            Some(Ok(SeqEvent::Finished {
                reason,
                completion_tokens,
                ..
            })) => Ok(self.finish(finish_label(reason), completion_tokens)),
            Some(Err(e)) => Err(e),
            None => Err(ApiError::Internal(
                "the sequence ended without finishing".into(),
            )),
        };
        if !matches!(update, Ok(Update::Token { .. })) {
            // Ends the decode (and any prefill) now.
            self.seq = None;
        }
        Some(update)
    }

    fn on_token(&mut self, token: TokenLp) -> Update {
        self.tokens += 1;
        let now = Instant::now();
        if let Some(last) = self.last_token.replace(now) {
            self.metrics
                .itl
                .observe(now.duration_since(last).as_secs_f64());
        }
        let piece = match self.tokenizer.is_special(token.id) {
            true => String::new(),
            false => self
                .detok
                .push_token(self.tokenizer.as_ref(), token.id)
                .unwrap_or_default(),
        };
        match self.stop.push(&piece) {
            StopOutput::Continue(text) => Update::Token {
                index: self.index,
                text,
                token,
            },
            StopOutput::Stopped { text, .. } => {
                let tokens = self.tokens;
                let mut fin = self.finish("stop", tokens);
                if let Update::Finish { text: rest, .. } = &mut fin {
                    *rest = text + rest;
                }
                fin
            }
        }
    }

    fn finish(&mut self, reason: &'static str, completion_tokens: u32) -> Update {
        let mut text = String::new();
        if !self.stop.is_stopped() {
            let tail = self.detok.finish();
            text = match self.stop.push(&tail) {
                StopOutput::Continue(t) => t + &self.stop.finish(),
                StopOutput::Stopped { text, .. } => text,
            };
        }
        let reason = match self.stop.is_stopped() {
            true => "stop",
            false => reason,
        };
        Update::Finish {
            index: self.index,
            text,
            reason,
            completion_tokens: completion_tokens.max(self.tokens),
        }
    }
}
