//! A decode worker on the tiny random model, served on 127.0.0.1:0.
#![allow(dead_code)]

use std::sync::Arc;

use clap::Parser;
use pdserve_decode::state::AppState;
use pdserve_decode::{build_app, build_state, Args};
use pdserve_engine::sampler::{sample, SamplingParams, TokenCounts};
use pdserve_engine::testing::{write_tiny_gguf, TinyModelSpec};
use pdserve_engine::{KvPool, LoadOptions, Model, WeightFormat};
use pdserve_protocol::internal::{GenerateEvent, GenerateRequest, KvSource, SamplingSpec};

pub const EOS: u32 = 2;

pub struct Worker {
    pub url: String,
    pub state: Arc<AppState>,
    pub model: Arc<Model>,
    _dir: tempfile::TempDir,
}

pub async fn start(extra: &[&str]) -> Worker {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tiny.gguf");
    write_tiny_gguf(&path, &TinyModelSpec::default()).unwrap();
    let mut argv = vec![
        "pdserve-decode",
        "--model",
        path.to_str().unwrap(),
        "--port",
        "0",
    ];
    argv.extend_from_slice(extra);
    let args = Args::parse_from(argv);
    let opts = LoadOptions {
        weights: WeightFormat::Q8_0,
        ..Default::default()
    };
    let model = Arc::new(Model::load(&path, &opts).unwrap());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let state = build_state(model.clone(), EOS, &args, url.clone());
    let app = build_app(state.clone());
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    Worker {
        url,
        state,
        model,
        _dir: dir,
    }
}

pub fn prompt(n: usize, salt: u32) -> Vec<u32> {
    (0..n as u32)
        .map(|i| 3 + (i * 37 + 11 + salt * 13) % 250)
        .collect()
}

pub fn request(id: &str, prompt: Vec<u32>, max_tokens: u32, source: KvSource) -> GenerateRequest {
    GenerateRequest {
        request_id: id.to_string(),
        prompt_tokens: prompt,
        sampling: SamplingSpec {
            temperature: 0.0,
            max_tokens,
            ignore_eos: true,
            ..Default::default()
        },
        kv_source: source,
    }
}

/// Posts a generate request; returns the response (status checked by the caller).
pub async fn post(url: &str, req: &GenerateRequest) -> reqwest::Response {
    reqwest::Client::new()
        .post(format!("{url}/v1/internal/generate"))
        .json(req)
        .send()
        .await
        .unwrap()
}

/// Reads the next JSON line of a generate stream.
pub struct Lines {
    resp: reqwest::Response,
    buf: Vec<u8>,
}

impl Lines {
    pub fn new(resp: reqwest::Response) -> Self {
        Self {
            resp,
            buf: Vec::new(),
        }
    }

    pub async fn next(&mut self) -> Option<GenerateEvent> {
        loop {
            if let Some(i) = self.buf.iter().position(|&b| b == b'\n') {
                let line: Vec<u8> = self.buf.drain(..=i).collect();
                return Some(serde_json::from_slice(&line).unwrap());
            }
            match self.resp.chunk().await.unwrap() {
                Some(c) => self.buf.extend_from_slice(&c),
                None => return None,
            }
        }
    }

    pub async fn all(mut self) -> Vec<GenerateEvent> {
        let mut out = Vec::new();
        while let Some(e) = self.next().await {
            out.push(e);
        }
        out
    }
}

pub fn tokens(events: &[GenerateEvent]) -> Vec<u32> {
    events
        .iter()
        .filter_map(|e| match e {
            GenerateEvent::Token { id, .. } => Some(*id),
            _ => None,
        })
        .collect()
}

/// Greedy generation straight on the engine, as the reference.
pub fn reference(model: &Model, prompt: &[u32], n: usize) -> Vec<u32> {
    let pool = KvPool::new(model.kv_layout(), 4096);
    let mut kv = pool.allocate(prompt.len() + n).unwrap();
    let greedy = SamplingParams {
        temperature: 0.0,
        ..Default::default()
    };
    let mut logits = model.prefill(prompt, &mut kv).unwrap();
    let mut out = Vec::new();
    while out.len() < n {
        let t = sample(&logits, &greedy, kv.len() as u64, &TokenCounts::default())
            .unwrap()
            .token;
        out.push(t);
        logits = model
            .decode_step(&mut [(&mut kv, t)])
            .unwrap()
            .into_rows()
            .remove(0);
    }
    out
}

pub async fn load(url: &str) -> serde_json::Value {
    reqwest::get(format!("{url}/load"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}

/// Waits (bounded) until the worker holds no KV.
pub async fn wait_kv_free(url: &str) -> bool {
    for _ in 0..200 {
        if load(url).await["kv_used_tokens"] == 0 {
            return true;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    false
}
