//! The seam between HTTP and scheduling: [`Dispatcher::start`] places one
//! sequence (a prompt and its sampling) on the pools and returns a stream of
//! its tokens.
//!
//! The flow (DESIGN "Processes and data flow"): pick a decode worker and open
//! its generate stream, which reserves KV; unless the prompt is prefilled
//! locally, pick a prefill worker and send it the job naming the decode
//! worker's ingest URL; retry a failed prefill on another worker; relay the
//! decode worker's tokens. Dropping the [`Sequence`] cancels everything.

use std::sync::Arc;
use std::time::{Duration, Instant};

use pdserve_protocol::internal::{
    ErrorBody, FinishReason, GenerateEvent, GenerateRequest, KvSource, Pool, PrefillEvent,
    PrefillJob, PrefillResult, PromptLogprob, SamplingSpec,
};
use pdserve_runtime::metrics::labels;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tracing::Instrument;

mod client;
pub mod placement;
mod pump;
mod relay;

use crate::config::DispatchConfig;
use crate::error::ApiError;
use crate::metrics::{pool_label, RouterMetrics};
use crate::ndjson::LineReader;
use crate::policy::prefix::cached_tokens;
use crate::policy::{Policy, RequestInfo};
use crate::registry::{Assignment, PrefillHold, Registry, WorkerView};
use pump::Pump;
use relay::Relay;

pub use pump::reason as migration_reason;

/// Events buffered between the upstream reader and the client.
const EVENT_BUFFER: usize = 64;

/// One sequence to generate.
#[derive(Debug, Clone)]
pub struct SequenceRequest {
    pub request_id: String,
    pub prompt: Vec<u32>,
    pub sampling: SamplingSpec,
    /// The decode worker to try first (a sibling choice's, whose prompt
    /// blocks it caches), when it is ready.
    pub prefer_decode: Option<String>,
    /// The decode worker not to use (the one a migrating stream left).
    pub avoid_decode: Option<String>,
}

/// What a sequence produces.
#[derive(Debug, Clone, PartialEq)]
pub enum SeqEvent {
    /// The prompt's logprobs, before the first token (when asked for).
    PromptLogprobs(Vec<PromptLogprob>),
    Token {
        id: u32,
        logprob: f32,
        top_logprobs: Vec<(u32, f32)>,
    },
    Finished {
        reason: FinishReason,
        prompt_tokens: u32,
        completion_tokens: u32,
    },
}

/// A running sequence. Dropping it cancels the decode stream and the prefill job.
pub struct Sequence {
    rx: mpsc::Receiver<Result<SeqEvent, ApiError>>,
    /// An event taken early by [`Sequence::started`].
    peeked: Option<Result<SeqEvent, ApiError>>,
    cached_tokens: u32,
    decode_url: String,
    _pump: AbortOnDrop,
}

impl Sequence {
    pub async fn next(&mut self) -> Option<Result<SeqEvent, ApiError>> {
        match self.peeked.take() {
            Some(e) => Some(e),
            None => self.rx.recv().await,
        }
    }

    /// Waits for the first event (the first token, once the prompt's KV is
    /// in the decode worker's cache), keeping it for [`Sequence::next`].
    pub async fn started(&mut self) {
        if self.peeked.is_none() {
            self.peeked = self.rx.recv().await;
        }
    }

    /// The decode worker that runs the sequence.
    pub fn decode_url(&self) -> &str {
        &self.decode_url
    }

    /// Leading prompt tokens the decode worker had cached.
    pub fn cached_tokens(&self) -> u32 {
        self.cached_tokens
    }
}

struct AbortOnDrop(JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

pub struct Dispatcher {
    pub registry: Arc<Registry>,
    client: reqwest::Client,
    cfg: DispatchConfig,
    prefill_policy: Box<dyn Policy>,
    decode_policy: Box<dyn Policy>,
    metrics: Arc<RouterMetrics>,
}

/// An opened decode stream, KV reserved.
struct Decode {
    url: String,
    reader: LineReader,
    kv_url: Option<String>,
    fingerprint: Option<u64>,
    cached_tokens: u32,
    /// The prompt is prefilled on the decode worker itself.
    local: bool,
    /// Counts the sequence on the worker until its report does.
    _assigned: Assignment,
    /// The prompt's tokens bound for the prefill pool, counted until a
    /// prefill worker's assignment counts them.
    hold: Option<PrefillHold>,
    /// The call's trace span, open while the stream is.
    _span: tracing::Span,
}

impl Dispatcher {
    pub fn new(
        registry: Arc<Registry>,
        cfg: DispatchConfig,
        policies: (Box<dyn Policy>, Box<dyn Policy>),
        metrics: Arc<RouterMetrics>,
        token: &pdserve_runtime::auth::InternalToken,
    ) -> Self {
        let client = client::worker_client(&cfg, token);
        Self {
            registry,
            client,
            cfg,
            prefill_policy: policies.0,
            decode_policy: policies.1,
            metrics,
        }
    }

    /// The client of every call to a worker (health polls included).
    pub fn client(&self) -> &reqwest::Client {
        &self.client
    }

    /// The rule that places prompts (`auto` mode's thresholds).
    fn placement_rule(&self) -> placement::Rule {
        placement::Rule {
            mode: self.cfg.mode,
            local_prefill_max_tokens: self.cfg.local_prefill_max_tokens,
            spill: self.cfg.local_prefill_spill,
        }
    }

    /// Places the sequence; returns once its KV is reserved on a decode
    /// worker. From then on a failure that another worker can fix migrates
    /// the sequence ([`relay`]).
    pub async fn start(self: &Arc<Self>, req: SequenceRequest) -> Result<Sequence, ApiError> {
        let deadline = tokio::time::Instant::now() + self.cfg.request_timeout;
        let pump = self.attempt(&req, deadline).await?;
        let (cached_tokens, decode_url) = (pump.cached_tokens(), pump.url().to_string());
        let (tx, rx) = mpsc::channel(EVENT_BUFFER);
        let relay = Relay::new(self.clone(), req, deadline, tx);
        let task = tokio::spawn(relay.run(pump).in_current_span());
        Ok(Sequence {
            rx,
            peeked: None,
            cached_tokens,
            decode_url,
            _pump: AbortOnDrop(task),
        })
    }

    /// One attempt at the sequence: a decode stream with KV reserved, and
    /// the prefill job that fills it unless the decode worker prefills.
    async fn attempt(
        self: &Arc<Self>,
        req: &SequenceRequest,
        deadline: tokio::time::Instant,
    ) -> Result<Pump, ApiError> {
        let started = Instant::now();
        let mut decode = self.open_decode(req).await?;
        self.observe_stage(
            labels::STAGE_DECODE_RESERVE,
            started.elapsed().as_secs_f64(),
        );
        let prefill = match (&decode.kv_url, decode.local) {
            (Some(kv_url), false) => {
                let target = (kv_url.as_str(), decode.fingerprint, decode.cached_tokens);
                Some(self.clone().prefill_call(req, target, decode.hold.take()))
            }
            (None, false) => {
                return Err(ApiError::Upstream {
                    pool: Pool::Decode,
                    message: "the decode worker gave no KV address".into(),
                })
            }
            (_, true) => None,
        };
        Ok(Pump::new(self.clone(), decode, prefill, deadline))
    }

    fn lease(&self) -> Duration {
        let attempts = self.cfg.prefill_retries + 1;
        self.cfg.prefill_timeout * attempts + Duration::from_secs(attempts as u64)
    }

    /// The generate request for a decode worker.
    fn generate_body(&self, req: &SequenceRequest, local: bool) -> GenerateRequest {
        GenerateRequest {
            request_id: req.request_id.clone(),
            prompt_tokens: req.prompt.clone(),
            sampling: req.sampling.clone(),
            kv_source: match local {
                true => KvSource::Local,
                false => KvSource::Remote {
                    lease_ms: self.lease().as_millis() as u64,
                },
            },
        }
    }

    /// Opens a generate stream on a decode worker, trying others when one is
    /// full or unreachable. Where the prompt is prefilled depends on how
    /// much of it the chosen worker's prefix cache lacks.
    async fn open_decode(&self, req: &SequenceRequest) -> Result<Decode, ApiError> {
        let info = RequestInfo {
            prompt_tokens: req.prompt.len() as u64,
            reserve_tokens: (req.prompt.len() + req.sampling.max_tokens as usize) as u64,
            prompt: &req.prompt,
            known_cached: None,
        };
        self.check_fits(info.reserve_tokens)?;
        let mut tried: Vec<String> = req.avoid_decode.iter().cloned().collect();
        let mut last = ApiError::NoWorker(Pool::Decode);
        for _ in 0..self.cfg.decode_attempts {
            let preferred = match tried.is_empty() {
                true => self.preferred(req.prefer_decode.as_deref()),
                false => None,
            };
            let Some(w) = preferred.or_else(|| self.pick(Pool::Decode, &info, &tried, None)) else {
                break;
            };
            tried.push(w.url.clone());
            let uncached = req.prompt.len() as u64 - cached_tokens(&w, &req.prompt);
            let place = self.placement_rule().place(&self.registry, &w, uncached)?;
            let local = place.is_local();
            let body = self.generate_body(req, local);
            // Counted from now, so requests placed while this one waits for
            // its reservation see the work: the decode worker's own prefill,
            // or the tokens bound for the prefill pool.
            let local_tokens = if local { uncached } else { 0 };
            let assigned =
                self.registry
                    .assign_with_prefill(&w.url, info.reserve_tokens, local_tokens);
            let hold = (!local).then(|| self.registry.hold_prefill(uncached));
            match self.try_decode(&w, &body, assigned).await {
                Ok(mut d) => {
                    if let placement::Placement::Local(reason) = place {
                        self.metrics
                            .local_prefills
                            .with_label_values(&[reason])
                            .inc();
                    }
                    d.hold = hold;
                    return Ok(d);
                }
                Err(e) if e.status().is_server_error() => last = e,
                Err(e) => return Err(e),
            }
        }
        Err(last)
    }

    /// A 400 for a sequence that no ready decode worker's whole KV cache
    /// could hold (when every one has reported its size): no retry can help.
    fn check_fits(&self, tokens: u64) -> Result<(), ApiError> {
        let sizes = self.registry.kv_sizes(Pool::Decode);
        let largest = sizes.iter().copied().max().unwrap_or(0);
        if sizes.is_empty() || sizes.contains(&0) || tokens <= largest {
            return Ok(());
        }
        Err(ApiError::Invalid {
            param: Some("max_tokens"),
            message: format!(
                "the prompt and max_tokens need {tokens} tokens of KV cache; the largest decode \
                 worker holds {largest}: shorten the prompt or lower max_tokens"
            ),
        })
    }

    async fn try_decode(
        &self,
        w: &WorkerView,
        body: &GenerateRequest,
        assigned: Assignment,
    ) -> Result<Decode, ApiError> {
        let url = format!("{}/v1/internal/generate", w.url);
        let span = crate::trace::worker_call("decode", &w.url);
        let reserved = async {
            let resp = self
                .post(Pool::Decode, (&w.url, &url), body, self.cfg.connect_timeout)
                .await?;
            let mut reader = LineReader::new(resp);
            let first = reader.next::<GenerateEvent>();
            let first = tokio::time::timeout(self.cfg.connect_timeout, first).await;
            Ok::<_, ApiError>((reader, first))
        };
        let (reader, first) = match reserved.instrument(span.clone()).await {
            Ok(r) => r,
            Err(e) => {
                crate::trace::record_error(&span, e.kind(), &e.to_string());
                return Err(e);
            }
        };
        let first = first
            .map_err(|_| self.upstream(Pool::Decode, format!("{} sent no reservation", w.url)))?;
        match first {
            Ok(Some(GenerateEvent::Reserved {
                kv_url,
                report_seq,
                cached_tokens,
            })) => {
                assigned.acknowledged(report_seq);
                Ok(Decode {
                    url: w.url.clone(),
                    reader,
                    kv_url,
                    fingerprint: w.fingerprint,
                    cached_tokens,
                    local: matches!(body.kv_source, KvSource::Local),
                    _assigned: assigned,
                    hold: None,
                    _span: span,
                })
            }
            Ok(Some(GenerateEvent::Error(e))) => Err(self.worker_error(Pool::Decode, e)),
            other => {
                self.registry.mark_down(&w.url);
                Err(self.upstream(
                    Pool::Decode,
                    format!("unexpected start of stream: {other:?}"),
                ))
            }
        }
    }

    /// POSTs JSON to a worker; a refusal becomes the worker's error, a
    /// connection failure marks the worker down.
    /// `within` bounds the wait for the response headers: a decode worker
    /// answers at once, a prefill worker only when the KV is delivered.
    async fn post<T: serde::Serialize>(
        &self,
        pool: Pool,
        (base, url): (&str, &str),
        body: &T,
        within: Duration,
    ) -> Result<reqwest::Response, ApiError> {
        let send = pdserve_runtime::otel::inject(self.client.post(url).json(body)).send();
        let resp = match tokio::time::timeout(within, send).await {
            Ok(Ok(r)) => r,
            // Out of file descriptors here is not the worker's fault: a
            // retryable 503, and the worker stays up.
            Ok(Err(e)) if pdserve_runtime::net::is_fd_exhaustion(&e) => {
                tracing::warn!(worker = %base, "out of file descriptors: {e}");
                return Err(ApiError::Busy {
                    pool,
                    message: "the router is out of file descriptors".into(),
                });
            }
            Ok(Err(e)) => {
                self.registry.mark_down(base);
                let e = pdserve_runtime::net::error_chain(&e);
                return Err(self.upstream(pool, format!("{base}: {e}")));
            }
            Err(_) => return Err(self.upstream(pool, format!("{base} did not answer"))),
        };
        if resp.status().is_success() {
            return Ok(resp);
        }
        let status = resp.status();
        match resp.json::<ErrorBody>().await {
            Ok(e) => Err(self.worker_error(pool, e)),
            Err(_) => Err(self.upstream(pool, format!("{base} answered {status}"))),
        }
    }

    fn worker_error(&self, pool: Pool, e: ErrorBody) -> ApiError {
        let err = ApiError::from_worker(pool, e);
        self.metrics
            .worker_errors
            .with_label_values(&[pool_label(pool), err.kind()])
            .inc();
        err
    }

    fn upstream(&self, pool: Pool, message: String) -> ApiError {
        let err = ApiError::Upstream { pool, message };
        self.metrics
            .worker_errors
            .with_label_values(&[pool_label(pool), err.kind()])
            .inc();
        err
    }

    /// The decode worker at `url`, when it is ready.
    fn preferred(&self, url: Option<&str>) -> Option<WorkerView> {
        let url = url?;
        let all = self.registry.candidates(Pool::Decode, None);
        all.into_iter().find(|w| w.url == url)
    }

    /// A ready worker not tried yet (or any ready one when all were tried).
    fn pick(
        &self,
        pool: Pool,
        info: &RequestInfo,
        tried: &[String],
        fingerprint: Option<u64>,
    ) -> Option<WorkerView> {
        let all = self.registry.candidates(pool, fingerprint);
        let fresh: Vec<WorkerView> = all
            .iter()
            .filter(|w| !tried.contains(&w.url))
            .cloned()
            .collect();
        let set = match (fresh.is_empty(), pool) {
            (false, _) => fresh,
            // Every prefill worker was tried: any but the one that just
            // failed. A decode worker that refused is not asked twice.
            (true, Pool::Prefill) => all
                .into_iter()
                .filter(|w| tried.last() != Some(&w.url))
                .collect(),
            (true, Pool::Decode) => return None,
        };
        let policy = match pool {
            Pool::Prefill => &self.prefill_policy,
            Pool::Decode => &self.decode_policy,
        };
        policy.select(&set, info).and_then(|i| set.get(i).cloned())
    }

    /// The prefill job for the decode worker at `kv_url` (with
    /// `fingerprint`), which holds the first `cached_tokens` of the prompt.
    /// The attempt's relay polls it: it starts on the relay's first poll,
    /// and dropping it cancels the call. (As a task of its own it started
    /// late under load: the relay's task, spawned right after it, took the
    /// slot tokio runs next and sent it behind everything queued.)
    fn prefill_call(
        self: Arc<Self>,
        req: &SequenceRequest,
        (kv_url, fingerprint, cached_tokens): (&str, Option<u64>, u32),
        hold: Option<PrefillHold>,
    ) -> PrefillCall {
        let job = PrefillJob {
            request_id: req.request_id.clone(),
            prompt_tokens: req.prompt.clone(),
            sampling: req.sampling.clone(),
            kv_destination: kv_url.to_string(),
            deadline_ms: self.cfg.prefill_timeout.as_millis() as u64,
            cached_tokens,
        };
        Box::pin(async move { self.prefill(job, fingerprint, hold).await }.in_current_span())
    }

    /// Runs the job on a prefill worker, retrying retryable failures on others.
    async fn prefill(
        &self,
        job: PrefillJob,
        fingerprint: Option<u64>,
        mut hold: Option<PrefillHold>,
    ) -> Result<PrefillResult, ApiError> {
        let info = RequestInfo {
            prompt_tokens: job.prompt_tokens.len() as u64,
            reserve_tokens: 0,
            prompt: &job.prompt_tokens,
            known_cached: None,
        };
        let mut tried = Vec::new();
        let mut last = ApiError::NoWorker(Pool::Prefill);
        for attempt in 0..=self.cfg.prefill_retries {
            if attempt > 0 {
                self.metrics.prefill_retries.inc();
                tokio::time::sleep(Duration::from_millis(50 << attempt.min(5))).await;
            }
            let Some(w) = self.pick(Pool::Prefill, &info, &tried, fingerprint) else {
                continue;
            };
            tried.push(w.url.clone());
            let assigned = self.registry.assign(&w.url, info.prompt_tokens);
            // The worker's assignment counts the tokens from here on.
            hold.take();
            let started = Instant::now();
            let span = crate::trace::worker_call("prefill", &w.url);
            span.record("pdserve.attempt", attempt);
            let call = self.prefill_once(&w.url, &job, &assigned);
            let call = tokio::time::timeout(self.cfg.prefill_timeout, call);
            let result = call.instrument(span.clone()).await;
            match &result {
                Ok(Err(e)) => crate::trace::record_error(&span, e.kind(), &e.to_string()),
                Err(_) => crate::trace::record_error(&span, "timeout", "timed out"),
                Ok(Ok(_)) => {}
            }
            match result {
                Ok(Ok(r)) => {
                    self.observe_prefill(&r, started.elapsed());
                    let computed =
                        (job.prompt_tokens.len() as u32).saturating_sub(job.cached_tokens);
                    self.metrics.offered.prefill(r.compute_seconds, computed);
                    return Ok(r);
                }
                Ok(Err(e)) if e.status().is_server_error() => {
                    tracing::warn!(request_id = %job.request_id, worker = %w.url, "prefill failed, retrying: {e}");
                    last = e;
                }
                Ok(Err(e)) => return Err(e),
                Err(_) => {
                    tracing::warn!(request_id = %job.request_id, worker = %w.url, "prefill timed out");
                    last = self.upstream(Pool::Prefill, format!("{} timed out", w.url));
                }
            }
        }
        Err(last)
    }

    /// One attempt: the worker answers `queued` (acknowledging the job for
    /// the load accounting), then `done` once the KV is delivered.
    async fn prefill_once(
        &self,
        base: &str,
        job: &PrefillJob,
        assigned: &Assignment,
    ) -> Result<PrefillResult, ApiError> {
        let url = format!("{base}/v1/internal/prefill");
        let within = self.cfg.prefill_timeout;
        let resp = self.post(Pool::Prefill, (base, &url), job, within).await?;
        let mut reader = LineReader::new(resp);
        loop {
            match reader.next::<PrefillEvent>().await {
                Ok(Some(PrefillEvent::Queued { report_seq })) => assigned.acknowledged(report_seq),
                Ok(Some(PrefillEvent::Done(result))) => return Ok(result),
                Ok(Some(PrefillEvent::Error(e))) => return Err(self.worker_error(Pool::Prefill, e)),
                Ok(None) | Err(_) => {
                    let message = format!("{base}: the prefill answer broke off");
                    return Err(self.upstream(Pool::Prefill, message));
                }
            }
        }
    }

    fn observe_prefill(&self, r: &PrefillResult, total: Duration) {
        self.observe_stage(labels::STAGE_PREFILL_QUEUE, r.queue_seconds);
        self.observe_stage(labels::STAGE_PREFILL, r.compute_seconds);
        self.observe_stage(
            labels::STAGE_KV_TRANSFER,
            total.as_secs_f64() - r.queue_seconds - r.compute_seconds,
        );
    }

    fn observe_stage(&self, stage: &str, secs: f64) {
        self.metrics
            .stage
            .with_label_values(&[stage])
            .observe(secs.max(0.0));
    }
}

/// A prefill job's call, with its retries on other prefill workers;
/// dropping it cancels the job on the worker.
type PrefillCall =
    std::pin::Pin<Box<dyn std::future::Future<Output = Result<PrefillResult, ApiError>> + Send>>;
