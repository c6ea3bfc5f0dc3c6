use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use clap::Parser;
use pdserve_decode::{build_app, build_state, Args};
use pdserve_engine::Tokenizer;
use pdserve_protocol::internal::{Pool, WorkerRegistration};
use pdserve_runtime::registration;
use pdserve_runtime::shutdown::{self, Drain};
use tokio_util::sync::CancellationToken;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    pdserve_runtime::telemetry::init(&args.telemetry);
    tracing::info!(?args, "starting the decode worker");
    let margs = args.model.clone();
    let model = tokio::task::spawn_blocking(move || margs.load()).await??;
    let tokenizer = Tokenizer::from_gguf_file(&args.model.path)?;
    let listener = pdserve_runtime::http::listen(&args.host, args.port).await?;
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
    let token = CancellationToken::new();
    shutdown::cancel_on_signal(token.clone());
    let s = state.clone();
    let load = Arc::new(move || pdserve_decode::http::load_report(&s));
    let registered = registration::start(&args.registration, registration, load, token.clone());
    // Queued and running sequences, and reservations still waiting for their KV.
    let (s1, s2) = (state.clone(), state.clone());
    let drain = Drain {
        stop_accepting: Box::new(move || s1.ready.store(false, Ordering::Relaxed)),
        in_flight: Box::new(move || s2.engine.in_flight() + s2.pending().len() as u64),
        deadline: Duration::from_secs(args.drain.drain_seconds),
    };
    shutdown::serve(listener, build_app(state), token, drain).await?;
    registration::finish(registered).await;
    tracing::info!("stopped");
    Ok(())
}
