//! The model thread: continuous batching over every active sequence.
//!
//! One loop owns the model. Between steps it takes new sequences from a
//! bounded channel, prefills waiting prompts a chunk at a time, admits ready
//! sequences into the batch, gives every active sequence room for one more
//! token (preempting the latest admitted when the KV runs out), runs one
//! batched decode step, streams each new token, and retires finished or
//! cancelled sequences at once (dropping a sequence frees its KV).
//!
//! A preempted sequence keeps its tokens and goes back to the front of the
//! queue; its KV is recomputed (from the prefix cache where it is still
//! there) and it resumes exactly where it was: sampling depends only on the
//! seed, the position and the tokens so far.

use std::collections::VecDeque;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::Instant;

use pdserve_engine::sampler::{logprob_of, Grammars, Sampled, SamplingError, SeqSampler};
use pdserve_engine::{KvError, KvPool, Model, SeqKv};
use pdserve_protocol::internal::{ErrorBody, ErrorClass, ErrorKind, PromptLogprob};
use pdserve_worker::decode::{retire, DecodeArgs, DecodeJob, DecodeMetrics, Outcome, SeqStream};
use pdserve_worker::queue::EngineStats;
use rayon::prelude::*;
use tokio::sync::mpsc;

use crate::backend::RealKv;
use crate::seq::Seq;

/// Scheduler settings.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// Batch size, KV budget and blocks, prefill chunk and queue length.
    pub limits: DecodeArgs,
    /// Peak memory bandwidth, for the MBU estimate.
    pub peak_bytes_per_second: f64,
    /// Compiles requests' grammars (None: constrained requests are refused).
    pub grammars: Option<Grammars>,
}

pub(crate) struct Scheduler {
    model: Arc<Model>,
    pool: KvPool,
    eos: u32,
    cfg: EngineConfig,
    metrics: Arc<DecodeMetrics>,
    stats: Arc<EngineStats>,
    /// Sequences not in the batch: prefilling, or waiting for a slot.
    waiting: VecDeque<Seq>,
    active: Vec<Seq>,
    admissions: u64,
    /// Seconds the last decode step took (a token of every active sequence).
    step_secs: f64,
}

impl Scheduler {
    /// Starts the model thread on the jobs of `rx`.
    pub(crate) fn spawn(
        model: Arc<Model>,
        pool: KvPool,
        eos: u32,
        cfg: EngineConfig,
        (metrics, stats): (Arc<DecodeMetrics>, Arc<EngineStats>),
        rx: mpsc::Receiver<DecodeJob<RealKv>>,
    ) {
        let mut sched = Self {
            model,
            pool,
            eos,
            cfg,
            metrics,
            stats,
            waiting: VecDeque::new(),
            active: Vec::new(),
            admissions: 0,
            step_secs: 0.0,
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
            // The engine holds at most --max-queue waiting sequences; the
            // rest wait in the bounded channel, and a full one refuses.
            while self.waiting.len() < self.cfg.limits.max_queue.max(1) {
                match rx.try_recv() {
                    Ok(job) => self.intake(job),
                    Err(_) => break,
                }
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
        // As queued: the prompt tokens the prefix cache did not hold.
        self.stats
            .taken((job.prompt.len() - job.kv.cached) as u64, true);
        let prompt_len = job.prompt.len() as u32;
        let sampler = SeqSampler::new(&job.sampling, &job.prompt, self.cfg.grammars.as_ref());
        let stream = SeqStream::new(job.request_id, prompt_len, job.sampling, job.events);
        let sampler = match sampler {
            Ok(s) => s,
            Err(e) => return stream.fail(sampling_error(e), &self.metrics),
        };
        if stream.spec.prompt_logprobs {
            let top = stream.spec.top_logprobs as usize;
            match self.prompt_logprobs(&job.prompt, top) {
                Ok(entries) => stream.prompt_logprobs(entries),
                Err(e) => return stream.fail(e, &self.metrics),
            }
        }
        let mut seq = Seq {
            sampler,
            stream,
            tokens: job.prompt,
            kv: job.kv.kv,
            admitted: 0,
        };
        if let Some(first) = job.first {
            if let Outcome::Done = self.emit(&mut seq, first) {
                return;
            }
        }
        self.waiting.push_back(seq);
    }

    /// The logprob of every prompt token after the first, computed a chunk
    /// at a time on a scratch KV: the sequence's own KV may hold a cached
    /// prefix, whose positions were never computed here.
    fn prompt_logprobs(&self, prompt: &[u32], top: usize) -> Result<Vec<PromptLogprob>, ErrorBody> {
        let mut kv = self.pool.sequence();
        let chunk = self.cfg.limits.prefill_chunk_tokens.max(1);
        let mut out = Vec::with_capacity(prompt.len().saturating_sub(1));
        for (c, tokens) in prompt.chunks(chunk).enumerate() {
            kv.reserve_to(c * chunk + tokens.len())
                .map_err(|e| ErrorBody::from(&e))?;
            let logits = self
                .model
                .prefill_all_logits(tokens, &mut kv)
                .map_err(|e| ErrorBody::from(&e))?;
            let nexts = prompt.iter().skip(c * chunk + 1).take(tokens.len());
            for (i, &next) in nexts.enumerate() {
                let (logprob, top_logprobs) =
                    logprob_of(logits.row(i), next, top).map_err(sampling_error)?;
                out.push(PromptLogprob {
                    logprob,
                    top_logprobs,
                });
            }
        }
        Ok(out)
    }

    /// One scheduling round: a prefill chunk, admission, room for the next
    /// token, a decode step.
    fn iteration(&mut self) {
        let queues = (&mut self.active, &mut self.waiting);
        let drain = (self.stats.as_ref(), self.step_secs);
        retire(queues, |s| &s.stream, drain, &self.metrics);
        if self.active.len() < self.cfg.limits.max_batch {
            self.prefill_chunk();
        }
        while self.active.len() < self.cfg.limits.max_batch {
            match self.waiting.iter().position(|s| s.last().is_some()) {
                Some(i) => {
                    let mut s = self.waiting.remove(i).expect("index from position");
                    self.admissions += 1;
                    s.admitted = self.admissions;
                    self.active.push(s);
                }
                None => break,
            }
        }
        self.make_room();
        if !self.active.is_empty() {
            self.decode_step();
        }
    }

    /// Prefills the next chunk of the oldest sequence that needs it.
    fn prefill_chunk(&mut self) {
        let Some(i) = self.waiting.iter().position(|s| s.needs_prefill()) else {
            return;
        };
        let started = Instant::now();
        let seq = &mut self.waiting[i];
        let (from, target) = (seq.kv.len(), seq.context_len());
        let end = (from + self.cfg.limits.prefill_chunk_tokens.max(1)).min(target);
        if let Err(e) = seq.kv.reserve_to(end) {
            // No room until running sequences finish: it waits.
            tracing::debug!(request_id = %seq.stream.request_id, "prefill waits for KV: {e}");
            return;
        }
        let result = self.model.prefill(&seq.tokens[from..end], &mut seq.kv);
        let logits = match result {
            Ok(l) => l,
            Err(e) => {
                let s = self.waiting.remove(i).expect("index from position");
                s.stream.fail(ErrorBody::from(&e), &self.metrics);
                return;
            }
        };
        self.metrics
            .prefill_chunk(end - from, started.elapsed().as_secs_f64());
        if end < target || self.waiting[i].generated() > 0 {
            // More to prefill, or a recomputed sequence: it resumes with its last token.
            return;
        }
        let mut seq = self.waiting.remove(i).expect("index from position");
        match Self::sample(&mut seq, &logits) {
            Ok(sampled) => {
                if let Outcome::Continue = self.emit(&mut seq, sampled) {
                    self.waiting.insert(i, seq);
                }
            }
            Err(e) => seq.stream.fail(e, &self.metrics),
        }
    }

    /// Gives every active sequence room for one more token, preempting the
    /// latest admitted sequences while the KV has too few blocks.
    fn make_room(&mut self) {
        let mut i = 0;
        while i < self.active.len() {
            let s = &mut self.active[i];
            match s.kv.reserve_to(s.kv.len() + 1) {
                Ok(()) => i += 1,
                Err(KvError::Exhausted { .. }) => {
                    let victim = self.latest_admitted();
                    self.preempt(victim);
                    // The victim may be this sequence, or one before it.
                    i = i.min(self.active.len());
                    if victim < i {
                        i -= 1;
                    }
                }
                Err(e) => {
                    let s = self.active.remove(i);
                    s.stream.fail(ErrorBody::from(&e), &self.metrics);
                }
            }
        }
    }

    fn latest_admitted(&self) -> usize {
        (0..self.active.len())
            .max_by_key(|&i| self.active[i].admitted)
            .unwrap_or(0)
    }

    /// Takes an active sequence out of the batch and frees its KV; it goes
    /// back to the front of the queue to be recomputed.
    fn preempt(&mut self, i: usize) {
        let mut s = self.active.remove(i);
        tracing::info!(request_id = %s.stream.request_id, tokens = s.tokens.len(), "preempted: KV full");
        self.metrics.preemptions.inc();
        s.kv = self.recompute_kv(&s);
        self.waiting.push_front(s);
    }

    /// A fresh KV for a preempted sequence, with what the prefix cache still
    /// holds of it.
    fn recompute_kv(&self, s: &Seq) -> SeqKv {
        let mut kv = self.pool.sequence();
        kv.attach_prefix(&s.tokens[..s.context_len()]);
        kv
    }

    fn decode_step(&mut self) {
        let started = Instant::now();
        let kv_tokens: usize = self.active.iter().map(|s| s.kv.len() + 1).sum();
        let mut batch: Vec<(&mut SeqKv, u32)> = self
            .active
            .iter_mut()
            .map(|s| {
                let last = *s.tokens.last().expect("active sequences have a last token");
                (&mut s.kv, last)
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
        // Masks and draws are independent per sequence: all threads share them.
        let mut active = std::mem::take(&mut self.active);
        let drawn: Vec<_> = active
            .par_iter_mut()
            .enumerate()
            .map(|(i, seq)| Self::sample(seq, logits.row(i)))
            .collect();
        let mut keep = Vec::with_capacity(n);
        for (mut seq, drawn) in active.into_iter().zip(drawn) {
            match drawn {
                Ok(sampled) => {
                    if let Outcome::Continue = self.emit(&mut seq, sampled) {
                        keep.push(seq);
                    }
                }
                Err(e) => seq.stream.fail(e, &self.metrics),
            }
        }
        self.active = keep;
        self.step_secs = started.elapsed().as_secs_f64();
        self.record_step(n, kv_tokens, self.step_secs);
    }

    fn record_step(&self, n: usize, kv_tokens: usize, secs: f64) {
        self.metrics.step(n, secs);
        let bytes = self.model.weight_bytes()
            + kv_tokens
                * self
                    .model
                    .kv_layout()
                    .bytes_per_token(self.pool.config().dtype);
        self.metrics
            .mbu
            .set(bytes as f64 / secs.max(1e-9) / self.cfg.peak_bytes_per_second.max(1.0));
        self.stats.record_rate(n, secs);
    }

    fn sample(seq: &mut Seq, logits: &[f32]) -> Result<Sampled, ErrorBody> {
        let position = seq.kv.len() as u64;
        seq.sampler.sample(logits, position).map_err(sampling_error)
    }

    /// Streams a sampled token and decides whether the sequence goes on.
    fn emit(&self, seq: &mut Seq, s: Sampled) -> Outcome {
        let token = s.token;
        if let Err(e) = seq.sampler.accept(token) {
            seq.stream.fail(sampling_error(e), &self.metrics);
            return Outcome::Done;
        }
        let outcome = seq.stream.emit(s, Some(self.eos), &self.metrics);
        if outcome == Outcome::Continue {
            seq.tokens.push(token);
        }
        outcome
    }

    fn publish(&self) {
        let waiting_tokens: usize = self.waiting.iter().map(Seq::pending_tokens).sum();
        self.metrics.publish(
            &self.stats,
            self.active.len(),
            self.waiting.len(),
            waiting_tokens as u64,
        );
    }
}

/// A sampling failure as the stream reports it: the request's fault
/// (a grammar that refuses, or bad parameters).
fn sampling_error(e: SamplingError) -> ErrorBody {
    ErrorBody::fatal(ErrorKind::Sampling, e.to_string())
}
