//! The simulated prefill engine: one job at a time, as the real worker runs
//! a long prompt. It takes `a·tokens + b` per prompt for the tokens its
//! simulated prefix cache lacks, spread evenly over the chunks and layers,
//! and frames each layer's KV (zeros of the real size) at the moment the
//! real forward pass would have written it, so the upload overlaps the
//! simulated compute as it does for real. Like the real worker it sends
//! only the rows the decode worker lacks (`job.cached_tokens` onwards).

use std::ops::Range;
use std::sync::Arc;

use bytes::Bytes;
use pdserve_protocol::internal::{ErrorBody, KvReport, PrefillJob};
use pdserve_protocol::kvwire::{self, KvDtype, KvHeader, KvTrailer};
use pdserve_protocol::prefix::PrefixDigest;
use pdserve_text::ModelConfig;
use pdserve_worker::kv::KvArgs;
use pdserve_worker::prefill::{
    cancelled, Computed, PrefillBackend, PrefillMetrics, PrefillTask as Task,
};
use pdserve_worker::queue::{EngineQueue, EngineStats};
use tokio::sync::mpsc;
use tokio::time::Instant;

use crate::latency::LatencyModel;
use crate::prefix::PrefixCache;
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
    /// Block size and prefix-cache switch.
    pub kv: KvArgs,
    /// Tokens the simulated prefix cache holds at most.
    pub cache_tokens: usize,
}

/// The simulated engine as the worker layer's backend.
pub struct MockPrefill {
    shape: MockShape,
    cache: Arc<PrefixCache>,
    queue: EngineQueue<Task>,
}

impl MockPrefill {
    /// Starts the engine task (on the current tokio runtime).
    pub fn spawn(cfg: EngineConfig, metrics: Arc<PrefillMetrics>) -> Self {
        let (queue, rx) = EngineQueue::new(cfg.queue_capacity);
        let shape = cfg.shape.clone();
        let cache = Arc::new(PrefixCache::new(
            &cfg.kv,
            cfg.cache_tokens,
            shape.kv.fingerprint,
        ));
        let engine = Engine {
            cfg,
            metrics,
            stats: queue.stats().clone(),
            cache: cache.clone(),
        };
        tokio::spawn(engine.run(rx));
        Self {
            shape,
            cache,
            queue,
        }
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

    /// The prefix cache's counters (a mock holds no KV between jobs).
    fn kv_usage(&self) -> KvReport {
        let capacity = self.cache_capacity();
        self.cache.report(0, capacity)
    }

    fn prefix_digest(&self) -> Option<PrefixDigest> {
        self.cache.digest()
    }
}

impl MockPrefill {
    fn cache_capacity(&self) -> u64 {
        self.cache.capacity_tokens() as u64
    }
}

struct Engine {
    cfg: EngineConfig,
    metrics: Arc<PrefillMetrics>,
    stats: Arc<EngineStats>,
    cache: Arc<PrefixCache>,
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
        let own = self.cache.lookup(&job.prompt_tokens);
        let total = self.cfg.latency.prefill(n - own);
        let header = self.header(job);
        let mut sent = self
            .send(
                task,
                kvwire::encode_header(&header).map_err(ErrorBody::from)?,
            )
            .await?;
        let from = job.cached_tokens as usize;
        let layers = self.cfg.shape.kv.n_layers;
        // Rows from the cache that the decode worker lacks go at once.
        if own > from {
            for layer in 0..layers {
                sent += self.send_rows(task, &header, layer, from..own).await?;
            }
        }
        let chunk_len = self.cfg.chunk_tokens.max(1);
        let computed = (n - own) as f64;
        for start in (own..n).step_by(chunk_len) {
            let end = (start + chunk_len).min(n);
            for layer in 0..layers {
                // Layer `layer` of this chunk is "written" once this share of the prompt is done.
                let done = (start - own) as f64
                    + (end - start) as f64 * f64::from(layer + 1) / f64::from(layers);
                self.until(task, started + total.mul_f64(done / computed))
                    .await?;
                sent += self
                    .send_rows(task, &header, layer, start.max(from)..end)
                    .await?;
            }
        }
        self.until(task, started + total).await?;
        self.cache.insert(&job.prompt_tokens);
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
        self.record(n - own, secs);
        Ok(Computed {
            finished_at: Instant::now(),
            first_token: first.token,
            queue_seconds: 0.0,
            compute_seconds: secs,
            bytes: sent,
        })
    }

    /// The stream's header: it starts after the tokens the decode worker holds.
    fn header(&self, job: &PrefillJob) -> KvHeader {
        let tokens = (job.cached_tokens, job.prompt_tokens.len() as u32);
        self.cfg.shape.kv.header(
            &job.request_id,
            tokens,
            job.sampling.seed,
            self.cfg.kv_dtype,
        )
    }

    /// Frames one layer's `rows` (zeros of the real size) and sends them;
    /// nothing for an empty range.
    async fn send_rows(
        &self,
        task: &Task,
        header: &KvHeader,
        layer: u32,
        rows: Range<usize>,
    ) -> Result<u64, ErrorBody> {
        if rows.is_empty() {
            return Ok(0);
        }
        let n = rows.len() as u32;
        let zeros = vec![0u8; header.layer_payload_len(1, n).unwrap_or(0) as usize];
        let mut frame = Vec::with_capacity(zeros.len() + 32);
        kvwire::encode_layers(layer, 1, rows.start as u32, n, &zeros, &mut frame)
            .map_err(ErrorBody::from)?;
        self.send(task, frame).await
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

    /// Hands a frame to the upload, without waiting (as the real engine: a
    /// slow receiver fails this job only).
    async fn send(&self, task: &Task, frame: Vec<u8>) -> Result<u64, ErrorBody> {
        let n = frame.len() as u64;
        if task.cancel.is_cancelled() {
            return Err(cancelled());
        }
        task.frames.send(Bytes::from(frame))?;
        self.metrics.kv_transfer_bytes.inc_by(n);
        Ok(n)
    }
}
