//! The autoscaler end to end, on the mock engine: the router binary runs
//! local mock workers; a prefill-heavy burst scales the prefill pool only,
//! a decode-heavy burst the decode pool only, both fall back afterwards, and
//! no request fails, during scale-up or while workers drain.

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::process::*;
use common::*;
use futures_util::future::join_all;
use serde_json::json;

fn ready_workers(metrics: &str, pool: &str) -> usize {
    let key = format!("pdserve_workers{{pool=\"{pool}\",state=\"ready\"}} ");
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(&key))
        .and_then(|v| v.trim().parse::<f64>().ok())
        .unwrap_or(0.0) as usize
}

/// The router's metrics, or nothing while it does not answer.
async fn metrics_or_empty(url: &str) -> String {
    match reqwest::get(format!("{url}/metrics")).await {
        Ok(r) => r.text().await.unwrap_or_default(),
        Err(_) => String::new(),
    }
}

/// Sends `n` concurrent completions; every one must succeed in full.
async fn burst(url: &str, n: usize, prompt: &str, max_tokens: u32) {
    let sends = (0..n).map(|_| {
        let body = completion_body(
            prompt,
            json!({"max_tokens": max_tokens, "ignore_eos": true}),
        );
        async move { post_json(url, "/v1/completions", &body).await }
    });
    for (status, v) in join_all(sends).await {
        assert_eq!(status, 200, "{v}");
        assert_eq!(v["usage"]["completion_tokens"], max_tokens, "{v}");
    }
}

/// Runs `load` while sampling the ready workers of both pools; returns the
/// highest counts seen.
async fn peak_during(url: &str, load: impl std::future::Future<Output = ()>) -> (usize, usize) {
    let peaks = Arc::new((AtomicUsize::new(0), AtomicUsize::new(0)));
    let (u, pk) = (url.to_string(), peaks.clone());
    let watcher = tokio::spawn(async move {
        loop {
            let m = metrics_or_empty(&u).await;
            pk.0.fetch_max(ready_workers(&m, "prefill"), Ordering::Relaxed);
            pk.1.fetch_max(ready_workers(&m, "decode"), Ordering::Relaxed);
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    });
    let done = tokio::time::timeout(Duration::from_secs(120), load).await;
    watcher.abort();
    assert!(done.is_ok(), "the burst took over two minutes");
    (
        peaks.0.load(Ordering::Relaxed),
        peaks.1.load(Ordering::Relaxed),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn pools_scale_up_and_down_independently_without_failures() {
    if workspace_binary("pdserve-mock-worker").is_none() {
        return;
    }
    let model = pdserve_testkit::tiny::TinyModel::new();
    let router = Router::start(
        &model.path,
        MODEL,
        &[
            "--local-engine",
            "mock",
            "--mode",
            "disaggregated",
            "--autoscaler-interval-ms",
            "200",
            "--prefill-max-replicas",
            "3",
            "--decode-max-replicas",
            "3",
            "--prefill-target-backlog-seconds",
            "0.5",
            "--prefill-tokens-per-second",
            "500",
            "--decode-target",
            "8",
            "--scale-down-window-seconds",
            "3",
            "--scale-cooldown-seconds",
            "1",
        ],
    );
    router.wait_ready(Duration::from_secs(30)).await;
    let url = router.url.clone();

    // Prefill-heavy: long prompts, one token each.
    let long = "the quick brown fox jumps over the lazy dog ".repeat(12);
    let (p, d) = peak_during(&url, burst(&url, 24, &long, 1)).await;
    let m = metrics(&url).await;
    assert!(p >= 2, "prefill did not scale up (peak {p}):\n{m}");
    assert_eq!(d, 1, "decode must not scale on a prefill burst");

    // Decode-heavy: short prompts, long outputs.
    let (_, d) = peak_during(&url, burst(&url, 40, "hi", 120)).await;
    assert!(d >= 2, "decode did not scale up (peak {d})");

    // Back down to one each, with requests flowing while workers drain.
    let until = Instant::now() + Duration::from_secs(60);
    loop {
        burst(&url, 2, "still here", 4).await;
        let m = metrics(&url).await;
        if ready_workers(&m, "prefill") == 1 && ready_workers(&m, "decode") == 1 {
            break;
        }
        assert!(
            Instant::now() < until,
            "the pools did not scale back down:\n{m}"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let m = metrics(&url).await;
    let failed: f64 = m
        .lines()
        .filter(|l| l.starts_with("pdserve_requests_total{") && !l.contains("status=\"ok\""))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum();
    assert_eq!(failed, 0.0, "{m}");
}
