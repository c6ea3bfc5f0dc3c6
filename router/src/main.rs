use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Parser;
use pdserve_protocol::internal::Pool;
use pdserve_router::autoscaler::{self, Executor, ExecutorKind, ExportOnly, LocalExecutor};
use pdserve_router::http::AppState;
use pdserve_router::supervisor::{Supervisor, SupervisorConfig};
use pdserve_router::{build_app, build_state, discovery, discovery_config, Args};
use pdserve_runtime::auth::Secret;
use tokio_util::sync::CancellationToken;

/// mimalloc instead of the system allocator: the router allocates small,
/// short-lived buffers for every relayed token (frames, lines, SSE chunks),
/// where glibc's malloc took a sixth of the router's CPU at 1,000 streams
/// (docs/benchmarks.md).
#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> anyhow::Result<()> {
    let mut args = Args::parse();
    pdserve_runtime::telemetry::init(&args.telemetry, "pdserve-router");
    let local = args.local.local_prefill + args.local.local_decode > 0;
    if local && !args.internal.token().is_set() {
        // The workers this router starts get a token nobody else knows.
        tracing::info!("generated an internal token for the local workers");
        args.internal.internal_token = Some(Secret::generate());
    }
    args.internal.token().warn_if_unset("router");
    pdserve_runtime::run(run(args))
}

async fn run(args: Args) -> anyhow::Result<()> {
    tracing::info!(?args, "starting the router");
    let state = build_state(&args)?;
    let listener = tokio::net::TcpListener::bind((args.host.as_str(), args.port))
        .await
        .with_context(|| format!("binding {}:{}", args.host, args.port))?;
    let addr = listener.local_addr()?;
    let shutdown = CancellationToken::new();
    pdserve_runtime::shutdown::cancel_on_signal(shutdown.clone());
    discovery::spawn(
        state.registry.clone(),
        discovery_config(&args),
        state.dispatcher.client().clone(),
        shutdown.clone(),
    );
    let drain = Duration::from_secs(args.drain_seconds);
    let local = local_workers(&args, addr.port(), drain);
    let executor = executor(&args, &state, local.as_ref())?;
    autoscaler::spawn(
        state.registry.clone(),
        state.metrics.clone(),
        executor,
        args.autoscaler.clone(),
        shutdown.clone(),
    );
    tracing::info!(%addr, model = %state.frontend.model_name, "listening");
    serve(listener, state, shutdown, drain).await?;
    if let Some(sup) = local {
        sup.shutdown().await;
    }
    tracing::info!("stopped");
    Ok(())
}

/// Starts the local workers the flags ask for, registering with this router.
fn local_workers(args: &Args, port: u16, drain: Duration) -> Option<Arc<Supervisor>> {
    if args.local.local_prefill + args.local.local_decode == 0 {
        return None;
    }
    let router_url = format!("http://127.0.0.1:{port}");
    let token = args.internal.token().secret().cloned();
    let mut cfg = SupervisorConfig::new(&args.local, &args.model, router_url, drain, token);
    cfg.otlp_endpoint = args.telemetry.otlp_endpoint.clone();
    tracing::info!(?cfg, "starting local workers");
    let sup = Supervisor::new(cfg);
    (0..args.local.local_prefill).for_each(|_| sup.spawn(Pool::Prefill));
    (0..args.local.local_decode).for_each(|_| sup.spawn(Pool::Decode));
    Some(sup)
}

/// What carries out the autoscaler's decisions: the local supervisor, or
/// nobody (the decisions are only exported, for KEDA).
fn executor(
    args: &Args,
    state: &AppState,
    local: Option<&Arc<Supervisor>>,
) -> anyhow::Result<Arc<dyn Executor>> {
    Ok(match (args.autoscaler.autoscaler_executor, local) {
        (Some(ExecutorKind::Local) | None, Some(sup)) => Arc::new(LocalExecutor(sup.clone())),
        (Some(ExecutorKind::Local), None) => {
            anyhow::bail!(
                "--autoscaler-executor local needs local workers (--local-prefill/--local-decode)"
            )
        }
        (_, _) => Arc::new(ExportOnly(state.registry.clone())),
    })
}

/// Serves until `shutdown`, then refuses new requests and lets those in
/// flight finish, for at most `drain`: what is still open then is cut.
async fn serve(
    listener: tokio::net::TcpListener,
    state: Arc<AppState>,
    shutdown: CancellationToken,
    drain: Duration,
) -> std::io::Result<()> {
    let s = state.clone();
    let stop = shutdown.clone();
    let graceful = async move {
        stop.cancelled().await;
        s.admission.stop_accepting();
        let until = Instant::now() + drain;
        while Instant::now() < until && s.admission.in_flight() > 0 {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        tracing::info!("requests drained");
    };
    let served = axum::serve(
        pdserve_runtime::shutdown::no_delay(listener),
        build_app(state.clone()),
    )
    .with_graceful_shutdown(graceful);
    // The graceful shutdown also waits for idle keep-alive connections and
    // streams that outlive the drain: bound it.
    let deadline = async {
        shutdown.cancelled().await;
        tokio::time::sleep(drain + Duration::from_secs(1)).await;
    };
    tokio::select! {
        r = served => r,
        () = deadline => {
            let cut = state.admission.in_flight();
            tracing::warn!(cut, "the drain deadline passed: closing what is still open");
            Ok(())
        }
    }
}
