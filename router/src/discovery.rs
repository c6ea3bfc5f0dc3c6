//! Keeping the registry true: static lists, Kubernetes headless-service DNS
//! re-resolved periodically, health polls of the workers that do not
//! heartbeat, and expiry of the ones that stopped.

use std::sync::Arc;
use std::time::Duration;

use futures_util::future::join_all;
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
    pub worker_timeout: Duration,
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
    let timeout = cfg.health_interval.max(Duration::from_millis(200));
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
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(cfg.health_interval.max(Duration::from_millis(10)));
        loop {
            tokio::select! {
                biased;
                _ = stop.cancelled() => break,
                _ = tick.tick() => {}
            }
            poll_once(&registry, &client, timeout).await;
            registry.expire(cfg.worker_timeout);
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

/// Asks every polled worker for its load, concurrently.
pub async fn poll_once(registry: &Registry, client: &reqwest::Client, timeout: Duration) {
    let urls = registry.pollable();
    let results = join_all(urls.iter().map(|u| fetch_load(client, u, timeout))).await;
    for (url, load) in urls.iter().zip(results) {
        match load {
            Poll::Load(load) => {
                registry.record_load(url, load);
            }
            Poll::Failed => registry.poll_failed(url),
            // This process ran out of file descriptors: says nothing of the worker.
            Poll::NoDescriptors => {}
        }
    }
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

    #[tokio::test]
    async fn dns_names_resolve_into_worker_urls() {
        let r = Registry::default();
        resolve_into(&r, Pool::Decode, "localhost:8200").await;
        let urls = r.pollable();
        assert!(!urls.is_empty());
        assert!(urls.iter().all(|u| u.ends_with(":8200")), "{urls:?}");
    }
}
