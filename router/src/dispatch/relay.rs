//! One sequence from its first attempt to its end, across decode workers:
//! when an attempt fails in a way another worker can fix (the stream broke
//! or went silent, the worker failed or handed the stream back while
//! draining, the prefill failed), the sequence **migrates**: its prompt plus
//! every token generated so far is placed again, with `max_tokens` reduced
//! and the generated tokens marked `replayed_tokens`. Sampling is seeded by
//! (seed, absolute position), so the continuation is token for token the
//! one an unbroken run would have produced; the client sees one stream.

use std::sync::Arc;
use std::time::{Duration, Instant};

use pdserve_protocol::internal::{FinishReason, PromptLogprob, MAX_REQUEST_ID_LEN};
use tokio::sync::mpsc;

use tracing::Instrument;

use super::pump::{is_migratable, reason, End, Pump};
use super::{Dispatcher, SeqEvent, SequenceRequest};
use crate::error::ApiError;

/// Outcomes of a migration (the `outcome` label of `pdserve_migrations_total`).
mod outcome {
    /// The stream goes on on another worker.
    pub const MIGRATED: &str = "migrated";
    /// `--migration-limit` or `--migration-max-tokens` forbade it.
    pub const REFUSED: &str = "refused";
    /// No other worker could take the stream.
    pub const FAILED: &str = "failed";
}

/// The client's side of a sequence, which outlives its attempts: the
/// channel, the tokens generated so far and how many a new attempt replays.
pub(super) struct Out {
    tx: mpsc::Sender<Result<SeqEvent, ApiError>>,
    generated: Vec<u32>,
    /// Tokens of the current attempt's prompt that earlier attempts generated.
    replayed: u32,
    /// When the stream stopped moving, until the next token after a migration.
    lost_since: Option<Instant>,
    last_token: Instant,
    /// The prompt's logprobs went out (a later attempt's are dropped).
    prompt_logprobs_sent: bool,
    dispatcher: Arc<Dispatcher>,
}

impl Out {
    /// Passes the prompt's logprobs on, once; false once the client has
    /// gone away.
    pub(super) async fn prompt_logprobs(&mut self, entries: Vec<PromptLogprob>) -> bool {
        if std::mem::replace(&mut self.prompt_logprobs_sent, true) {
            return !self.tx.is_closed();
        }
        self.tx
            .send(Ok(SeqEvent::PromptLogprobs(entries)))
            .await
            .is_ok()
    }

    /// Passes a token on; false once the client has gone away.
    pub(super) async fn token(&mut self, token: SeqEvent) -> bool {
        if let SeqEvent::Token { id, .. } = &token {
            self.generated.push(*id);
        }
        let now = Instant::now();
        if let Some(since) = self.lost_since.take() {
            let lost = now.duration_since(since).as_secs_f64();
            self.dispatcher.metrics.migration.lost.observe(lost);
        }
        self.last_token = now;
        self.tx.send(Ok(token)).await.is_ok()
    }

    /// Passes the finish on, counted as the client sees the sequence: the
    /// replayed tokens are completion tokens, not prompt tokens.
    pub(super) async fn finished(
        &mut self,
        (reason, prompt, completion): (FinishReason, u32, u32),
    ) {
        let event = SeqEvent::Finished {
            reason,
            prompt_tokens: prompt.saturating_sub(self.replayed),
            completion_tokens: completion + self.replayed,
        };
        let _ = self.tx.send(Ok(event)).await;
    }

    /// Resolves when the client has gone away.
    pub(super) async fn closed(&self) {
        self.tx.closed().await
    }
}

/// A sequence's relay across its attempts.
pub(super) struct Relay {
    dispatcher: Arc<Dispatcher>,
    /// The sequence as the client asked for it.
    req: SequenceRequest,
    deadline: tokio::time::Instant,
    migrations: u32,
    out: Out,
}

impl Relay {
    pub(super) fn new(
        dispatcher: Arc<Dispatcher>,
        req: SequenceRequest,
        deadline: tokio::time::Instant,
        tx: mpsc::Sender<Result<SeqEvent, ApiError>>,
    ) -> Self {
        let out = Out {
            tx,
            generated: Vec::new(),
            replayed: 0,
            lost_since: None,
            last_token: Instant::now(),
            prompt_logprobs_sent: false,
            dispatcher: dispatcher.clone(),
        };
        Self {
            dispatcher,
            req,
            deadline,
            migrations: 0,
            out,
        }
    }

    /// Relays attempts, starting with `pump`, until the sequence ends.
    pub(super) async fn run(mut self, mut pump: Pump) {
        loop {
            let (err, reason) = match pump.run(&mut self.out).await {
                End::Done => {
                    // The client's connection task was just woken with the
                    // last event, into the slot tokio runs next. Tearing the
                    // attempt down (the worker's stream) wakes the worker
                    // connection's task, which takes that slot and sends the
                    // client's behind every other stream's token of the
                    // decode step: milliseconds at a thousand streams.
                    // Yielding first lets the last event go out.
                    tokio::task::yield_now().await;
                    return;
                }
                End::Failed(err, reason) => (err, reason),
            };
            let left = pump.url().to_string();
            // Cancels the old stream (freeing its KV) and its prefill job.
            drop(pump);
            let next = match reason {
                Some(reason) => self.migrate(reason, &left, err).await,
                None => Err(err),
            };
            match next {
                Ok(Some(p)) => pump = p,
                Ok(None) => return,
                Err(e) => {
                    let _ = self.out.tx.send(Err(e)).await;
                    return;
                }
            }
        }
    }

    /// Continues the sequence on another decode worker; `Ok(None)` when
    /// nothing was left to generate (the finish was all that was lost).
    async fn migrate(
        &mut self,
        reason: &'static str,
        left: &str,
        err: ApiError,
    ) -> Result<Option<Pump>, ApiError> {
        let generated = self.out.generated.len() as u32;
        let max_tokens = self.req.sampling.max_tokens;
        if generated >= max_tokens {
            let prompt = self.req.prompt.len() as u32 + self.out.replayed;
            let finish = (FinishReason::Length, prompt, max_tokens - self.out.replayed);
            self.out.finished(finish).await;
            return Ok(None);
        }
        let cfg = &self.dispatcher.cfg.migration;
        let context = self.req.prompt.len() + generated as usize;
        if self.migrations >= cfg.limit || context > cfg.max_tokens {
            self.count(reason, outcome::REFUSED);
            tracing::warn!(request_id = %self.req.request_id, worker = %left, reason, "stream not migrated: {err}");
            return Err(err);
        }
        self.out.lost_since = Some(self.out.last_token);
        let span = crate::trace::migration(reason, left, generated);
        let placed = self.place(reason, left, generated).instrument(span.clone());
        let pump = placed.await?;
        span.record("pdserve.migration.joined", pump.url());
        Ok(Some(pump))
    }

    /// Places the continuation, trying again (with backoff, within
    /// `--migration-limit`) while no worker can take it for now.
    async fn place(
        &mut self,
        reason: &'static str,
        left: &str,
        generated: u32,
    ) -> Result<Pump, ApiError> {
        loop {
            self.migrations += 1;
            let mut req = self.continuation();
            if reason != reason::PREFILL_FAILED {
                req.avoid_decode = Some(left.to_string());
            }
            let e = match self.dispatcher.attempt(&req, self.deadline).await {
                Ok(pump) => {
                    self.count(reason, outcome::MIGRATED);
                    self.out.replayed = generated;
                    tracing::warn!(
                        request_id = %self.req.request_id, left = %left, joined = %pump.url(),
                        reason, replayed = generated, migration = self.migrations,
                        "stream migrated"
                    );
                    return Ok(pump);
                }
                Err(e) => e,
            };
            self.count(reason, outcome::FAILED);
            tracing::warn!(request_id = %self.req.request_id, worker = %left, reason, "stream could not migrate: {e}");
            if !is_migratable(&e) || self.migrations >= self.dispatcher.cfg.migration.limit {
                return Err(e);
            }
            let backoff = Duration::from_millis(100 << self.migrations.min(5));
            tokio::time::sleep_until(self.deadline.min(tokio::time::Instant::now() + backoff))
                .await;
        }
    }

    /// The sequence from where it stands: prompt plus what was generated,
    /// the rest of `max_tokens`, under the request id with this migration's
    /// suffix. [`Relay::place`] keeps it off the worker it left when that
    /// worker failed it (a failed prefill is not the decode worker's fault:
    /// it may take the stream again, and may be the only one).
    fn continuation(&self) -> SequenceRequest {
        let generated = &self.out.generated;
        let mut req = self.req.clone();
        let suffix = format!(".m{}", self.migrations);
        let id = &self.req.request_id;
        let keep = id.len().min(MAX_REQUEST_ID_LEN - suffix.len());
        let keep = (0..=keep)
            .rev()
            .find(|&i| id.is_char_boundary(i))
            .unwrap_or(0);
        req.request_id = format!("{}{suffix}", &id[..keep]);
        req.prompt.extend_from_slice(generated);
        req.sampling.max_tokens -= generated.len() as u32;
        req.sampling.replayed_tokens += generated.len() as u32;
        // The prompt's logprobs come once, and only over the prompt itself.
        req.sampling.prompt_logprobs &= !self.out.prompt_logprobs_sent && generated.is_empty();
        req.prefer_decode = None;
        req
    }

    fn count(&self, reason: &str, outcome: &str) {
        self.dispatcher
            .metrics
            .migration
            .total
            .with_label_values(&[reason, outcome])
            .inc();
    }
}
