//! Every error class: its status, its OpenAI body, and `Retry-After` where
//! a retry can help. Worker failures come from scripted test doubles.

mod common;

use std::time::Duration;

use axum::routing::{get, post as route_post};
use axum::Json;
use common::*;
use pdserve_protocol::internal::{ErrorBody, ErrorKind, GenerateEvent, LoadReport};
use serde_json::{json, Value};

fn check_error(status: u16, v: &Value, want_status: u16, code: &str) {
    assert_eq!(status, want_status, "{v}");
    let e = &v["error"];
    assert_eq!(e["code"], code, "{v}");
    assert!(e["message"].as_str().unwrap().len() > 5, "{v}");
    assert!(e["type"].is_string(), "{v}");
    assert!(e.get("param").is_some(), "{v}");
}

/// A decode worker double: ready, and answering generate with `generate`.
async fn decode_double<H, T>(generate: H) -> String
where
    H: axum::handler::Handler<T, ()>,
    T: 'static,
{
    let load = LoadReport {
        ready: true,
        kv_free_tokens: 100_000,
        ..Default::default()
    };
    let app = axum::Router::new()
        .route("/load", get(move || async move { Json(load.clone()) }))
        .route("/v1/internal/generate", route_post(generate));
    serve(app).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_are_400_404_and_413() {
    let c = cluster(Opts {
        router_args: &["--max-body-bytes", "2000"],
        ..Default::default()
    })
    .await;
    let raw = reqwest::Client::new()
        .post(format!("{}/v1/chat/completions", c.url))
        .header("content-type", "application/json")
        .body("{not json")
        .send()
        .await
        .unwrap();
    let status = raw.status().as_u16();
    check_error(status, &raw.json().await.unwrap(), 400, "invalid_json");
    let cases = [
        (
            chat_body("x", json!({"max_tokens": "ten"})),
            400,
            "invalid_json",
        ),
        (chat_body("x", json!({"messages": 3})), 400, "invalid_json"),
        (
            chat_body("x", json!({"temperature": -1})),
            400,
            "invalid_value",
        ),
        (chat_body("x", json!({"n": 0})), 400, "invalid_value"),
        (
            chat_body("x", json!({"messages": []})),
            400,
            "invalid_value",
        ),
        (
            chat_body(
                "x",
                json!({"messages": [{"role": "wizard", "content": "x"}]}),
            ),
            400,
            "invalid_value",
        ),
        (
            chat_body("x", json!({"model": "gpt-9"})),
            404,
            "model_not_found",
        ),
        (
            chat_body("x", json!({"max_tokens": 600})),
            400,
            "context_length_exceeded",
        ),
        (
            chat_body(&"long ".repeat(500), json!({})),
            413,
            "payload_too_large",
        ),
    ];
    for (body, status, code) in cases {
        let (s, v) = post_json(&c.url, "/v1/chat/completions", &body).await;
        check_error(s, &v, status, code);
    }
    let (s, v) = post_json(
        &c.url,
        "/v1/completions",
        &completion_body("", json!({"prompt": [99999]})),
    )
    .await;
    check_error(s, &v, 400, "invalid_value");
    let (s, v) = post_json(
        &c.url,
        "/v1/completions",
        &completion_body("", json!({"prompt": []})),
    )
    .await;
    check_error(s, &v, 400, "invalid_value");
    // Unknown fields are ignored.
    let (s, v) = post_json(
        &c.url,
        "/v1/chat/completions",
        &chat_body("x", json!({"frobnicate": true, "user": "u1"})),
    )
    .await;
    assert_eq!(s, 200, "{v}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_keys_are_required_when_configured() {
    let c = cluster(Opts {
        router_args: &["--api-key", "k1,k2"],
        ..Default::default()
    })
    .await;
    let (s, v) = post_json(&c.url, "/v1/chat/completions", &chat_body("x", json!({}))).await;
    check_error(s, &v, 401, "invalid_api_key");
    for key in ["k2", "k1x", ""] {
        let r = reqwest::Client::new()
            .post(format!("{}/v1/chat/completions", c.url))
            .bearer_auth(key)
            .json(&chat_body("x", json!({})))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status() == 200, key == "k2", "key {key:?}");
    }
    // Health and metrics stay open for probes and scrapers.
    assert_eq!(
        reqwest::get(format!("{}/ready", c.url))
            .await
            .unwrap()
            .status(),
        200
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn too_many_requests_in_flight_is_429_with_retry_after() {
    let c = cluster(Opts {
        router_args: &["--max-concurrent-requests", "1"],
        ..Default::default()
    })
    .await;
    // Holds the only slot: a long stream nobody reads.
    let body = chat_body(
        "x",
        json!({"stream": true, "max_tokens": 400, "ignore_eos": true}),
    );
    let held = post(&c.url, "/v1/chat/completions", &body).await;
    assert_eq!(held.status(), 200);
    let r = post(&c.url, "/v1/chat/completions", &chat_body("x", json!({}))).await;
    assert_eq!(r.headers()["retry-after"], "1");
    let status = r.status().as_u16();
    check_error(status, &r.json().await.unwrap(), 429, "rate_limit_exceeded");
    drop(held);
    wait_until(Duration::from_secs(10), || async {
        post(&c.url, "/v1/chat/completions", &chat_body("x", json!({})))
            .await
            .status()
            == 200
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_decode_worker_is_503_and_not_ready() {
    let c = cluster(Opts {
        decode: 0,
        ..Default::default()
    })
    .await;
    assert_eq!(
        reqwest::get(format!("{}/ready", c.url))
            .await
            .unwrap()
            .status(),
        503
    );
    let r = post(&c.url, "/v1/chat/completions", &chat_body("x", json!({}))).await;
    assert_eq!(r.headers()["retry-after"], "1");
    let status = r.status().as_u16();
    check_error(status, &r.json().await.unwrap(), 503, "no_worker");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_disaggregated_router_without_a_prefill_worker_is_not_ready() {
    let model = pdserve_testkit::tiny::TinyModel::new();
    let (decode, _worker) = mock(&model, "decode", &[]).await;
    let listed = format!("--decode-url={decode}");
    let (url, _) = router(
        model.arg(),
        &[],
        &[],
        &["--mode", "disaggregated", listed.as_str()],
    )
    .await;
    // The decode worker enters placement, the router still cannot serve.
    wait_until(Duration::from_secs(10), || async {
        let m = reqwest::get(format!("{url}/metrics"))
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        m.contains("pdserve_workers{pool=\"decode\",state=\"ready\"} 1")
    })
    .await;
    let ready = reqwest::get(format!("{url}/ready")).await.unwrap().status();
    assert_eq!(ready, 503, "no prefill worker, yet ready");
    let r = post(&url, "/v1/chat/completions", &chat_body("x", json!({}))).await;
    let status = r.status().as_u16();
    check_error(status, &r.json().await.unwrap(), 503, "no_worker");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_decode_pool_is_503() {
    let full = decode_double(|| async {
        let e = ErrorBody::retryable(ErrorKind::KvExhausted, "the KV budget is full");
        (axum::http::StatusCode::SERVICE_UNAVAILABLE, Json(e))
    })
    .await;
    let c = cluster(Opts {
        decode: 0,
        extra_decode: vec![full],
        ..Default::default()
    })
    .await;
    let (s, v) = post_json(&c.url, "/v1/chat/completions", &chat_body("x", json!({}))).await;
    check_error(s, &v, 503, "overloaded");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broken_decode_worker_is_502() {
    let broken = decode_double(|| async { "this is not the protocol\n" }).await;
    let c = cluster(Opts {
        decode: 0,
        extra_decode: vec![broken],
        ..Default::default()
    })
    .await;
    let (s, v) = post_json(&c.url, "/v1/chat/completions", &chat_body("x", json!({}))).await;
    check_error(s, &v, 502, "upstream_error");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_past_its_deadline_is_504() {
    // Reserves, then never produces a token.
    let stuck = decode_double(|| async {
        let line = serde_json::to_string(&GenerateEvent::Reserved {
            kv_url: None,
            report_seq: 0,
            cached_tokens: 0,
        })
        .unwrap()
            + "\n";
        let s = futures_util::stream::once(async move { Ok::<_, std::io::Error>(line) })
            .chain(futures_util::stream::pending());
        axum::body::Body::from_stream(s)
    })
    .await;
    let c = cluster(Opts {
        decode: 0,
        extra_decode: vec![stuck],
        router_args: &["--request-timeout-seconds", "1", "--mode", "aggregated"],
        ..Default::default()
    })
    .await;
    let (s, v) = post_json(&c.url, "/v1/chat/completions", &chat_body("x", json!({}))).await;
    check_error(s, &v, 504, "deadline_exceeded");
}

use futures_util::StreamExt;
