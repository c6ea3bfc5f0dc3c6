//! The model thread: continuous batching over every active sequence.
//!
//! One loop owns the model. Between steps it takes new sequences from a
//! bounded channel, prefills local prompts a chunk at a time, admits ready
//! sequences into the batch, runs one batched decode step, streams each new
//! token, and retires finished or cancelled sequences at once (dropping a
//! sequence frees its KV).

use std::collections::VecDeque;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use pdserve_engine::sampler::{sample, Sampled, SamplingParams, TokenCounts};
use pdserve_engine::{Model, SeqKv};
use pdserve_protocol::internal::{ErrorBody, FinishReason, GenerateEvent, SamplingSpec};
use pdserve_runtime::metrics::labels;
use pdserve_runtime::queue::{try_submit, QueueGauge};
use tokio::sync::mpsc;

use crate::metrics::DecodeMetrics;

/// Scheduler limits.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// Sequences per decode step at most.
    pub max_batch: usize,
    /// Prompt tokens per local prefill chunk.
    pub prefill_chunk_tokens: usize,
    /// Sequences that may wait in the intake channel.
    pub queue_capacity: usize,
    /// Peak memory bandwidth, for the MBU estimate.
    pub peak_bytes_per_second: f64,
}

/// The token a prefill worker sampled after the prompt.
#[derive(Debug, Clone, PartialEq)]
pub struct FirstToken {
    pub id: u32,
    pub logprob: f32,
    pub top_logprobs: Vec<(u32, f32)>,
}

/// How a submitted sequence starts.
#[derive(Debug)]
pub enum Start {
    /// Prefill the prompt here.
    Prefill,
    /// The prompt's KV was imported; generation continues from this token.
    Imported(FirstToken),
}

/// A sequence handed to the engine.
pub struct Job {
    pub request_id: String,
    pub prompt: Vec<u32>,
    pub sampling: SamplingSpec,
    pub kv: SeqKv,
    pub start: Start,
    pub events: mpsc::UnboundedSender<GenerateEvent>,
}

/// Counters the HTTP side reads for `/load`.
#[derive(Debug, Default)]
pub struct EngineStats {
    pub queue: QueueGauge,
    pub active: AtomicU64,
    /// Generated tokens per second over the last step, as f64 bits.
    pub tokens_per_second: AtomicU64,
}

/// Sends work to the model thread.
#[derive(Clone)]
pub struct EngineHandle {
    tx: mpsc::Sender<Job>,
    pub stats: Arc<EngineStats>,
}

impl EngineHandle {
    /// Starts the model thread.
    pub fn spawn(
        model: Arc<Model>,
        eos: u32,
        cfg: EngineConfig,
        metrics: Arc<DecodeMetrics>,
    ) -> Self {
        let (tx, rx) = mpsc::channel(cfg.queue_capacity.max(1));
        let stats = Arc::new(EngineStats::default());
        let mut sched = Scheduler {
            model,
            eos,
            cfg,
            metrics,
            stats: stats.clone(),
            waiting: VecDeque::new(),
            active: Vec::new(),
        };
        std::thread::Builder::new()
            .name("pdserve-decode-engine".into())
            .spawn(move || sched.run(rx))
            .expect("spawn the engine thread");
        Self { tx, stats }
    }

    /// Queues a sequence; a full queue or a stopped engine is a retryable error.
    pub fn submit(&self, job: Job) -> Result<(), ErrorBody> {
        let tokens = job.prompt.len() as u64;
        try_submit(&self.tx, &self.stats.queue, job, tokens)
    }

    /// Sequences queued or running.
    pub fn in_flight(&self) -> u64 {
        self.stats.queue.requests() + self.stats.active.load(Ordering::Relaxed)
    }
}

struct Seq {
    id: String,
    prompt: Vec<u32>,
    spec: SamplingSpec,
    params: SamplingParams,
    kv: SeqKv,
    /// Prompt tokens already in the KV (local prefill progress).
    prefilled: usize,
    /// The last sampled token, to feed to the next step; `None` until prefilled.
    last: Option<u32>,
    generated: u32,
    history: TokenCounts,
    events: mpsc::UnboundedSender<GenerateEvent>,
}

/// What happened to a sequence after a token.
enum Outcome {
    Continue,
    Done,
}

struct Scheduler {
    model: Arc<Model>,
    eos: u32,
    cfg: EngineConfig,
    metrics: Arc<DecodeMetrics>,
    stats: Arc<EngineStats>,
    /// Sequences not yet in the batch: prefilling, or waiting for a slot.
    waiting: VecDeque<Seq>,
    active: Vec<Seq>,
}

impl Scheduler {
    fn run(&mut self, mut rx: mpsc::Receiver<Job>) {
        loop {
            if self.waiting.is_empty() && self.active.is_empty() {
                match rx.blocking_recv() {
                    Some(job) => self.intake(job),
                    None => return,
                }
            }
            while let Ok(job) = rx.try_recv() {
                self.intake(job);
            }
            let result = std::panic::catch_unwind(AssertUnwindSafe(|| self.iteration()));
            if result.is_err() {
                tracing::error!("engine iteration panicked; failing the sequences in it");
                for s in self.active.drain(..).chain(self.waiting.drain(..)) {
                    let _ = s.events.send(GenerateEvent::Error(ErrorBody::retryable(
                        "engine_panic",
                        "the engine failed",
                    )));
                }
            }
            self.publish();
        }
    }

    fn intake(&mut self, job: Job) {
        // Counted active before it leaves the queue: a drain polling
        // `in_flight` between the two must not see zero.
        self.stats.active.fetch_add(1, Ordering::Relaxed);
        self.stats.queue.taken(job.prompt.len() as u64);
        let params = SamplingParams::from(&job.sampling);
        let mut seq = Seq {
            id: job.request_id,
            prefilled: 0,
            last: None,
            generated: 0,
            history: TokenCounts::default(),
            prompt: job.prompt,
            spec: job.sampling,
            params,
            kv: job.kv,
            events: job.events,
        };
        if let Start::Imported(first) = job.start {
            seq.prefilled = seq.prompt.len();
            let sampled = Sampled {
                token: first.id,
                logprob: first.logprob,
                top_logprobs: first.top_logprobs,
            };
            if let Outcome::Done = self.emit(&mut seq, sampled) {
                return;
            }
        }
        self.waiting.push_back(seq);
    }

    /// One scheduling round: a prefill chunk, admission, a decode step.
    fn iteration(&mut self) {
        self.active.retain(|s| !s.events.is_closed());
        self.waiting.retain(|s| !s.events.is_closed());
        if self.active.len() < self.cfg.max_batch {
            self.prefill_chunk();
        }
        while self.active.len() < self.cfg.max_batch {
            match self.waiting.iter().position(|s| s.last.is_some()) {
                Some(i) => {
                    let s = self.waiting.remove(i).expect("index from position");
                    self.active.push(s);
                }
                None => break,
            }
        }
        if !self.active.is_empty() {
            self.decode_step();
        }
    }

    /// Prefills the next chunk of the oldest sequence that needs it.
    fn prefill_chunk(&mut self) {
        let Some(i) = self.waiting.iter().position(|s| s.last.is_none()) else {
            return;
        };
        let chunk = self.cfg.prefill_chunk_tokens.max(1);
        let started = Instant::now();
        let seq = &mut self.waiting[i];
        let end = (seq.prefilled + chunk).min(seq.prompt.len());
        let result = self
            .model
            .prefill(&seq.prompt[seq.prefilled..end], &mut seq.kv);
        self.metrics
            .prefill_seconds
            .observe(started.elapsed().as_secs_f64());
        let logits = match result {
            Ok(l) => l,
            Err(e) => {
                let s = self.waiting.remove(i).expect("index from position");
                self.fail(s, ErrorBody::fatal(e.kind(), e.to_string()));
                return;
            }
        };
        self.metrics
            .prompt_tokens
            .inc_by((end - seq.prefilled) as u64);
        seq.prefilled = end;
        if end < seq.prompt.len() {
            return;
        }
        let mut seq = self.waiting.remove(i).expect("index from position");
        match self.sample(&seq, &logits) {
            Ok(sampled) => {
                if let Outcome::Continue = self.emit(&mut seq, sampled) {
                    self.waiting.insert(i, seq);
                }
            }
            Err(e) => self.fail(seq, e),
        }
    }

    fn decode_step(&mut self) {
        let started = Instant::now();
        let kv_tokens: usize = self.active.iter().map(|s| s.kv.len() + 1).sum();
        let mut batch: Vec<(&mut SeqKv, u32)> = self
            .active
            .iter_mut()
            .map(|s| {
                (
                    &mut s.kv,
                    s.last.expect("active sequences have a last token"),
                )
            })
            .collect();
        let result = self.model.decode_step(&mut batch);
        let n = self.active.len();
        let logits = match result {
            Ok(l) => l,
            Err(e) => {
                tracing::error!("decode step failed: {e}");
                for s in std::mem::take(&mut self.active) {
                    self.fail(s, ErrorBody::retryable(e.kind(), e.to_string()));
                }
                return;
            }
        };
        let mut keep = Vec::with_capacity(n);
        for (i, mut seq) in std::mem::take(&mut self.active).into_iter().enumerate() {
            match self.sample(&seq, logits.row(i)) {
                Ok(sampled) => {
                    if let Outcome::Continue = self.emit(&mut seq, sampled) {
                        keep.push(seq);
                    }
                }
                Err(e) => self.fail(seq, e),
            }
        }
        self.active = keep;
        let secs = started.elapsed().as_secs_f64();
        self.metrics.batch_size.observe(n as f64);
        self.metrics.step_seconds.observe(secs);
        let bytes =
            self.model.weight_bytes() + kv_tokens * self.model.kv_layout().bytes_per_token();
        self.metrics
            .mbu
            .set(bytes as f64 / secs.max(1e-9) / self.cfg.peak_bytes_per_second.max(1.0));
        self.stats
            .tokens_per_second
            .store((n as f64 / secs.max(1e-9)).to_bits(), Ordering::Relaxed);
    }

    fn sample(&self, seq: &Seq, logits: &[f32]) -> Result<Sampled, ErrorBody> {
        let position = seq.kv.len() as u64;
        sample(logits, &seq.params, position, &seq.history)
            .map_err(|e| ErrorBody::fatal("sampling", e.to_string()))
    }

    /// Streams a sampled token and decides whether the sequence goes on.
    fn emit(&self, seq: &mut Seq, s: Sampled) -> Outcome {
        seq.generated += 1;
        seq.history.add(s.token);
        self.metrics.generation_tokens.inc();
        let stop = (!seq.spec.ignore_eos && s.token == self.eos)
            || seq.spec.stop_token_ids.contains(&s.token);
        if !stop {
            let event = GenerateEvent::Token {
                id: s.token,
                logprob: s.logprob,
                top_logprobs: s.top_logprobs,
            };
            if seq.events.send(event).is_err() {
                self.metrics
                    .requests
                    .with_label_values(&[labels::STATUS_CANCELLED])
                    .inc();
                return Outcome::Done;
            }
        }
        let reason = match (stop, seq.generated >= seq.spec.max_tokens) {
            (true, _) => FinishReason::Stop,
            (false, true) => FinishReason::Length,
            (false, false) => {
                seq.last = Some(s.token);
                return Outcome::Continue;
            }
        };
        let _ = seq.events.send(GenerateEvent::Finished {
            reason,
            prompt_tokens: seq.prompt.len() as u32,
            completion_tokens: seq.generated,
        });
        self.metrics
            .requests
            .with_label_values(&[labels::STATUS_OK])
            .inc();
        tracing::debug!(request_id = %seq.id, ?reason, tokens = seq.generated, "sequence finished");
        Outcome::Done
    }

    fn fail(&self, seq: Seq, err: ErrorBody) {
        tracing::warn!(request_id = %seq.id, "sequence failed: {err}");
        self.metrics
            .requests
            .with_label_values(&[labels::STATUS_ERROR])
            .inc();
        let _ = seq.events.send(GenerateEvent::Error(err));
    }

    fn publish(&self) {
        let pool = DecodeMetrics::pool();
        let waiting_tokens: usize = self
            .waiting
            .iter()
            .map(|s| s.prompt.len() - s.prefilled)
            .sum();
        let queued = self.stats.queue.requests() as usize;
        self.stats.active.store(
            (self.active.len() + self.waiting.len()) as u64,
            Ordering::Relaxed,
        );
        self.metrics
            .active_sequences
            .with_label_values(&pool)
            .set(self.active.len() as i64);
        self.metrics
            .queue_depth
            .with_label_values(&pool)
            .set((self.waiting.len() + queued) as i64);
        self.metrics
            .queue_depth_tokens
            .with_label_values(&pool)
            .set(waiting_tokens as i64);
    }
}
