//! A worker's side of discovery: register with the router, heartbeat the
//! load report, deregister when draining. The router may be down or slow;
//! the worker keeps serving and keeps trying.

use std::sync::Arc;
use std::time::Duration;

use clap::Args;
use pdserve_protocol::internal::{Deregistration, Heartbeat, LoadReport, WorkerRegistration};
use pdserve_runtime::auth::{InternalToken, Secret};
use serde::Serialize;
use tokio_util::sync::CancellationToken;

/// Registration flags, flattened into each worker's arguments.
#[derive(Args, Debug, Clone)]
pub struct RegistrationArgs {
    /// The routers to register with and heartbeat to, comma-separated (none:
    /// the routers must be told about this worker by their static lists or
    /// DNS). Several routers behind one address each get the same reports,
    /// so each places work as the others would, and losing one loses only
    /// the streams it carried.
    #[arg(long, env = "PDSERVE_ROUTER_URL", value_delimiter = ',')]
    pub router_url: Vec<String>,
    /// Milliseconds between heartbeats.
    #[arg(long, env = "PDSERVE_HEARTBEAT_MS", default_value_t = 500)]
    pub heartbeat_ms: u64,
    /// This worker's identity at the router (default: random per process).
    /// The router refuses a known id registering from another URL.
    #[arg(long, env = "PDSERVE_WORKER_ID")]
    pub worker_id: Option<String>,
}

impl RegistrationArgs {
    /// The routers, without empty entries or trailing slashes.
    pub fn routers(&self) -> Vec<String> {
        let mut out: Vec<String> = Vec::new();
        for r in &self.router_url {
            let r = r.trim().trim_end_matches('/');
            if !r.is_empty() && !out.iter().any(|o| o == r) {
                out.push(r.to_string());
            }
        }
        out
    }
}

/// Starts [`spawn`] for each router of `--router-url`, all under one worker
/// id: every router knows this worker by the same identity.
pub fn start(
    args: &RegistrationArgs,
    token: &InternalToken,
    mut registration: WorkerRegistration,
    load: Arc<dyn Fn() -> LoadReport + Send + Sync>,
    stop: CancellationToken,
) -> Vec<tokio::task::JoinHandle<()>> {
    let routers = args.routers();
    if routers.is_empty() {
        return Vec::new();
    }
    let every = Duration::from_millis(args.heartbeat_ms);
    let id = args.worker_id.clone();
    registration.worker_id =
        Some(id.unwrap_or_else(|| Secret::generate().expose()[..16].to_string()));
    routers
        .into_iter()
        .map(|router| {
            let reg = registration.clone();
            spawn(router, reg, every, token, load.clone(), stop.clone())
        })
        .collect()
}

/// Waits (briefly) for the deregistrations to reach the routers, so a worker
/// that drained at once does not exit before saying so.
pub async fn finish(tasks: Vec<tokio::task::JoinHandle<()>>) {
    let all = futures_util::future::join_all(tasks);
    let _ = tokio::time::timeout(Duration::from_secs(3), all).await;
}

/// Registers, then heartbeats `load()` until `stop` is cancelled, then deregisters.
pub fn spawn(
    router_url: String,
    registration: WorkerRegistration,
    every: Duration,
    token: &InternalToken,
    load: Arc<dyn Fn() -> LoadReport + Send + Sync>,
    stop: CancellationToken,
) -> tokio::task::JoinHandle<()> {
    let headers = token.client_headers();
    tokio::spawn(async move {
        let client = reqwest::Client::builder()
            .pool_idle_timeout(pdserve_runtime::net::POOL_IDLE_TIMEOUT)
            .default_headers(headers)
            .timeout(Duration::from_secs(2))
            .build()
            .unwrap_or_default();
        let base = router_url.trim_end_matches('/').to_string();
        let url = registration.url.clone();
        let mut registered = false;
        let mut tick = tokio::time::interval(every.max(Duration::from_millis(10)));
        loop {
            tokio::select! {
                biased;
                _ = stop.cancelled() => break,
                _ = tick.tick() => {}
            }
            if !registered {
                registered = post(&client, &base, "register", &registration).await;
                continue;
            }
            let beat = Heartbeat {
                url: url.clone(),
                load: load(),
            };
            // A heartbeat the router does not know (it restarted) re-registers.
            registered = post(&client, &base, "heartbeat", &beat).await;
        }
        post(&client, &base, "deregister", &Deregistration { url }).await;
    })
}

async fn post<T: Serialize>(client: &reqwest::Client, base: &str, what: &str, body: &T) -> bool {
    let url = format!("{base}/v1/internal/workers/{what}");
    match client.post(&url).json(body).send().await {
        Ok(r) if r.status().is_success() => true,
        Ok(r) => {
            tracing::warn!(%url, status = %r.status(), "the router refused the {what}");
            false
        }
        Err(e) => {
            tracing::debug!(%url, "the router is unreachable: {e}");
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use axum::routing::post;
    use axum::Router;
    use pdserve_protocol::internal::Pool;

    use super::*;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn registers_heartbeats_and_deregisters() {
        let seen: Arc<Mutex<Vec<(String, serde_json::Value)>>> = Arc::default();
        let record = |what: &'static str, seen: Arc<Mutex<Vec<(String, serde_json::Value)>>>| {
            post(
                move |axum::Json(v): axum::Json<serde_json::Value>| async move {
                    seen.lock().unwrap().push((what.to_string(), v));
                },
            )
        };
        let app = Router::new()
            .route(
                "/v1/internal/workers/register",
                record("register", seen.clone()),
            )
            .route(
                "/v1/internal/workers/heartbeat",
                record("heartbeat", seen.clone()),
            )
            .route(
                "/v1/internal/workers/deregister",
                record("deregister", seen.clone()),
            );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let router = format!("http://{}", listener.local_addr().unwrap());
        tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
        let reg = WorkerRegistration {
            pool: Pool::Decode,
            url: "http://127.0.0.1:1".into(),
            model_fingerprint: 7,
            weights: "q8_0".into(),
            worker_id: None,
        };
        let load = Arc::new(|| LoadReport {
            queued_requests: 3,
            ready: true,
            ..Default::default()
        });
        let stop = CancellationToken::new();
        let token = InternalToken::default();
        let task = spawn(
            router,
            reg,
            Duration::from_millis(20),
            &token,
            load,
            stop.clone(),
        );
        for _ in 0..200 {
            if seen
                .lock()
                .unwrap()
                .iter()
                .filter(|(w, _)| w == "heartbeat")
                .count()
                >= 2
            {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        stop.cancel();
        task.await.unwrap();
        let seen = seen.lock().unwrap();
        let kinds: Vec<&str> = seen.iter().map(|(w, _)| w.as_str()).collect();
        assert_eq!(kinds.first(), Some(&"register"));
        assert_eq!(kinds.last(), Some(&"deregister"));
        assert!(
            kinds.iter().filter(|k| **k == "heartbeat").count() >= 2,
            "{kinds:?}"
        );
        assert_eq!(seen[0].1["pool"], "decode");
        let beat = &seen.iter().find(|(w, _)| w == "heartbeat").unwrap().1;
        assert_eq!(beat["load"]["queued_requests"], 3);
    }

    #[test]
    fn router_url_takes_a_list() {
        #[derive(clap::Parser)]
        struct Cli {
            #[command(flatten)]
            reg: RegistrationArgs,
        }
        let parse = |argv: &[&str]| <Cli as clap::Parser>::parse_from(argv).reg.routers();
        assert!(parse(&["w"]).is_empty());
        assert_eq!(
            parse(&["w", "--router-url", "http://a:1/, http://b:2,,http://a:1"]),
            ["http://a:1", "http://b:2"]
        );
    }

    #[tokio::test]
    async fn an_unreachable_router_does_not_stop_the_worker() {
        let reg = WorkerRegistration {
            pool: Pool::Prefill,
            url: "http://127.0.0.1:1".into(),
            model_fingerprint: 1,
            weights: "q8_0".into(),
            worker_id: None,
        };
        let stop = CancellationToken::new();
        let load = Arc::new(LoadReport::default);
        let task = spawn(
            "http://127.0.0.1:9".into(),
            reg,
            Duration::from_millis(10),
            &InternalToken::default(),
            load,
            stop.clone(),
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
        stop.cancel();
        task.await.unwrap();
    }
}
