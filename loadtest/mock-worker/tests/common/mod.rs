//! Mock workers on loopback, each a real HTTP server built by the production
//! `build` and bound to 127.0.0.1:0, over a tiny GGUF written at test time.
#![allow(dead_code, unused_imports)]

use std::time::Duration;

use clap::Parser;
use pdserve_mock_worker::{build, Args, Worker};
use pdserve_runtime::shutdown::{self, Drain};
use pdserve_testkit::tiny::TinyModel;
use serde_json::{json, Value};
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

pub use pdserve_testkit::http::{fetch_metric as metric, load, post, wait_until};
pub use pdserve_testkit::ndjson::{events, prefill_outcome, token_ids, Lines};

/// The tiny model's shape: 2 layers, 2 KV heads of dim 16, 266 tokens.
pub const LAYERS: u64 = 2;
pub const KV_HEADS: u64 = 2;
pub const HEAD_DIM: u64 = 16;
pub const VOCAB: u32 = 266;

pub type Model = TinyModel;

pub fn tiny_model() -> Model {
    TinyModel::new()
}

pub struct Mock {
    pub url: String,
    pub worker: Worker,
}

/// A mock worker of `pool` ("prefill" or "decode") with extra flags.
pub async fn spawn(model: &Model, pool: &str, extra: &[&str]) -> Mock {
    let (listener, mock) = build_mock(model, pool, extra).await;
    let app = mock.worker.app();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    mock
}

/// Like [`spawn`], served as the binary serves it: it drains (within 30 s)
/// once `token` is cancelled, and the handle resolves when it has closed.
pub async fn spawn_draining(
    model: &Model,
    pool: &str,
    extra: &[&str],
    token: CancellationToken,
) -> (Mock, JoinHandle<std::io::Result<()>>) {
    let (listener, mock) = build_mock(model, pool, extra).await;
    let service = mock.worker.service(mock.url.clone());
    let drain = Drain {
        stop_accepting: service.stop_accepting,
        in_flight: service.in_flight,
        deadline: Duration::from_secs(30),
    };
    let served = tokio::spawn(shutdown::serve(listener, service.app, token, drain));
    (mock, served)
}

async fn build_mock(model: &Model, pool: &str, extra: &[&str]) -> (TcpListener, Mock) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let mut argv = vec!["mock", "--pool", pool, "--model", model.arg()];
    argv.extend_from_slice(extra);
    let worker = build(&Args::parse_from(argv), url.clone()).unwrap();
    (listener, Mock { url, worker })
}

/// A generate request body for a prompt of `prompt_len` tokens.
pub fn generate_body(id: &str, prompt_len: u32, sampling: Value, kv_source: Value) -> Value {
    let prompt: Vec<u32> = (0..prompt_len).map(|i| 3 + i % 200).collect();
    let mut s = json!({"temperature": 0, "max_tokens": 8});
    if let (Some(s), Value::Object(extra)) = (s.as_object_mut(), sampling) {
        s.extend(extra);
    }
    json!({"request_id": id, "prompt_tokens": prompt, "sampling": s, "kv_source": kv_source})
}

pub fn local() -> Value {
    json!({"kind": "local"})
}

pub fn remote(lease_ms: u64) -> Value {
    json!({"kind": "remote", "lease_ms": lease_ms})
}

/// Bytes of a KV stream of `n` tokens in f32, one chunk, with `n_top` top
/// logprobs, from the format (kvwire.rs): header 55 + id, each layer frame
/// 32 + K and V, end frame 17 + 8 per top logprob.
pub fn expected_stream_bytes(id: &str, n: u64, n_top: u64) -> u64 {
    let kv = LAYERS * 2 * n * KV_HEADS * HEAD_DIM * 4;
    55 + id.len() as u64 + LAYERS * 32 + kv + 17 + 8 * n_top
}

/// A decode mock that runs one sequence at a time, holds one more waiting
/// and queues one more: four local requests fill it.
pub const ONE_AT_A_TIME: &[&str] = &[
    "--max-batch",
    "1",
    "--max-queue",
    "1",
    "--step-fixed-ms",
    "50",
];

/// Fills a decode mock started with [`ONE_AT_A_TIME`]: one running, one
/// waiting in the engine, one in the intake queue. Returns their streams.
pub async fn fill_one_at_a_time(decode: &str) -> Vec<reqwest::Response> {
    let mut streams = Vec::new();
    for i in 0..3 {
        let body = generate_body(&format!("fill{i}"), 5, json!({"max_tokens": 40}), local());
        let resp = post(decode, "/v1/internal/generate", &body).await;
        assert_eq!(resp.status(), 200, "filler {i} is admitted");
        streams.push(resp);
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    streams
}
