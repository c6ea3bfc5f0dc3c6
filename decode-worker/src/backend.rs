//! The real engine as the worker layer's [`DecodeBackend`]: reservations in
//! the model's paged KV pool (with its prefix cache), KV imported into them,
//! sequences run by the continuous-batching thread.

use std::sync::Arc;

use pdserve_engine::{KvDtype as EngineDtype, KvPool, Model, ModelConfig, SeqKv};
use pdserve_protocol::internal::{ErrorBody, ErrorKind};
use pdserve_protocol::kvwire::KvShape;
use pdserve_protocol::prefix::PrefixDigest;
use pdserve_worker::decode::{DecodeBackend, DecodeJob, DecodeMetrics, KvImport, KvRows};
use pdserve_worker::kv::KvReport;
use pdserve_worker::queue::{EngineQueue, EngineStats};

use crate::engine::{EngineConfig, Scheduler};

/// A sequence's KV in the pool; dropping it gives its blocks back.
pub struct RealKv {
    pub kv: SeqKv,
    /// Leading prompt tokens taken from the prefix cache.
    pub cached: usize,
}

impl KvImport for RealKv {
    fn import(&mut self, r: KvRows<'_>) -> Result<(), ErrorBody> {
        let dtype = EngineDtype::from(r.dtype);
        self.kv
            .import_rows(r.layer, dtype, r.start, r.n, r.k, r.v)
            .map_err(|e| ErrorBody::from(&e))
    }

    fn finish(&mut self, tokens: &[u32]) -> Result<(), ErrorBody> {
        self.kv
            .finish_import(tokens)
            .map_err(|e| ErrorBody::from(&e))
    }

    fn reset(&mut self) {
        self.kv.truncate(self.cached);
    }

    fn cached(&self) -> usize {
        self.cached
    }
}

/// The model, its KV pool and its scheduler thread.
pub struct RealDecode {
    model: Arc<Model>,
    pool: KvPool,
    queue: EngineQueue<DecodeJob<RealKv>>,
}

impl RealDecode {
    /// Starts the scheduler thread over `model` and `pool`; `eos` ends a
    /// sequence unless it asks to ignore it.
    pub fn spawn(
        model: Arc<Model>,
        pool: KvPool,
        eos: u32,
        cfg: EngineConfig,
        metrics: Arc<DecodeMetrics>,
    ) -> Self {
        let (queue, rx) = EngineQueue::new(cfg.limits.max_queue);
        let stats = queue.stats().clone();
        Scheduler::spawn(model.clone(), pool.clone(), eos, cfg, (metrics, stats), rx);
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
        self.model.kv_shape(self.pool.config().dtype)
    }

    fn reserve(&self, prompt: &[u32], max_tokens: u32) -> Result<RealKv, ErrorBody> {
        let budget = self.pool.usage().budget_tokens;
        let total = prompt.len() + max_tokens as usize;
        if total > budget {
            return Err(ErrorBody::fatal(
                ErrorKind::KvCapacityExceeded,
                format!("{total} tokens exceed the KV cache budget of {budget}"),
            ));
        }
        let mut kv = self.pool.sequence();
        let cached = kv.attach_prefix(prompt);
        kv.reserve_to(prompt.len())
            .map_err(|e| ErrorBody::from(&e))?;
        Ok(RealKv { kv, cached })
    }

    fn submit(&self, job: DecodeJob<RealKv>) -> Result<(), ErrorBody> {
        let tokens = (job.prompt.len() - job.kv.cached) as u64;
        self.queue.submit(job, tokens)
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
