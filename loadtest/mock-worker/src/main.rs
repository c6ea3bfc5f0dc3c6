use std::sync::Arc;
use std::time::Duration;

use clap::Parser;
use pdserve_mock_worker::{build, Args};
use pdserve_runtime::{registration, shutdown};
use tokio_util::sync::CancellationToken;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    pdserve_runtime::telemetry::init(&args.telemetry);
    tracing::info!(?args, "starting a mock worker");
    let listener = pdserve_runtime::http::listen(&args.host, args.port).await?;
    let addr = listener.local_addr()?;
    let public_url = args
        .public_url
        .clone()
        .unwrap_or_else(|| format!("http://{addr}"));
    let worker = build(&args, public_url.clone())?;
    let token = CancellationToken::new();
    shutdown::cancel_on_signal(token.clone());
    let registered = args.registration.router_url.clone().map(|router| {
        let w = worker.clone();
        let load = Arc::new(move || w.load_report());
        let every = Duration::from_millis(args.registration.heartbeat_ms);
        let reg = worker.registration(public_url);
        registration::spawn(router, reg, every, load, token.clone())
    });
    let drain = worker.drain(Duration::from_secs(args.drain.drain_seconds));
    shutdown::serve(listener, worker.app(), token, drain).await?;
    // The deregistration starts with the drain; let it reach the router before exiting.
    if let Some(task) = registered {
        let _ = tokio::time::timeout(Duration::from_secs(3), task).await;
    }
    tracing::info!("stopped");
    Ok(())
}
