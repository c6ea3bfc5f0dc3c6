//! The model thread. It takes jobs off a bounded queue; when several short
//! prompts are waiting it runs them together, as segments of one forward
//! pass, and a long prompt runs alone, in chunks. Each layer's KV is framed
//! and handed to the job's HTTP upload as soon as the forward pass has
//! written it, so the transfer overlaps the rest of the compute. Running a
//! batch is in `prefill.rs`.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use pdserve_engine::{KvDtype, KvPool, Model};
use pdserve_protocol::internal::{ErrorBody, PrefillJob};
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
    /// Prompt tokens per forward pass of a prompt that runs alone.
    pub chunk_tokens: usize,
    /// Prompt tokens one batched forward pass may hold: queued prompts are
    /// added to a batch while the total stays within it.
    pub batch_tokens: usize,
    /// Jobs per batched forward pass at most (1 turns batching off).
    pub max_batch_jobs: usize,
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
    /// Starts the model thread. Call it inside a Tokio runtime: the thread
    /// uses the runtime's timer to bound its wait for a slow upload.
    pub fn spawn(model: Arc<Model>, cfg: EngineConfig, metrics: Arc<PrefillMetrics>) -> Self {
        let (tx, rx) = mpsc::channel(cfg.queue_capacity.max(1));
        let stats = Arc::new(QueueStats::default());
        // Room for a full batch of prompts, or one whole prompt.
        let kv_budget = model.config().context_length.max(cfg.batch_tokens);
        let worker = Worker {
            rt: tokio::runtime::Handle::current(),
            pool: KvPool::new(model.kv_layout(), kv_budget),
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

pub(crate) struct Worker {
    pub(crate) rt: tokio::runtime::Handle,
    pub(crate) model: Arc<Model>,
    pub(crate) pool: KvPool,
    pub(crate) cfg: EngineConfig,
    pub(crate) metrics: Arc<PrefillMetrics>,
    pub(crate) stats: Arc<QueueStats>,
}

impl Worker {
    fn run(self, mut rx: mpsc::Receiver<Task>) {
        // A job taken off the queue that did not fit the last batch.
        let mut held: Option<Task> = None;
        loop {
            let Some(first) = held.take().or_else(|| rx.blocking_recv()) else {
                return;
            };
            let batch = self.gather(first, &mut rx, &mut held);
            self.run_batch(batch);
        }
    }

    /// Adds queued jobs to `first` while the batch stays within the token
    /// and job budgets; a prompt longer than the budget runs alone. The
    /// first job that does not fit is `held` for the next batch.
    fn gather(
        &self,
        first: Task,
        rx: &mut mpsc::Receiver<Task>,
        held: &mut Option<Task>,
    ) -> Vec<Task> {
        let mut tokens = first.job.prompt_tokens.len();
        let mut batch = vec![first];
        while tokens < self.cfg.batch_tokens && batch.len() < self.cfg.max_batch_jobs {
            let Ok(task) = rx.try_recv() else { break };
            let n = task.job.prompt_tokens.len();
            if tokens + n > self.cfg.batch_tokens {
                *held = Some(task);
                break;
            }
            tokens += n;
            batch.push(task);
        }
        batch
    }

    fn run_batch(&self, tasks: Vec<Task>) {
        for t in &tasks {
            self.stats.queue.taken(t.job.prompt_tokens.len() as u64);
        }
        self.stats
            .running
            .store(tasks.len() as u64, Ordering::Relaxed);
        self.publish();
        let queued: Vec<f64> = tasks
            .iter()
            .map(|t| t.enqueued.elapsed().as_secs_f64())
            .collect();
        let results =
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.prefill(&tasks)))
                .unwrap_or_else(|_| {
                    let panicked =
                        || ErrorBody::retryable("engine_panic", "the prefill engine failed");
                    tasks.iter().map(|_| Err(panicked())).collect()
                });
        self.stats.running.store(0, Ordering::Relaxed);
        self.publish();
        for ((task, result), queue_seconds) in tasks.into_iter().zip(results).zip(queued) {
            let result = result.map(|c| Computed { queue_seconds, ..c });
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
}

/// The error of a job cancelled by `DELETE` or by its caller going away.
pub fn cancelled() -> ErrorBody {
    ErrorBody::fatal("cancelled", "the job was cancelled")
}
