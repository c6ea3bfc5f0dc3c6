//! A whole cluster on loopback: mock prefill and decode workers (the worker
//! layer's real HTTP side over the mock engine, on the tiny model's shape)
//! and a router in front of them, each a real HTTP server built by its
//! production constructor and bound to 127.0.0.1:0.
#![allow(dead_code, unused_imports)]

pub mod process;

use std::sync::Arc;

use clap::Parser;
use pdserve_mock_worker::Worker;
use pdserve_testkit::tiny::TinyModel;
use serde_json::{json, Value};
use tokio_util::sync::CancellationToken;

pub use pdserve_testkit::http::{
    bind, metric, metrics, post, post_json, serve, serve_on, wait_ready, wait_until,
};
pub use pdserve_testkit::sse::{sse_events, streamed_text};

pub const MODEL: &str = "tiny";

pub struct Cluster {
    pub url: String,
    pub router: Arc<pdserve_router::http::AppState>,
    pub decode: Vec<Worker>,
    pub decode_urls: Vec<String>,
    pub prefill_urls: Vec<String>,
    pub model: Arc<TinyModel>,
}

/// How many mock workers of each pool, and extra router flags.
pub struct Opts<'a> {
    pub prefill: usize,
    pub decode: usize,
    pub router_args: &'a [&'a str],
    /// Extra static worker URLs (test doubles), added to the router's lists.
    pub extra_prefill: Vec<String>,
    pub extra_decode: Vec<String>,
    /// Flags of every mock worker (default: a tenth of the default latency).
    pub mock_args: &'a [&'a str],
}

impl Default for Opts<'_> {
    fn default() -> Self {
        Self {
            prefill: 1,
            decode: 1,
            router_args: &[],
            extra_prefill: vec![],
            extra_decode: vec![],
            mock_args: &["--latency-scale", "0.1"],
        }
    }
}

/// A mock worker of `pool` on `model`, served on loopback.
pub async fn mock(model: &TinyModel, pool: &str, extra: &[&str]) -> (String, Worker) {
    let (listener, url) = bind().await;
    let mut argv = vec!["mock", "--pool", pool, "--model", model.arg()];
    argv.extend_from_slice(extra);
    let args = pdserve_mock_worker::Args::parse_from(argv);
    let worker = pdserve_mock_worker::build(&args, url.clone()).unwrap();
    serve_on(listener, worker.app());
    (url, worker)
}

pub async fn cluster(opts: Opts<'_>) -> Cluster {
    let model = Arc::new(TinyModel::new());
    let (mut decode, mut decode_urls, mut prefill_urls) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..opts.decode {
        let (url, worker) = mock(&model, "decode", opts.mock_args).await;
        decode.push(worker);
        decode_urls.push(url);
    }
    let mut all_decode = decode_urls.clone();
    all_decode.extend(opts.extra_decode.iter().cloned());
    // A prefill worker streams KV only to decode workers it knows.
    let known = format!("--decode-url={}", all_decode.join(","));
    let mut prefill_args = opts.mock_args.to_vec();
    if !all_decode.is_empty() {
        prefill_args.push(&known);
    }
    for _ in 0..opts.prefill {
        prefill_urls.push(mock(&model, "prefill", &prefill_args).await.0);
    }
    let mut all_prefill = prefill_urls.clone();
    all_prefill.extend(opts.extra_prefill.iter().cloned());
    let router = router(model.arg(), &all_prefill, &all_decode, opts.router_args).await;
    Cluster {
        url: router.0,
        router: router.1,
        decode,
        decode_urls,
        prefill_urls,
        model,
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
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    if !extra.contains(&"--health-interval-ms") {
        argv.extend(["--health-interval-ms".to_string(), "50".to_string()]);
    }
    if !prefill.is_empty() {
        argv.push(format!("--prefill-url={}", prefill.join(",")));
    }
    if !decode.is_empty() {
        argv.push(format!("--decode-url={}", decode.join(",")));
    }
    argv.extend(extra.iter().map(|s| s.to_string()));
    let args = pdserve_router::Args::try_parse_from(argv).unwrap();
    let (listener, url) = bind().await;
    let state = pdserve_router::spawn(&args, listener, CancellationToken::new()).unwrap();
    if !decode.is_empty() {
        wait_ready(&url).await;
    }
    (url, state)
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
