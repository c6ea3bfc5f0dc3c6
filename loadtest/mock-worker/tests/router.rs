//! The real router over mock workers that register themselves: a chat
//! completion goes through prefill, the KV stream and decode, and the
//! router detokenizes the mock's ids with the tiny model's tokenizer.

mod common;

use std::sync::Arc;
use std::time::Duration;

use clap::Parser;
use common::*;
use pdserve_protocol::internal::Pool;
use serde_json::{json, Value};
use tokio_util::sync::CancellationToken;

async fn router(model: &Model) -> (String, Arc<pdserve_router::http::AppState>) {
    let path = model.path.to_str().unwrap();
    let argv = [
        "pdserve-router",
        "--model",
        path,
        "--served-model-name",
        "tiny",
        "--mode",
        "disaggregated",
    ];
    let args = pdserve_router::Args::try_parse_from(argv).unwrap();
    let state = pdserve_router::build_state(&args).unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let app = pdserve_router::build_app(state.clone());
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (url, state)
}

fn register(router: &str, mock: &Mock, stop: &CancellationToken) {
    let w = mock.worker.clone();
    let load = Arc::new(move || w.load_report());
    let reg = mock.worker.registration(mock.url.clone());
    let every = Duration::from_millis(20);
    pdserve_runtime::registration::spawn(router.to_string(), reg, every, load, stop.clone());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_real_router_serves_chat_over_registered_mock_workers() {
    let model = tiny_model();
    let (url, state) = router(&model).await;
    let d = spawn(&model, "decode", &["--latency-scale", "0"]).await;
    let p = spawn(&model, "prefill", &["--latency-scale", "0"]).await;
    let stop = CancellationToken::new();
    register(&url, &d, &stop);
    register(&url, &p, &stop);
    let registry = state.registry.clone();
    wait_until(Duration::from_secs(10), || {
        let r = registry.clone();
        async move { r.has_ready(Pool::Decode) && r.has_ready(Pool::Prefill) }
    })
    .await;
    let body = json!({
        "model": "tiny",
        "messages": [{"role": "user", "content": "hello there"}],
        "max_tokens": 12,
        "temperature": 0,
    });
    let (status, v) = {
        let r = post(&url, "/v1/chat/completions", &body).await;
        (r.status().as_u16(), r.json::<Value>().await.unwrap())
    };
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["choices"][0]["finish_reason"], "length", "{v}");
    assert_eq!(v["usage"]["completion_tokens"], 12, "{v}");
    assert!(v["choices"][0]["message"]["content"].is_string(), "{v}");
    // It went through the prefill worker and the KV stream.
    assert_eq!(
        metric(&p.url, "pdserve_requests_total{status=\"ok\"}").await,
        1.0
    );
    assert!(metric(&d.url, "pdserve_kv_transfer_bytes_total").await > 0.0);
    let prompt = v["usage"]["prompt_tokens"].as_f64().unwrap();
    assert_eq!(metric(&p.url, "pdserve_prompt_tokens_total").await, prompt);
    // Streaming works too, and ends with [DONE].
    let mut stream_body = body.clone();
    stream_body["stream"] = json!(true);
    let text = post(&url, "/v1/chat/completions", &stream_body)
        .await
        .text()
        .await
        .unwrap();
    assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
    assert!(text.contains("\"finish_reason\":\"length\""), "{text}");
    stop.cancel();
}
