//! A decode worker on the tiny random model, served on 127.0.0.1:0.
#![allow(dead_code)]

use std::sync::Arc;

use clap::Parser;
use pdserve_decode::state::AppState;
use pdserve_decode::{build_app, build_state, Args};
use pdserve_engine::sampler::{sample, SamplingParams, TokenCounts};
use pdserve_engine::testing::{write_tiny_gguf, TinyModelSpec};
use pdserve_engine::{KvDtype, KvPool, LoadOptions, Model, WeightFormat};
use pdserve_protocol::internal::{GenerateEvent, GenerateRequest, KvSource, SamplingSpec};
use pdserve_protocol::kvwire::{self, KvHeader, KvTrailer};

pub const EOS: u32 = 2;

pub struct Worker {
    pub url: String,
    pub state: Arc<AppState>,
    pub model: Arc<Model>,
    _dir: tempfile::TempDir,
}

/// The tiny model written to a temporary directory, and loaded.
pub fn tiny_model() -> (tempfile::TempDir, std::path::PathBuf, Arc<Model>) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tiny.gguf");
    write_tiny_gguf(&path, &TinyModelSpec::default()).unwrap();
    let opts = LoadOptions {
        weights: WeightFormat::Q8_0,
        ..Default::default()
    };
    let model = Arc::new(Model::load(&path, &opts).unwrap());
    (dir, path, model)
}

pub async fn start(extra: &[&str]) -> Worker {
    let (dir, path, model) = tiny_model();
    let mut argv = vec![
        "pdserve-decode",
        "--model",
        path.to_str().unwrap(),
        "--port",
        "0",
    ];
    argv.extend_from_slice(extra);
    let args = Args::parse_from(argv);
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

    /// The events until the stream ends or breaks (a worker that went away).
    pub async fn try_all(mut self) -> Vec<GenerateEvent> {
        let mut out = Vec::new();
        while let Ok(Some(c)) = self.resp.chunk().await {
            self.buf.extend_from_slice(&c);
        }
        for line in self.buf.split(|&b| b == b'\n') {
            if let Ok(e) = serde_json::from_slice(line) {
                out.push(e);
            }
        }
        out
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

/// Computes a prompt's KV and first token like a prefill worker would, as a kvwire stream.
pub fn kv_stream(
    model: &Model,
    id: &str,
    p: &[u32],
    chunk: usize,
    dtype: KvDtype,
) -> (Vec<u8>, u32) {
    let pool = pdserve_engine::KvPool::new(model.kv_layout(), 4096);
    let mut kv = pool.allocate(p.len()).unwrap();
    let layout = model.kv_layout();
    let header = KvHeader {
        request_id: id.into(),
        model_fingerprint: model.fingerprint(),
        dtype: dtype.into(),
        n_layers: layout.n_layers as u32,
        n_kv_heads: layout.n_kv_heads as u32,
        head_dim: layout.head_dim as u32,
        n_tokens: p.len() as u32,
        seed: 0,
    };
    let mut out = kvwire::encode_header(&header).unwrap();
    let mut logits = Vec::new();
    for (c, tokens) in p.chunks(chunk).enumerate() {
        logits = model.prefill(tokens, &mut kv).unwrap();
        let start = c * chunk;
        for l in 0..layout.n_layers {
            let mut bytes = Vec::new();
            kv.export_layer(l, dtype, &mut bytes);
            let (k, v) = bytes.split_at(bytes.len() / 2);
            let row = layout.row() * dtype.size();
            let range = start * row..(start + tokens.len()) * row;
            let parts = [(&k[range.clone()], &v[range])];
            kvwire::encode_layer_parts(
                l as u32,
                start as u32,
                tokens.len() as u32,
                &parts,
                &mut out,
            )
            .unwrap();
        }
    }
    let greedy = SamplingParams {
        temperature: 0.0,
        ..Default::default()
    };
    let first = sample(&logits, &greedy, p.len() as u64, &TokenCounts::default()).unwrap();
    let trailer = KvTrailer {
        first_token: first.token,
        first_logprob: first.logprob,
        top_logprobs: vec![],
    };
    out.extend(kvwire::encode_end(&trailer).unwrap());
    (out, first.token)
}
