//! SIGTERM on the real `pdserve-prefill` binary: readiness turns 503, new
//! jobs are refused, a job in flight still delivers its KV, and the process
//! exits 0; the drain deadline cuts a delivery that takes too long.

mod common;

use std::time::{Duration, Instant};

use common::*;
use pdserve_engine::testing::TinyModelSpec;
use pdserve_protocol::internal::{ErrorBody, ErrorClass, PrefillResult};
use pdserve_runtime::testing::{eventually, WorkerProcess};

const WAIT: Duration = Duration::from_secs(30);

async fn spawn_worker(t: &Tiny, drain_seconds: &str) -> WorkerProcess {
    let args = [
        "--model",
        t.path.to_str().unwrap(),
        "--port",
        "0",
        "--threads",
        "1",
        "--drain-seconds",
        drain_seconds,
    ];
    WorkerProcess::start(env!("CARGO_BIN_EXE_pdserve-prefill"), &args, WAIT).await
}

async fn submit(
    url: &str,
    job: &pdserve_protocol::internal::PrefillJob,
) -> reqwest::Result<reqwest::Response> {
    reqwest::Client::new()
        .post(format!("{url}/v1/internal/prefill"))
        .json(job)
        .send()
        .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_lets_a_job_deliver_its_kv_then_exits() {
    let t = tiny(&TinyModelSpec::default());
    let mut w = spawn_worker(&t, "30").await;
    let mut sink = KvSink::start(false).await;
    let j = job("inflight", prompt(30, 0), &sink.url_for("inflight"));
    let url = w.url.clone();
    let running = tokio::spawn(async move { submit(&url, &j).await });
    // In flight: its upload has begun and the sink holds it back.
    assert_eq!(within(sink.started.recv()).await.unwrap(), "inflight");
    let signalled = Instant::now();
    w.terminate();
    let ready = eventually(WAIT, || async {
        let r = reqwest::get(format!("{}/ready", w.url)).await;
        r.map(|r| r.status() == 503).unwrap_or(false)
    });
    assert!(ready.await, "/ready turns 503 while draining");
    let late = job("late", prompt(5, 1), &sink.url_for("late"));
    let refused = submit(&w.url, &late).await.unwrap();
    assert_eq!(refused.status(), 503);
    assert!(refused.headers().contains_key("retry-after"));
    let e: ErrorBody = refused.json().await.unwrap();
    assert_eq!(
        (e.class, e.kind.as_str()),
        (ErrorClass::Retryable, "not_ready")
    );
    sink.open();
    let done = within(running).await.unwrap().unwrap();
    assert_eq!(done.status(), 200);
    let result: PrefillResult = done.json().await.unwrap();
    assert_eq!(result.prompt_tokens, 30);
    let body = sink.body("inflight").expect("the KV was delivered");
    assert_eq!(body.len() as u64, result.transfer_bytes);
    let status = w.exit_status(WAIT).await;
    assert!(status.success(), "{status:?}\n{}", w.log());
    assert!(
        signalled.elapsed() < Duration::from_secs(30),
        "exited before the drain deadline"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_drain_deadline_cuts_a_delivery_that_takes_too_long() {
    let t = tiny(&TinyModelSpec::default());
    let mut w = spawn_worker(&t, "1").await;
    let mut sink = KvSink::start(false).await;
    let j = job("stuck", prompt(30, 0), &sink.url_for("stuck"));
    let url = w.url.clone();
    let running = tokio::spawn(async move { submit(&url, &j).await });
    assert_eq!(within(sink.started.recv()).await.unwrap(), "stuck");
    let signalled = Instant::now();
    w.terminate();
    let status = w.exit_status(WAIT).await;
    assert!(status.success(), "{status:?}\n{}", w.log());
    assert!(
        signalled.elapsed() >= Duration::from_secs(1),
        "the drain waited for the job until its deadline"
    );
    let cut = within(running).await.unwrap();
    assert!(
        cut.map(|r| !r.status().is_success()).unwrap_or(true),
        "the cut job did not report success"
    );
    assert_eq!(sink.body("stuck"), None);
}
