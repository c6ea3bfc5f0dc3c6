//! The model thread: prompts run one after another, in chunks, and each
//! layer's KV is framed and handed to the HTTP upload as soon as the forward
//! pass has written it, so the transfer overlaps the rest of the compute.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use pdserve_engine::sampler::{sample, SamplingParams, TokenCounts};
use pdserve_engine::{KvDtype, KvPool, Model, Segment, SeqKv};
use pdserve_protocol::internal::{ErrorBody, PrefillJob};
use pdserve_protocol::kvwire::{self, KvHeader, KvTrailer};
use pdserve_runtime::queue::{try_submit, QueueGauge};
use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;

use crate::metrics::PrefillMetrics;

/// What the model thread reports for a finished prompt.
#[derive(Debug)]
pub struct Computed {
    /// When the forward pass and sampling ended (the end frame was queued).
    pub finished_at: Instant,
    pub first_token: u32,
    pub queue_seconds: f64,
    pub compute_seconds: f64,
    pub bytes: u64,
}

/// A job for the model thread.
pub struct Task {
    pub job: PrefillJob,
    pub enqueued: Instant,
    pub cancel: CancellationToken,
    /// Frames of the KV stream, read by the upload to the decode worker.
    pub frames: mpsc::Sender<Bytes>,
    pub reply: oneshot::Sender<Result<Computed, ErrorBody>>,
}

/// Scheduler settings.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    pub chunk_tokens: usize,
    pub queue_capacity: usize,
    pub kv_dtype: KvDtype,
    /// Peak FLOP/s, for the MFU estimate.
    pub peak_flops: f64,
}

/// Queue counters for `/load` and metrics.
#[derive(Debug, Default)]
pub struct QueueStats {
    pub queue: QueueGauge,
    pub running: AtomicU64,
    /// Prompt tokens per second of the last job, as f64 bits.
    pub tokens_per_second: AtomicU64,
}

/// Sends jobs to the model thread.
#[derive(Clone)]
pub struct EngineHandle {
    tx: mpsc::Sender<Task>,
    pub stats: Arc<QueueStats>,
}

impl EngineHandle {
    pub fn spawn(model: Arc<Model>, cfg: EngineConfig, metrics: Arc<PrefillMetrics>) -> Self {
        let (tx, rx) = mpsc::channel(cfg.queue_capacity.max(1));
        let stats = Arc::new(QueueStats::default());
        let worker = Worker {
            pool: KvPool::new(model.kv_layout(), model.config().context_length),
            model,
            cfg,
            metrics,
            stats: stats.clone(),
        };
        std::thread::Builder::new()
            .name("pdserve-prefill-engine".into())
            .spawn(move || worker.run(rx))
            .expect("spawn the engine thread");
        Self { tx, stats }
    }

    /// Queues a task; a full queue is a retryable error.
    pub fn submit(&self, task: Task) -> Result<(), ErrorBody> {
        let tokens = task.job.prompt_tokens.len() as u64;
        try_submit(&self.tx, &self.stats.queue, task, tokens)
    }

    pub fn in_flight(&self) -> u64 {
        self.stats.queue.requests() + self.stats.running.load(Ordering::Relaxed)
    }
}

struct Worker {
    model: Arc<Model>,
    pool: KvPool,
    cfg: EngineConfig,
    metrics: Arc<PrefillMetrics>,
    stats: Arc<QueueStats>,
}

impl Worker {
    fn run(self, mut rx: mpsc::Receiver<Task>) {
        while let Some(task) = rx.blocking_recv() {
            let tokens = task.job.prompt_tokens.len() as u64;
            self.stats.queue.taken(tokens);
            self.stats.running.store(1, Ordering::Relaxed);
            self.publish();
            let queue_seconds = task.enqueued.elapsed().as_secs_f64();
            let result = match task.cancel.is_cancelled() {
                true => Err(ErrorBody::fatal(
                    "cancelled",
                    "the job was cancelled while queued",
                )),
                false => {
                    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.prefill(&task)))
                        .unwrap_or_else(|_| {
                            Err(ErrorBody::retryable(
                                "engine_panic",
                                "the prefill engine failed",
                            ))
                        })
                }
            };
            let result = result.map(|mut c| {
                c.queue_seconds = queue_seconds;
                c
            });
            self.stats.running.store(0, Ordering::Relaxed);
            self.publish();
            let _ = task.reply.send(result);
        }
    }

    fn publish(&self) {
        let pool = [pdserve_runtime::metrics::labels::POOL_PREFILL];
        let queued = self.stats.queue.requests() + self.stats.running.load(Ordering::Relaxed);
        self.metrics
            .queue_depth
            .with_label_values(&pool)
            .set(queued as i64);
        let tokens = self.stats.queue.tokens();
        self.metrics
            .queue_depth_tokens
            .with_label_values(&pool)
            .set(tokens as i64);
    }

    /// Runs the prompt chunk by chunk, streaming each layer's new rows.
    fn prefill(&self, task: &Task) -> Result<Computed, ErrorBody> {
        let started = Instant::now();
        let prompt = &task.job.prompt_tokens;
        let mut kv = self
            .pool
            .allocate(prompt.len())
            .map_err(|e| ErrorBody::retryable(e.kind(), e.to_string()))?;
        let mut sent = 0u64;
        let header = self.header(&task.job)?;
        sent += self.send(
            task,
            kvwire::encode_header(&header)
                .map_err(ErrorBody::from)?
                .into(),
        )?;
        let mut logits = Vec::new();
        for (c, chunk) in prompt.chunks(self.cfg.chunk_tokens.max(1)).enumerate() {
            if task.cancel.is_cancelled() {
                return Err(ErrorBody::fatal("cancelled", "the job was cancelled"));
            }
            let start = c * self.cfg.chunk_tokens.max(1);
            logits = self.forward_chunk(task, &mut kv, chunk, start, &mut sent)?;
        }
        let params = SamplingParams::from(&task.job.sampling);
        let first = sample(
            &logits,
            &params,
            prompt.len() as u64,
            &TokenCounts::default(),
        )
        .map_err(|e| ErrorBody::fatal("sampling", e.to_string()))?;
        let trailer = KvTrailer {
            first_token: first.token,
            first_logprob: first.logprob,
            top_logprobs: first.top_logprobs,
        };
        sent += self.send(
            task,
            kvwire::encode_end(&trailer)
                .map_err(ErrorBody::from)?
                .into(),
        )?;
        let secs = started.elapsed().as_secs_f64();
        self.metrics.prefill_seconds.observe(secs);
        let flops = 2.0 * self.model.config().matmul_macs_per_token() as f64 * prompt.len() as f64;
        self.metrics
            .mfu
            .set(flops / secs.max(1e-9) / self.cfg.peak_flops.max(1.0));
        self.metrics.prompt_tokens.inc_by(prompt.len() as u64);
        self.stats.tokens_per_second.store(
            (prompt.len() as f64 / secs.max(1e-9)).to_bits(),
            Ordering::Relaxed,
        );
        Ok(Computed {
            finished_at: Instant::now(),
            first_token: first.token,
            queue_seconds: 0.0,
            compute_seconds: secs,
            bytes: sent,
        })
    }

    fn header(&self, job: &PrefillJob) -> Result<KvHeader, ErrorBody> {
        let layout = self.model.kv_layout();
        Ok(KvHeader {
            request_id: job.request_id.clone(),
            model_fingerprint: self.model.fingerprint(),
            dtype: self.cfg.kv_dtype.into(),
            n_layers: layout.n_layers as u32,
            n_kv_heads: layout.n_kv_heads as u32,
            head_dim: layout.head_dim as u32,
            n_tokens: job.prompt_tokens.len() as u32,
            seed: job.sampling.seed,
        })
    }

    /// One forward pass over `chunk`; frames each layer as soon as it is written.
    fn forward_chunk(
        &self,
        task: &Task,
        kv: &mut SeqKv,
        chunk: &[u32],
        start: usize,
        sent: &mut u64,
    ) -> Result<Vec<f32>, ErrorBody> {
        let mut failure: Option<ErrorBody> = None;
        let mut on_layer = |layer: usize, segs: &[Segment<'_>]| {
            if failure.is_some() {
                return;
            }
            match self.frame(segs[0].kv, layer, start, chunk.len()) {
                Ok(f) => match self.send(task, f) {
                    Ok(n) => *sent += n,
                    Err(e) => failure = Some(e),
                },
                Err(e) => failure = Some(e),
            }
        };
        let logits = self
            .model
            .forward(&mut [Segment { kv, tokens: chunk }], &mut on_layer)
            .map_err(|e| ErrorBody::fatal(e.kind(), e.to_string()))?;
        match failure {
            Some(e) => Err(e),
            None => Ok(logits.row(0).to_vec()),
        }
    }

    fn frame(
        &self,
        kv: &SeqKv,
        layer: usize,
        start: usize,
        tokens: usize,
    ) -> Result<Bytes, ErrorBody> {
        let (mut k, mut v) = (Vec::new(), Vec::new());
        kv.export_rows(layer, self.cfg.kv_dtype, start, tokens, &mut k, &mut v)
            .map_err(|e| ErrorBody::fatal(e.kind(), e.to_string()))?;
        let mut out = Vec::with_capacity(k.len() + v.len() + 64);
        kvwire::encode_layer_parts(
            layer as u32,
            start as u32,
            tokens as u32,
            &[(&k, &v)],
            &mut out,
        )
        .map_err(ErrorBody::from)?;
        Ok(Bytes::from(out))
    }

    /// Hands a frame to the upload; waits when the network is slower than compute.
    fn send(&self, task: &Task, frame: Bytes) -> Result<u64, ErrorBody> {
        let n = frame.len() as u64;
        let deadline = Duration::from_millis(task.job.deadline_ms.max(1));
        let started = Instant::now();
        let mut frame = Some(frame);
        while let Some(f) = frame.take() {
            match task.frames.try_send(f) {
                Ok(()) => {}
                Err(mpsc::error::TrySendError::Full(f))
                    if started.elapsed() < deadline && !task.cancel.is_cancelled() =>
                {
                    frame = Some(f);
                    std::thread::sleep(Duration::from_micros(200));
                }
                Err(_) => {
                    return Err(ErrorBody::retryable(
                        "kv_upload_failed",
                        "the KV upload to the decode worker stopped",
                    ))
                }
            }
        }
        self.metrics.kv_transfer_bytes.inc_by(n);
        Ok(n)
    }
}
