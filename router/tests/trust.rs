//! The trust boundary: with an internal token, every internal route of the
//! router and of both workers answers 401 without it or with a wrong one,
//! and the cluster still serves; registrations cannot hijack workers; a
//! prefill worker streams KV only to decode workers it knows; a stalled KV
//! upload frees its reservation; a request no decode worker can hold is a
//! 400; API keys never reach the log.

mod common;

use std::time::Duration;

use common::*;
use pdserve_testkit::http::load;
use pdserve_testkit::process::WorkerProcess;
use pdserve_testkit::tiny::TinyModel;
use reqwest::{Method, StatusCode};
use serde_json::{json, Value};

const TOKEN: &str = "t0k3n-for-tests";

async fn call(method: Method, url: &str, bearer: Option<&str>, body: &Value) -> StatusCode {
    let mut req = reqwest::Client::new().request(method, url).json(body);
    if let Some(b) = bearer {
        req = req.bearer_auth(b);
    }
    req.send().await.unwrap().status()
}

/// Without the token and with a wrong one: 401; with it: anything else.
async fn needs_token(method: Method, url: &str, body: Value) {
    for bearer in [None, Some("wrong")] {
        let status = call(method.clone(), url, bearer, &body).await;
        assert_eq!(status, 401, "{method} {url} with {bearer:?}");
    }
    let status = call(method.clone(), url, Some(TOKEN), &body).await;
    assert_ne!(status, 401, "{method} {url} with the token");
}

async fn open(url: &str) {
    let status = reqwest::get(url).await.unwrap().status();
    assert_ne!(status, 401, "{url} is open");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_internal_route_needs_the_token_and_the_cluster_serves_with_it() {
    let model = TinyModel::new();
    let auth = ["--internal-token", TOKEN];
    let (d, _decode) = mock(
        &model,
        "decode",
        &[&auth[..], &["--latency-scale", "0"]].concat(),
    )
    .await;
    let prefill_args = [&auth[..], &["--latency-scale", "0", "--decode-url", &d]].concat();
    let (p, _prefill) = mock(&model, "prefill", &prefill_args).await;
    let router_args = [&auth[..], &["--mode", "disaggregated"]].concat();
    let (r, _state) = router(
        model.arg(),
        std::slice::from_ref(&p),
        std::slice::from_ref(&d),
        &router_args,
    )
    .await;

    let reg = json!({"pool": "decode", "url": "http://127.0.0.1:1", "model_fingerprint": 1, "weights": "mock"});
    needs_token(
        Method::POST,
        &format!("{r}/v1/internal/workers/register"),
        reg,
    )
    .await;
    let hb = json!({"url": "http://127.0.0.1:1", "load": {"queued_requests": 0, "queued_tokens": 0, "active_sequences": 0, "kv_used_tokens": 0, "kv_free_tokens": 0, "tokens_per_second": 0.0, "ready": false}});
    needs_token(
        Method::POST,
        &format!("{r}/v1/internal/workers/heartbeat"),
        hb,
    )
    .await;
    let dereg = json!({"url": "http://127.0.0.1:1"});
    needs_token(
        Method::POST,
        &format!("{r}/v1/internal/workers/deregister"),
        dereg,
    )
    .await;
    needs_token(
        Method::GET,
        &format!("{r}/v1/internal/workers"),
        Value::Null,
    )
    .await;
    let gen = json!({"request_id": "g", "prompt_tokens": [3, 4], "sampling": {"max_tokens": 1}, "kv_source": {"kind": "local"}});
    needs_token(Method::POST, &format!("{d}/v1/internal/generate"), gen).await;
    needs_token(
        Method::POST,
        &format!("{d}/v1/internal/kv/none"),
        Value::Null,
    )
    .await;
    let job = json!({"request_id": "j", "prompt_tokens": [3, 4], "sampling": {"max_tokens": 1}, "kv_destination": format!("{d}/v1/internal/kv/j"), "deadline_ms": 1000});
    needs_token(Method::POST, &format!("{p}/v1/internal/prefill"), job).await;
    needs_token(
        Method::DELETE,
        &format!("{p}/v1/internal/prefill/j"),
        Value::Null,
    )
    .await;
    for w in [&d, &p] {
        needs_token(Method::GET, &format!("{w}/load"), Value::Null).await;
    }
    for base in [&r, &d, &p] {
        for path in ["/health", "/ready", "/metrics"] {
            open(&format!("{base}{path}")).await;
        }
    }
    // The router's own calls carry the token: polls, reservations, prefill, KV.
    let body = chat_body("hello", json!({"max_tokens": 6}));
    let (status, v) = post_json(&r, "/v1/chat/completions", &body).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["usage"]["completion_tokens"], 6, "{v}");
    let transfers = metric(
        &metrics(&r).await,
        "pdserve_request_stage_seconds_count{stage=\"kv_transfer\"}",
    );
    assert_eq!(transfers, 1.0, "it went through the prefill worker");
}

async fn register(router: &str, body: Value) -> StatusCode {
    call(
        Method::POST,
        &format!("{router}/v1/internal/workers/register"),
        None,
        &body,
    )
    .await
}

fn registration(url: &str, id: &str) -> Value {
    json!({"pool": "decode", "url": url, "model_fingerprint": 1, "weights": "mock", "worker_id": id})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fake_registration_is_refused() {
    let model = TinyModel::new();
    let (r, state) = router(model.arg(), &[], &[], &[]).await;
    for bad in [
        "127.0.0.1:5",
        "http://127.0.0.1",
        "http://127.0.0.1:5/x",
        "ftp://a:1",
        "http://u@a:1",
    ] {
        assert_eq!(register(&r, registration(bad, "x")).await, 400, "{bad}");
    }
    assert_eq!(
        register(&r, registration("http://127.0.0.1:5", "w1")).await,
        204
    );
    // Its heartbeats may spell the URL as it registered it, unnormalised.
    let hb = json!({"url": "HTTP://127.0.0.1:5/", "load": {"queued_requests": 0, "queued_tokens": 0, "active_sequences": 0, "kv_used_tokens": 0, "kv_free_tokens": 0, "tokens_per_second": 0.0, "ready": true}});
    let url = format!("{r}/v1/internal/workers/heartbeat");
    assert_eq!(call(Method::POST, &url, None, &hb).await, 204);
    // Another id at its URL, its id at another URL, its URL in the other pool.
    assert_eq!(
        register(&r, registration("http://127.0.0.1:5", "w2")).await,
        409
    );
    assert_eq!(
        register(&r, registration("http://127.0.0.1:6", "w1")).await,
        409
    );
    let other_pool = json!({"pool": "prefill", "url": "http://127.0.0.1:5", "model_fingerprint": 1, "weights": "mock", "worker_id": "w1"});
    assert_eq!(register(&r, other_pool).await, 409);
    assert_eq!(state.registry.list().len(), 1);
    // Only the hosts --worker-allow lists may register.
    let (r2, _) = router(
        model.arg(),
        &[],
        &[],
        &["--worker-allow", "10.0.0.0/8,node-1"],
    )
    .await;
    assert_eq!(
        register(&r2, registration("http://127.0.0.1:5", "a")).await,
        403
    );
    assert_eq!(
        register(&r2, registration("http://10.1.2.3:5", "b")).await,
        204
    );
    assert_eq!(
        register(&r2, registration("http://node-1:5", "c")).await,
        204
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefill_worker_sends_kv_only_to_a_decode_worker_it_knows() {
    let model = TinyModel::new();
    let (d, _decode) = mock(&model, "decode", &["--latency-scale", "0"]).await;
    let (p, _prefill) = mock(
        &model,
        "prefill",
        &["--latency-scale", "0", "--decode-url", &d],
    )
    .await;
    for dest in [
        "http://169.254.169.254:80/v1/internal/kv/j".to_string(),
        "http://127.0.0.1:1/v1/internal/kv/j".to_string(),
        format!("{d}/v1/internal/kv/other"),
        format!("{d}/elsewhere"),
    ] {
        let job = json!({"request_id": "j", "prompt_tokens": [3, 4, 5], "sampling": {"max_tokens": 1}, "kv_destination": dest, "deadline_ms": 1000});
        let (status, v) = post_json(&p, "/v1/internal/prefill", &job).await;
        assert_eq!(status, 400, "{dest}: {v}");
        assert_eq!(v["kind"], "kv_destination_refused", "{v}");
    }
    // A prefill worker that knows no decode worker refuses every destination.
    let (lone, _w) = mock(&model, "prefill", &["--latency-scale", "0"]).await;
    let job = json!({"request_id": "k", "prompt_tokens": [3, 4, 5], "sampling": {"max_tokens": 1}, "kv_destination": format!("{d}/v1/internal/kv/k"), "deadline_ms": 1000});
    let (status, v) = post_json(&lone, "/v1/internal/prefill", &job).await;
    assert_eq!(
        (status, v["kind"].as_str()),
        (400, Some("kv_destination_refused")),
        "{v}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_kv_upload_frees_its_reservation() {
    let model = TinyModel::new();
    let (d, _decode) = mock(&model, "decode", &["--kv-idle-timeout-ms", "200"]).await;
    let gen = json!({"request_id": "s", "prompt_tokens": (3..40).collect::<Vec<u32>>(), "sampling": {"max_tokens": 4}, "kv_source": {"kind": "remote", "lease_ms": 600}});
    let resp = post(&d, "/v1/internal/generate", &gen).await;
    assert_eq!(resp.status(), 200);
    assert!(load(&d).await.kv_used_tokens > 0, "reserved");
    // An upload that opens and then sends nothing, ever.
    let (_hold, rx) = tokio::sync::mpsc::channel::<Result<Vec<u8>, std::io::Error>>(1);
    let body = reqwest::Body::wrap_stream(tokio_stream_from(rx));
    let upload = reqwest::Client::new()
        .post(format!("{d}/v1/internal/kv/s"))
        .body(body)
        .send();
    let answered = tokio::time::timeout(Duration::from_secs(10), upload).await;
    let status = answered.expect("the idle upload was cut").unwrap().status();
    assert_eq!(status, 503, "the idle upload fails, retryable");
    let text = resp.text().await.unwrap();
    assert!(text.contains("kv_lease_expired"), "{text}");
    assert_eq!(load(&d).await.kv_used_tokens, 0, "the reservation is freed");
}

fn tokio_stream_from(
    mut rx: tokio::sync::mpsc::Receiver<Result<Vec<u8>, std::io::Error>>,
) -> impl futures_util::Stream<Item = Result<Vec<u8>, std::io::Error>> {
    futures_util::stream::poll_fn(move |cx| rx.poll_recv(cx))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_no_decode_worker_can_hold_is_a_400() {
    let c = cluster(Opts {
        mock_args: &["--latency-scale", "0", "--kv-cache-tokens", "128"],
        ..Default::default()
    })
    .await;
    wait_until(Duration::from_secs(5), || {
        let r = c.router.registry.clone();
        async move {
            let w = r.candidates(pdserve_protocol::internal::Pool::Decode, None);
            w.iter().all(|w| w.load.kv_free_tokens > 0)
        }
    })
    .await;
    let body = chat_body("hi", json!({"max_tokens": 300}));
    let (status, v) = post_json(&c.url, "/v1/chat/completions", &body).await;
    assert_eq!(status, 400, "{v}");
    let message = v["error"]["message"].as_str().unwrap();
    assert!(message.contains("KV cache"), "{message}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_log_of_a_start_with_api_keys_holds_no_key() {
    let model = TinyModel::new();
    let exe = env!("CARGO_BIN_EXE_pdserve-router");
    let args = [
        "--port",
        "0",
        "--model",
        model.arg(),
        "--api-key",
        "sk-never-logged-1,sk-never-logged-2",
        "--internal-token",
        "itok-never-logged",
    ];
    let router = WorkerProcess::start(exe, &args, Duration::from_secs(30)).await;
    let log = router.log();
    assert!(log.contains("starting the router"), "{log}");
    for secret in ["sk-never-logged", "itok-never-logged"] {
        assert!(!log.contains(secret), "{secret} in the log:\n{log}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_error_is_retried_on_another_worker() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

    use axum::routing::{get, post as route_post};
    use pdserve_protocol::internal::{ErrorBody, ErrorKind, LoadReport, PrefillEvent};

    // A prefill worker whose engine fails every job; it even calls the
    // failure fatal, as an older worker did.
    let calls = Arc::new(AtomicUsize::new(0));
    let counter = calls.clone();
    let load = LoadReport {
        ready: true,
        ..Default::default()
    };
    let failing = axum::Router::new()
        .route(
            "/load",
            get(move || async move { axum::Json(load.clone()) }),
        )
        .route(
            "/v1/internal/prefill",
            route_post(move || async move {
                counter.fetch_add(1, Ordering::SeqCst);
                let failed = ErrorBody::fatal(ErrorKind::EngineFailed, "the forward pass failed");
                let lines = [
                    PrefillEvent::Queued { report_seq: 0 },
                    PrefillEvent::Error(failed),
                ];
                lines
                    .iter()
                    .map(|e| serde_json::to_string(e).unwrap() + "\n")
                    .collect::<String>()
            }),
        );
    let failing = serve(failing).await;
    let c = cluster(Opts {
        extra_prefill: vec![failing],
        router_args: &["--mode", "disaggregated", "--prefill-policy", "round-robin"],
        ..Default::default()
    })
    .await;
    wait_until(Duration::from_secs(5), || async {
        let p = pdserve_protocol::internal::Pool::Prefill;
        c.router.registry.candidates(p, None).len() == 2
    })
    .await;
    for _ in 0..4 {
        let body = chat_body("a prompt to prefill", json!({"max_tokens": 4}));
        let (status, v) = post_json(&c.url, "/v1/chat/completions", &body).await;
        assert_eq!(status, 200, "{v}");
    }
    assert!(
        calls.load(Ordering::SeqCst) >= 1,
        "the failing worker was never tried"
    );
    let m = metrics(&c.url).await;
    assert!(metric(&m, "pdserve_prefill_retries_total") >= 1.0, "{m}");
}
