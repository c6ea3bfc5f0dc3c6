//! The model thread: continuous batching over every active sequence.
//!
//! One loop owns the model. Between steps it takes new sequences from a
//! bounded channel, prefills local prompts a chunk at a time, admits ready
//! sequences into the batch, runs one batched decode step, streams each new
//! token, and retires finished or cancelled sequences at once (dropping a
//! sequence frees its KV).

use std::collections::VecDeque;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::Instant;

use pdserve_engine::sampler::{sample, Sampled, SamplingParams, TokenCounts};
use pdserve_engine::{Model, SeqKv};
use pdserve_protocol::internal::{ErrorBody, ErrorClass, ErrorKind};
use pdserve_worker::decode::{DecodeArgs, DecodeJob, DecodeMetrics, Outcome, SeqStream, retire_closed};
use pdserve_worker::queue::EngineStats;
use tokio::sync::mpsc;

use crate::backend::RealKv;

/// Scheduler settings.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// Batch size, KV budget, prefill chunk and queue length.
    pub limits: DecodeArgs,
    /// Peak memory bandwidth, for the MBU estimate.
    pub peak_bytes_per_second: f64,
}

struct Seq {
    stream: SeqStream,
    prompt: Vec<u32>,
    params: SamplingParams,
    kv: SeqKv,
    /// Prompt tokens already in the KV (local prefill progress).
    prefilled: usize,
    /// The last sampled token, to feed to the next step; `None` until prefilled.
    last: Option<u32>,
    history: TokenCounts,
}

pub(crate) struct Scheduler {
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
    /// Starts the model thread on the jobs of `rx`.
    pub(crate) fn spawn(
        model: Arc<Model>,
        eos: u32,
        cfg: EngineConfig,
        metrics: Arc<DecodeMetrics>,
        stats: Arc<EngineStats>,
        rx: mpsc::Receiver<DecodeJob<RealKv>>,
    ) {
        let mut sched = Self {
            model,
            eos,
            cfg,
            metrics,
            stats,
            waiting: VecDeque::new(),
            active: Vec::new(),
        };
        std::thread::Builder::new()
            .name("pdserve-decode-engine".into())
            .spawn(move || sched.run(rx))
            .expect("spawn the engine thread");
    }

    fn run(&mut self, mut rx: mpsc::Receiver<DecodeJob<RealKv>>) {
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
                let err = ErrorBody::retryable(ErrorKind::EnginePanic, "the engine failed");
                for s in self.active.drain(..).chain(self.waiting.drain(..)) {
                    s.stream.fail(err.clone(), &self.metrics);
                }
            }
            self.publish();
        }
    }

    fn intake(&mut self, job: DecodeJob<RealKv>) {
        self.stats.taken(job.prompt.len() as u64, true);
        let prompt_len = job.prompt.len() as u32;
        let mut seq = Seq {
            params: SamplingParams::from(&job.sampling),
            stream: SeqStream::new(job.request_id, prompt_len, job.sampling, job.events),
            prompt: job.prompt,
            kv: job.kv.0,
            prefilled: 0,
            last: None,
            history: TokenCounts::default(),
        };
        if let Some(first) = job.first {
            seq.prefilled = seq.prompt.len();
            if let Outcome::Done = self.emit(&mut seq, first) {
                return;
            }
        }
        self.waiting.push_back(seq);
    }

    /// One scheduling round: a prefill chunk, admission, a decode step.
    fn iteration(&mut self) {
        let (active, waiting) = (&mut self.active, &mut self.waiting);
        retire_closed(active, waiting, |s| &s.stream, &self.metrics);
        if self.active.len() < self.cfg.limits.max_batch {
            self.prefill_chunk();
        }
        while self.active.len() < self.cfg.limits.max_batch {
            match self.waiting.iter().position(|s| s.last.is_some()) {
                Some(i) => self.active.extend(self.waiting.remove(i)),
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
        let chunk = self.cfg.limits.prefill_chunk_tokens.max(1);
        let started = Instant::now();
        let seq = &mut self.waiting[i];
        let end = (seq.prefilled + chunk).min(seq.prompt.len());
        let result = self
            .model
            .prefill(&seq.prompt[seq.prefilled..end], &mut seq.kv);
        let done = end - seq.prefilled;
        seq.prefilled = end;
        let logits = match result {
            Ok(l) => l,
            Err(e) => {
                let s = self.waiting.remove(i).expect("index from position");
                s.stream.fail(e.to_wire(ErrorClass::Fatal), &self.metrics);
                return;
            }
        };
        self.metrics
            .prefill_chunk(done, started.elapsed().as_secs_f64());
        if end < self.waiting[i].prompt.len() {
            return;
        }
        let mut seq = self.waiting.remove(i).expect("index from position");
        match self.sample(&seq, &logits) {
            Ok(sampled) => {
                if let Outcome::Continue = self.emit(&mut seq, sampled) {
                    self.waiting.insert(i, seq);
                }
            }
            Err(e) => seq.stream.fail(e, &self.metrics),
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
                    s.stream
                        .fail(e.to_wire(ErrorClass::Retryable), &self.metrics);
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
                Err(e) => seq.stream.fail(e, &self.metrics),
            }
        }
        self.active = keep;
        let secs = started.elapsed().as_secs_f64();
        self.metrics.step(n, secs);
        let bytes =
            self.model.weight_bytes() + kv_tokens * self.model.kv_layout().bytes_per_token();
        self.metrics
            .mbu
            .set(bytes as f64 / secs.max(1e-9) / self.cfg.peak_bytes_per_second.max(1.0));
        self.stats.record_rate(n, secs);
    }

    fn sample(&self, seq: &Seq, logits: &[f32]) -> Result<Sampled, ErrorBody> {
        let position = seq.kv.len() as u64;
        sample(logits, &seq.params, position, &seq.history)
            .map_err(|e| ErrorBody::fatal(ErrorKind::Sampling, e.to_string()))
    }

    /// Streams a sampled token and decides whether the sequence goes on.
    fn emit(&self, seq: &mut Seq, s: Sampled) -> Outcome {
        let token = s.token;
        seq.history.add(token);
        let outcome = seq.stream.emit(s, Some(self.eos), &self.metrics);
        if outcome == Outcome::Continue {
            seq.last = Some(token);
        }
        outcome
    }

    fn publish(&self) {
        let waiting_tokens: usize = self
            .waiting
            .iter()
            .map(|s| s.prompt.len() - s.prefilled)
            .sum();
        self.metrics.publish(
            &self.stats,
            self.active.len(),
            self.waiting.len(),
            waiting_tokens as u64,
        );
    }
}
