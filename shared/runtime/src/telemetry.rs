//! Logging setup, shared by every binary.

use clap::Args;
use tracing_subscriber::EnvFilter;

/// Logging flags, flattened into each binary's arguments.
#[derive(Args, Debug, Clone)]
pub struct TelemetryArgs {
    /// Log filter, in `RUST_LOG` syntax.
    #[arg(long, env = "PDSERVE_LOG", default_value = "info")]
    pub log: String,
    /// Log one JSON object per line instead of text.
    #[arg(long, env = "PDSERVE_LOG_JSON")]
    pub log_json: bool,
}

/// Installs the global subscriber (a second call is a no-op).
pub fn init(args: &TelemetryArgs) {
    let filter = EnvFilter::try_new(&args.log).unwrap_or_else(|_| EnvFilter::new("info"));
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_target(false)
        .with_ansi(ansi)
        .with_writer(std::io::stderr);
    let _ = match args.log_json {
        true => builder.json().try_init(),
        false => builder.try_init(),
    };
}
