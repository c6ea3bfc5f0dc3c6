//! pdserve's mock engine worker: a prefill or decode worker that loads no
//! weights but speaks the real internal protocol (generate streams, real KV
//! frames of the right size, `/load`, `/metrics`, registration), taking the
//! time a latency model gives. Router, autoscaler and scale tests run
//! hundreds of them without the CPU cost of the model.

pub mod budget;
pub mod config;
pub mod decode;
pub mod latency;
pub mod metrics;
pub mod prefill;
pub mod server;
pub mod shape;
pub mod tokens;

use std::sync::Arc;

use pdserve_engine::ModelConfig;
use pdserve_protocol::internal::{LoadReport, Pool, WorkerRegistration};
use pdserve_runtime::shutdown::Drain;

pub use config::{Args, PoolKind};
use decode::batcher::BatcherConfig;
use decode::DecodeState;
use prefill::{EngineConfig, PrefillState};
use server::Readiness;
use shape::MockShape;

/// What `weights` a mock registers with: it has none.
pub const WEIGHTS: &str = "mock";

/// Why a mock worker could not be built.
#[derive(Debug, thiserror::Error)]
pub enum BuildError {
    #[error("reading the model's shape: {0}")]
    Model(#[from] pdserve_engine::EngineError),
    #[error(transparent)]
    Shape(#[from] shape::ShapeError),
    #[error("latency model: {0}")]
    Latency(#[from] latency::FitError),
}

impl BuildError {
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Model(_) => "invalid_model",
            Self::Shape(e) => e.kind(),
            Self::Latency(e) => e.kind(),
        }
    }
}

/// A mock worker of either pool.
#[derive(Clone)]
pub enum Worker {
    Decode(Arc<DecodeState>),
    Prefill(Arc<PrefillState>),
}

/// Reads the shape from `--model`'s header and builds the worker (its
/// batcher or engine task starts on the current tokio runtime). A decode
/// worker names `public_url` in its KV ingest URLs.
pub fn build(args: &Args, public_url: String) -> Result<Worker, BuildError> {
    let shape = MockShape::new(ModelConfig::from_gguf_file(&args.model)?)?;
    let latency = args.latency.model()?;
    tracing::info!(
        ?latency,
        fingerprint = shape.fingerprint,
        "the mock's model"
    );
    Ok(match args.pool {
        PoolKind::Decode => {
            let cfg = BatcherConfig {
                max_batch: args.max_batch.max(1),
                prefill_chunk_tokens: args.prefill_chunk_tokens,
                queue_capacity: args.max_queue,
                vocab: shape.vocab,
                latency,
            };
            Worker::Decode(DecodeState::new(
                shape,
                cfg,
                args.kv_cache_tokens,
                public_url,
            ))
        }
        PoolKind::Prefill => Worker::Prefill(PrefillState::new(EngineConfig {
            shape,
            latency,
            chunk_tokens: args.prefill_chunk_tokens,
            queue_capacity: args.max_queue,
            kv_dtype: args.kv_dtype,
        })),
    })
}

impl Worker {
    /// The axum application: the real worker's routes.
    pub fn app(&self) -> axum::Router {
        match self {
            Self::Decode(s) => decode::routes(s.clone()),
            Self::Prefill(s) => prefill::routes(s.clone()),
        }
    }

    pub fn load_report(&self) -> LoadReport {
        match self {
            Self::Decode(s) => s.load_report(),
            Self::Prefill(s) => s.load_report(),
        }
    }

    /// Requests queued, running, or (decode) waiting for their KV.
    pub fn in_flight(&self) -> u64 {
        match self {
            Self::Decode(s) => s.in_flight(),
            Self::Prefill(s) => s.in_flight(),
        }
    }

    /// What the shared drain (`pdserve_runtime::shutdown::serve`) needs.
    pub fn drain(&self, deadline: std::time::Duration) -> Drain {
        let (stopping, counting) = (self.clone(), self.clone());
        Drain {
            stop_accepting: Box::new(move || stopping.readiness().stop()),
            in_flight: Box::new(move || counting.in_flight()),
            deadline,
        }
    }

    pub fn readiness(&self) -> &Readiness {
        match self {
            Self::Decode(s) => &s.readiness,
            Self::Prefill(s) => &s.readiness,
        }
    }

    /// What to tell the router when registering at `url`.
    pub fn registration(&self, url: String) -> WorkerRegistration {
        let (pool, shape) = match self {
            Self::Decode(s) => (Pool::Decode, &s.shape),
            Self::Prefill(s) => (Pool::Prefill, &s.shape),
        };
        WorkerRegistration {
            pool,
            url,
            model_fingerprint: shape.fingerprint,
            weights: WEIGHTS.to_string(),
        }
    }
}
