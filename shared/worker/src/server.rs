//! Running a worker process: the flags every worker shares, and the server
//! loop: listen, register and heartbeat, serve, drain on SIGTERM, deregister.

use std::sync::Arc;
use std::time::Duration;

use clap::Args;
use pdserve_protocol::internal::{LoadReport, Pool, WorkerRegistration};
use pdserve_runtime::auth::InternalAuthArgs;
use pdserve_runtime::shutdown::{self, Drain, DrainArgs};
use pdserve_runtime::telemetry::TelemetryArgs;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use pdserve_runtime::auth::InternalToken;

use crate::readiness::Readiness;
use crate::registration::{self, RegistrationArgs};

/// The flags of every worker binary but its port (whose variable and
/// default differ by binary).
#[derive(Args, Debug, Clone)]
pub struct ServerArgs {
    /// Address to listen on.
    #[arg(long, env = "PDSERVE_HOST", default_value = "127.0.0.1")]
    pub host: String,
    /// Base URL at which the router and other workers reach this worker
    /// (default: http://HOST:PORT as bound).
    #[arg(long, env = "PDSERVE_PUBLIC_URL")]
    pub public_url: Option<String>,
    #[command(flatten)]
    pub drain: DrainArgs,
    #[command(flatten)]
    pub registration: RegistrationArgs,
    #[command(flatten)]
    pub auth: InternalAuthArgs,
    #[command(flatten)]
    pub telemetry: TelemetryArgs,
}

impl ServerArgs {
    /// Binds `port` on `--host`; returns the listener and the worker's public URL.
    pub async fn bind(&self, port: u16) -> std::io::Result<(TcpListener, String)> {
        let listener = crate::http::listen(&self.host, port).await?;
        let addr = listener.local_addr()?;
        let url = self
            .public_url
            .clone()
            .unwrap_or_else(|| format!("http://{addr}"));
        Ok((listener, url))
    }
}

/// A worker server, as the serve loop sees it.
pub trait Served: Send + Sync + 'static {
    /// The worker's routes.
    fn routes(self: &Arc<Self>) -> axum::Router;
    /// The load report the router balances and scales on.
    fn load_report(&self) -> LoadReport;
    fn readiness(&self) -> &Readiness;
    /// Draining starts, to end by `deadline`: stop taking work (and hand
    /// back what cannot finish in time).
    fn start_drain(self: &Arc<Self>, _deadline: std::time::Instant) {
        self.readiness().stop();
    }
    /// Work still in flight: queued, running, or delivering its result.
    fn in_flight(&self) -> u64;
    /// `GET /metrics`.
    fn metrics_page(&self) -> axum::response::Response;
}

/// A worker's routes: `internal` and `/load` behind the internal token,
/// and the open ones, `/health`, `/ready` (503 while draining) and `/metrics`.
pub fn worker_routes<S: Served>(
    server: &Arc<S>,
    token: &InternalToken,
    internal: axum::Router<Arc<S>>,
) -> axum::Router {
    use axum::extract::State;
    use axum::routing::get;
    let internal = internal.layer(axum::middleware::from_fn(crate::trace::middleware));
    let internal = internal.route(
        "/load",
        get(|State(s): State<Arc<S>>| async move { axum::Json(s.load_report()) }),
    );
    let open = axum::Router::new()
        .route("/health", get(|| async { "ok" }))
        .route(
            "/ready",
            get(|State(s): State<Arc<S>>| async move { s.readiness().status() }),
        )
        .route(
            "/metrics",
            get(|State(s): State<Arc<S>>| async move { s.metrics_page() }),
        );
    token
        .protect(internal)
        .merge(open)
        .with_state(server.clone())
}

/// A built worker, ready to serve: its routes, what it registers as, its
/// load report and what its drain needs.
pub struct Service {
    pub app: axum::Router,
    pub registration: WorkerRegistration,
    pub load: Arc<dyn Fn() -> LoadReport + Send + Sync>,
    /// Turns readiness off (called once when draining starts, with its deadline).
    pub stop_accepting: Box<dyn FnOnce(std::time::Instant) + Send>,
    /// Work still in flight: queued, running, or delivering its result.
    pub in_flight: Box<dyn Fn() -> u64 + Send + Sync>,
}

impl Service {
    /// `server`, registering as a worker of `pool` at `url` with
    /// `fingerprint` and `weights`.
    pub fn new<S: Served>(
        server: &Arc<S>,
        pool: Pool,
        url: String,
        fingerprint: u64,
        weights: &str,
    ) -> Self {
        let (load, stop, count) = (server.clone(), server.clone(), server.clone());
        Service {
            app: server.routes(),
            registration: WorkerRegistration {
                pool,
                url,
                model_fingerprint: fingerprint,
                weights: weights.to_string(),
                worker_id: None,
            },
            load: Arc::new(move || load.load_report()),
            stop_accepting: Box::new(move |deadline| stop.start_drain(deadline)),
            in_flight: Box::new(move || count.in_flight()),
        }
    }
}

/// Serves `service` on `listener` until SIGTERM or Ctrl-C, then drains (at
/// most `--drain-seconds`), deregisters from the router and returns.
pub async fn serve(
    listener: TcpListener,
    service: Service,
    args: &ServerArgs,
) -> std::io::Result<()> {
    let token = CancellationToken::new();
    shutdown::cancel_on_signal(token.clone());
    // Only now: whoever waits for this line may signal at once.
    tracing::info!(addr = %listener.local_addr()?, "listening");
    let internal = args.auth.token();
    internal.warn_if_unset("worker");
    let load = service.load.clone();
    let registered = registration::start(
        &args.registration,
        &internal,
        service.registration,
        service.load,
        token.clone(),
    );
    let drain = Drain {
        stop_accepting: service.stop_accepting,
        in_flight: service.in_flight,
        deadline: Duration::from_secs(args.drain.drain_seconds),
    };
    shutdown::serve(listener, service.app, token, drain).await?;
    // The deregistration starts with the drain; let it reach the router.
    registration::finish(registered).await;
    // What it still holds as it exits: nothing, after a full drain.
    let last = load();
    tracing::info!(
        active_sequences = last.active_sequences,
        queued_requests = last.queued_requests,
        kv_used_tokens = last.kv_used_tokens,
        "stopped"
    );
    Ok(())
}
