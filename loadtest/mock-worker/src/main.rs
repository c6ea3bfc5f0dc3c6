use clap::Parser;
use pdserve_mock_worker::{build, Args, PoolKind};

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let service = match args.pool {
        PoolKind::Prefill => "pdserve-mock-prefill",
        PoolKind::Decode => "pdserve-mock-decode",
    };
    pdserve_runtime::telemetry::init(&args.server.telemetry, service);
    pdserve_runtime::run(serve(args))
}

async fn serve(args: Args) -> anyhow::Result<()> {
    tracing::info!(?args, "starting a mock worker");
    let (listener, url) = args.server.bind(args.port).await?;
    let worker = build(&args, url.clone())?;
    pdserve_worker::serve(listener, worker.service(url), &args.server).await?;
    Ok(())
}
