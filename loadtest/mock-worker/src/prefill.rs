//! The simulated prefill engine: one job at a time, as the real worker runs
//! a long prompt. It takes `a·tokens + b` per prompt, spread evenly over the
//! chunks and layers, and frames each layer's KV (zeros of the real size) at
//! the moment the real forward pass would have written it, so the upload
//! overlaps the simulated compute as it does for real.

use std::sync::Arc;

use bytes::Bytes;
use pdserve_protocol::internal::{ErrorBody, PrefillJob};
use pdserve_protocol::kvwire::{self, KvDtype, KvHeader, KvTrailer};
use pdserve_text::ModelConfig;
use pdserve_worker::prefill::{
    cancelled, upload_stopped, Computed, PrefillBackend, PrefillMetrics, PrefillTask as Task,
};
use pdserve_worker::queue::{EngineQueue, EngineStats};
use tokio::sync::mpsc;
use tokio::time::Instant;

use crate::latency::LatencyModel;
use crate::shape::MockShape;
use crate::tokens::sample_for;

/// Engine settings.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    pub shape: MockShape,
    pub latency: LatencyModel,
    pub chunk_tokens: usize,
    pub queue_capacity: usize,
    pub kv_dtype: KvDtype,
}

/// The simulated engine as the worker layer's backend.
pub struct MockPrefill {
    shape: MockShape,
    queue: EngineQueue<Task>,
}

impl MockPrefill {
    /// Starts the engine task (on the current tokio runtime).
    pub fn spawn(cfg: EngineConfig, metrics: Arc<PrefillMetrics>) -> Self {
        let (queue, rx) = EngineQueue::new(cfg.queue_capacity);
        let shape = cfg.shape.clone();
        let engine = Engine {
            cfg,
            metrics,
            stats: queue.stats().clone(),
        };
        tokio::spawn(engine.run(rx));
        Self { shape, queue }
    }

    pub fn shape(&self) -> &MockShape {
        &self.shape
    }
}

impl PrefillBackend for MockPrefill {
    fn config(&self) -> &ModelConfig {
        &self.shape.config
    }

    fn submit(&self, task: Task) -> Result<(), ErrorBody> {
        let tokens = task.job.prompt_tokens.len() as u64;
        self.queue.submit(task, tokens)
    }

    fn stats(&self) -> &EngineStats {
        self.queue.stats()
    }
}

struct Engine {
    cfg: EngineConfig,
    metrics: Arc<PrefillMetrics>,
    stats: Arc<EngineStats>,
}

impl Engine {
    async fn run(self, mut rx: mpsc::Receiver<Task>) {
        while let Some(task) = rx.recv().await {
            self.stats.taken(task.job.prompt_tokens.len() as u64, true);
            self.metrics.publish(&self.stats);
            let queue_seconds = task.enqueued.elapsed().as_secs_f64();
            let result = match task.cancel.is_cancelled() {
                true => Err(cancelled()),
                false => self.prefill(&task).await,
            };
            let result = result.map(|c| Computed { queue_seconds, ..c });
            self.stats.set_running(0);
            self.metrics.publish(&self.stats);
            let _ = task.reply.send(result);
        }
    }

    /// Streams the header, each chunk's layer frames on the simulated
    /// schedule, then the end frame with the first token.
    async fn prefill(&self, task: &Task) -> Result<Computed, ErrorBody> {
        let started = Instant::now();
        self.metrics.batch_size.observe(1.0);
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
        let layers = self.cfg.shape.kv.n_layers;
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
        let first = sample_for(&job.sampling, self.cfg.shape.vocab, n as u64);
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
            .kv
            .header(&job.request_id, n, job.sampling.seed, self.cfg.kv_dtype)
    }

    fn record(&self, tokens: usize, secs: f64) {
        self.metrics.prompt_done(tokens, secs);
        self.stats.record_rate(tokens, secs);
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
        tokio::select! {
            biased;
            _ = task.cancel.cancelled() => return Err(cancelled()),
            r = task.frames.send(Bytes::from(frame)) => r.map_err(|_| upload_stopped())?,
        }
        self.metrics.kv_transfer_bytes.inc_by(n);
        Ok(n)
    }
}
