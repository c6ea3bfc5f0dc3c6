//! The pdserve router: the OpenAI-compatible API in front of the prefill and
//! decode pools. It tokenizes and validates requests, places each sequence on
//! a decode worker and (unless it is prefilled locally) a prefill worker,
//! relays the tokens back as text, and keeps the worker registry.

pub mod autoscaler;
pub mod config;
pub mod defaults;
pub mod discovery;
pub mod dispatch;
pub mod error;
pub mod frontend;
pub mod http;
pub mod metrics;
mod ndjson;
pub mod params;
pub mod policy;
pub mod registry;
pub mod request;
pub mod respond;
pub mod structured;
pub mod supervisor;
pub mod trace;

use std::sync::Arc;

use pdserve_protocol::internal::Pool;

pub use config::Args;
use dispatch::Dispatcher;
use frontend::Frontend;
use http::AppState;
use metrics::RouterMetrics;
use registry::Registry;

/// Builds the router's state: front end, registry (with the static workers),
/// dispatcher and metrics. Discovery loops are started separately.
pub fn build_state(args: &Args) -> anyhow::Result<Arc<AppState>> {
    args.validate().map_err(anyhow::Error::msg)?;
    let frontend = Frontend::load(&args.model, args.model_name(), args.limits())?;
    let registry = Arc::new(Registry::default());
    for url in &args.prefill_urls {
        registry.add_static(Pool::Prefill, url);
    }
    for url in &args.decode_urls {
        registry.add_static(Pool::Decode, url);
    }
    let metrics = Arc::new(RouterMetrics::new());
    let tuning = args.prefix_tuning();
    let policies = (
        policy::build(args.prefill_policy, Pool::Prefill, tuning),
        policy::build(args.decode_policy, Pool::Decode, tuning),
    );
    let internal = args.internal.token();
    let dispatcher = Arc::new(Dispatcher::new(
        registry.clone(),
        args.dispatch(),
        policies,
        metrics.clone(),
        &internal,
    ));
    Ok(Arc::new(AppState {
        frontend,
        dispatcher,
        registry,
        metrics: metrics.clone(),
        api_keys: args.api_keys.clone(),
        internal,
        worker_allow: args.worker_allow().map_err(anyhow::Error::msg)?,
        admission: request::Admission::new(args.limits().max_concurrent_requests, metrics.clone()),
        started: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or_default(),
    }))
}

pub fn build_app(state: Arc<AppState>) -> axum::Router {
    http::routes(state)
}

/// The router of `args` serving on `listener`, with its discovery loops,
/// until `stop` is cancelled; no local workers and no autoscaler. For
/// embedding a router in a test or a tool; the binary does more.
pub fn spawn(
    args: &Args,
    listener: tokio::net::TcpListener,
    stop: tokio_util::sync::CancellationToken,
) -> anyhow::Result<Arc<AppState>> {
    let state = build_state(args)?;
    discovery::spawn(
        state.registry.clone(),
        discovery_config(args),
        state.dispatcher.client().clone(),
        stop.clone(),
    );
    let app = build_app(state.clone());
    tokio::spawn(async move {
        let served = axum::serve(listener, app).with_graceful_shutdown(stop.cancelled_owned());
        if let Err(e) = served.await {
            tracing::error!("the embedded router stopped: {e}");
        }
    });
    Ok(state)
}

/// The discovery settings from the flags.
pub fn discovery_config(args: &Args) -> discovery::DiscoveryConfig {
    use std::time::Duration;
    discovery::DiscoveryConfig {
        prefill_dns: args.prefill_dns.clone(),
        decode_dns: args.decode_dns.clone(),
        dns_refresh: Duration::from_secs(args.dns_refresh_seconds),
        health_interval: Duration::from_millis(args.health_interval_ms),
        health_timeout: Duration::from_millis(args.health_timeout_ms),
        worker_timeout: Duration::from_millis(args.worker_timeout_ms),
    }
}
