//! The mock decode worker over HTTP: local generation, KV admission, client
//! disconnects, the latency model, `/load` and `/metrics`, draining.

mod common;

use std::time::{Duration, Instant};

use common::*;
use pdserve_protocol::internal::{ErrorBody, ErrorClass, ErrorKind, FinishReason, GenerateEvent};
use serde_json::json;

const FAST: &[&str] = &["--latency-scale", "0"];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn local_generation_gives_max_tokens_then_length() {
    let model = tiny_model();
    let d = spawn(&model, "decode", FAST).await;
    let body = generate_body(
        "r1",
        5,
        json!({"max_tokens": 7, "top_logprobs": 3, "seed": 9, "temperature": 1}),
        local(),
    );
    let events = events(post(&d.url, "/v1/internal/generate", &body).await).await;
    assert!(matches!(
        events[0],
        GenerateEvent::Reserved { kv_url: None, .. }
    ));
    let ids = token_ids(&events);
    assert_eq!(ids.len(), 7, "{events:?}");
    assert!(ids.iter().all(|&t| (3..VOCAB).contains(&t)), "{ids:?}");
    for e in &events {
        if let GenerateEvent::Token {
            id,
            logprob,
            top_logprobs,
        } = e
        {
            assert_eq!(top_logprobs.len(), 3);
            assert_eq!(top_logprobs[0], (*id, *logprob));
            assert!(*logprob < 0.0);
        }
    }
    let finished = GenerateEvent::Finished {
        reason: FinishReason::Length,
        prompt_tokens: 5,
        completion_tokens: 7,
    };
    assert_eq!(events.last(), Some(&finished));
    // The same seed gives the same tokens; another seed others; greedy
    // sampling ignores the seed.
    let run = |id: &str, sampling: serde_json::Value| {
        let body = generate_body(id, 5, sampling, local());
        let url = d.url.clone();
        async move { token_ids(&events_of(&url, body).await) }
    };
    let seeded = |seed: u64| json!({"max_tokens": 7, "seed": seed, "temperature": 1});
    assert_eq!(run("r2", seeded(9)).await, ids);
    assert_ne!(run("r3", seeded(10)).await, ids);
    let greedy = |seed: u64| json!({"max_tokens": 7, "seed": seed, "temperature": 0});
    assert_eq!(run("r4", greedy(9)).await, run("r5", greedy(10)).await);
}

async fn events_of(url: &str, body: serde_json::Value) -> Vec<GenerateEvent> {
    events(post(url, "/v1/internal/generate", &body).await).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stop_token_ends_the_sequence_with_stop() {
    let model = tiny_model();
    let d = spawn(&model, "decode", FAST).await;
    let ids = token_ids(
        &events_of(
            &d.url,
            generate_body("a", 4, json!({"max_tokens": 6}), local()),
        )
        .await,
    );
    let stop = ids[3];
    let body = generate_body(
        "b",
        4,
        json!({"max_tokens": 6, "stop_token_ids": [stop]}),
        local(),
    );
    let events = events_of(&d.url, body).await;
    let upto = ids.iter().position(|&t| t == stop).unwrap();
    assert_eq!(token_ids(&events), ids[..upto]);
    let done = events.last().unwrap();
    assert!(
        matches!(
            done,
            GenerateEvent::Finished {
                reason: FinishReason::Stop,
                ..
            }
        ),
        "{done:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_kv_budget_is_a_retryable_503_and_a_disconnect_frees_it() {
    let model = tiny_model();
    let slow = ["--kv-cache-tokens", "100", "--step-fixed-ms", "20"];
    let d = spawn(&model, "decode", &slow).await;
    // 10 prompt + 80 new tokens: 90 of the 100 reserved for seconds.
    let body = generate_body("big", 10, json!({"max_tokens": 80}), local());
    let mut first = Lines::new(post(&d.url, "/v1/internal/generate", &body).await);
    assert!(matches!(
        first.next().await,
        Some(GenerateEvent::Reserved { .. })
    ));
    assert!(matches!(
        first.next().await,
        Some(GenerateEvent::Token { .. })
    ));
    assert_eq!(load(&d.url).await.kv_used_tokens, 90);
    let refused = post(
        &d.url,
        "/v1/internal/generate",
        &generate_body("more", 10, json!({"max_tokens": 8}), local()),
    )
    .await;
    assert_eq!(refused.status(), 503);
    assert_eq!(refused.headers()["retry-after"], "1");
    let err: ErrorBody = refused.json().await.unwrap();
    assert_eq!(
        (err.class, err.kind),
        (ErrorClass::Retryable, ErrorKind::KvExhausted)
    );
    let too_big = post(
        &d.url,
        "/v1/internal/generate",
        &generate_body("huge", 10, json!({"max_tokens": 200}), local()),
    )
    .await;
    assert_eq!(too_big.status(), 400, "more than the whole budget is fatal");
    drop(first);
    wait_until(Duration::from_secs(5), || async {
        load(&d.url).await.kv_used_tokens == 0
    })
    .await;
    assert_eq!(
        metric(&d.url, "pdserve_requests_total{status=\"cancelled\"}").await,
        1.0
    );
    let after = events_of(
        &d.url,
        generate_body("more", 10, json!({"max_tokens": 2}), local()),
    )
    .await;
    assert_eq!(token_ids(&after).len(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_leaving_while_waiting_for_kv_frees_it_at_once() {
    let model = tiny_model();
    let d = spawn(&model, "decode", FAST).await;
    let body = generate_body("w", 10, json!({"max_tokens": 10}), remote(60_000));
    let mut resp = Lines::new(post(&d.url, "/v1/internal/generate", &body).await);
    let reserved = resp.next().await.unwrap();
    let want = format!("{}/v1/internal/kv/w", d.url);
    assert!(
        matches!(&reserved, GenerateEvent::Reserved { kv_url: Some(u), .. } if *u == want),
        "{reserved:?}"
    );
    assert_eq!(load(&d.url).await.kv_used_tokens, 20);
    drop(resp);
    // Long before the 60 s lease.
    wait_until(Duration::from_secs(5), || async {
        load(&d.url).await.kv_used_tokens == 0
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expired_lease_ends_the_stream_with_a_retryable_error() {
    let model = tiny_model();
    let d = spawn(&model, "decode", FAST).await;
    let events = events_of(&d.url, generate_body("l", 4, json!({}), remote(50))).await;
    match events.last() {
        Some(GenerateEvent::Error(e)) => assert_eq!(
            (e.class, e.kind.as_str()),
            (ErrorClass::Retryable, "kv_lease_expired")
        ),
        other => panic!("{other:?}"),
    }
    assert_eq!(load(&d.url).await.kv_used_tokens, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decode_steps_take_the_modelled_time() {
    let model = tiny_model();
    // Local prefill free; c = 20 ms per step.
    let step = |c: &'static str, d: &'static str| {
        let no_prefill = ["--prefill-fixed-ms", "0", "--prefill-ms-per-token", "0"];
        [
            &no_prefill[..],
            &["--step-fixed-ms", c, "--step-ms-per-seq", d],
        ]
        .concat()
    };
    let d = spawn(&model, "decode", &step("20", "0")).await;
    let started = Instant::now();
    // The first token comes from the prefill, the next 10 from 10 steps.
    let events = events_of(
        &d.url,
        generate_body("t", 4, json!({"max_tokens": 11}), local()),
    )
    .await;
    assert_eq!(token_ids(&events).len(), 11);
    let took = started.elapsed();
    assert!(
        took >= Duration::from_millis(200),
        "10 steps of 20 ms took {took:?}"
    );
    // d = 10 ms per sequence: 4 sequences for 5 steps take at least 5 × 40 ms.
    let d = spawn(&model, "decode", &step("0", "10")).await;
    let started = Instant::now();
    let runs = (0..4).map(|i| {
        events_of(
            &d.url,
            generate_body(&format!("b{i}"), 4, json!({"max_tokens": 6}), local()),
        )
    });
    for events in futures_util::future::join_all(runs).await {
        assert_eq!(token_ids(&events).len(), 6);
    }
    let took = started.elapsed();
    assert!(
        took >= Duration::from_millis(200),
        "a batch of 4 took {took:?}"
    );
    assert!(metric(&d.url, "pdserve_decode_batch_size_sum").await >= 4.0 * 5.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn load_and_metrics_report_what_happened() {
    let model = tiny_model();
    let d = spawn(
        &model,
        "decode",
        &["--latency-scale", "0", "--kv-cache-tokens", "1000"],
    )
    .await;
    for i in 0..3 {
        let events = events_of(
            &d.url,
            generate_body(&format!("m{i}"), 6, json!({"max_tokens": 4}), local()),
        )
        .await;
        assert_eq!(token_ids(&events).len(), 4);
    }
    let report = load(&d.url).await;
    assert_eq!((report.kv_used_tokens, report.kv_free_tokens), (0, 1000));
    assert_eq!((report.queued_requests, report.active_sequences), (0, 0));
    assert!(report.ready);
    let m = |s: &'static str| metric(&d.url, s);
    assert_eq!(m("pdserve_generation_tokens_total").await, 12.0);
    assert_eq!(m("pdserve_prompt_tokens_total").await, 18.0);
    assert_eq!(m("pdserve_requests_total{status=\"ok\"}").await, 3.0);
    assert_eq!(m("pdserve_kv_cache_capacity_tokens").await, 1000.0);
    assert_eq!(m("pdserve_kv_cache_usage_ratio").await, 0.0);
    assert_eq!(
        m("pdserve_decode_step_seconds_count").await,
        9.0,
        "3 sequences × 3 steps after their first token"
    );
    assert_eq!(m("pdserve_active_sequences{pool=\"decode\"}").await, 0.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn draining_refuses_new_work_and_lets_running_work_finish() {
    let model = tiny_model();
    let token = tokio_util::sync::CancellationToken::new();
    let flags = ["--step-fixed-ms", "10", "--step-ms-per-seq", "0"];
    let (d, served) = spawn_draining(&model, "decode", &flags, token.clone()).await;
    let mut running = Lines::new(
        post(
            &d.url,
            "/v1/internal/generate",
            &generate_body("run", 4, json!({"max_tokens": 30}), local()),
        )
        .await,
    );
    assert!(matches!(
        running.next().await,
        Some(GenerateEvent::Reserved { .. })
    ));
    token.cancel();
    wait_until(Duration::from_secs(5), || async {
        reqwest::get(format!("{}/ready", d.url))
            .await
            .unwrap()
            .status()
            == 503
    })
    .await;
    let refused = post(
        &d.url,
        "/v1/internal/generate",
        &generate_body("new", 4, json!({}), local()),
    )
    .await;
    assert_eq!(refused.status(), 503);
    let kind = refused.json::<ErrorBody>().await.unwrap().kind;
    assert_eq!(kind, ErrorKind::NotReady);
    let mut tokens = 0;
    while let Some(e) = running.next().await {
        tokens += matches!(e, GenerateEvent::Token { .. }) as usize;
    }
    assert_eq!(tokens, 30, "the running sequence finished");
    // Drained: the server closes by itself.
    let closed = tokio::time::timeout(Duration::from_secs(5), served).await;
    closed.unwrap().unwrap().unwrap();
    assert_eq!(d.worker.in_flight(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_waiting_queue_is_bounded_and_reported_as_queued() {
    let model = tiny_model();
    let d = spawn(&model, "decode", ONE_AT_A_TIME).await;
    let _streams = fill_one_at_a_time(&d.url).await;
    let body = generate_body("q3", 5, json!({"max_tokens": 40}), local());
    let refused = post(&d.url, "/v1/internal/generate", &body).await;
    assert_eq!(refused.status(), 503);
    let e: ErrorBody = refused.json().await.unwrap();
    assert_eq!(
        (e.class, e.kind),
        (ErrorClass::Retryable, ErrorKind::Overloaded)
    );
    // The one the engine holds, waiting, and the one in the queue count as queued.
    let load = pdserve_testkit::http::load(&d.url).await;
    assert_eq!(
        (load.queued_requests, load.active_sequences),
        (2, 1),
        "{load:?}"
    );
    assert_eq!(load.queued_tokens, 10, "{load:?}");
}
