//! Relaying one sequence's decode stream to its client, until it ends, the
//! prefill fails, the deadline passes or the client goes away; and timing
//! the stages on the way.

use std::sync::Arc;
use std::time::{Duration, Instant};

use pdserve_protocol::internal::{GenerateEvent, Pool, PrefillResult};
use pdserve_runtime::metrics::labels;
use tokio::sync::mpsc;

use super::{AbortOnDropResult, Decode, Dispatcher, SeqEvent};
use crate::error::ApiError;

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
}

type Prefill = Result<Result<PrefillResult, ApiError>, tokio::task::JoinError>;

/// What woke the pump up.
enum Step {
    Prefill(Prefill),
    Decode(Result<GenerateEvent, ApiError>),
}

/// One sequence's relay.
pub(super) struct Pump {
    dispatcher: Arc<Dispatcher>,
    decode: Decode,
    prefill: Option<AbortOnDropResult>,
    tx: mpsc::Sender<Result<SeqEvent, ApiError>>,
    deadline: tokio::time::Instant,
    timing: Timing,
}

impl Pump {
    pub(super) fn new(
        dispatcher: Arc<Dispatcher>,
        decode: Decode,
        prefill: Option<AbortOnDropResult>,
        tx: mpsc::Sender<Result<SeqEvent, ApiError>>,
        deadline: tokio::time::Instant,
    ) -> Self {
        let timing = Timing {
            reserved: Instant::now(),
            local: prefill.is_none(),
            first_token: None,
            prefilled: None,
        };
        Self {
            dispatcher,
            decode,
            prefill,
            tx,
            deadline,
            timing,
        }
    }

    /// Relays events until the sequence ends or fails, or the client goes away.
    pub(super) async fn run(mut self) {
        loop {
            let Some(event) = self.next().await else {
                return;
            };
            let Some(out) = self.translate(event) else {
                continue;
            };
            let done = !matches!(out, Ok(SeqEvent::Token { .. }));
            if done && out.is_ok() {
                self.settle_prefill().await;
            }
            if self.tx.send(out).await.is_err() || done {
                return;
            }
        }
    }

    /// The next event of the decode stream, or the prefill's failure;
    /// `None` once the client has gone away.
    async fn next(&mut self) -> Option<Result<GenerateEvent, ApiError>> {
        loop {
            let reading = self.decode.reader.next::<GenerateEvent>();
            let step = tokio::select! {
                biased;
                _ = self.tx.closed() => return None,
                r = prefill_answer(&mut self.prefill), if self.prefill.is_some() => Step::Prefill(r),
                ev = tokio::time::timeout_at(self.deadline, reading) => Step::Decode(match ev {
                    Err(_) => Err(ApiError::Deadline(self.dispatcher.cfg.request_timeout.as_secs())),
                    Ok(Ok(Some(ev))) => Ok(ev),
                    Ok(Ok(None)) | Ok(Err(_)) => Err(self.broken()),
                }),
            };
            match step {
                Step::Decode(event) => return Some(event),
                Step::Prefill(r) => {
                    self.prefill = None;
                    match r {
                        Ok(Ok(_)) => self.timing.prefill_answered(&self.dispatcher),
                        Ok(Err(e)) => return Some(Err(e)),
                        Err(_) => {
                            return Some(Err(ApiError::Internal("the prefill task failed".into())))
                        }
                    }
                }
            }
        }
    }

    /// The decode worker's stream broke: it is marked down.
    fn broken(&self) -> ApiError {
        let url = &self.decode.url;
        self.dispatcher.registry.mark_down(url);
        let message = format!("{url}: the token stream broke");
        self.dispatcher.upstream(Pool::Decode, message)
    }

    /// A decode event as the client's sequence sees it; `None` for none.
    fn translate(
        &mut self,
        event: Result<GenerateEvent, ApiError>,
    ) -> Option<Result<SeqEvent, ApiError>> {
        let event = match event {
            Ok(event) => event,
            Err(e) => return Some(Err(e)),
        };
        Some(match event {
            GenerateEvent::Reserved { .. } => return None,
            GenerateEvent::Token {
                id,
                logprob,
                top_logprobs,
            } => {
                self.timing.token(&self.dispatcher);
                Ok(SeqEvent::Token {
                    id,
                    logprob,
                    top_logprobs,
                })
            }
            GenerateEvent::Finished {
                reason,
                prompt_tokens,
                completion_tokens,
            } => Ok(SeqEvent::Finished {
                reason,
                prompt_tokens,
                completion_tokens,
            }),
            GenerateEvent::Error(e) => Err(self.dispatcher.worker_error(Pool::Decode, e)),
        })
    }

    /// The KV arrived (the decode finished), but the prefill worker's answer
    /// may still be on its way: let it land, for the stage metrics, rather
    /// than cancel a finished job.
    async fn settle_prefill(&mut self) {
        if let Some(mut p) = self.prefill.take() {
            if let Ok(Ok(Ok(_))) = tokio::time::timeout(Duration::from_secs(2), &mut p.0).await {
                self.dispatcher
                    .observe_stage(labels::STAGE_FIRST_DECODE, 0.0);
            }
        }
    }
}

/// The prefill task's answer (call it only while there is one).
async fn prefill_answer(prefill: &mut Option<AbortOnDropResult>) -> Prefill {
    match prefill {
        Some(p) => (&mut p.0).await,
        None => std::future::pending().await,
    }
}
