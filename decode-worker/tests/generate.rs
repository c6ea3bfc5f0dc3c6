//! The decode worker end to end on the tiny model: local prefill, continuous
//! batching, remote KV ingest, leases, cancellation and errors.

mod common;

use common::*;
use futures_util::StreamExt;
use pdserve_engine::KvDtype;
use pdserve_protocol::internal::{ErrorKind, FinishReason, GenerateEvent, KvSource};
use pdserve_worker::Served;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn local_generation_streams_the_engine_tokens() {
    let w = start(&[]).await;
    let p = prompt(12, 0);
    let resp = post(&w.url, &request("r1", p.clone(), 9, KvSource::Local)).await;
    assert_eq!(resp.status(), 200);
    let events = Lines::new(resp).all().await;
    assert!(matches!(
        events[0],
        GenerateEvent::Reserved { kv_url: None, .. }
    ));
    assert_eq!(tokens(&events), reference(&w.model, &p, 9));
    assert_eq!(
        events.last().unwrap(),
        &GenerateEvent::Finished {
            reason: FinishReason::Length,
            prompt_tokens: 12,
            completion_tokens: 9
        }
    );
    assert!(
        wait_kv_free(&w.url).await,
        "KV freed after the sequence ends"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_sequences_batch_without_changing_tokens() {
    let w = start(&["--prefill-chunk-tokens", "5"]).await;
    let lens = [3usize, 17, 8, 30];
    let mut streams = Vec::new();
    for (i, &n) in lens.iter().enumerate() {
        let req = request(
            &format!("c{i}"),
            prompt(n, i as u32),
            10 + i as u32,
            KvSource::Local,
        );
        streams.push(tokio::spawn({
            let url = w.url.clone();
            async move { Lines::new(post(&url, &req).await).all().await }
        }));
    }
    for (i, s) in streams.into_iter().enumerate() {
        let events = s.await.unwrap();
        assert_eq!(
            tokens(&events),
            reference(&w.model, &prompt(lens[i], i as u32), 10 + i),
            "sequence {i}"
        );
    }
    let metrics = pdserve_testkit::http::metrics(&w.url).await;
    assert!(
        metrics.contains("pdserve_decode_batch_size_bucket"),
        "{metrics}"
    );
    assert!(
        metrics.contains("pdserve_generation_tokens_total 46"),
        "{metrics}"
    );
}

async fn reserve_remote(w: &Worker, id: &str, p: &[u32], n: u32, lease_ms: u64) -> (Lines, String) {
    let resp = post(
        &w.url,
        &request(id, p.to_vec(), n, KvSource::Remote { lease_ms }),
    )
    .await;
    assert_eq!(resp.status(), 200);
    let mut lines = Lines::new(resp);
    let Some(GenerateEvent::Reserved {
        kv_url: Some(url), ..
    }) = lines.next().await
    else {
        panic!("expected a Reserved event with a KV URL")
    };
    (lines, url)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn remote_kv_in_chunks_gives_exactly_the_local_tokens() {
    let w = start(&[]).await;
    let p = prompt(23, 3);
    let (lines, url) = reserve_remote(&w, "remote-1", &p, 8, 5_000).await;
    let (stream, _) = kv_stream(&w.model, "remote-1", &p, 10, KvDtype::F32);
    let resp = reqwest::Client::new()
        .post(&url)
        .body(stream)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200, "{}", resp.text().await.unwrap());
    let events = lines.all().await;
    assert_eq!(tokens(&events), reference(&w.model, &p, 8));
    assert!(matches!(
        events.last(),
        Some(GenerateEvent::Finished {
            reason: FinishReason::Length,
            ..
        })
    ));
    let metrics = pdserve_testkit::http::metrics(&w.url).await;
    assert!(
        metrics.contains("pdserve_kv_transfer_bytes_total"),
        "{metrics}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn corrupt_kv_is_refused_and_the_reservation_survives_for_a_retry() {
    let w = start(&[]).await;
    let p = prompt(9, 4);
    let (lines, url) = reserve_remote(&w, "retry-1", &p, 4, 5_000).await;
    let (good, _) = kv_stream(&w.model, "retry-1", &p, 9, KvDtype::F16);
    let mut bad = good.clone();
    let mid = bad.len() / 2;
    bad[mid] ^= 0x40;
    let client = reqwest::Client::new();
    let resp = client.post(&url).body(bad).send().await.unwrap();
    assert_eq!(resp.status(), 400);
    let body: serde_json::Value = resp.json().await.unwrap();
    assert_eq!(body["class"], "fatal", "{body}");
    // A stream cut short, as when a prefill worker dies mid-transfer.
    let (mut other, _) = kv_stream(&w.model, "retry-1", &p, 9, KvDtype::F16);
    other.truncate(other.len() - 30);
    let resp = client.post(&url).body(other).send().await.unwrap();
    assert_eq!(resp.status(), 503, "a truncated stream is retryable");
    let resp = client.post(&url).body(good).send().await.unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(tokens(&lines.all().await).len(), 4);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expired_lease_releases_the_reservation() {
    let w = start(&[]).await;
    let (lines, url) = reserve_remote(&w, "late-1", &prompt(5, 1), 4, 100).await;
    assert!(load(&w.url).await.kv_used_tokens > 0);
    let events = lines.all().await;
    match events.last() {
        Some(GenerateEvent::Error(e)) => assert_eq!(e.kind, ErrorKind::KvLeaseExpired),
        other => panic!("expected a lease error, got {other:?}"),
    }
    assert!(wait_kv_free(&w.url).await);
    let resp = reqwest::Client::new()
        .post(&url)
        .body(vec![0u8; 10])
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 400, "the reservation is gone");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_disconnect_frees_the_kv() {
    let w = start(&[]).await;
    let resp = post(
        &w.url,
        &request("gone-1", prompt(20, 2), 400, KvSource::Local),
    )
    .await;
    let mut lines = Lines::new(resp);
    assert!(matches!(
        lines.next().await,
        Some(GenerateEvent::Reserved { .. })
    ));
    assert!(matches!(
        lines.next().await,
        Some(GenerateEvent::Token { .. })
    ));
    drop(lines);
    assert!(
        wait_kv_free(&w.url).await,
        "KV still held after the client left"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_get_classified_errors() {
    let w = start(&["--kv-cache-tokens", "100"]).await;
    let client = reqwest::Client::new();
    let resp = client
        .post(format!("{}/v1/internal/generate", w.url))
        .header("content-type", "application/json")
        .body("{not json")
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 400);
    for (req, kind) in [
        (request("e1", vec![], 4, KvSource::Local), "invalid_request"),
        (
            request("e2", vec![3, 99_999], 4, KvSource::Local),
            "invalid_request",
        ),
        (
            request("e3", prompt(10, 0), 600, KvSource::Local),
            "context_length_exceeded",
        ),
        (
            request("bad id", prompt(3, 0), 4, KvSource::Local),
            "invalid_request_id",
        ),
    ] {
        let resp = post(&w.url, &req).await;
        assert_eq!(resp.status(), 400);
        let body: serde_json::Value = resp.json().await.unwrap();
        assert_eq!(body["kind"], kind, "{body}");
    }
    // 100 tokens in blocks of 16: 112. A sequence that cannot fit even
    // alone is refused for good.
    let resp = post(&w.url, &request("e5", prompt(60, 0), 60, KvSource::Local)).await;
    assert_eq!(
        resp.status(),
        400,
        "120 tokens never fit a 112-token budget"
    );
    let body: serde_json::Value = resp.json().await.unwrap();
    assert_eq!(body["kind"], "kv_capacity_exceeded", "{body}");
    // One that fits alone but not now (a reservation waits for its KV) is
    // refused for now.
    let (_held, _) = reserve_remote(&w, "holder", &prompt(90, 1), 4, 60_000).await;
    let resp = post(&w.url, &request("e6", prompt(30, 0), 4, KvSource::Local)).await;
    assert_eq!(
        resp.status(),
        503,
        "30 prompt tokens do not fit in the 16 left"
    );
    assert_eq!(resp.headers()["retry-after"], "1");
    let body: serde_json::Value = resp.json().await.unwrap();
    assert_eq!(
        (body["kind"].as_str(), body["class"].as_str()),
        (Some("kv_exhausted"), Some("retryable"))
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_ready_and_load() {
    let w = start(&[]).await;
    assert_eq!(
        reqwest::get(format!("{}/health", w.url))
            .await
            .unwrap()
            .status(),
        200
    );
    assert_eq!(
        reqwest::get(format!("{}/ready", w.url))
            .await
            .unwrap()
            .status(),
        200
    );
    let l = load(&w.url).await;
    assert!(l.ready);
    assert_eq!(l.kv_free_tokens, 65_536);
    w.server.readiness().stop();
    assert_eq!(
        reqwest::get(format!("{}/ready", w.url))
            .await
            .unwrap()
            .status(),
        503
    );
    let resp = post(&w.url, &request("d1", prompt(4, 0), 2, KvSource::Local)).await;
    assert_eq!(resp.status(), 503, "a draining worker refuses new work");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_leaving_while_waiting_for_kv_frees_the_reservation_at_once() {
    let w = start(&[]).await;
    // A lease far longer than the test: only the disconnect can free it.
    let (lines, _url) = reserve_remote(&w, "gone-1", &prompt(5, 2), 4, 600_000).await;
    assert!(load(&w.url).await.kv_used_tokens > 0);
    drop(lines);
    assert!(wait_kv_free(&w.url).await);
    assert_eq!(w.server.waiting_for_kv(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_that_ends_during_a_failed_ingest_releases_the_reservation() {
    let w = start(&[]).await;
    let p = prompt(9, 5);
    let (lines, url) = reserve_remote(&w, "slow-1", &p, 4, 300).await;
    let (stream, _) = kv_stream(&w.model, "slow-1", &p, 9, KvDtype::F32);
    // Half the stream now, then nothing until the lease has ended, then the
    // upload breaks (its sender is dropped mid-stream).
    let half = stream[..stream.len() / 2].to_vec();
    let body = futures_util::stream::once(async move { Ok::<_, std::io::Error>(half) }).chain(
        futures_util::stream::once(async {
            tokio::time::sleep(std::time::Duration::from_millis(700)).await;
            Err(std::io::Error::other("the prefill worker died"))
        }),
    );
    let resp = reqwest::Client::new()
        .post(&url)
        .body(reqwest::Body::wrap_stream(body))
        .send()
        .await;
    assert!(resp.map(|r| !r.status().is_success()).unwrap_or(true));
    let events = tokio::time::timeout(std::time::Duration::from_secs(10), lines.all())
        .await
        .expect("the stream must end: the reservation outlived its lease");
    match events.last() {
        Some(GenerateEvent::Error(e)) => assert_eq!(e.kind, ErrorKind::KvLeaseExpired),
        other => panic!("expected a lease error, got {other:?}"),
    }
    assert!(wait_kv_free(&w.url).await);
}
