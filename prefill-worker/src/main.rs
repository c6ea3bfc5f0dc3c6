use std::sync::Arc;

use clap::Parser;
use pdserve_prefill::{build, Args};

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    // Before any thread exists: the thread pools read these at first use.
    pdserve_engine::threads::set_env(args.model.threads);
    pdserve_runtime::telemetry::init(&args.server.telemetry, "pdserve-prefill");
    pdserve_runtime::run(serve(args))
}

async fn serve(args: Args) -> anyhow::Result<()> {
    tracing::info!(?args, "starting the prefill worker");
    let margs = args.model.clone();
    let model = Arc::new(tokio::task::spawn_blocking(move || margs.load()).await??);
    let (listener, url) = args.server.bind(args.port).await?;
    let server = build(model.clone(), &args).map_err(anyhow::Error::msg)?;
    let fingerprint = model.kv_fingerprint(args.kv.kv_cache_dtype.into());
    let service = server.service(url, fingerprint, &args.model.weights.to_string());
    pdserve_worker::serve(listener, service, &args.server).await?;
    Ok(())
}
