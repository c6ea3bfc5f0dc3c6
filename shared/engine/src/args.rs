//! The model flags every worker shares, flattened into each binary's arguments.

use std::path::PathBuf;
use std::time::Instant;

use clap::Args;

use crate::error::{EngineError, Result};
use crate::model::{LoadOptions, Model};
use crate::quant::{set_kernel, KernelChoice};
use crate::weights::WeightFormat;

/// Which model to load, and how.
#[derive(Args, Debug, Clone)]
pub struct ModelArgs {
    /// GGUF model file.
    #[arg(long = "model", env = "PDSERVE_MODEL")]
    pub path: PathBuf,
    /// Weight format: native, q8_0 or f32. Prefill and decode workers must match.
    #[arg(long, env = "PDSERVE_WEIGHTS", default_value = "native")]
    pub weights: WeightFormat,
    /// Kernel path for `native` weights: auto (the best this CPU has),
    /// avx512vnni, avx2 or scalar. Every path gives the same bits.
    #[arg(long, env = "PDSERVE_KERNEL", default_value = "auto")]
    pub kernel: KernelChoice,
    /// Device: cpu, or cuda[:N] in a CUDA build.
    #[arg(long, env = "PDSERVE_DEVICE", default_value = "cpu")]
    pub device: String,
    /// Threads for the model (0 = one per core).
    #[arg(long, env = "PDSERVE_THREADS", default_value_t = 0)]
    pub threads: usize,
}

impl ModelArgs {
    /// Sizes the thread pools, then loads the model (blocking: call it off the async runtime).
    pub fn load(&self) -> Result<Model> {
        let threads = crate::threads::configure(self.threads);
        let kernel = set_kernel(self.kernel).map_err(EngineError::unsupported)?;
        let device = crate::device::parse_device(&self.device)?;
        let started = Instant::now();
        let opts = LoadOptions {
            weights: self.weights,
            device,
        };
        let model = Model::load(&self.path, &opts)?;
        tracing::info!(
            path = %self.path.display(),
            weights = %self.weights,
            %kernel,
            threads,
            secs = started.elapsed().as_secs_f64(),
            fingerprint = model.fingerprint(),
            "model loaded"
        );
        Ok(model)
    }
}
