//! The mock prefill worker over HTTP: real KV streams into a mock decode
//! worker, the prefill latency, the bounded queue, cancellation.

mod common;

use std::time::Duration;

use common::*;
use pdserve_mock_worker::Worker;
use pdserve_protocol::internal::{ErrorBody, ErrorClass, ErrorKind, FinishReason, GenerateEvent};
use pdserve_protocol::kvwire::{self, KvDtype, KvHeader};
use serde_json::{json, Value};

const FAST: &[&str] = &["--latency-scale", "0"];

fn job(id: &str, generate: &Value, kv_url: &str) -> Value {
    json!({
        "request_id": id,
        "prompt_tokens": generate["prompt_tokens"],
        "sampling": generate["sampling"],
        "kv_destination": kv_url,
        "deadline_ms": 30_000,
    })
}

/// A KV stream header for the tiny model's shape.
fn tiny_header(id: &str, fingerprint: u64, n_tokens: u32) -> KvHeader {
    KvHeader {
        request_id: id.into(),
        model_fingerprint: fingerprint,
        dtype: KvDtype::F32,
        n_layers: LAYERS as u32,
        n_kv_heads: KV_HEADS as u32,
        head_dim: HEAD_DIM as u32,
        n_tokens,
        start_token: 0,
        seed: 0,
        trace: None,
    }
}

/// Opens a remote generate stream; returns it and its KV URL.
async fn reserve(decode: &str, body: &Value) -> (Lines, String) {
    let resp = post(decode, "/v1/internal/generate", body).await;
    assert_eq!(resp.status(), 200);
    let mut lines = Lines::new(resp);
    match lines.next().await {
        Some(GenerateEvent::Reserved {
            kv_url: Some(url), ..
        }) => (lines, url),
        other => panic!("{other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefill_streams_real_kv_that_the_decode_worker_accepts() {
    let model = tiny_model();
    let d = spawn(&model, "decode", FAST).await;
    // Chunks of 16 tokens: a 40-token prompt is sent as 3 chunks of 2 layer frames.
    let p = spawn(
        &model,
        "prefill",
        &[
            "--latency-scale",
            "0",
            "--prefill-chunk-tokens",
            "16",
            "--decode-url",
            d.url.as_str(),
        ],
    )
    .await;
    let body = generate_body(
        "rt",
        40,
        json!({"max_tokens": 6, "seed": 3, "top_logprobs": 2}),
        remote(30_000),
    );
    let (resp, kv_url) = reserve(&d.url, &body).await;
    let r = post(&p.url, "/v1/internal/prefill", &job("rt", &body, &kv_url)).await;
    let result = prefill_outcome(r).await.expect("the KV was delivered");
    // f16 on the wire, the cache type's default.
    let kv = LAYERS * 2 * 40 * KV_HEADS * HEAD_DIM * 2;
    let framing = 55 + 2 + 3 * LAYERS * 32 + 17 + 8 * 2;
    assert_eq!(result.transfer_bytes, kv + framing);
    assert_eq!(
        (result.request_id.as_str(), result.prompt_tokens),
        ("rt", 40)
    );
    let streamed = resp.all().await;
    let ids = token_ids(&streamed);
    assert_eq!(ids.len(), 6);
    assert_eq!(ids[0], result.first_token);
    let done = GenerateEvent::Finished {
        reason: FinishReason::Length,
        prompt_tokens: 40,
        completion_tokens: 6,
    };
    assert_eq!(streamed.last(), Some(&done));
    // Disaggregated tokens equal aggregated ones.
    let local_body = generate_body("agg", 40, json!({"max_tokens": 6, "seed": 3}), local());
    let aggregated = events(post(&d.url, "/v1/internal/generate", &local_body).await).await;
    assert_eq!(token_ids(&aggregated), ids);
    // Both sides count the same bytes.
    let bytes = result.transfer_bytes as f64;
    assert_eq!(
        metric(&d.url, "pdserve_kv_transfer_bytes_total").await,
        bytes
    );
    assert_eq!(
        metric(&p.url, "pdserve_kv_transfer_bytes_total").await,
        bytes
    );
    assert_eq!(metric(&p.url, "pdserve_prompt_tokens_total").await, 40.0);
    assert_eq!(
        metric(&p.url, "pdserve_requests_total{status=\"ok\"}").await,
        1.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_decode_worker_refuses_kv_of_another_model() {
    let model = tiny_model();
    let d = spawn(&model, "decode", FAST).await;
    let body = generate_body("fp", 4, json!({}), remote(30_000));
    let (_resp, kv_url) = reserve(&d.url, &body).await;
    let header = tiny_header("fp", 42, 4);
    let client = reqwest::Client::new();
    let r = client
        .post(&kv_url)
        .body(kvwire::encode_header(&header).unwrap())
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    let err: ErrorBody = r.json().await.unwrap();
    assert_eq!(err.class, ErrorClass::Fatal);
    assert!(err.message.contains("model_fingerprint"), "{err:?}");
    assert_eq!(
        load(&d.url).await.kv_used_tokens,
        12,
        "the reservation is kept for another prefill worker"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn long_prompts_take_longer_to_prefill() {
    let model = tiny_model();
    let d = spawn(&model, "decode", FAST).await;
    // a = 1 ms per token, b = 0: 400 tokens take at least 400 ms.
    let p = spawn(
        &model,
        "prefill",
        &[
            "--prefill-ms-per-token",
            "1",
            "--prefill-fixed-ms",
            "0",
            "--decode-url",
            d.url.as_str(),
        ],
    )
    .await;
    let body = generate_body("long", 400, json!({"max_tokens": 1}), remote(30_000));
    let (_resp, kv_url) = reserve(&d.url, &body).await;
    let started = std::time::Instant::now();
    let r = post(&p.url, "/v1/internal/prefill", &job("long", &body, &kv_url)).await;
    let result = prefill_outcome(r).await.expect("the KV was delivered");
    assert!(
        started.elapsed() >= Duration::from_millis(400),
        "{:?}",
        started.elapsed()
    );
    assert!(result.compute_seconds >= 0.4, "{result:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_queue_is_overloaded_and_a_delete_cancels() {
    let model = tiny_model();
    let d = spawn(&model, "decode", FAST).await;
    // Each job takes 100 s unless cancelled; one may wait.
    let p = spawn(
        &model,
        "prefill",
        &[
            "--max-queue",
            "1",
            "--prefill-fixed-ms",
            "100000",
            "--decode-url",
            d.url.as_str(),
        ],
    )
    .await;
    let (mut jobs, mut streams) = (Vec::new(), Vec::new());
    for id in ["q0", "q1"] {
        let body = generate_body(id, 4, json!({}), remote(120_000));
        let (resp, kv_url) = reserve(&d.url, &body).await;
        streams.push(resp);
        let (p_url, job) = (p.url.clone(), job(id, &body, &kv_url));
        jobs.push(tokio::spawn(async move {
            post(&p_url, "/v1/internal/prefill", &job).await
        }));
        // q0 runs before q1 is sent, so q1 is the one waiting.
        let want = if id == "q0" { (0, 1) } else { (1, 1) };
        wait_until(Duration::from_secs(5), || async {
            let l = load(&p.url).await;
            (l.queued_requests, l.active_sequences) == want
        })
        .await;
    }
    let body = generate_body("q2", 4, json!({}), remote(120_000));
    let (_resp, kv_url) = reserve(&d.url, &body).await;
    let r = post(&p.url, "/v1/internal/prefill", &job("q2", &body, &kv_url)).await;
    assert_eq!(r.status(), 503);
    assert_eq!(
        r.json::<ErrorBody>().await.unwrap().kind,
        ErrorKind::Overloaded
    );
    let client = reqwest::Client::new();
    for (id, job) in ["q0", "q1"].into_iter().zip(jobs) {
        let del = client
            .delete(format!("{}/v1/internal/prefill/{id}", p.url))
            .send()
            .await
            .unwrap();
        assert_eq!(del.status(), 200);
        // Queued, then cancelled: an error line.
        let e = prefill_outcome(job.await.unwrap()).await.unwrap_err();
        assert_eq!(e.kind, ErrorKind::Cancelled);
    }
    let gone = client
        .delete(format!("{}/v1/internal/prefill/q0", p.url))
        .send()
        .await
        .unwrap();
    assert_eq!(gone.status(), 404);
    assert_eq!(
        metric(&p.url, "pdserve_requests_total{status=\"error\"}").await,
        2.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_that_ends_during_a_failed_ingest_still_releases_the_kv() {
    let model = tiny_model();
    let d = spawn(&model, "decode", FAST).await;
    let body = generate_body("late", 4, json!({}), remote(200));
    let (resp, kv_url) = reserve(&d.url, &body).await;
    let fingerprint = d
        .worker
        .service(String::new())
        .registration
        .model_fingerprint;
    let header = tiny_header("late", fingerprint, 4);
    // A prefill worker sends the header, stalls past the lease, then dies.
    let (tx, mut rx) = tokio::sync::mpsc::channel::<Result<Vec<u8>, std::io::Error>>(1);
    tx.send(Ok(kvwire::encode_header(&header).unwrap()))
        .await
        .unwrap();
    let stream = futures_util::stream::poll_fn(move |cx| rx.poll_recv(cx));
    let upload = reqwest::Client::new()
        .post(&kv_url)
        .body(reqwest::Body::wrap_stream(stream))
        .send();
    let upload = tokio::spawn(upload);
    // The ingest has taken the reservation out of the waiting map.
    let Worker::Decode(server) = &d.worker else {
        unreachable!()
    };
    let server = server.clone();
    wait_until(Duration::from_secs(5), || {
        std::future::ready(server.waiting_for_kv() == 0)
    })
    .await;
    assert_eq!(load(&d.url).await.kv_used_tokens, 12);
    // Well past the 200 ms lease: its timer has fired while the ingest held the reservation.
    tokio::time::sleep(Duration::from_secs(1)).await;
    drop(tx);
    let refused = upload.await.unwrap().unwrap();
    assert_eq!(refused.status(), 503, "a truncated stream is retryable");
    let events = tokio::time::timeout(Duration::from_secs(10), resp.all()).await;
    match events.expect("the stream ends").last() {
        Some(GenerateEvent::Error(e)) => assert_eq!(e.kind, ErrorKind::KvLeaseExpired),
        other => panic!("the stream must end with the expired lease: {other:?}"),
    }
    assert_eq!(load(&d.url).await.kv_used_tokens, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_queue_after_the_kv_arrived_ends_the_stream_with_a_retryable_error() {
    let model = tiny_model();
    let d = spawn(&model, "decode", ONE_AT_A_TIME).await;
    let p = spawn(
        &model,
        "prefill",
        &["--latency-scale", "0", "--decode-url", d.url.as_str()],
    )
    .await;
    // Reserve first (a reservation does not queue), then fill the engine:
    // one running, one waiting, one in the intake queue.
    let body = generate_body("late", 8, json!({"max_tokens": 4}), remote(30_000));
    let (mut lines, kv_url) = reserve(&d.url, &body).await;
    let _fillers = fill_one_at_a_time(&d.url).await;
    // The KV arrives, but the sequence cannot be queued.
    let r = post(&p.url, "/v1/internal/prefill", &job("late", &body, &kv_url)).await;
    let e = prefill_outcome(r).await.unwrap_err();
    assert_eq!(e.kind, ErrorKind::Overloaded, "{e:?}");
    // The generate stream says so, retryable, instead of just ending.
    match lines.next().await {
        Some(GenerateEvent::Error(e)) => {
            assert_eq!(
                (e.class, e.kind),
                (ErrorClass::Retryable, ErrorKind::Overloaded)
            );
        }
        other => panic!("{other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_draining_prefill_worker_returns_its_queued_jobs_at_once_as_retryable() {
    let model = tiny_model();
    let d = spawn(&model, "decode", FAST).await;
    let token = tokio_util::sync::CancellationToken::new();
    let slow = [
        "--prefill-fixed-ms",
        "100000",
        "--decode-url",
        d.url.as_str(),
    ];
    let (p, _served) = spawn_draining(&model, "prefill", &slow, token.clone()).await;
    let mut jobs = Vec::new();
    for id in ["run", "queued"] {
        let body = generate_body(id, 4, json!({}), remote(120_000));
        let (_resp, kv_url) = reserve(&d.url, &body).await;
        let (p_url, job) = (p.url.clone(), job(id, &body, &kv_url));
        jobs.push(tokio::spawn(async move {
            post(&p_url, "/v1/internal/prefill", &job).await
        }));
        let want = if id == "run" { (0, 1) } else { (1, 1) };
        wait_until(Duration::from_secs(5), || async {
            let l = load(&p.url).await;
            (l.queued_requests, l.active_sequences) == want
        })
        .await;
    }
    let queued = jobs.pop().unwrap();
    let started = std::time::Instant::now();
    token.cancel();
    let e = prefill_outcome(queued.await.unwrap()).await.unwrap_err();
    assert_eq!(
        (e.class, &e.kind),
        (ErrorClass::Retryable, &ErrorKind::NotReady),
        "{e:?}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "at once: {:?}",
        started.elapsed()
    );
    // The job being computed is not returned: it goes on.
    let running = jobs.pop().unwrap().await.unwrap();
    let still = tokio::time::timeout(Duration::from_millis(300), prefill_outcome(running)).await;
    assert!(
        still.is_err(),
        "the running job goes on while the worker drains: {still:?}"
    );
}
