use std::sync::Arc;

use clap::Parser;
use pdserve_prefill::{build, Args};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    pdserve_runtime::telemetry::init(&args.server.telemetry);
    tracing::info!(?args, "starting the prefill worker");
    let margs = args.model.clone();
    let model = Arc::new(tokio::task::spawn_blocking(move || margs.load()).await??);
    let (listener, url) = args.server.bind(args.port).await?;
    let server = build(model.clone(), &args);
    let service = server.service(url, model.fingerprint(), &args.model.weights.to_string());
    pdserve_worker::serve(listener, service, &args.server).await?;
    Ok(())
}
