//! Mock workers on loopback, each a real HTTP server built by the production
//! `build` and bound to 127.0.0.1:0, over a tiny GGUF written at test time.
#![allow(dead_code)]

use std::path::PathBuf;
use std::time::{Duration, Instant};

use clap::Parser;
use pdserve_engine::testing::{write_tiny_gguf, TinyModelSpec};
use pdserve_mock_worker::{build, Args, Worker};
use pdserve_protocol::internal::{GenerateEvent, LoadReport};
use pdserve_runtime::shutdown;
use serde_json::{json, Value};
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// The tiny model's shape: 2 layers, 2 KV heads of dim 16, 266 tokens.
pub const LAYERS: u64 = 2;
pub const KV_HEADS: u64 = 2;
pub const HEAD_DIM: u64 = 16;
pub const VOCAB: u32 = 266;

pub struct Model {
    pub path: PathBuf,
    _dir: tempfile::TempDir,
}

pub fn tiny_model() -> Model {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tiny.gguf");
    write_tiny_gguf(&path, &TinyModelSpec::default()).unwrap();
    Model { path, _dir: dir }
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
    let (app, drain) = (
        mock.worker.app(),
        mock.worker.drain(Duration::from_secs(30)),
    );
    let served = tokio::spawn(shutdown::serve(listener, app, token, drain));
    (mock, served)
}

async fn build_mock(model: &Model, pool: &str, extra: &[&str]) -> (TcpListener, Mock) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let path = model.path.to_str().unwrap();
    let mut argv = vec!["mock", "--pool", pool, "--model", path];
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

pub async fn post(url: &str, path: &str, body: &Value) -> reqwest::Response {
    reqwest::Client::new()
        .post(format!("{url}{path}"))
        .json(body)
        .send()
        .await
        .unwrap()
}

/// Reads a whole generate stream.
pub async fn events(resp: reqwest::Response) -> Vec<GenerateEvent> {
    assert_eq!(resp.status(), 200);
    let text = resp.text().await.unwrap();
    text.lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// Reads the next event of a generate stream, buffering partial lines.
pub async fn next_event(resp: &mut reqwest::Response, buf: &mut Vec<u8>) -> Option<GenerateEvent> {
    loop {
        if let Some(i) = buf.iter().position(|&b| b == b'\n') {
            let line: Vec<u8> = buf.drain(..=i).collect();
            return Some(serde_json::from_slice(&line).unwrap());
        }
        buf.extend_from_slice(&resp.chunk().await.unwrap()?);
    }
}

pub fn token_ids(events: &[GenerateEvent]) -> Vec<u32> {
    events
        .iter()
        .filter_map(|e| match e {
            GenerateEvent::Token { id, .. } => Some(*id),
            _ => None,
        })
        .collect()
}

pub async fn load(url: &str) -> LoadReport {
    reqwest::get(format!("{url}/load"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}

/// The value of the series `series` (name and labels, exactly as rendered).
pub async fn metric(url: &str, series: &str) -> f64 {
    let text = reqwest::get(format!("{url}/metrics"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let prefix = format!("{series} ");
    text.lines()
        .find_map(|l| l.strip_prefix(&prefix))
        .unwrap_or_else(|| panic!("no series {series} in:\n{text}"))
        .parse()
        .unwrap()
}

/// Polls `f` until it is true; panics after `within`.
pub async fn wait_until<F, Fut>(within: Duration, mut f: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let until = Instant::now() + within;
    while !f().await {
        assert!(
            Instant::now() < until,
            "condition not met within {within:?}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Bytes of a KV stream of `n` tokens in f32, one chunk, with `n_top` top
/// logprobs, from the format (kvwire.rs): header 51 + id, each layer frame
/// 32 + K and V, end frame 17 + 8 per top logprob.
pub fn expected_stream_bytes(id: &str, n: u64, n_top: u64) -> u64 {
    let kv = LAYERS * 2 * n * KV_HEADS * HEAD_DIM * 4;
    51 + id.len() as u64 + LAYERS * 32 + kv + 17 + 8 * n_top
}
