//! SIGTERM on the real `pdserve-prefill` binary: readiness turns 503, new
//! jobs are refused, a job in flight still delivers its KV, and the process
//! exits 0; the drain deadline cuts a delivery that takes too long.

mod common;

use std::time::Duration;

use common::*;
use pdserve_protocol::internal::{PrefillEvent, PrefillJob};
use pdserve_testkit::ndjson::{prefill_outcome, Lines};
use pdserve_testkit::process::{assert_refused_while_draining, WorkerProcess};
use pdserve_testkit::tiny::TinyModelSpec;
use tokio::task::JoinHandle;

async fn submit(url: &str, job: &PrefillJob) -> reqwest::Result<reqwest::Response> {
    reqwest::Client::new()
        .post(format!("{url}/v1/internal/prefill"))
        .json(job)
        .send()
        .await
}

/// A worker process with one job in flight: its upload has begun and the
/// sink holds it back. Returns the job's pending response.
struct InFlight {
    worker: WorkerProcess,
    sink: KvSink,
    response: JoinHandle<reqwest::Result<reqwest::Response>>,
    _tiny: Tiny,
}

async fn job_in_flight(id: &str, drain_seconds: u64) -> InFlight {
    let tiny = tiny(&TinyModelSpec::default());
    let exe = env!("CARGO_BIN_EXE_pdserve-prefill");
    let mut sink = KvSink::start(false).await;
    let extra = ["--decode-url", sink.url.as_str()];
    let worker = WorkerProcess::worker_with(exe, &tiny.path, drain_seconds, &extra).await;
    let (url, j) = (
        worker.url.clone(),
        job(id, prompt(30, 0), &sink.url_for(id)),
    );
    let response = tokio::spawn(async move { submit(&url, &j).await });
    assert_eq!(within(sink.started.recv()).await.unwrap(), id);
    InFlight {
        worker,
        sink,
        response,
        _tiny: tiny,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_lets_a_job_deliver_its_kv_then_exits() {
    let InFlight {
        mut worker,
        sink,
        response,
        _tiny,
    } = job_in_flight("inflight", 30).await;
    worker.terminate();
    assert!(
        worker.turns_unready().await,
        "/ready turns 503 while draining"
    );
    let late = job("late", prompt(5, 1), &sink.url_for("late"));
    assert_refused_while_draining(submit(&worker.url, &late).await.unwrap()).await;
    sink.open();
    let done = within(response).await.unwrap().unwrap();
    let result = prefill_outcome(done).await.expect("the KV was delivered");
    assert_eq!(result.prompt_tokens, 30);
    let body = sink.body("inflight").expect("the KV was delivered");
    assert_eq!(body.len() as u64, result.transfer_bytes);
    let took = worker.exits_cleanly().await;
    assert!(
        took < Duration::from_secs(30),
        "exited before the drain deadline"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_drain_deadline_cuts_a_delivery_that_takes_too_long() {
    let InFlight {
        mut worker,
        sink,
        response,
        _tiny,
    } = job_in_flight("stuck", 1).await;
    worker.terminate();
    let took = worker.exits_cleanly().await;
    assert!(
        took >= Duration::from_secs(1) && took < Duration::from_secs(10),
        "the drain waited for the job until its deadline, and no longer: {took:?}"
    );
    // The answer broke off (or ended in an error), never `done`.
    if let Ok(resp) = within(response).await.unwrap() {
        let mut lines = Lines::new(resp);
        while let Ok(Some(event)) = within(lines.try_next_as::<PrefillEvent>()).await {
            let done = matches!(event, PrefillEvent::Done(_));
            assert!(!done, "the cut job did not report success");
        }
    }
    assert_eq!(sink.body("stuck"), None);
}
