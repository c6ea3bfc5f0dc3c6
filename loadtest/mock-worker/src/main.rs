use clap::Parser;
use pdserve_mock_worker::{build, Args};

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    pdserve_runtime::telemetry::init(&args.server.telemetry);
    pdserve_runtime::run(serve(args))
}

async fn serve(args: Args) -> anyhow::Result<()> {
    tracing::info!(?args, "starting a mock worker");
    let (listener, url) = args.server.bind(args.port).await?;
    let worker = build(&args, url.clone())?;
    pdserve_worker::serve(listener, worker.service(url), &args.server).await?;
    Ok(())
}
