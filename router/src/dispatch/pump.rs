//! Relaying one attempt at a sequence (one decode stream, and its prefill
//! job) to the client, until it ends, fails, the deadline passes or the
//! client goes away; timing the stages on the way. A failure says whether
//! the stream may migrate ([`super::relay`]).

use std::sync::Arc;
use std::time::{Duration, Instant};

use pdserve_protocol::internal::{ErrorKind, GenerateEvent, Pool, PrefillResult};
use pdserve_runtime::metrics::labels;

use super::relay::Out;
use super::{Decode, Dispatcher, PrefillCall, SeqEvent};
use crate::error::ApiError;

/// Why a stream may move to another decode worker (the `reason` label of
/// `pdserve_migrations_total`).
pub mod reason {
    /// The connection to the decode worker failed or closed without a finish.
    pub const STREAM_BROKEN: &str = "stream_broken";
    /// The decode worker sent nothing for `--stream-idle-timeout-ms`.
    pub const IDLE_TIMEOUT: &str = "idle_timeout";
    /// A draining decode worker handed the stream back.
    pub const HANDED_BACK: &str = "handed_back";
    /// The decode worker failed the sequence with a retryable error.
    pub const WORKER_ERROR: &str = "worker_error";
    /// The prompt's prefill failed on every prefill worker tried.
    pub const PREFILL_FAILED: &str = "prefill_failed";
    /// Another stream found the worker dead or silent, or it stopped
    /// heartbeating (the router marked it down or removed it).
    pub const WORKER_LOST: &str = "worker_lost";
}

/// How often a stream checks whether its decode worker was lost.
const LOST_CHECK: Duration = Duration::from_millis(200);

/// How an attempt ended.
pub(super) enum End {
    /// The sequence finished (or failed for good), and the client has the
    /// last event; or the client went away.
    Done,
    /// The attempt failed; `Some(reason)` when another worker may go on
    /// with the stream.
    Failed(ApiError, Option<&'static str>),
}

/// When a sequence reached its milestones, for the stage metrics.
struct Timing {
    reserved: Instant,
    local: bool,
    first_token: Option<Instant>,
    prefilled: Option<Instant>,
}

impl Timing {
    /// The prefill worker answered: its KV is delivered. The answer can lag
    /// the last KV frame, so the first token may be out already.
    fn prefill_answered(&mut self, d: &Dispatcher) {
        match self.first_token {
            Some(_) => d.observe_stage(labels::STAGE_FIRST_DECODE, 0.0),
            None => self.prefilled = Some(Instant::now()),
        }
    }

    /// A token arrived; the first one ends the prefill (local) or the first decode.
    fn token(&mut self, d: &Dispatcher) {
        if self.first_token.is_some() {
            return;
        }
        self.first_token = Some(Instant::now());
        match (self.local, self.prefilled) {
            (true, _) => {
                d.observe_stage(labels::STAGE_PREFILL, self.reserved.elapsed().as_secs_f64())
            }
            (false, Some(t)) => {
                d.observe_stage(labels::STAGE_FIRST_DECODE, t.elapsed().as_secs_f64())
            }
            (false, None) => {}
        }
    }

    /// Whether the decode worker owes the next event now: a token came, or
    /// the prompt's KV is delivered. Before that the prefill's own timeouts
    /// apply (a long queue is not a dead worker).
    fn expecting(&self) -> bool {
        self.first_token.is_some() || self.prefilled.is_some()
    }
}

type Prefill = Result<PrefillResult, ApiError>;

/// What woke the pump up.
enum Step {
    Prefill(Prefill),
    Decode(Result<GenerateEvent, End>),
    ClientGone,
    Lost,
}

/// One attempt's relay.
pub(super) struct Pump {
    dispatcher: Arc<Dispatcher>,
    decode: Decode,
    prefill: Option<PrefillCall>,
    deadline: tokio::time::Instant,
    timing: Timing,
    lost_check: tokio::time::Interval,
}

impl Pump {
    pub(super) fn new(
        dispatcher: Arc<Dispatcher>,
        decode: Decode,
        prefill: Option<PrefillCall>,
        deadline: tokio::time::Instant,
    ) -> Self {
        let timing = Timing {
            reserved: Instant::now(),
            local: prefill.is_none(),
            first_token: None,
            prefilled: None,
        };
        let mut lost_check = tokio::time::interval(LOST_CHECK);
        lost_check.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        Self {
            dispatcher,
            decode,
            prefill,
            deadline,
            timing,
            lost_check,
        }
    }

    /// The decode worker of this attempt.
    pub(super) fn url(&self) -> &str {
        &self.decode.url
    }

    /// Leading prompt tokens the decode worker had cached.
    pub(super) fn cached_tokens(&self) -> u32 {
        self.decode.cached_tokens
    }

    /// Relays events to `out` until the attempt ends.
    pub(super) async fn run(&mut self, out: &mut Out) -> End {
        loop {
            let event = match self.next(out).await {
                Ok(event) => event,
                Err(end) => return end,
            };
            let finished = match event {
                GenerateEvent::Reserved { .. } => continue,
                GenerateEvent::PromptLogprobs { entries } => {
                    if !out.prompt_logprobs(entries).await {
                        return End::Done;
                    }
                    continue;
                }
                GenerateEvent::Token {
                    id,
                    logprob,
                    top_logprobs,
                } => {
                    self.timing.token(&self.dispatcher);
                    let token = SeqEvent::Token {
                        id,
                        logprob,
                        top_logprobs,
                    };
                    if !out.token(token).await {
                        return End::Done;
                    }
                    continue;
                }
                GenerateEvent::Finished {
                    reason,
                    prompt_tokens,
                    completion_tokens,
                } => (reason, prompt_tokens, completion_tokens),
                GenerateEvent::Error(e) => {
                    let reason = match e.kind {
                        ErrorKind::HandedBack => reason::HANDED_BACK,
                        _ => reason::WORKER_ERROR,
                    };
                    let err = self.dispatcher.worker_error(Pool::Decode, e);
                    let migratable = is_migratable(&err);
                    return End::Failed(err, migratable.then_some(reason));
                }
            };
            self.settle_prefill().await;
            out.finished(finished).await;
            return End::Done;
        }
    }

    /// The next event of the decode stream; `Err` for the prefill's
    /// failure, a broken or silent stream, the deadline or a client gone.
    async fn next(&mut self, out: &Out) -> Result<GenerateEvent, End> {
        loop {
            let idle = self.idle_deadline();
            let reading = self.decode.reader.next::<GenerateEvent>();
            let step = tokio::select! {
                biased;
                _ = out.closed() => Step::ClientGone,
                _ = self.lost_check.tick() => Step::Lost,
                r = prefill_answer(&mut self.prefill), if self.prefill.is_some() => Step::Prefill(r),
                ev = tokio::time::timeout_at(idle, reading) => Step::Decode(match ev {
                    Err(_) => Err(self.silent()),
                    Ok(Ok(Some(ev))) => Ok(ev),
                    Ok(Ok(None)) | Ok(Err(_)) => Err(self.broken()),
                }),
            };
            match step {
                Step::ClientGone => return Err(End::Done),
                Step::Lost if self.dispatcher.registry.is_lost(&self.decode.url) => {
                    let message = format!("{}: the worker was lost", self.decode.url);
                    let err = self.dispatcher.upstream(Pool::Decode, message);
                    return Err(End::Failed(err, Some(reason::WORKER_LOST)));
                }
                Step::Lost => {}
                Step::Decode(event) => return event,
                Step::Prefill(r) => {
                    self.prefill = None;
                    match r {
                        Ok(_) => self.timing.prefill_answered(&self.dispatcher),
                        Err(e) => {
                            let migratable = is_migratable(&e);
                            let reason = migratable.then_some(reason::PREFILL_FAILED);
                            return Err(End::Failed(e, reason));
                        }
                    }
                }
            }
        }
    }

    /// The request's deadline, or sooner the idle limit when the worker owes
    /// the next event.
    fn idle_deadline(&self) -> tokio::time::Instant {
        match self.dispatcher.cfg.migration.idle_timeout {
            Some(idle) if self.timing.expecting() => {
                self.deadline.min(tokio::time::Instant::now() + idle)
            }
            _ => self.deadline,
        }
    }

    /// Nothing came in time: the request's deadline (final), or a stream
    /// gone silent (it may migrate). The worker is quarantined only when
    /// its heartbeats or polls stopped too: a worker that still reports is
    /// slow for this stream, not dead for all of them.
    fn silent(&self) -> End {
        if tokio::time::Instant::now() >= self.deadline {
            let secs = self.dispatcher.cfg.request_timeout.as_secs();
            return End::Failed(ApiError::Deadline(secs), None);
        }
        let url = &self.decode.url;
        let idle = self
            .dispatcher
            .cfg
            .migration
            .idle_timeout
            .unwrap_or_default();
        let registry = &self.dispatcher.registry;
        if !registry.heard_within(url, idle) {
            registry.mark_down(url);
        }
        let message = format!("{url}: the token stream went silent");
        let err = self.dispatcher.upstream(Pool::Decode, message);
        End::Failed(err, Some(reason::IDLE_TIMEOUT))
    }

    /// The decode worker's stream broke: it is marked down.
    fn broken(&self) -> End {
        let url = &self.decode.url;
        self.dispatcher.registry.mark_down(url);
        let message = format!("{url}: the token stream broke");
        let err = self.dispatcher.upstream(Pool::Decode, message);
        End::Failed(err, Some(reason::STREAM_BROKEN))
    }

    /// The KV arrived (the decode finished), but the prefill worker's answer
    /// may still be on its way: let it land, for the stage metrics, rather
    /// than cancel a finished job.
    async fn settle_prefill(&mut self) {
        if let Some(p) = self.prefill.take() {
            if let Ok(Ok(_)) = tokio::time::timeout(Duration::from_secs(2), p).await {
                self.dispatcher
                    .observe_stage(labels::STAGE_FIRST_DECODE, 0.0);
            }
        }
    }
}

/// Whether another attempt may succeed where this error ended one: a
/// worker or a pool failed, not the request nor its deadline.
pub(super) fn is_migratable(e: &ApiError) -> bool {
    matches!(
        e,
        ApiError::Upstream { .. } | ApiError::Busy { .. } | ApiError::NoWorker(_)
    )
}

/// The prefill call's answer (call it only while there is one).
async fn prefill_answer(prefill: &mut Option<PrefillCall>) -> Prefill {
    match prefill {
        Some(p) => p.as_mut().await,
        None => std::future::pending().await,
    }
}
