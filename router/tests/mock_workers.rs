//! The router over mock workers that register themselves (no static list):
//! a chat completion goes through prefill, the KV stream and decode, and the
//! router detokenizes the mock's ids with the tiny model's tokenizer.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::*;
use pdserve_mock_worker::Worker;
use pdserve_protocol::internal::Pool;
use pdserve_runtime::auth::InternalToken;
use pdserve_testkit::http::fetch_metric;
use pdserve_testkit::tiny::TinyModel;
use serde_json::{json, Value};
use tokio_util::sync::CancellationToken;

fn register(
    router: &str,
    url: &str,
    worker: &Worker,
    token: &InternalToken,
    stop: &CancellationToken,
) {
    let w = worker.clone();
    let load = Arc::new(move || w.load_report());
    let reg = worker.service(url.to_string()).registration;
    let every = Duration::from_millis(20);
    pdserve_worker::registration::spawn(router.to_string(), reg, every, token, load, stop.clone());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_real_router_serves_chat_over_registered_mock_workers() {
    let model = TinyModel::new();
    let (url, state) = router(model.arg(), &[], &[], &["--mode", "disaggregated"]).await;
    let (d, decode) = mock(&model, "decode", &["--latency-scale", "0"]).await;
    let (p, prefill) = mock(
        &model,
        "prefill",
        &["--latency-scale", "0", "--decode-url", &d],
    )
    .await;
    let stop = CancellationToken::new();
    let open = InternalToken::default();
    register(&url, &d, &decode, &open, &stop);
    register(&url, &p, &prefill, &open, &stop);
    let registry = state.registry.clone();
    wait_until(Duration::from_secs(10), || {
        let r = registry.clone();
        async move { r.has_ready(Pool::Decode) && r.has_ready(Pool::Prefill) }
    })
    .await;
    let body = chat_body("hello there", json!({"max_tokens": 12}));
    let (status, v): (u16, Value) = post_json(&url, "/v1/chat/completions", &body).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["choices"][0]["finish_reason"], "length", "{v}");
    assert_eq!(v["usage"]["completion_tokens"], 12, "{v}");
    assert!(v["choices"][0]["message"]["content"].is_string(), "{v}");
    // It went through the prefill worker and the KV stream.
    let ok = "pdserve_requests_total{status=\"ok\"}";
    assert_eq!(fetch_metric(&p, ok).await, 1.0);
    assert!(fetch_metric(&d, "pdserve_kv_transfer_bytes_total").await > 0.0);
    let prompt = v["usage"]["prompt_tokens"].as_f64().unwrap();
    assert_eq!(
        fetch_metric(&p, "pdserve_prompt_tokens_total").await,
        prompt
    );
    // Streaming works too, and ends with [DONE].
    let mut stream_body = body.clone();
    stream_body["stream"] = json!(true);
    let (events, done) = sse_events(post(&url, "/v1/chat/completions", &stream_body).await).await;
    assert!(done);
    let last = &events.last().unwrap()["choices"][0];
    assert_eq!(last["finish_reason"], "length", "{events:?}");
    stop.cancel();
}
