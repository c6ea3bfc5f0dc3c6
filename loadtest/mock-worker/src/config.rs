//! Command-line flags (each with an environment variable). Where a real
//! worker's variable would mean something else here, the name is
//! `PDSERVE_MOCK_*`.

use std::path::PathBuf;

use clap::{Args as ClapArgs, Parser, ValueEnum};
use pdserve_protocol::kvwire::KvDtype;
use pdserve_worker::decode::DecodeArgs;
use pdserve_worker::prefill::DestinationArgs;
use pdserve_worker::ServerArgs;

use crate::latency::{read_profile, FitError, LatencyModel};

/// Which pool the mock serves in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum PoolKind {
    Prefill,
    Decode,
}

/// pdserve mock worker: a prefill or decode worker that loads no weights,
/// speaks the real internal protocol and takes the time a latency model says.
#[derive(Parser, Debug, Clone)]
#[command(name = "pdserve-mock-worker", version, about)]
pub struct Args {
    /// The pool to serve in.
    #[arg(long, env = "PDSERVE_MOCK_POOL", value_enum)]
    pub pool: PoolKind,
    /// Port to listen on (0 picks a free one).
    #[arg(long, env = "PDSERVE_MOCK_PORT", default_value_t = 0)]
    pub port: u16,
    /// GGUF file whose header gives the shape (layers, KV heads, head dim, vocabulary, context); its weights are never read.
    #[arg(long, env = "PDSERVE_MODEL")]
    pub model: PathBuf,
    /// The decode scheduler's limits; a prefill mock uses its chunk size
    /// (KV frames) and queue length.
    #[command(flatten)]
    pub decode: DecodeArgs,
    /// Prefill: KV element type on the wire, f32 or f16 (default: the
    /// cache's, --kv-cache-dtype, as a real prefill worker sends).
    #[arg(long, env = "PDSERVE_KV_DTYPE")]
    pub kv_dtype: Option<KvDtype>,
    #[command(flatten)]
    pub latency: LatencyArgs,
    /// Prefill: where KV may go (as a real prefill worker).
    #[command(flatten)]
    pub destinations: DestinationArgs,
    #[command(flatten)]
    pub server: ServerArgs,
}

/// The latency model's terms. Defaults: SmolLM2-135M q8_0 on 2 cores
/// (docs/benchmarks.md).
#[derive(ClapArgs, Debug, Clone)]
pub struct LatencyArgs {
    /// Prefill milliseconds per prompt token (a).
    #[arg(long, env = "PDSERVE_MOCK_PREFILL_MS_PER_TOKEN", default_value_t = 1.8)]
    pub prefill_ms_per_token: f64,
    /// Prefill milliseconds per prompt (b).
    #[arg(long, env = "PDSERVE_MOCK_PREFILL_FIXED_MS", default_value_t = 5.0)]
    pub prefill_fixed_ms: f64,
    /// Milliseconds per decode step (c).
    #[arg(long, env = "PDSERVE_MOCK_STEP_FIXED_MS", default_value_t = 6.7)]
    pub step_fixed_ms: f64,
    /// Decode-step milliseconds per sequence in the batch (d).
    #[arg(long, env = "PDSERVE_MOCK_STEP_MS_PER_SEQ", default_value_t = 2.5)]
    pub step_ms_per_seq: f64,
    /// Decode-step milliseconds per context token in the batch (e).
    #[arg(
        long,
        env = "PDSERVE_MOCK_STEP_MS_PER_CONTEXT_TOKEN",
        default_value_t = 0.0
    )]
    pub step_ms_per_context_token: f64,
    /// Multiplies every term (0: as fast as possible, for router-overhead tests).
    #[arg(long, env = "PDSERVE_MOCK_LATENCY_SCALE", default_value_t = 1.0)]
    pub latency_scale: f64,
    /// JSON from `pdserve-loadtest engine --json`: a, b, c and d are fitted from it instead.
    #[arg(long, env = "PDSERVE_MOCK_FIT_FROM")]
    pub fit_from: Option<PathBuf>,
    /// Which weights' result of a multi-result --fit-from file to use.
    #[arg(long, env = "PDSERVE_MOCK_FIT_WEIGHTS", default_value = "q8_0")]
    pub fit_weights: String,
}

impl LatencyArgs {
    /// The validated model, fitted when `--fit-from` is given.
    pub fn model(&self) -> Result<LatencyModel, FitError> {
        let ms = 1e-3;
        let flags = LatencyModel {
            prefill_per_token: self.prefill_ms_per_token * ms,
            prefill_fixed: self.prefill_fixed_ms * ms,
            step_fixed: self.step_fixed_ms * ms,
            step_per_seq: self.step_ms_per_seq * ms,
            step_per_context_token: self.step_ms_per_context_token * ms,
            scale: self.latency_scale,
        };
        let model = match &self.fit_from {
            Some(path) => flags.fitted(&read_profile(path, &self.fit_weights)?)?,
            None => flags,
        };
        model.validate()?;
        Ok(model)
    }
}
