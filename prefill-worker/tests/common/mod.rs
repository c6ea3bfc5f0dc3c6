//! Helpers shared by the prefill worker's tests: the tiny model, jobs and
//! tasks, and a KV sink that stands in for a decode worker's ingest endpoint.
#![allow(dead_code)]

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Body;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::routing::post;
use bytes::Bytes;
use futures_util::StreamExt;
use pdserve_engine::KvDtype;
use pdserve_engine::{LoadOptions, Model, WeightFormat};
use pdserve_prefill::EngineConfig;
use pdserve_protocol::internal::{ErrorBody, PrefillJob, SamplingSpec};
use pdserve_testkit::tiny::{TinyModel, TinyModelSpec};
use pdserve_worker::prefill::frames::{self, FrameReceiver};
use pdserve_worker::prefill::{Computed, PrefillTask as Task};
use tokio::sync::{mpsc, oneshot, watch};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

/// The tiny model written to a temporary directory (kept alive by the guard).
pub struct Tiny {
    pub path: PathBuf,
    pub model: Arc<Model>,
    _file: TinyModel,
}

pub fn tiny(spec: &TinyModelSpec) -> Tiny {
    let file = TinyModel::with(spec);
    let opts = LoadOptions {
        weights: WeightFormat::Native,
        ..Default::default()
    };
    let model = Arc::new(Model::load(&file.path, &opts).unwrap());
    Tiny {
        path: file.path.clone(),
        model,
        _file: file,
    }
}

/// Engine settings for tests: chunks of `chunk_tokens`, batches up to `batch_tokens`.
pub fn engine_config(chunk_tokens: usize, batch_tokens: usize) -> EngineConfig {
    EngineConfig {
        chunk_tokens,
        batch_tokens,
        max_batch_jobs: 8,
        queue_capacity: 16,
        kv_dtype: KvDtype::F32,
        peak_flops: 1e9,
        grammars: None,
    }
}

pub fn prompt(n: usize, salt: u32) -> Vec<u32> {
    (0..n as u32)
        .map(|i| 3 + (i * 31 + 7 + salt * 17) % 250)
        .collect()
}

pub fn job(id: &str, prompt: Vec<u32>, kv_destination: &str) -> PrefillJob {
    PrefillJob {
        request_id: id.into(),
        prompt_tokens: prompt,
        sampling: SamplingSpec {
            temperature: 0.8,
            seed: 42,
            max_tokens: 8,
            ..Default::default()
        },
        kv_destination: kv_destination.into(),
        deadline_ms: 20_000,
        cached_tokens: 0,
    }
}

/// A task for the engine, the receiving end of its frames and its reply.
pub struct TaskEnds {
    pub frames: FrameReceiver,
    pub reply: oneshot::Receiver<Result<Computed, ErrorBody>>,
    pub cancel: CancellationToken,
}

/// Frames without a byte cap.
pub const UNCAPPED: u64 = u64::MAX;

/// A task whose frames may queue up to `cap_bytes` unread.
pub fn task(job: PrefillJob, cap_bytes: u64) -> (Task, TaskEnds) {
    let (frames_tx, frames) = frames::channel(cap_bytes);
    let (reply_tx, reply) = oneshot::channel();
    let cancel = CancellationToken::new();
    let task = Task {
        job,
        enqueued: Instant::now(),
        cancel: cancel.clone(),
        frames: frames_tx,
        reply: reply_tx,
    };
    (
        task,
        TaskEnds {
            frames,
            reply,
            cancel,
        },
    )
}

impl TaskEnds {
    /// Reads every frame until the engine drops the task, then its reply.
    pub async fn finish(mut self) -> (Vec<Bytes>, Result<Computed, ErrorBody>) {
        let mut frames = Vec::new();
        while let Some(f) = within(self.frames.recv()).await {
            frames.push(f);
        }
        (frames, within(self.reply).await.unwrap())
    }
}

/// Awaits `f`, failing the test if it takes more than 30 s.
pub async fn within<F: std::future::Future>(f: F) -> F::Output {
    tokio::time::timeout(Duration::from_secs(30), f)
        .await
        .expect("timed out")
}

/// A stand-in for a decode worker's KV ingest: it reads the first bytes of
/// each upload, reports the request id on `started`, and reads the rest
/// only once the gate is open. It keeps every complete body.
pub struct KvSink {
    pub url: String,
    pub started: mpsc::UnboundedReceiver<String>,
    gate: watch::Sender<bool>,
    bodies: Arc<Mutex<HashMap<String, Vec<u8>>>>,
}

#[derive(Clone)]
struct SinkState {
    started: mpsc::UnboundedSender<String>,
    gate: watch::Receiver<bool>,
    bodies: Arc<Mutex<HashMap<String, Vec<u8>>>>,
}

impl KvSink {
    /// Starts the sink on 127.0.0.1:0, with the gate open or closed.
    pub async fn start(open: bool) -> Self {
        let (started_tx, started) = mpsc::unbounded_channel();
        let (gate, gate_rx) = watch::channel(open);
        let bodies = Arc::new(Mutex::new(HashMap::new()));
        let state = SinkState {
            started: started_tx,
            gate: gate_rx,
            bodies: bodies.clone(),
        };
        let app = axum::Router::new()
            .route("/v1/internal/kv/{id}", post(receive))
            .with_state(state);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
        Self {
            url,
            started,
            gate,
            bodies,
        }
    }

    pub fn url_for(&self, id: &str) -> String {
        format!("{}/v1/internal/kv/{id}", self.url)
    }

    pub fn open(&self) {
        self.gate.send_replace(true);
    }

    /// The complete body uploaded for `id`, if one arrived.
    pub fn body(&self, id: &str) -> Option<Vec<u8>> {
        self.bodies.lock().unwrap().get(id).cloned()
    }
}

async fn receive(State(s): State<SinkState>, Path(id): Path<String>, body: Body) -> StatusCode {
    let mut stream = body.into_data_stream();
    let mut got = Vec::new();
    if let Some(Ok(first)) = stream.next().await {
        got.extend_from_slice(&first);
    }
    let _ = s.started.send(id.clone());
    let mut gate = s.gate.clone();
    if gate.wait_for(|open| *open).await.is_err() {
        return StatusCode::SERVICE_UNAVAILABLE;
    }
    while let Some(chunk) = stream.next().await {
        match chunk {
            Ok(c) => got.extend_from_slice(&c),
            Err(_) => return StatusCode::BAD_REQUEST,
        }
    }
    s.bodies.lock().unwrap().insert(id, got);
    StatusCode::OK
}
