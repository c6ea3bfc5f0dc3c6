use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::Parser;
use pdserve_mock_worker::{build, Args};
use pdserve_runtime::registration;
use tokio_util::sync::CancellationToken;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    pdserve_runtime::telemetry::init(&args.telemetry);
    let listener = tokio::net::TcpListener::bind((args.host.as_str(), args.port))
        .await
        .with_context(|| format!("binding {}:{}", args.host, args.port))?;
    let addr = listener.local_addr()?;
    let public_url = args
        .public_url
        .clone()
        .unwrap_or_else(|| format!("http://{addr}"));
    let worker = build(&args, public_url.clone())?;
    tracing::info!(?args, "starting a mock worker");
    let shutdown = CancellationToken::new();
    pdserve_runtime::shutdown::cancel_on_signal(shutdown.clone());
    let registered = args.registration.router_url.clone().map(|router| {
        let w = worker.clone();
        let load = Arc::new(move || w.load_report());
        let every = Duration::from_millis(args.registration.heartbeat_ms);
        let reg = worker.registration(public_url);
        registration::spawn(router, reg, every, load, shutdown.clone())
    });
    tracing::info!(%addr, "listening");
    let w = worker.clone();
    let deadline = Duration::from_secs(args.drain_seconds);
    let drain = async move {
        pdserve_mock_worker::server::drain(w.readiness(), || w.in_flight(), shutdown, deadline)
            .await
    };
    axum::serve(listener, worker.app())
        .with_graceful_shutdown(drain)
        .await?;
    // The deregistration starts with the drain; let it reach the router before exiting.
    if let Some(task) = registered {
        let _ = tokio::time::timeout(Duration::from_secs(3), task).await;
    }
    tracing::info!("stopped");
    Ok(())
}
