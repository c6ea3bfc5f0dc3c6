//! The real engine as the worker layer's [`DecodeBackend`]: reservations in
//! the model's KV pool, KV imported into them, sequences run by the
//! continuous-batching thread.

use std::sync::Arc;

use pdserve_engine::{KvDtype as EngineDtype, KvPool, Model, ModelConfig, SeqKv};
use pdserve_protocol::internal::ErrorBody;
use pdserve_protocol::kvwire::KvShape;
use pdserve_worker::decode::{DecodeBackend, DecodeJob, DecodeMetrics, KvImport, KvRows};
use pdserve_worker::queue::{EngineQueue, EngineStats};

use crate::engine::{EngineConfig, Scheduler};

/// A sequence's KV in the pool; dropping it returns its reservation.
pub struct RealKv(pub SeqKv);

impl KvImport for RealKv {
    fn import(&mut self, r: KvRows<'_>) -> Result<(), ErrorBody> {
        let dtype = EngineDtype::from(r.dtype);
        self.0
            .import_rows(r.layer, dtype, r.start, r.n, r.k, r.v)
            .map_err(|e| ErrorBody::from(&e))
    }

    fn finish(&mut self, tokens: &[u32]) -> Result<(), ErrorBody> {
        self.0
            .finish_import(tokens)
            .map_err(|e| ErrorBody::from(&e))
    }

    fn reset(&mut self) {
        self.0.truncate(0);
    }
}

/// The model, its KV pool and its scheduler thread.
pub struct RealDecode {
    model: Arc<Model>,
    pool: KvPool,
    queue: EngineQueue<DecodeJob<RealKv>>,
}

impl RealDecode {
    /// Starts the scheduler thread over `model`; `eos` ends a sequence
    /// unless it asks to ignore it.
    pub fn spawn(model: Arc<Model>, eos: u32, cfg: EngineConfig, metrics: Arc<DecodeMetrics>) -> Self {
        let (queue, rx) = EngineQueue::new(cfg.limits.max_queue);
        let stats = queue.stats().clone();
        let pool = KvPool::new(model.kv_layout(), cfg.limits.kv_cache_tokens);
        Scheduler::spawn(model.clone(), eos, cfg, metrics, stats, rx);
        Self { model, pool, queue }
    }

    pub fn model(&self) -> &Arc<Model> {
        &self.model
    }

    pub fn pool(&self) -> &KvPool {
        &self.pool
    }
}

impl DecodeBackend for RealDecode {
    type Kv = RealKv;

    fn config(&self) -> &ModelConfig {
        self.model.config()
    }

    fn kv_shape(&self) -> KvShape {
        self.model.kv_shape()
    }

    fn reserve(&self, tokens: usize) -> Result<RealKv, ErrorBody> {
        self.pool
            .allocate(tokens)
            .map(RealKv)
            .map_err(|e| ErrorBody::from(&e))
    }

    fn submit(&self, job: DecodeJob<RealKv>) -> Result<(), ErrorBody> {
        let tokens = job.prompt.len() as u64;
        self.queue.submit(job, tokens)
    }

    fn stats(&self) -> &EngineStats {
        self.queue.stats()
    }

    fn kv_usage(&self) -> (u64, u64) {
        let usage = self.pool.usage();
        (usage.reserved_tokens as u64, usage.budget_tokens as u64)
    }
}
