//! The simulated continuous batcher: one task advances every active
//! sequence by one token per step, taking the time the latency model gives
//! for the batch. Between steps it takes new sequences from a bounded
//! channel, simulates local prefill a chunk at a time, admits sequences up to
//! `max_batch`, and retires finished or disconnected ones (dropping a
//! sequence releases its KV reservation).

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use pdserve_protocol::internal::{ErrorBody, FinishReason, GenerateEvent, SamplingSpec};
use pdserve_runtime::metrics::labels;
use pdserve_runtime::queue::{try_submit, QueueGauge};
use tokio::sync::mpsc;
use tokio::time::Instant;

use crate::budget::Reservation;
use crate::latency::LatencyModel;
use crate::metrics::DecodeMetrics;
use crate::tokens::{sample, Sampled};

/// A sequence handed to the batcher.
pub struct Job {
    pub request_id: String,
    pub prompt_len: u32,
    pub sampling: SamplingSpec,
    /// The token a prefill worker sampled; `None`: prefill here.
    pub first: Option<Sampled>,
    pub events: mpsc::UnboundedSender<GenerateEvent>,
    pub kv: Reservation,
}

/// Batcher settings.
#[derive(Debug, Clone)]
pub struct BatcherConfig {
    pub max_batch: usize,
    pub prefill_chunk_tokens: usize,
    pub queue_capacity: usize,
    pub vocab: u32,
    pub latency: LatencyModel,
}

/// Counters the HTTP side reads for `/load`.
#[derive(Debug, Default)]
pub struct BatcherStats {
    pub queue: QueueGauge,
    /// Sequences taken by the batcher and not finished (prefilling, waiting or in the batch).
    pub active: AtomicU64,
    /// Tokens per second of the last step, as f64 bits.
    pub tokens_per_second: AtomicU64,
}

/// Sends sequences to the batcher.
#[derive(Clone)]
pub struct BatcherHandle {
    tx: mpsc::Sender<Job>,
    pub stats: Arc<BatcherStats>,
}

impl BatcherHandle {
    /// Starts the batcher task (on the current tokio runtime).
    pub fn spawn(cfg: BatcherConfig, metrics: Arc<DecodeMetrics>) -> Self {
        let (tx, rx) = mpsc::channel(cfg.queue_capacity.max(1));
        let stats = Arc::new(BatcherStats::default());
        let batcher = Batcher {
            cfg,
            metrics,
            stats: stats.clone(),
            waiting: VecDeque::new(),
            active: Vec::new(),
        };
        tokio::spawn(batcher.run(rx));
        Self { tx, stats }
    }

    /// Queues a sequence; a full queue or a stopped batcher is a retryable error.
    pub fn submit(&self, job: Job) -> Result<(), ErrorBody> {
        let tokens = u64::from(job.prompt_len);
        try_submit(&self.tx, &self.stats.queue, job, tokens)
    }

    /// Sequences queued or running.
    pub fn in_flight(&self) -> u64 {
        self.stats.queue.requests() + self.stats.active.load(Ordering::Relaxed)
    }
}

struct Seq {
    id: String,
    prompt_len: u32,
    spec: SamplingSpec,
    /// Prompt tokens whose prefill has been simulated.
    prefilled: u32,
    /// Whether the first token is out (the sequence can join the batch).
    started: bool,
    generated: u32,
    events: mpsc::UnboundedSender<GenerateEvent>,
    _kv: Reservation,
}

impl Seq {
    /// The position of the next token: the tokens before it.
    fn position(&self) -> u64 {
        u64::from(self.prompt_len) + u64::from(self.generated)
    }
}

enum Outcome {
    Continue,
    Done,
}

struct Batcher {
    cfg: BatcherConfig,
    metrics: Arc<DecodeMetrics>,
    stats: Arc<BatcherStats>,
    waiting: VecDeque<Seq>,
    active: Vec<Seq>,
}

impl Batcher {
    async fn run(mut self, mut rx: mpsc::Receiver<Job>) {
        loop {
            if self.waiting.is_empty() && self.active.is_empty() {
                match rx.recv().await {
                    Some(job) => self.intake(job),
                    None => return,
                }
            }
            while let Ok(job) = rx.try_recv() {
                self.intake(job);
            }
            self.iteration().await;
            self.publish();
        }
    }

    fn intake(&mut self, job: Job) {
        // Counted as active before it leaves the queue's count, so a drain
        // never sees zero in flight while the batcher holds a sequence.
        self.stats.active.fetch_add(1, Ordering::Relaxed);
        self.stats.queue.taken(u64::from(job.prompt_len));
        let mut seq = Seq {
            id: job.request_id,
            prompt_len: job.prompt_len,
            spec: job.sampling,
            prefilled: 0,
            started: false,
            generated: 0,
            events: job.events,
            _kv: job.kv,
        };
        if let Some(first) = job.first {
            seq.prefilled = seq.prompt_len;
            if let Outcome::Done = self.emit(&mut seq, first) {
                return;
            }
        }
        self.waiting.push_back(seq);
    }

    /// One round: retire the disconnected, a prefill chunk, admission, a step.
    async fn iteration(&mut self) {
        let before = self.active.len() + self.waiting.len();
        self.active.retain(|s| !s.events.is_closed());
        self.waiting.retain(|s| !s.events.is_closed());
        let gone = before - self.active.len() - self.waiting.len();
        let cancelled = self
            .metrics
            .common
            .requests
            .with_label_values(&[labels::STATUS_CANCELLED]);
        cancelled.inc_by(gone as u64);
        if self.active.len() < self.cfg.max_batch {
            self.prefill_chunk().await;
        }
        while self.active.len() < self.cfg.max_batch {
            match self.waiting.iter().position(|s| s.started) {
                Some(i) => self.active.extend(self.waiting.remove(i)),
                None => break,
            }
        }
        if !self.active.is_empty() {
            self.decode_step().await;
        }
    }

    /// Simulates the next prefill chunk of the oldest sequence that needs one.
    async fn prefill_chunk(&mut self) {
        let Some(i) = self.waiting.iter().position(|s| !s.started) else {
            return;
        };
        let started = Instant::now();
        let seq = &self.waiting[i];
        let chunk =
            (seq.prompt_len - seq.prefilled).min(self.cfg.prefill_chunk_tokens.max(1) as u32);
        pass(started, self.cfg.latency.prefill(chunk as usize)).await;
        self.metrics
            .prefill_seconds
            .observe(started.elapsed().as_secs_f64());
        self.metrics.common.prompt_tokens.inc_by(u64::from(chunk));
        let seq = &mut self.waiting[i];
        seq.prefilled += chunk;
        if seq.prefilled < seq.prompt_len {
            return;
        }
        let mut seq = self.waiting.remove(i).expect("index from position");
        let first = self.next_token(&seq);
        if let Outcome::Continue = self.emit(&mut seq, first) {
            self.waiting.insert(i, seq);
        }
    }

    async fn decode_step(&mut self) {
        let started = Instant::now();
        let n = self.active.len();
        let context: u64 = self.active.iter().map(Seq::position).sum();
        pass(started, self.cfg.latency.step(n, context)).await;
        let mut keep = Vec::with_capacity(n);
        for mut seq in std::mem::take(&mut self.active) {
            let token = self.next_token(&seq);
            if let Outcome::Continue = self.emit(&mut seq, token) {
                keep.push(seq);
            }
        }
        self.active = keep;
        let secs = started.elapsed().as_secs_f64();
        self.metrics.batch_size.observe(n as f64);
        self.metrics.step_seconds.observe(secs);
        self.stats
            .tokens_per_second
            .store((n as f64 / secs.max(1e-9)).to_bits(), Ordering::Relaxed);
    }

    fn next_token(&self, seq: &Seq) -> Sampled {
        sample(
            self.cfg.vocab,
            seq.spec.seed,
            seq.position(),
            seq.spec.top_logprobs,
        )
    }

    /// Streams a token and decides whether the sequence goes on.
    fn emit(&self, seq: &mut Seq, s: Sampled) -> Outcome {
        seq.generated += 1;
        seq.started = true;
        self.metrics.generation_tokens.inc();
        let stop = seq.spec.stop_token_ids.contains(&s.token);
        if !stop {
            let event = GenerateEvent::Token {
                id: s.token,
                logprob: s.logprob,
                top_logprobs: s.top_logprobs,
            };
            if seq.events.send(event).is_err() {
                self.metrics.common.finished(labels::STATUS_CANCELLED);
                return Outcome::Done;
            }
        }
        let reason = match (stop, seq.generated >= seq.spec.max_tokens) {
            (true, _) => FinishReason::Stop,
            (false, true) => FinishReason::Length,
            (false, false) => return Outcome::Continue,
        };
        let _ = seq.events.send(GenerateEvent::Finished {
            reason,
            prompt_tokens: seq.prompt_len,
            completion_tokens: seq.generated,
        });
        self.metrics.common.finished(labels::STATUS_OK);
        tracing::debug!(request_id = %seq.id, ?reason, tokens = seq.generated, "sequence finished");
        Outcome::Done
    }

    fn publish(&self) {
        let pool = DecodeMetrics::pool();
        let waiting_tokens: u32 = self
            .waiting
            .iter()
            .map(|s| s.prompt_len - s.prefilled)
            .sum();
        let queued = self.stats.queue.requests() as usize;
        let taken = self.active.len() + self.waiting.len();
        self.stats.active.store(taken as u64, Ordering::Relaxed);
        let m = &self.metrics;
        m.active_sequences
            .with_label_values(&pool)
            .set(self.active.len() as i64);
        let depth = &m.common.queue_depth;
        depth
            .with_label_values(&pool)
            .set((self.waiting.len() + queued) as i64);
        let depth_tokens = &m.common.queue_depth_tokens;
        depth_tokens
            .with_label_values(&pool)
            .set(i64::from(waiting_tokens));
    }
}

/// Lets the simulated time `d` pass since `started`; with no time to pass,
/// yields so that other tasks run.
async fn pass(started: Instant, d: Duration) {
    match d.is_zero() {
        true => tokio::task::yield_now().await,
        false => tokio::time::sleep_until(started + d).await,
    }
}
