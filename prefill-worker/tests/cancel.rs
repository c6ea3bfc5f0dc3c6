//! Stopping a prefill: a job cancelled before it runs computes nothing, a
//! `DELETE` ends the job with a `cancelled` error, and a decode worker that
//! reads too slowly fails its own job at once, never its batch.

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
        t.model
            .kv_pool(8192, 16, false, pdserve_engine::DEFAULT_KV_DTYPE),
        cfg,
        Arc::new(PrefillMetrics::new()),
    );
    (t, engine)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_cancelled_while_queued_computes_nothing() {
    let (_t, engine) = layered_engine();
    let paused = engine.pause();
    let (task, ends) = task(job("c", prompt(40, 0), "http://unused"), UNCAPPED);
    engine.submit(task).unwrap();
    ends.cancel.cancel();
    drop(paused);
    let (frames, reply) = ends.finish().await;
    let err = reply.unwrap_err();
    assert_eq!(err.kind, ErrorKind::Cancelled, "{err:?}");
    assert!(
        frames.len() <= 1,
        "{} layer frames of a cancelled job",
        frames.len()
    );
    assert_eq!(engine.stats().in_flight(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_receiver_fails_its_own_job_and_not_the_rest_of_its_batch() {
    let (_t, engine) = layered_engine();
    let paused = engine.pause();
    // Nobody reads this one's frames, and its buffer holds the header only.
    let (task1, stalled) = task(job("stall", prompt(20, 2), "http://unused"), 1);
    let (task2, ends2) = task(job("next", prompt(20, 3), "http://unused"), UNCAPPED);
    engine.submit(task1).unwrap();
    engine.submit(task2).unwrap();
    drop(paused);
    // Both ran in one batch; the model thread never waited for the stalled one.
    let (frames, reply) = ends2.finish().await;
    reply.unwrap();
    let err = within(stalled.reply).await.unwrap().unwrap_err();
    assert_eq!(err.kind, ErrorKind::KvUploadFailed, "{err:?}");
    assert_eq!(
        frames.len(),
        1 + LAYERS + 1,
        "header, one frame per layer, end"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delete_cancels_a_running_job() {
    let t = tiny(&TinyModelSpec::default());
    let mut sink = KvSink::start(false).await;
    let model = t.path.to_str().unwrap();
    let args =
        pdserve_prefill::Args::parse_from(["p", "--model", model, "--decode-url", &sink.url]);
    let url = serve(
        pdserve_prefill::build(t.model.clone(), &args)
            .unwrap()
            .routes(),
    )
    .await;
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
    // The outcome is read while the sink still holds the upload, so only
    // the cancel can end the job. (Opening the gate first raced: on a busy
    // machine the upload could finish before the job's task saw the
    // cancel, and the job was reported done.)
    let resp = within(running).await.unwrap().unwrap();
    let e = within(prefill_outcome(resp)).await.unwrap_err();
    assert_eq!(e.kind, ErrorKind::Cancelled, "{e:?}");
    sink.open();
    let gone = client
        .delete(format!("{url}/v1/internal/prefill/del"))
        .send()
        .await
        .unwrap();
    assert_eq!(gone.status(), 404, "the job is forgotten");
}
