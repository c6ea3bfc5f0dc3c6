//! The model thread, and the real engine as the worker layer's
//! [`PrefillBackend`]. The thread takes jobs off a bounded queue; when
//! several short prompts are waiting it runs them together, as segments of
//! one forward pass, and a long prompt runs alone, in chunks. Each layer's
//! KV is framed and handed to the job's HTTP upload as soon as the forward
//! pass has written it, so the transfer overlaps the rest of the compute.
//! Running a batch is in `prefill.rs`.

use std::sync::Arc;

use pdserve_engine::sampler::Grammars;
use pdserve_engine::{KvDtype, KvPool, Model, ModelConfig};
use pdserve_protocol::internal::{ErrorBody, ErrorKind, KvReport};
use pdserve_protocol::prefix::PrefixDigest;
use pdserve_worker::prefill::{Computed, PrefillBackend, PrefillMetrics, PrefillTask as Task};
use pdserve_worker::queue::{EngineQueue, EngineStats};
use tokio::sync::mpsc;

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
    /// Compiles requests' grammars for the first token (None: constrained
    /// requests are refused).
    pub grammars: Option<Grammars>,
}

/// The model and its thread: the real prefill engine.
#[derive(Clone)]
pub struct EngineHandle {
    model: Arc<Model>,
    pool: KvPool,
    queue: EngineQueue<Task>,
    gate: Arc<std::sync::Mutex<()>>,
}

impl EngineHandle {
    /// Starts the model thread. It never waits on the network: a job's KV
    /// frames queue for its upload up to a byte cap (`frames`).
    pub fn spawn(
        model: Arc<Model>,
        pool: KvPool,
        cfg: EngineConfig,
        metrics: Arc<PrefillMetrics>,
    ) -> Self {
        let (queue, rx) = EngineQueue::new(cfg.queue_capacity);
        let worker = Worker {
            pool: pool.clone(),
            model: model.clone(),
            cfg,
            metrics,
            stats: queue.stats().clone(),
            gate: Arc::default(),
        };
        let gate = worker.gate.clone();
        std::thread::Builder::new()
            .name("pdserve-prefill-engine".into())
            .spawn(move || worker.run(rx))
            .expect("spawn the engine thread");
        Self {
            model,
            pool,
            queue,
            gate,
        }
    }

    pub fn model(&self) -> &Arc<Model> {
        &self.model
    }

    /// Holds the model thread before its next batch until the guard drops;
    /// jobs submitted meanwhile queue up and run together (tests, and
    /// operators who want a worker quiet for a moment).
    pub fn pause(&self) -> std::sync::MutexGuard<'_, ()> {
        self.gate.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl PrefillBackend for EngineHandle {
    fn config(&self) -> &ModelConfig {
        self.model.config()
    }

    fn submit(&self, task: Task) -> Result<(), ErrorBody> {
        let tokens = task.job.prompt_tokens.len() as u64;
        self.queue.submit(task, tokens)
    }

    fn stats(&self) -> &EngineStats {
        self.queue.stats()
    }

    fn kv_usage(&self) -> KvReport {
        self.pool.report()
    }

    fn prefix_digest(&self) -> Option<PrefixDigest> {
        self.pool.prefix_digest()
    }
}

pub(crate) struct Worker {
    pub(crate) model: Arc<Model>,
    pub(crate) pool: KvPool,
    pub(crate) cfg: EngineConfig,
    pub(crate) metrics: Arc<PrefillMetrics>,
    pub(crate) stats: Arc<EngineStats>,
    /// Locked by [`EngineHandle::pause`].
    pub(crate) gate: Arc<std::sync::Mutex<()>>,
}

impl Worker {
    fn run(self, mut rx: mpsc::Receiver<Task>) {
        // A job taken off the queue that did not fit the last batch.
        let mut held: Option<Task> = None;
        loop {
            let Some(first) = held.take().or_else(|| rx.blocking_recv()) else {
                return;
            };
            drop(self.gate.lock());
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
            self.stats.taken(t.job.prompt_tokens.len() as u64, true);
        }
        self.metrics.publish(&self.stats);
        let queued: Vec<f64> = tasks
            .iter()
            .map(|t| t.enqueued.elapsed().as_secs_f64())
            .collect();
        let results =
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.prefill(&tasks)))
                .unwrap_or_else(|_| {
                    let panicked = || {
                        ErrorBody::retryable(ErrorKind::EnginePanic, "the prefill engine failed")
                    };
                    tasks.iter().map(|_| Err(panicked())).collect()
                });
        self.stats.set_running(0);
        self.metrics.publish(&self.stats);
        for ((task, result), queue_seconds) in tasks.into_iter().zip(results).zip(queued) {
            let result = result.map(|c| Computed { queue_seconds, ..c });
            let _ = task.reply.send(result);
        }
    }
}
