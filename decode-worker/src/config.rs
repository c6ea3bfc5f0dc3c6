//! Command-line flags (each with an environment variable).

use clap::Parser;
use pdserve_engine::args::ModelArgs;
use pdserve_worker::decode::DecodeArgs;
use pdserve_worker::ServerArgs;

/// pdserve decode worker.
#[derive(Parser, Debug, Clone)]
#[command(name = "pdserve-decode", version, about)]
pub struct Args {
    /// Port to listen on (0 picks a free one).
    #[arg(long, env = "PDSERVE_DECODE_PORT", default_value_t = 8200)]
    pub port: u16,
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub decode: DecodeArgs,
    /// Peak memory bandwidth of this machine in GB/s, for the bandwidth-utilisation (MBU) estimate.
    #[arg(
        long,
        env = "PDSERVE_PEAK_MEMORY_BANDWIDTH_GBPS",
        default_value_t = 46.0
    )]
    pub peak_memory_bandwidth_gbps: f64,
    #[command(flatten)]
    pub server: ServerArgs,
}
