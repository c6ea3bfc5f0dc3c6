use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Parser;
use pdserve_decode::{build_app, build_state, Args};
use pdserve_engine::Tokenizer;
use pdserve_protocol::internal::{Pool, WorkerRegistration};
use pdserve_runtime::registration;
use tokio_util::sync::CancellationToken;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    pdserve_runtime::telemetry::init(&args.telemetry);
    tracing::info!(?args, "starting the decode worker");
    let margs = args.model.clone();
    let model = tokio::task::spawn_blocking(move || margs.load()).await??;
    let tokenizer = Tokenizer::from_gguf_file(&args.model.path)?;
    let listener = tokio::net::TcpListener::bind((args.host.as_str(), args.port))
        .await
        .with_context(|| format!("binding {}:{}", args.host, args.port))?;
    let addr = listener.local_addr()?;
    let public_url = args
        .public_url
        .clone()
        .unwrap_or_else(|| format!("http://{addr}"));
    let registration = WorkerRegistration {
        pool: Pool::Decode,
        url: public_url.clone(),
        model_fingerprint: model.fingerprint(),
        weights: args.model.weights.to_string(),
    };
    let state = build_state(Arc::new(model), tokenizer.eos_token_id(), &args, public_url);
    let shutdown = CancellationToken::new();
    pdserve_runtime::shutdown::cancel_on_signal(shutdown.clone());
    if let Some(router) = args.registration.router_url.clone() {
        let s = state.clone();
        let load = Arc::new(move || pdserve_decode::http::load_report(&s));
        let every = Duration::from_millis(args.registration.heartbeat_ms);
        registration::spawn(router, registration, every, load, shutdown.clone());
    }
    tracing::info!(%addr, "listening");
    let drain = drain(
        state.clone(),
        shutdown.clone(),
        Duration::from_secs(args.drain_seconds),
    );
    let server = axum::serve(listener, build_app(state)).with_graceful_shutdown(drain);
    server.await?;
    tracing::info!("stopped");
    Ok(())
}

/// On shutdown: stop taking work, let in-flight sequences finish (bounded by
/// `deadline`), then let the server close.
async fn drain(
    state: Arc<pdserve_decode::state::AppState>,
    token: CancellationToken,
    deadline: Duration,
) {
    token.cancelled().await;
    state.ready.store(false, Ordering::Relaxed);
    let until = Instant::now() + deadline;
    while Instant::now() < until && (state.engine.in_flight() > 0 || !state.pending().is_empty()) {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tracing::info!("drained");
}
