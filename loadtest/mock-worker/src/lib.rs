//! pdserve's mock engine worker: a prefill or decode worker that loads no
//! weights. It is the worker layer's real HTTP side (`pdserve-worker`: the
//! same routes, generate streams, KV ingest under leases, real KV frames of
//! the right size, `/load`, `/metrics`, registration, drain) over a backend
//! that takes the time a latency model gives instead of computing. Router,
//! autoscaler and scale tests run hundreds of them without the model's CPU
//! cost.

pub mod budget;
pub mod config;
pub mod decode;
pub use pdserve_protocol::latency;
pub mod prefill;
pub mod prefix;
pub mod shape;
pub mod tokens;

use std::sync::Arc;

use pdserve_protocol::internal::LoadReport;
use pdserve_text::ModelConfig;
use pdserve_worker::decode::{DecodeMetrics, DecodeNet, DecodeServer};
use pdserve_worker::prefill::{PrefillMetrics, PrefillNet, PrefillServer};
use pdserve_worker::{Readiness, Served, Service};

pub use config::{Args, PoolKind};
use decode::{BatcherConfig, MockDecode};
use prefill::{EngineConfig, MockPrefill};
use shape::MockShape;

/// What `weights` a mock registers with: it has none.
pub const WEIGHTS: &str = "mock";

/// Why a mock worker could not be built.
#[derive(Debug, thiserror::Error)]
pub enum BuildError {
    #[error("reading the model's shape: {0}")]
    Model(#[from] pdserve_text::TextError),
    #[error(transparent)]
    Shape(#[from] shape::ShapeError),
    #[error("latency model: {0}")]
    Latency(#[from] latency::FitError),
    #[error("{0}")]
    Flags(String),
}

impl BuildError {
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Model(_) => "invalid_model",
            Self::Shape(e) => e.kind(),
            Self::Latency(e) => e.kind(),
            Self::Flags(_) => "invalid_flags",
        }
    }
}

/// A mock worker of either pool.
#[derive(Clone)]
pub enum Worker {
    Decode(Arc<DecodeServer<MockDecode>>),
    Prefill(Arc<PrefillServer<MockPrefill>>),
}

/// Reads the shape from `--model`'s header and builds the worker (its
/// batcher or engine task starts on the current tokio runtime). A decode
/// worker names `public_url` in its KV ingest URLs; both register with it.
pub fn build(args: &Args, public_url: String) -> Result<Worker, BuildError> {
    let shape = MockShape::new(ModelConfig::from_gguf_file(&args.model)?)?;
    let latency = args.latency.model()?;
    let token = args.server.auth.token();
    tracing::info!(
        ?latency,
        fingerprint = shape.kv.fingerprint,
        "the mock's model"
    );
    Ok(match args.pool {
        PoolKind::Decode => {
            let cfg = BatcherConfig {
                limits: args.decode.clone(),
                latency,
            };
            let metrics = Arc::new(DecodeMetrics::new());
            let backend = MockDecode::spawn(shape, cfg, metrics.clone());
            let net = DecodeNet::new(token, &args.decode);
            Worker::Decode(DecodeServer::new(backend, metrics, public_url, net))
        }
        PoolKind::Prefill => {
            let cfg = EngineConfig {
                shape,
                latency,
                chunk_tokens: args.decode.prefill_chunk_tokens,
                kv: args.decode.kv.clone(),
                cache_tokens: args.decode.kv_cache_tokens,
                queue_capacity: args.decode.max_queue,
                kv_dtype: args.kv_dtype.unwrap_or(args.decode.kv.kv_cache_dtype),
            };
            let net = PrefillNet::from_args(&args.server, &args.destinations)
                .map_err(BuildError::Flags)?;
            let metrics = Arc::new(PrefillMetrics::new());
            let backend = MockPrefill::spawn(cfg, metrics.clone());
            Worker::Prefill(PrefillServer::new(backend, metrics, net))
        }
    })
}

impl Worker {
    /// The axum application: the worker layer's routes.
    pub fn app(&self) -> axum::Router {
        match self {
            Self::Decode(s) => s.routes(),
            Self::Prefill(s) => s.routes(),
        }
    }

    /// The worker, ready to serve, registering at `url`.
    pub fn service(&self, url: String) -> Service {
        match self {
            Self::Decode(s) => s.service(s.backend().shape().kv.fingerprint, WEIGHTS),
            Self::Prefill(s) => s.service(url, s.backend().shape().kv.fingerprint, WEIGHTS),
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

    pub fn readiness(&self) -> &Readiness {
        match self {
            Self::Decode(s) => s.readiness(),
            Self::Prefill(s) => s.readiness(),
        }
    }
}
