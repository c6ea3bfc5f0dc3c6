//! The simulated continuous batcher: one task advances every active
//! sequence by one token per step, taking the time the latency model gives
//! for the batch. Between steps it takes new sequences from a bounded
//! channel, simulates local prefill a chunk at a time, admits sequences up to
//! `max_batch`, and retires finished or disconnected ones (dropping a
//! sequence releases its KV reservation).

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use pdserve_protocol::internal::ErrorBody;
use pdserve_protocol::kvwire::KvShape;
use pdserve_protocol::prefix::PrefixDigest;
use pdserve_text::{ModelConfig, Sampled};
use pdserve_worker::decode::{
    retire, DecodeArgs, DecodeBackend, DecodeJob, DecodeMetrics, KvImport, Outcome, SeqStream,
};
use pdserve_worker::kv::KvReport;
use pdserve_worker::queue::{EngineQueue, EngineStats};
use tokio::sync::mpsc;
use tokio::time::Instant;

use crate::budget::{KvBudget, Reservation};
use crate::latency::LatencyModel;
use crate::prefix::PrefixCache;
use crate::shape::MockShape;
use crate::tokens::sample_for;

type Job = DecodeJob<Reservation>;

/// Batcher settings.
#[derive(Debug, Clone)]
pub struct BatcherConfig {
    /// Batch size, KV budget, prefill chunk and queue length.
    pub limits: DecodeArgs,
    pub latency: LatencyModel,
}

/// The simulated engine as the worker layer's backend: a KV budget in
/// tokens and the batcher task.
pub struct MockDecode {
    shape: MockShape,
    budget: Arc<KvBudget>,
    cache: PrefixCache,
    queue: EngineQueue<Job>,
}

impl MockDecode {
    /// Starts the batcher task (on the current tokio runtime).
    pub fn spawn(shape: MockShape, cfg: BatcherConfig, metrics: Arc<DecodeMetrics>) -> Self {
        let (queue, rx) = EngineQueue::new(cfg.limits.max_queue);
        let budget = KvBudget::new(cfg.limits.kv_cache_tokens as u64);
        let cache = PrefixCache::new(
            &cfg.limits.kv,
            cfg.limits.kv_cache_tokens,
            shape.kv.fingerprint,
        );
        let batcher = Batcher {
            vocab: shape.vocab,
            cfg,
            metrics,
            stats: queue.stats().clone(),
            waiting: VecDeque::new(),
            active: Vec::new(),
            step_secs: 0.0,
        };
        tokio::spawn(batcher.run(rx));
        Self {
            shape,
            budget,
            cache,
            queue,
        }
    }

    pub fn shape(&self) -> &MockShape {
        &self.shape
    }
}

impl DecodeBackend for MockDecode {
    type Kv = Reservation;

    fn config(&self) -> &ModelConfig {
        &self.shape.config
    }

    fn kv_shape(&self) -> KvShape {
        self.shape.kv
    }

    /// The whole of prompt + `max_tokens` up front (the mock has no blocks
    /// to grow), holding what the simulated prefix cache has of the prompt.
    fn reserve(&self, prompt: &[u32], max_tokens: u32) -> Result<Reservation, ErrorBody> {
        let tokens = prompt.len() as u64 + u64::from(max_tokens);
        let kv = self.budget.reserve(tokens)?;
        Ok(kv.with_cached(self.cache.lookup(prompt)))
    }

    fn submit(&self, job: Job) -> Result<(), ErrorBody> {
        let tokens = (job.prompt.len() - job.kv.cached()) as u64;
        self.cache.insert(&job.prompt);
        self.queue.submit(job, tokens)
    }

    fn stats(&self) -> &EngineStats {
        self.queue.stats()
    }

    fn kv_usage(&self) -> KvReport {
        self.cache
            .report(self.budget.used(), self.budget.capacity())
    }

    fn prefix_digest(&self) -> Option<PrefixDigest> {
        self.cache.digest()
    }
}

struct Seq {
    stream: SeqStream,
    /// Prompt tokens whose prefill has been simulated.
    prefilled: u32,
    /// Whether the first token is out (the sequence can join the batch).
    started: bool,
    _kv: Reservation,
}

struct Batcher {
    vocab: u32,
    cfg: BatcherConfig,
    metrics: Arc<DecodeMetrics>,
    stats: Arc<EngineStats>,
    waiting: VecDeque<Seq>,
    active: Vec<Seq>,
    /// Seconds the last step took.
    step_secs: f64,
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
            // At most --max-queue waiting sequences, as the real engine.
            while self.waiting.len() < self.cfg.limits.max_queue.max(1) {
                match rx.try_recv() {
                    Ok(job) => self.intake(job),
                    Err(_) => break,
                }
            }
            self.iteration().await;
            self.publish();
        }
    }

    fn intake(&mut self, job: Job) {
        // As queued: the prompt tokens the prefix cache did not hold.
        self.stats
            .taken((job.prompt.len() - job.kv.cached()) as u64, true);
        let prompt_len = job.prompt.len() as u32;
        let mut seq = Seq {
            prefilled: job.kv.cached() as u32,
            stream: SeqStream::new(job.request_id, prompt_len, job.sampling, job.events),
            started: false,
            _kv: job.kv,
        };
        if let Some(first) = job.first {
            seq.prefilled = prompt_len;
            if let Outcome::Done = self.emit(&mut seq, first) {
                return;
            }
        }
        self.waiting.push_back(seq);
    }

    /// One round: retire the disconnected, a prefill chunk, admission, a step.
    async fn iteration(&mut self) {
        let queues = (&mut self.active, &mut self.waiting);
        let drain = (self.stats.as_ref(), self.step_secs);
        retire(queues, |s| &s.stream, drain, &self.metrics);
        if self.active.len() < self.cfg.limits.max_batch.max(1) {
            self.prefill_chunk().await;
        }
        while self.active.len() < self.cfg.limits.max_batch.max(1) {
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
        let chunk = (seq.stream.prompt_len - seq.prefilled)
            .min(self.cfg.limits.prefill_chunk_tokens.max(1) as u32);
        pass(started, self.cfg.latency.prefill(chunk as usize)).await;
        self.metrics
            .prefill_chunk(chunk as usize, started.elapsed().as_secs_f64());
        let seq = &mut self.waiting[i];
        seq.prefilled += chunk;
        if seq.prefilled < seq.stream.prompt_len {
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
        let context: u64 = self.active.iter().map(|s| s.stream.position()).sum();
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
        self.step_secs = secs;
        self.metrics.step(n, secs);
        self.stats.record_rate(n, secs);
    }

    fn next_token(&self, seq: &Seq) -> Sampled {
        sample_for(&seq.stream.spec, self.vocab, seq.stream.position())
    }

    /// Streams a token and decides whether the sequence goes on (a mock
    /// has no end-of-sequence token: only stop tokens and `max_tokens`).
    fn emit(&self, seq: &mut Seq, s: Sampled) -> Outcome {
        seq.started = true;
        seq.stream.emit(s, None, &self.metrics)
    }

    fn publish(&self) {
        let waiting_tokens: u32 = self
            .waiting
            .iter()
            .map(|s| s.stream.prompt_len - s.prefilled)
            .sum();
        self.metrics.publish(
            &self.stats,
            self.active.len(),
            self.waiting.len(),
            u64::from(waiting_tokens),
        );
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
