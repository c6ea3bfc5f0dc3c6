//! Keeping the registry true: static lists, Kubernetes headless-service DNS
//! re-resolved periodically, health polls of the workers that do not
//! heartbeat, and expiry of the ones that stopped.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use pdserve_protocol::internal::{LoadReport, Pool};
use tokio_util::sync::CancellationToken;

use crate::registry::Registry;

/// Splits `name:port`.
pub fn parse_host_port(s: &str) -> Result<(String, u16), String> {
    let (host, port) = s
        .rsplit_once(':')
        .ok_or_else(|| format!("{s:?} must be name:port"))?;
    let port = port
        .parse::<u16>()
        .map_err(|_| format!("{s:?}: {port:?} is not a port"))?;
    match host.is_empty() {
        true => Err(format!("{s:?} has no host name")),
        false => Ok((host.to_string(), port)),
    }
}

#[derive(Debug, Clone)]
pub struct DiscoveryConfig {
    pub prefill_dns: Option<String>,
    pub decode_dns: Option<String>,
    pub dns_refresh: Duration,
    pub health_interval: Duration,
    /// How long one health poll may take before it counts as failed.
    pub health_timeout: Duration,
    pub worker_timeout: Duration,
}

impl DiscoveryConfig {
    /// How long a polled worker may go unheard before it leaves placement
    /// (until it answers again): a busy worker answers every poll within
    /// `health_timeout` of sending it, so it is never silent longer than
    /// that plus one interval.
    pub fn polled_silence(&self) -> Duration {
        self.worker_timeout
            .max(self.health_timeout + self.health_interval)
    }
}

/// Starts the DNS and health loops; they stop when `stop` is cancelled.
/// Polls go out on `client`, the dispatcher's: over HTTP/2 they share its
/// one connection to each worker (and notice when that connection fails).
pub fn spawn(
    registry: Arc<Registry>,
    cfg: DiscoveryConfig,
    client: reqwest::Client,
    stop: CancellationToken,
) {
    let dns: Vec<(Pool, String)> = [
        (Pool::Prefill, cfg.prefill_dns.clone()),
        (Pool::Decode, cfg.decode_dns.clone()),
    ]
    .into_iter()
    .filter_map(|(p, d)| d.map(|d| (p, d)))
    .collect();
    if !dns.is_empty() {
        let (r, s, every) = (registry.clone(), stop.clone(), cfg.dns_refresh);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(every.max(Duration::from_millis(100)));
            loop {
                tokio::select! {
                    biased;
                    _ = s.cancelled() => break,
                    _ = tick.tick() => {}
                }
                for (pool, name) in &dns {
                    resolve_into(&r, *pool, name).await;
                }
            }
        });
    }
    let timeout = cfg.health_timeout.max(Duration::from_millis(200));
    let polling = Arc::new(Mutex::new(HashSet::new()));
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(cfg.health_interval.max(Duration::from_millis(10)));
        loop {
            tokio::select! {
                biased;
                _ = stop.cancelled() => break,
                _ = tick.tick() => {}
            }
            let round = poll_each(&registry, &client, timeout, &polling);
            round.settle(&registry, cfg.health_interval).await;
            registry.expire(cfg.worker_timeout, cfg.polled_silence());
        }
    });
}

async fn resolve_into(registry: &Registry, pool: Pool, name: &str) {
    if parse_host_port(name).is_err() {
        return;
    }
    match tokio::net::lookup_host(name.to_string()).await {
        Ok(addrs) => {
            let mut urls: Vec<String> = addrs.map(|a| format!("http://{a}")).collect();
            urls.sort();
            urls.dedup();
            registry.sync_dns(pool, &urls);
        }
        // Keep the last known set: a DNS hiccup must not empty a pool.
        Err(e) => tracing::warn!(%name, "cannot resolve workers: {e}"),
    }
}

/// One round of polls. The answers that come within the round are recorded
/// together when it settles (so the first reports of a prefill and a
/// decode worker land at once, not a readiness check apart); a later
/// answer is recorded by its own poll when it comes.
struct Round {
    /// The answers so far; `None` once the round has settled.
    answers: Mutex<Option<Vec<(String, Poll)>>>,
    expected: usize,
    all_in: tokio::sync::Notify,
}

impl Round {
    fn answer(&self, registry: &Registry, url: String, poll: Poll) {
        let mut answers = self.answers.lock().unwrap_or_else(|e| e.into_inner());
        match answers.as_mut() {
            Some(v) => {
                v.push((url, poll));
                if v.len() == self.expected {
                    self.all_in.notify_one();
                }
            }
            None => {
                drop(answers);
                record(registry, &url, poll);
            }
        }
    }

    /// Waits for every answer, or `within`, then records what came.
    async fn settle(&self, registry: &Registry, within: Duration) {
        if self.expected > 0 {
            let _ = tokio::time::timeout(within, self.all_in.notified()).await;
        }
        let answers = self
            .answers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        for (url, poll) in answers.unwrap_or_default() {
            record(registry, &url, poll);
        }
    }
}

fn record(registry: &Registry, url: &str, poll: Poll) {
    match poll {
        Poll::Load(load) => {
            registry.record_load(url, load);
        }
        Poll::Failed => registry.poll_failed(url),
        // This process ran out of file descriptors: says nothing of the worker.
        Poll::NoDescriptors => {}
    }
}

/// Asks every polled worker for its load, each on its own task, within
/// `timeout`: a worker slow to answer (busy with a burst, its answer queued
/// behind its own work) holds up only its own next poll, not the others',
/// and is not asked again while a poll to it is still out.
fn poll_each(
    registry: &Arc<Registry>,
    client: &reqwest::Client,
    timeout: Duration,
    polling: &Arc<Mutex<HashSet<String>>>,
) -> Arc<Round> {
    let urls: Vec<String> = {
        let mut out = polling.lock().unwrap_or_else(|e| e.into_inner());
        registry
            .pollable()
            .into_iter()
            .filter(|u| out.insert(u.clone()))
            .collect()
    };
    let round = Arc::new(Round {
        answers: Mutex::new(Some(Vec::with_capacity(urls.len()))),
        expected: urls.len(),
        all_in: tokio::sync::Notify::new(),
    });
    for url in urls {
        let (registry, client) = (registry.clone(), client.clone());
        let (polling, round) = (polling.clone(), round.clone());
        tokio::spawn(async move {
            let poll = fetch_load(&client, &url, timeout).await;
            round.answer(&registry, url.clone(), poll);
            // Only now may the next poll go out, so answers land in order.
            polling
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .remove(&url);
        });
    }
    round
}

enum Poll {
    Load(LoadReport),
    Failed,
    NoDescriptors,
}

async fn fetch_load(client: &reqwest::Client, base: &str, timeout: Duration) -> Poll {
    let resp = match client
        .get(format!("{base}/load"))
        .timeout(timeout)
        .send()
        .await
    {
        Ok(r) => r,
        Err(e) if pdserve_runtime::net::is_fd_exhaustion(&e) => return Poll::NoDescriptors,
        Err(_) => return Poll::Failed,
    };
    let report = async { resp.error_for_status().ok()?.json().await.ok() };
    match report.await {
        Some(load) => Poll::Load(load),
        None => Poll::Failed,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_port_parsing() {
        assert_eq!(
            parse_host_port("prefill.ns.svc:8100").unwrap(),
            ("prefill.ns.svc".to_string(), 8100)
        );
        assert!(parse_host_port("prefill").is_err());
        assert!(parse_host_port(":80").is_err());
        assert!(parse_host_port("a:http").is_err());
    }

    /// A busy worker answers its polls late (behind its own work): that is
    /// not an outage, and its polls must not pile up either.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_worker_slow_to_answer_its_polls_stays_in_placement() {
        let asked = Arc::new(std::sync::atomic::AtomicU32::new(0));
        let count = asked.clone();
        let app = axum::Router::new().route(
            "/load",
            axum::routing::get(move || {
                count.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                async {
                    tokio::time::sleep(Duration::from_millis(400)).await;
                    axum::Json(LoadReport {
                        ready: true,
                        ..LoadReport::default()
                    })
                }
            }),
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        tokio::spawn(async move { axum::serve(listener, app).await });
        let registry = Arc::new(Registry::default());
        registry.add_static(Pool::Decode, &url);
        let cfg = DiscoveryConfig {
            prefill_dns: None,
            decode_dns: None,
            dns_refresh: Duration::from_secs(5),
            health_interval: Duration::from_millis(100),
            health_timeout: Duration::from_secs(2),
            worker_timeout: Duration::from_millis(300),
        };
        let stop = CancellationToken::new();
        spawn(registry.clone(), cfg, reqwest::Client::new(), stop.clone());
        let in_placement = || !registry.candidates(Pool::Decode, None).is_empty();
        let until = std::time::Instant::now() + Duration::from_secs(5);
        while !in_placement() {
            assert!(std::time::Instant::now() < until, "never came in");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let start = std::time::Instant::now();
        for _ in 0..20 {
            tokio::time::sleep(Duration::from_millis(100)).await;
            assert!(in_placement(), "a slow poll took the worker out");
        }
        stop.cancel();
        // One poll at a time: about one per 400 ms answer, not one per tick.
        let polls = asked.load(std::sync::atomic::Ordering::Relaxed);
        let ticks = start.elapsed().as_millis() as u32 / 100;
        assert!(polls <= ticks / 2 + 2, "{polls} polls in {ticks} ticks");
    }

    #[tokio::test]
    async fn dns_names_resolve_into_worker_urls() {
        let r = Registry::default();
        resolve_into(&r, Pool::Decode, "localhost:8200").await;
        let urls = r.pollable();
        assert!(!urls.is_empty());
        assert!(urls.iter().all(|u| u.ends_with(":8200")), "{urls:?}");
    }
}
