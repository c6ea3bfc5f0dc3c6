//! A decode worker on the tiny random model, served on 127.0.0.1:0.
#![allow(dead_code)]

use std::sync::Arc;

use clap::Parser;
use pdserve_decode::{build, Args, RealDecode};
use pdserve_engine::sampler::{sample, SamplingParams, TokenCounts};
use pdserve_engine::{KvDtype, KvPool, LoadOptions, Model, WeightFormat};
use pdserve_protocol::internal::{GenerateRequest, KvSource, SamplingSpec};
use pdserve_protocol::kvwire::{self, KvTrailer};
use pdserve_testkit::tiny::{TinyModel, TINY_EOS};
use pdserve_worker::decode::DecodeServer;
use pdserve_worker::Served;

pub use pdserve_testkit::http::load;
pub use pdserve_testkit::ndjson::{token_ids as tokens, Lines};

pub struct Worker {
    pub url: String,
    pub server: Arc<DecodeServer<RealDecode>>,
    pub model: Arc<Model>,
    _tiny: TinyModel,
}

/// The tiny model, written to a temporary directory and loaded.
pub fn tiny_model() -> (TinyModel, Arc<Model>) {
    let tiny = TinyModel::new();
    let opts = LoadOptions {
        weights: WeightFormat::Native,
        ..Default::default()
    };
    let model = Arc::new(Model::load(&tiny.path, &opts).unwrap());
    (tiny, model)
}

pub async fn start(extra: &[&str]) -> Worker {
    let (tiny, model) = tiny_model();
    let mut argv = vec!["pdserve-decode", "--model", tiny.arg(), "--port", "0"];
    argv.extend_from_slice(extra);
    let args = Args::parse_from(argv);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let server = build(model.clone(), TINY_EOS, &args, url.clone());
    let app = server.routes();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    Worker {
        url,
        server,
        model,
        _tiny: tiny,
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
    pdserve_testkit::http::post(url, "/v1/internal/generate", req).await
}

/// Greedy generation straight on the engine, as the reference.
pub fn reference(model: &Model, prompt: &[u32], n: usize) -> Vec<u32> {
    let greedy = SamplingSpec {
        temperature: 0.0,
        ..Default::default()
    };
    reference_with(model, prompt, &greedy, n)
}

/// Generation with `spec` straight on the engine, as the reference.
pub fn reference_with(model: &Model, prompt: &[u32], spec: &SamplingSpec, n: usize) -> Vec<u32> {
    let pool = KvPool::new(model.kv_layout(), 4096);
    let mut kv = pool.allocate(prompt.len() + n).unwrap();
    let params = SamplingParams::from(spec);
    let mut history = TokenCounts::default();
    let mut logits = model.prefill(prompt, &mut kv).unwrap();
    let mut out = Vec::new();
    while out.len() < n {
        let t = sample(&logits, &params, kv.len() as u64, &history)
            .unwrap()
            .token;
        history.add(t);
        out.push(t);
        logits = model
            .decode_step(&mut [(&mut kv, t)])
            .unwrap()
            .into_rows()
            .remove(0);
    }
    out
}

/// Waits (bounded) until the worker holds no KV.
pub async fn wait_kv_free(url: &str) -> bool {
    for _ in 0..200 {
        if load(url).await.kv_used_tokens == 0 {
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
    let pool = KvPool::new(model.kv_layout(), 4096);
    let mut kv = pool.allocate(p.len()).unwrap();
    let layout = model.kv_layout();
    let header =
        model
            .kv_shape(pool.config().dtype)
            .header(id, (0, p.len() as u32), 0, dtype.into());
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
