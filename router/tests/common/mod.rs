//! A whole cluster on loopback: prefill and decode workers on the tiny random
//! model, and a router in front of them, each a real HTTP server built by its
//! production `build_app` and bound to 127.0.0.1:0.
#![allow(dead_code)]

pub mod process;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;
use pdserve_engine::testing::{write_tiny_gguf, TinyModelSpec};
use pdserve_engine::{LoadOptions, Model, WeightFormat};
use serde_json::{json, Value};

pub const MODEL: &str = "tiny";

pub struct Cluster {
    pub url: String,
    pub router: Arc<pdserve_router::http::AppState>,
    pub decode: Vec<Arc<pdserve_decode::state::AppState>>,
    pub decode_urls: Vec<String>,
    pub prefill_urls: Vec<String>,
    pub model_path: PathBuf,
    _dir: Arc<tempfile::TempDir>,
}

pub async fn serve(app: axum::Router) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    url
}

fn load(path: &Path) -> Arc<Model> {
    let opts = LoadOptions {
        weights: WeightFormat::Q8_0,
        ..Default::default()
    };
    Arc::new(Model::load(path, &opts).unwrap())
}

/// How many real workers of each pool, and extra router flags.
pub struct Opts<'a> {
    pub prefill: usize,
    pub decode: usize,
    pub router_args: &'a [&'a str],
    /// Extra static worker URLs (test doubles), added to the router's lists.
    pub extra_prefill: Vec<String>,
    pub extra_decode: Vec<String>,
}

impl Default for Opts<'_> {
    fn default() -> Self {
        Self {
            prefill: 1,
            decode: 1,
            router_args: &[],
            extra_prefill: vec![],
            extra_decode: vec![],
        }
    }
}

pub async fn cluster(opts: Opts<'_>) -> Cluster {
    let dir = Arc::new(tempfile::tempdir().unwrap());
    let path = dir.path().join("tiny.gguf");
    write_tiny_gguf(&path, &TinyModelSpec::default()).unwrap();
    let p = path.to_str().unwrap().to_string();
    let mut decode = Vec::new();
    let mut decode_urls = Vec::new();
    for _ in 0..opts.decode {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let args =
            pdserve_decode::Args::parse_from(["d", "--model", &p, "--kv-cache-tokens", "4096"]);
        let state = pdserve_decode::build_state(load(&path), 2, &args, url.clone());
        let app = pdserve_decode::build_app(state.clone());
        tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
        decode.push(state);
        decode_urls.push(url);
    }
    let mut prefill_urls = Vec::new();
    for _ in 0..opts.prefill {
        let args = pdserve_prefill::Args::parse_from(["p", "--model", &p]);
        let state = pdserve_prefill::build_state(load(&path), &args);
        prefill_urls.push(serve(pdserve_prefill::build_app(state)).await);
    }
    let mut all_prefill = prefill_urls.clone();
    all_prefill.extend(opts.extra_prefill.iter().cloned());
    let mut all_decode = decode_urls.clone();
    all_decode.extend(opts.extra_decode.iter().cloned());
    let router = router(&p, &all_prefill, &all_decode, opts.router_args).await;
    Cluster {
        url: router.0,
        router: router.1,
        decode,
        decode_urls,
        prefill_urls,
        model_path: path,
        _dir: dir,
    }
}

/// A router over the given workers; returns once a decode worker is ready
/// (and every listed prefill worker, unless a test double never becomes ready).
pub async fn router(
    model: &str,
    prefill: &[String],
    decode: &[String],
    extra: &[&str],
) -> (String, Arc<pdserve_router::http::AppState>) {
    let mut argv: Vec<String> = [
        "pdserve-router",
        "--model",
        model,
        "--served-model-name",
        MODEL,
        "--health-interval-ms",
        "50",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    if !prefill.is_empty() {
        argv.push(format!("--prefill-url={}", prefill.join(",")));
    }
    if !decode.is_empty() {
        argv.push(format!("--decode-url={}", decode.join(",")));
    }
    argv.extend(extra.iter().map(|s| s.to_string()));
    let args = pdserve_router::Args::try_parse_from(argv).unwrap();
    let state = pdserve_router::build_state(&args).unwrap();
    pdserve_router::discovery::spawn(
        state.registry.clone(),
        pdserve_router::discovery_config(&args),
        tokio_util::sync::CancellationToken::new(),
    );
    let url = serve(pdserve_router::build_app(state.clone())).await;
    if !decode.is_empty() {
        wait_until(Duration::from_secs(10), || async {
            reqwest::get(format!("{url}/ready")).await.unwrap().status() == 200
        })
        .await;
    }
    (url, state)
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
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

pub fn chat_body(content: &str, extra: Value) -> Value {
    let mut body = json!({
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 8,
        "temperature": 0,
    });
    merge(&mut body, extra);
    body
}

pub fn completion_body(prompt: &str, extra: Value) -> Value {
    let mut body = json!({"model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0});
    merge(&mut body, extra);
    body
}

fn merge(body: &mut Value, extra: Value) {
    if let (Some(b), Value::Object(e)) = (body.as_object_mut(), extra) {
        b.extend(e);
    }
}

pub async fn post(url: &str, path: &str, body: &Value) -> reqwest::Response {
    reqwest::Client::new()
        .post(format!("{url}{path}"))
        .json(body)
        .send()
        .await
        .unwrap()
}

/// POSTs and returns (status, JSON body).
pub async fn post_json(url: &str, path: &str, body: &Value) -> (u16, Value) {
    let r = post(url, path, body).await;
    let status = r.status().as_u16();
    (status, r.json().await.unwrap())
}

/// Reads a whole SSE response: the JSON of every `data:` event, and whether
/// it ended with `[DONE]`.
pub async fn sse_events(resp: reqwest::Response) -> (Vec<Value>, bool) {
    assert_eq!(resp.status(), 200);
    assert_eq!(
        resp.headers()["content-type"].to_str().unwrap(),
        "text/event-stream"
    );
    let text = resp.text().await.unwrap();
    let mut events = Vec::new();
    let mut done = false;
    for block in text.split("\n\n").filter(|b| !b.is_empty()) {
        let data = block
            .strip_prefix("data: ")
            .expect("every event is a data line");
        assert!(!done, "nothing may follow [DONE]");
        match data {
            "[DONE]" => done = true,
            json => events.push(serde_json::from_str(json).unwrap()),
        }
    }
    (events, done)
}

/// The text of choice `index` in a stream of chunks.
pub fn streamed_text(events: &[Value], index: u64) -> String {
    events
        .iter()
        .flat_map(|e| e["choices"].as_array().cloned().unwrap_or_default())
        .filter(|c| c["index"] == index)
        .filter_map(|c| {
            c["delta"]["content"]
                .as_str()
                .or(c["text"].as_str())
                .map(str::to_string)
        })
        .collect()
}
