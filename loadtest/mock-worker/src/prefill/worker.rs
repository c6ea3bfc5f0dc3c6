//! The simulated prefill engine: one job at a time, as the real worker. It
//! takes `a·tokens + b` per prompt, spread evenly over the chunks and
//! layers, and frames each layer's KV (zeros of the real size) at the moment
//! the real forward pass would have written it, so the upload overlaps the
//! simulated compute as it does for real.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use bytes::Bytes;
use pdserve_protocol::internal::{ErrorBody, PrefillJob};
use pdserve_protocol::kvwire::{self, KvDtype, KvHeader, KvTrailer};
use pdserve_runtime::queue::{try_submit, QueueGauge};
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::latency::LatencyModel;
use crate::metrics::PrefillMetrics;
use crate::shape::MockShape;
use crate::tokens::sample;

/// What the engine reports for a finished prompt.
#[derive(Debug)]
pub struct Computed {
    /// When the simulated compute ended (the end frame was queued).
    pub finished_at: Instant,
    pub first_token: u32,
    pub queue_seconds: f64,
    pub compute_seconds: f64,
    pub bytes: u64,
}

/// A job for the engine.
pub struct Task {
    pub job: PrefillJob,
    pub enqueued: Instant,
    pub cancel: CancellationToken,
    /// Frames of the KV stream, read by the upload to the decode worker.
    pub frames: mpsc::Sender<Bytes>,
    pub reply: oneshot::Sender<Result<Computed, ErrorBody>>,
}

/// Engine settings.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    pub shape: MockShape,
    pub latency: LatencyModel,
    pub chunk_tokens: usize,
    pub queue_capacity: usize,
    pub kv_dtype: KvDtype,
}

/// Queue counters for `/load`.
#[derive(Debug, Default)]
pub struct QueueStats {
    pub queue: QueueGauge,
    pub running: AtomicU64,
    /// Prompt tokens per second of the last job, as f64 bits.
    pub tokens_per_second: AtomicU64,
}

/// Sends jobs to the engine.
#[derive(Clone)]
pub struct EngineHandle {
    tx: mpsc::Sender<Task>,
    pub stats: Arc<QueueStats>,
}

impl EngineHandle {
    /// Starts the engine task (on the current tokio runtime).
    pub fn spawn(cfg: EngineConfig, metrics: Arc<PrefillMetrics>) -> Self {
        let (tx, rx) = mpsc::channel(cfg.queue_capacity.max(1));
        let stats = Arc::new(QueueStats::default());
        let engine = Engine {
            cfg,
            metrics,
            stats: stats.clone(),
        };
        tokio::spawn(engine.run(rx));
        Self { tx, stats }
    }

    /// Queues a task; a full queue is `overloaded` (retryable).
    pub fn submit(&self, task: Task) -> Result<(), ErrorBody> {
        let tokens = task.job.prompt_tokens.len() as u64;
        try_submit(&self.tx, &self.stats.queue, task, tokens)
    }

    pub fn in_flight(&self) -> u64 {
        self.stats.queue.requests() + self.stats.running.load(Ordering::Relaxed)
    }
}

struct Engine {
    cfg: EngineConfig,
    metrics: Arc<PrefillMetrics>,
    stats: Arc<QueueStats>,
}

fn cancelled() -> ErrorBody {
    ErrorBody::fatal("cancelled", "the job was cancelled")
}

impl Engine {
    async fn run(self, mut rx: mpsc::Receiver<Task>) {
        while let Some(task) = rx.recv().await {
            self.stats.queue.taken(task.job.prompt_tokens.len() as u64);
            self.stats.running.store(1, Ordering::Relaxed);
            self.publish();
            let queue_seconds = task.enqueued.elapsed().as_secs_f64();
            let result = match task.cancel.is_cancelled() {
                true => Err(cancelled()),
                false => self.prefill(&task).await,
            };
            let result = result.map(|c| Computed { queue_seconds, ..c });
            self.stats.running.store(0, Ordering::Relaxed);
            self.publish();
            let _ = task.reply.send(result);
        }
    }

    fn publish(&self) {
        let pool = PrefillMetrics::pool();
        let s = &self.stats;
        let queued = s.queue.requests() + s.running.load(Ordering::Relaxed);
        let m = &self.metrics.common;
        m.queue_depth.with_label_values(&pool).set(queued as i64);
        m.queue_depth_tokens
            .with_label_values(&pool)
            .set(s.queue.tokens() as i64);
    }

    /// Streams the header, each chunk's layer frames on the simulated
    /// schedule, then the end frame with the first token.
    async fn prefill(&self, task: &Task) -> Result<Computed, ErrorBody> {
        let started = Instant::now();
        let job = &task.job;
        let n = job.prompt_tokens.len();
        let total = self.cfg.latency.prefill(n);
        let header = self.header(job);
        let mut sent = self
            .send(
                task,
                kvwire::encode_header(&header).map_err(ErrorBody::from)?,
            )
            .await?;
        let chunk_len = self.cfg.chunk_tokens.max(1);
        let layers = self.cfg.shape.n_layers;
        for start in (0..n).step_by(chunk_len) {
            let tokens = chunk_len.min(n - start);
            let zeros = vec![0u8; header.layer_payload_len(1, tokens as u32).unwrap_or(0) as usize];
            for layer in 0..layers {
                // Layer `layer` of this chunk is "written" once this share of the prompt is done.
                let done = start as f64 + tokens as f64 * f64::from(layer + 1) / f64::from(layers);
                self.until(task, started + total.mul_f64(done / n as f64))
                    .await?;
                let mut frame = Vec::with_capacity(zeros.len() + 32);
                kvwire::encode_layers(layer, 1, start as u32, tokens as u32, &zeros, &mut frame)
                    .map_err(ErrorBody::from)?;
                sent += self.send(task, frame).await?;
            }
        }
        self.until(task, started + total).await?;
        let first = sample(
            self.cfg.shape.vocab,
            job.sampling.seed,
            n as u64,
            job.sampling.top_logprobs,
        );
        let trailer = KvTrailer {
            first_token: first.token,
            first_logprob: first.logprob,
            top_logprobs: first.top_logprobs,
        };
        sent += self
            .send(task, kvwire::encode_end(&trailer).map_err(ErrorBody::from)?)
            .await?;
        let secs = started.elapsed().as_secs_f64();
        self.record(n, secs);
        Ok(Computed {
            finished_at: Instant::now(),
            first_token: first.token,
            queue_seconds: 0.0,
            compute_seconds: secs,
            bytes: sent,
        })
    }

    fn header(&self, job: &PrefillJob) -> KvHeader {
        let n = job.prompt_tokens.len() as u32;
        self.cfg
            .shape
            .header(&job.request_id, n, job.sampling.seed, self.cfg.kv_dtype)
    }

    fn record(&self, tokens: usize, secs: f64) {
        self.metrics.prefill_seconds.observe(secs);
        self.metrics.common.prompt_tokens.inc_by(tokens as u64);
        let rate = tokens as f64 / secs.max(1e-9);
        self.stats
            .tokens_per_second
            .store(rate.to_bits(), Ordering::Relaxed);
    }

    /// Waits until `when`, unless the job is cancelled first.
    async fn until(&self, task: &Task, when: Instant) -> Result<(), ErrorBody> {
        if when <= Instant::now() {
            return match task.cancel.is_cancelled() {
                true => Err(cancelled()),
                false => Ok(()),
            };
        }
        tokio::select! {
            biased;
            _ = task.cancel.cancelled() => Err(cancelled()),
            _ = tokio::time::sleep_until(when) => Ok(()),
        }
    }

    /// Hands a frame to the upload; waits when the network is slower than compute.
    async fn send(&self, task: &Task, frame: Vec<u8>) -> Result<u64, ErrorBody> {
        let n = frame.len() as u64;
        let stopped = || {
            ErrorBody::retryable(
                "kv_upload_failed",
                "the KV upload to the decode worker stopped",
            )
        };
        tokio::select! {
            biased;
            _ = task.cancel.cancelled() => return Err(cancelled()),
            r = task.frames.send(Bytes::from(frame)) => r.map_err(|_| stopped())?,
        }
        self.metrics.common.kv_transfer_bytes.inc_by(n);
        Ok(n)
    }
}
