//! The model flags every worker shares, flattened into each binary's arguments.

use std::path::PathBuf;
use std::time::Instant;

use clap::Args;

use crate::error::Result;
use crate::model::{LoadOptions, Model};
use crate::weights::WeightFormat;

/// Which model to load, and how.
#[derive(Args, Debug, Clone)]
pub struct ModelArgs {
    /// GGUF model file.
    #[arg(long = "model", env = "PDSERVE_MODEL")]
    pub path: PathBuf,
    /// Weight format: q8_0, f32 or native. Prefill and decode workers must match.
    #[arg(long, env = "PDSERVE_WEIGHTS", default_value = "q8_0")]
    pub weights: WeightFormat,
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
            threads,
            secs = started.elapsed().as_secs_f64(),
            fingerprint = model.fingerprint(),
            "model loaded"
        );
        Ok(model)
    }
}
