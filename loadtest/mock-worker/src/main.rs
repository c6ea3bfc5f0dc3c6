use clap::Parser;
use pdserve_mock_worker::{build, Args};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    pdserve_runtime::telemetry::init(&args.server.telemetry);
    tracing::info!(?args, "starting a mock worker");
    let (listener, url) = args.server.bind(args.port).await?;
    let worker = build(&args, url.clone())?;
    pdserve_worker::serve(listener, worker.service(url), &args.server).await?;
    Ok(())
}
