//! Stopping a running prefill: the engine stops between layers when the job
//! is cancelled, a `DELETE` ends the job with a `cancelled` error, and an
//! upload that stalls ends the job at its deadline.

mod common;

use std::sync::Arc;

use clap::Parser;
use common::*;
use pdserve_prefill::EngineHandle;
use pdserve_protocol::internal::ErrorKind;
use pdserve_testkit::http::serve;
use pdserve_testkit::ndjson::prefill_outcome;
use pdserve_testkit::tiny::TinyModelSpec;
use pdserve_worker::prefill::{PrefillBackend, PrefillMetrics};
use pdserve_worker::Served;

const LAYERS: usize = 6;

/// An engine on a tiny model of `LAYERS` layers.
fn layered_engine() -> (Tiny, EngineHandle) {
    let t = tiny(&TinyModelSpec {
        n_layers: LAYERS,
        ..Default::default()
    });
    let cfg = engine_config(512, 512);
    let engine = EngineHandle::spawn(
        t.model.clone(),
        t.model.kv_pool(8192, 16, false),
        cfg,
        Arc::new(PrefillMetrics::new()),
    );
    (t, engine)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancelled_job_stops_between_layers_of_one_chunk() {
    let (_t, engine) = layered_engine();
    // Room for one frame: the engine can run at most one layer ahead of us.
    let (task, mut ends) = task(job("c", prompt(40, 0), "http://unused"), 1);
    engine.submit(task).unwrap();
    let _header = within(ends.frames.recv()).await.unwrap();
    let _layer0 = within(ends.frames.recv()).await.unwrap();
    ends.cancel.cancel();
    let (rest, reply) = ends.finish().await;
    let err = reply.unwrap_err();
    assert_eq!(err.kind, ErrorKind::Cancelled, "{err:?}");
    // Layer 1 may be in the channel and layer 2 may race the cancel; no more.
    assert!(
        rest.len() <= 2,
        "{} more frames after the cancel: the later layers still ran",
        rest.len()
    );
    assert_eq!(engine.stats().in_flight(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_upload_fails_at_the_deadline_and_the_engine_goes_on() {
    let (_t, engine) = layered_engine();
    let mut stalled = job("stall", prompt(20, 2), "http://unused");
    stalled.deadline_ms = 300;
    // Nobody reads past the header: the engine waits on a full channel.
    let (task1, mut ends) = task(stalled, 1);
    let started = std::time::Instant::now();
    engine.submit(task1).unwrap();
    let _header = within(ends.frames.recv()).await.unwrap();
    let err = within(&mut ends.reply).await.unwrap().unwrap_err();
    let waited = started.elapsed();
    assert_eq!(err.kind, ErrorKind::DeadlineExceeded, "{err:?}");
    assert!(
        waited >= std::time::Duration::from_millis(300),
        "failed after {waited:?}, before the deadline"
    );
    // The model thread is free again: the next job completes.
    let (task2, ends2) = task(job("next", prompt(20, 3), "http://unused"), 64);
    engine.submit(task2).unwrap();
    let (frames, reply) = ends2.finish().await;
    reply.unwrap();
    assert_eq!(
        frames.len(),
        1 + LAYERS + 1,
        "header, one frame per layer, end"
    );
    drop(ends);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delete_cancels_a_running_job() {
    let t = tiny(&TinyModelSpec::default());
    let args = pdserve_prefill::Args::parse_from(["p", "--model", t.path.to_str().unwrap()]);
    let url = serve(pdserve_prefill::build(t.model.clone(), &args).routes()).await;
    let mut sink = KvSink::start(false).await;
    let client = reqwest::Client::new();
    let job = job("del", prompt(30, 1), &sink.url_for("del"));
    let running = tokio::spawn(
        client
            .post(format!("{url}/v1/internal/prefill"))
            .json(&job)
            .send(),
    );
    // The upload has begun: the job is running or delivering.
    assert_eq!(within(sink.started.recv()).await.unwrap(), "del");
    let del = client
        .delete(format!("{url}/v1/internal/prefill/del"))
        .send()
        .await
        .unwrap();
    assert_eq!(del.status(), 200);
    sink.open();
    let resp = within(running).await.unwrap().unwrap();
    let e = prefill_outcome(resp).await.unwrap_err();
    assert_eq!(e.kind, ErrorKind::Cancelled, "{e:?}");
    let gone = client
        .delete(format!("{url}/v1/internal/prefill/del"))
        .send()
        .await
        .unwrap();
    assert_eq!(gone.status(), 404, "the job is forgotten");
}
