//! SIGTERM on the real `pdserve-decode` binary: readiness turns 503, new
//! work is refused, in-flight sequences finish, and the process exits 0;
//! the drain deadline cuts work that takes too long.

mod common;

use std::time::Duration;

use common::*;
use pdserve_engine::KvDtype;
use pdserve_protocol::internal::{ErrorClass, ErrorKind, FinishReason, GenerateEvent, KvSource};
use pdserve_testkit::http::eventually;
use pdserve_testkit::process::{assert_refused_while_draining, WorkerProcess, WAIT};

async fn spawn_worker(path: &std::path::Path, drain_seconds: u64) -> WorkerProcess {
    WorkerProcess::worker(env!("CARGO_BIN_EXE_pdserve-decode"), path, drain_seconds).await
}

/// Opens a sequence whose KV comes later; returns its stream and KV URL.
async fn reserve(url: &str, id: &str, n: u32, lease_ms: u64) -> (Lines, String) {
    let req = request(id, prompt(20, 1), n, KvSource::Remote { lease_ms });
    let mut lines = Lines::new(post(url, &req).await);
    let Some(GenerateEvent::Reserved {
        kv_url: Some(kv), ..
    }) = lines.next().await
    else {
        panic!("no reservation")
    };
    (lines, kv)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_finishes_in_flight_sequences_then_exits() {
    let (tiny, model) = tiny_model();
    let mut w = spawn_worker(&tiny.path, 30).await;
    // In flight for sure: a sequence whose KV has not arrived yet. And a
    // local one that may or may not still be generating at the signal.
    let (mut lines, kv_url) = reserve(&w.url, "inflight", 40, 60_000).await;
    let local = request("local", prompt(20, 3), 300, KvSource::Local);
    let local = Lines::new(post(&w.url, &local).await);
    let local = tokio::spawn(local.all());
    w.terminate();
    assert!(w.turns_unready().await, "/ready turns 503 while draining");
    let refused = post(&w.url, &request("late", prompt(5, 2), 4, KvSource::Local)).await;
    assert_refused_while_draining(refused).await;
    // The prefill side delivers the KV during the drain; generation completes.
    let (stream, _) = kv_stream(&model, "inflight", &prompt(20, 1), 8, KvDtype::F32);
    let ingest = reqwest::Client::new()
        .post(&kv_url)
        .body(stream)
        .send()
        .await
        .unwrap();
    assert_eq!(ingest.status(), 200, "KV is accepted while draining");
    let mut events = Vec::new();
    while let Some(e) = tokio::time::timeout(WAIT, lines.next()).await.unwrap() {
        events.push(e);
    }
    assert_eq!(tokens(&events).len(), 40, "{events:?}");
    assert!(
        matches!(
            events.last(),
            Some(GenerateEvent::Finished {
                reason: FinishReason::Length,
                completion_tokens: 40,
                ..
            })
        ),
        "{events:?}"
    );
    let local = tokio::time::timeout(WAIT, local).await.unwrap().unwrap();
    assert_eq!(tokens(&local).len(), 300, "the local sequence finished too");
    let took = w.exits_cleanly().await;
    assert!(
        took < Duration::from_secs(30),
        "exited before the drain deadline"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reservation_still_waiting_at_the_drain_margin_is_handed_back() {
    let (tiny, _model) = tiny_model();
    let mut w = spawn_worker(&tiny.path, 2).await;
    // Its KV never comes, and its lease outlasts the drain.
    let (lines, _kv_url) = reserve(&w.url, "stuck", 8, 600_000).await;
    w.terminate();
    let took = w.exits_cleanly().await;
    assert!(
        took >= Duration::from_millis(1400) && took < Duration::from_secs(2),
        "handed back 0.5 s before the 2 s deadline, and exited then: {took:?}"
    );
    let rest = tokio::time::timeout(WAIT, lines.try_all()).await.unwrap();
    assert!(tokens(&rest).is_empty(), "{rest:?}");
    let handed_back = rest.iter().any(|e| {
        matches!(e, GenerateEvent::Error(b) if b.kind == ErrorKind::HandedBack && b.class == ErrorClass::Retryable)
    });
    assert!(handed_back, "{rest:?}");
    let logged = eventually(WAIT, || async { w.log().contains("handed back") }).await;
    assert!(logged, "{}", w.log());
}
