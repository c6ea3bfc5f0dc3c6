//! Dispatch across the pools: modes give the same tokens, failed prefill
//! workers are retried invisibly, and a client that goes away frees its KV.

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::routing::{get, post as route_post};
use axum::Json;
use common::*;
use futures_util::StreamExt;
use pdserve_protocol::internal::LoadReport;
use serde_json::json;

async fn text(url: &str, prompt: &str, extra: serde_json::Value) -> String {
    let (s, v) = post_json(url, "/v1/completions", &completion_body(prompt, extra)).await;
    assert_eq!(s, 200, "{v}");
    v["choices"][0]["text"].as_str().unwrap().to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn aggregated_and_disaggregated_give_the_same_tokens() {
    let c = cluster(Opts {
        router_args: &["--mode", "disaggregated"],
        ..Default::default()
    })
    .await;
    let p = c.model.arg();
    let (agg, _) = router(
        p,
        &c.prefill_urls,
        &c.decode_urls,
        &["--mode", "aggregated"],
    )
    .await;
    let prompts = ["The quick brown fox jumps", "A", &"long prompt ".repeat(40)];
    for (i, prompt) in prompts.iter().enumerate() {
        for extra in [
            json!({"max_tokens": 16, "ignore_eos": true}),
            json!({"max_tokens": 16, "ignore_eos": true, "temperature": 0.9, "seed": i}),
        ] {
            let d = text(&c.url, prompt, extra.clone()).await;
            let a = text(&agg, prompt, extra.clone()).await;
            assert_eq!(d, a, "prompt {i}, {extra}");
        }
    }
    let m = metrics(&c.url).await;
    assert!(
        metric(
            &m,
            "pdserve_request_stage_seconds_count{stage=\"kv_transfer\"}"
        ) >= 6.0,
        "{m}"
    );
    let m = metrics(&agg).await;
    assert_eq!(
        metric(
            &m,
            "pdserve_request_stage_seconds_count{stage=\"kv_transfer\"}"
        ),
        0.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auto_mode_prefills_short_prompts_locally() {
    let c = cluster(Opts {
        router_args: &["--mode", "auto", "--local-prefill-max-tokens", "16"],
        ..Default::default()
    })
    .await;
    text(&c.url, "Hi", json!({"max_tokens": 2})).await;
    let m = metrics(&c.url).await;
    assert_eq!(
        metric(
            &m,
            "pdserve_request_stage_seconds_count{stage=\"kv_transfer\"}"
        ),
        0.0
    );
    text(
        &c.url,
        &"many words here ".repeat(10),
        json!({"max_tokens": 2}),
    )
    .await;
    let m = metrics(&c.url).await;
    assert_eq!(
        metric(
            &m,
            "pdserve_request_stage_seconds_count{stage=\"kv_transfer\"}"
        ),
        1.0
    );
}

/// Sends `n` completions at once; returns the spilled prefills the router
/// counted once all have answered (each must succeed).
async fn burst_spills(spill: &str, n: usize) -> f64 {
    let c = cluster(Opts {
        router_args: &["--mode", "auto", "--local-prefill-spill-tokens", spill],
        // Real mock latency: 1.8 ms a prompt token, so a burst queues.
        mock_args: &["--latency-scale", "1"],
        ..Default::default()
    })
    .await;
    // Each prompt its own: a prompt the decode worker has already cached
    // would be prefilled there as a short one, neither spilled nor sent.
    let prompts: Vec<String> = (0..n)
        .map(|i| format!("prompt {i}: {}", "many words here ".repeat(25)))
        .collect();
    let calls = prompts
        .iter()
        .map(|p| text(&c.url, p, json!({"max_tokens": 2})));
    futures_util::future::join_all(calls).await;
    let m = metrics(&c.url).await;
    let spilled = metric(&m, "pdserve_local_prefills_total{reason=\"spill\"}");
    let remote = metric(
        &m,
        "pdserve_request_stage_seconds_count{stage=\"kv_transfer\"}",
    );
    assert_eq!(spilled + remote, n as f64, "{m}");
    spilled
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_spills_onto_the_decode_worker_once_the_prefill_pool_backs_up() {
    // 10 prompts of about 75 tokens: past 150 pending tokens on the
    // prefill worker, the decode worker prefills the next ones itself.
    let spilled = burst_spills("150", 10).await;
    assert!(
        (1.0..10.0).contains(&spilled),
        "{spilled} of 10 spilled: the pool and the decode worker should share the burst"
    );
    assert_eq!(burst_spills("off", 10).await, 0.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefill_worker_that_dies_mid_job_is_retried_on_another() {
    // Looks healthy, but drops the connection on every job, as a worker
    // killed mid-prefill would.
    let calls = Arc::new(AtomicUsize::new(0));
    let counter = calls.clone();
    let load = LoadReport {
        ready: true,
        ..Default::default()
    };
    let dying = axum::Router::new()
        .route("/load", get(move || async move { Json(load.clone()) }))
        .route(
            "/v1/internal/prefill",
            route_post(move || async move {
                counter.fetch_add(1, Ordering::SeqCst);
                panic!("killed mid-job");
                #[allow(unreachable_code)]
                ()
            }),
        );
    let dying = serve(dying).await;
    let c = cluster(Opts {
        extra_prefill: vec![dying],
        router_args: &["--mode", "disaggregated", "--prefill-policy", "round-robin"],
        ..Default::default()
    })
    .await;
    wait_until(Duration::from_secs(5), || async {
        c.router
            .registry
            .candidates(pdserve_protocol::internal::Pool::Prefill, None)
            .len()
            == 2
    })
    .await;
    let reference = text(
        &c.url,
        "Some prompt that is prefilled",
        json!({"max_tokens": 8, "ignore_eos": true}),
    )
    .await;
    for _ in 0..4 {
        let t = text(
            &c.url,
            "Some prompt that is prefilled",
            json!({"max_tokens": 8, "ignore_eos": true}),
        )
        .await;
        assert_eq!(t, reference);
    }
    assert!(
        calls.load(Ordering::SeqCst) >= 1,
        "the dying worker was never tried"
    );
    let m = metrics(&c.url).await;
    assert!(metric(&m, "pdserve_prefill_retries_total") >= 1.0, "{m}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_disconnects_frees_its_kv() {
    for mode in ["aggregated", "disaggregated"] {
        let c = cluster(Opts {
            router_args: &["--mode", mode],
            ..Default::default()
        })
        .await;
        let decode = c.decode[0].clone();
        let body = chat_body(
            "x",
            json!({"stream": true, "max_tokens": 400, "ignore_eos": true}),
        );
        let resp = post(&c.url, "/v1/chat/completions", &body).await;
        assert_eq!(resp.status(), 200);
        let mut chunks = resp.bytes_stream();
        let _first = chunks.next().await.unwrap().unwrap();
        assert!(
            decode.load_report().kv_used_tokens > 0,
            "{mode}: KV is reserved while streaming"
        );
        drop(chunks);
        wait_until(Duration::from_secs(10), || {
            let d = decode.clone();
            async move { d.load_report().kv_used_tokens == 0 }
        })
        .await;
        let m = metrics(&c.url).await;
        assert_eq!(metric(&m, "pdserve_requests_in_flight"), 0.0, "{mode}");
        assert_eq!(
            metric(
                &m,
                "pdserve_requests_total{endpoint=\"chat\",status=\"cancelled\"}"
            ),
            1.0,
            "{mode}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefill_slower_than_the_connect_timeout_is_not_retried() {
    // Regression: the prefill call answers only once the KV is delivered, so
    // it must wait for the prefill deadline, not the (short) connect timeout.
    let real = Arc::new(std::sync::Mutex::new(String::new()));
    let target = real.clone();
    let calls = Arc::new(AtomicUsize::new(0));
    let counter = calls.clone();
    let load = LoadReport {
        ready: true,
        ..Default::default()
    };
    let slow = axum::Router::new()
        .route("/load", get(move || async move { Json(load.clone()) }))
        .route(
            "/v1/internal/prefill",
            route_post(move |body: axum::body::Bytes| async move {
                counter.fetch_add(1, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(600)).await;
                let url = format!("{}/v1/internal/prefill", target.lock().unwrap());
                let r = reqwest::Client::new()
                    .post(url)
                    .header("content-type", "application/json")
                    .body(body)
                    .send()
                    .await
                    .unwrap();
                (
                    axum::http::StatusCode::from_u16(r.status().as_u16()).unwrap(),
                    r.bytes().await.unwrap(),
                )
            }),
        );
    let slow = serve(slow).await;
    let c = cluster(Opts {
        prefill: 1,
        ..Default::default()
    })
    .await;
    *real.lock().unwrap() = c.prefill_urls[0].clone();
    let p = c.model.arg();
    let (url, _) = router(
        p,
        &[slow],
        &c.decode_urls,
        &[
            "--mode",
            "disaggregated",
            "--worker-connect-timeout-ms",
            "200",
        ],
    )
    .await;
    text(
        &url,
        "A prompt that takes a while",
        json!({"max_tokens": 4}),
    )
    .await;
    assert_eq!(
        calls.load(Ordering::SeqCst),
        1,
        "one prefill attempt, no retries"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_splits_evenly_over_equal_decode_workers_with_every_policy() {
    // Regression: the router counted a decode assignment only until the
    // reservation returned, then trusted the worker's next report; between
    // two reports a burst landed on one worker (12 of 12).
    for policy in ["prefix", "least-load", "round-robin", "power-of-two"] {
        let c = cluster(Opts {
            decode: 2,
            mock_args: &["--latency-scale", "1"],
            // One report at start, then none during the burst.
            router_args: &[
                "--mode",
                "aggregated",
                "--decode-policy",
                policy,
                "--health-interval-ms",
                "60000",
            ],
            ..Default::default()
        })
        .await;
        // One after another, each reserved before the next is sent.
        let mut streams = Vec::new();
        for i in 0..12 {
            let body = chat_body(
                &format!("prompt {i}"),
                json!({"max_tokens": 100, "stream": true}),
            );
            let resp = post(&c.url, "/v1/chat/completions", &body).await;
            assert_eq!(resp.status(), 200);
            let mut chunks = resp.bytes_stream();
            chunks.next().await.unwrap().unwrap();
            streams.push(chunks);
        }
        let running: Vec<u64> = c
            .decode
            .iter()
            .map(|w| w.load_report().active_sequences)
            .collect();
        drop(streams);
        assert!(
            running.iter().all(|&n| (5..=7).contains(&n)),
            "{policy}: 12 requests landed {running:?}"
        );
    }
}

/// Sends `n` streaming requests with the same long prompt, each reserved
/// before the next; returns the sequences running on each decode worker.
async fn hot_prefix_burst(c: &Cluster, n: usize) -> Vec<u64> {
    let prompt = "one hot system prompt that every request shares ".repeat(4);
    let mut streams = Vec::new();
    for _ in 0..n {
        let body = chat_body(&prompt, json!({"max_tokens": 100, "stream": true}));
        let resp = post(&c.url, "/v1/chat/completions", &body).await;
        assert_eq!(resp.status(), 200);
        let mut chunks = resp.bytes_stream();
        chunks.next().await.unwrap().unwrap();
        streams.push(chunks);
        // Let the workers' reports (and prefix digests) reach the router.
        tokio::time::sleep(Duration::from_millis(30)).await;
    }
    c.decode
        .iter()
        .map(|w| w.load_report().active_sequences)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_prefix_policy_spreads_one_hot_prefix_over_saturated_workers() {
    // By the load term alone, and, with affinity weighted far above load,
    // by the balance guard.
    let heavy: &[&str] = &[
        "--prefix-weight",
        "1000",
        "--prefix-balance-abs-tokens",
        "1000",
    ];
    for extra in [&[][..], heavy] {
        let mut args = vec!["--mode", "aggregated", "--decode-policy", "prefix"];
        args.extend_from_slice(extra);
        let c = cluster(Opts {
            decode: 2,
            mock_args: &["--latency-scale", "1"],
            router_args: &args,
            ..Default::default()
        })
        .await;
        let running = hot_prefix_burst(&c, 12).await;
        assert!(
            running.iter().all(|&n| n >= 3),
            "{extra:?}: 12 requests landed {running:?}"
        );
        let cached: Vec<u64> = c
            .decode
            .iter()
            .map(|w| w.load_report().prefix_cache.unwrap().len() as u64)
            .collect();
        assert!(
            cached.iter().all(|&b| b > 0),
            "both cache the prefix: {cached:?}"
        );
    }
}
