use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Parser;
use pdserve_prefill::http::AppState;
use pdserve_prefill::{build_app, build_state, Args};
use pdserve_protocol::internal::{Pool, WorkerRegistration};
use pdserve_runtime::registration;
use tokio_util::sync::CancellationToken;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    pdserve_runtime::telemetry::init(&args.telemetry);
    tracing::info!(?args, "starting the prefill worker");
    let margs = args.model.clone();
    let model = tokio::task::spawn_blocking(move || margs.load()).await??;
    let listener = tokio::net::TcpListener::bind((args.host.as_str(), args.port))
        .await
        .with_context(|| format!("binding {}:{}", args.host, args.port))?;
    let addr = listener.local_addr()?;
    tracing::info!(%addr, "listening");
    let registration = WorkerRegistration {
        pool: Pool::Prefill,
        url: args
            .public_url
            .clone()
            .unwrap_or_else(|| format!("http://{addr}")),
        model_fingerprint: model.fingerprint(),
        weights: args.model.weights.to_string(),
    };
    let state = build_state(Arc::new(model), &args);
    let shutdown = CancellationToken::new();
    pdserve_runtime::shutdown::cancel_on_signal(shutdown.clone());
    if let Some(router) = args.registration.router_url.clone() {
        let s = state.clone();
        let load = Arc::new(move || pdserve_prefill::http::load_report(&s));
        let every = Duration::from_millis(args.registration.heartbeat_ms);
        registration::spawn(router, registration, every, load, shutdown.clone());
    }
    let drain = drain(
        state.clone(),
        shutdown,
        Duration::from_secs(args.drain_seconds),
    );
    axum::serve(listener, build_app(state))
        .with_graceful_shutdown(drain)
        .await?;
    tracing::info!("stopped");
    Ok(())
}

/// On shutdown: refuse new jobs, let queued and running ones deliver their KV
/// (bounded by `deadline`), then let the server close.
async fn drain(state: Arc<AppState>, token: CancellationToken, deadline: Duration) {
    token.cancelled().await;
    state.ready.store(false, Ordering::Relaxed);
    let until = Instant::now() + deadline;
    while Instant::now() < until && state.engine.in_flight() > 0 {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tracing::info!("drained");
}
