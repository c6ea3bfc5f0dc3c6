use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use clap::Parser;
use pdserve_prefill::{build_app, build_state, Args};
use pdserve_protocol::internal::{Pool, WorkerRegistration};
use pdserve_runtime::registration;
use pdserve_runtime::shutdown::{self, Drain};
use tokio_util::sync::CancellationToken;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    pdserve_runtime::telemetry::init(&args.telemetry);
    tracing::info!(?args, "starting the prefill worker");
    let margs = args.model.clone();
    let model = tokio::task::spawn_blocking(move || margs.load()).await??;
    let listener = pdserve_runtime::http::listen(&args.host, args.port).await?;
    let addr = listener.local_addr()?;
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
    let token = CancellationToken::new();
    shutdown::cancel_on_signal(token.clone());
    let s = state.clone();
    let load = Arc::new(move || pdserve_prefill::http::load_report(&s));
    let registered = registration::start(&args.registration, registration, load, token.clone());
    // Queued and running jobs, and jobs still delivering their KV.
    let (s1, s2) = (state.clone(), state.clone());
    let drain = Drain {
        stop_accepting: Box::new(move || s1.ready.store(false, Ordering::Relaxed)),
        in_flight: Box::new(move || s2.in_flight()),
        deadline: Duration::from_secs(args.drain.drain_seconds),
    };
    shutdown::serve(listener, build_app(state), token, drain).await?;
    registration::finish(registered).await;
    tracing::info!("stopped");
    Ok(())
}
