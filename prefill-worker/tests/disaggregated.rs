//! A prefill worker and a decode worker on the tiny model, talking over
//! loopback exactly as in a cluster.

use std::sync::Arc;

use clap::Parser;
use pdserve_engine::{LoadOptions, Model, WeightFormat};
use pdserve_protocol::internal::{
    ErrorBody, ErrorClass, ErrorKind, GenerateEvent, GenerateRequest, KvSource, PrefillJob,
    SamplingSpec,
};
use pdserve_testkit::http::{metrics, post, serve};
use pdserve_testkit::ndjson::{prefill_outcome, token_ids, Lines};
use pdserve_testkit::tiny::{TinyModel, TINY_EOS};
use pdserve_worker::Served;

struct Cluster {
    prefill: String,
    decode: String,
    _tiny: TinyModel,
}

async fn cluster(prefill_args: &[&str]) -> Cluster {
    cluster_with(&[], prefill_args).await
}

async fn cluster_with(decode_args: &[&str], prefill_args: &[&str]) -> Cluster {
    let tiny = TinyModel::new();
    let opts = LoadOptions {
        weights: WeightFormat::Native,
        ..Default::default()
    };
    let model = || Arc::new(Model::load(&tiny.path, &opts).unwrap());
    // The decode worker.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let decode = format!("http://{}", listener.local_addr().unwrap());
    let mut argv = vec!["d", "--model", tiny.arg()];
    argv.extend_from_slice(decode_args);
    let dargs = pdserve_decode::Args::parse_from(argv);
    let app = pdserve_decode::build(model(), TINY_EOS, &dargs, decode.clone()).routes();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    // The prefill worker, with its own copy of the model.
    let mut argv = vec!["p", "--model", tiny.arg(), "--decode-url", &decode];
    argv.extend_from_slice(prefill_args);
    let pargs = pdserve_prefill::Args::parse_from(argv);
    let prefill = serve(pdserve_prefill::build(model(), &pargs).unwrap().routes()).await;
    Cluster {
        prefill,
        decode,
        _tiny: tiny,
    }
}

fn prompt(n: usize) -> Vec<u32> {
    (0..n as u32).map(|i| 3 + (i * 31 + 7) % 250).collect()
}

fn sampling(max_tokens: u32) -> SamplingSpec {
    SamplingSpec {
        temperature: 0.8,
        seed: 42,
        max_tokens,
        ignore_eos: true,
        ..Default::default()
    }
}

/// Runs a generate stream to the end; returns its token ids and last event.
async fn run_stream(resp: reqwest::Response) -> (Vec<u32>, GenerateEvent) {
    let events = Lines::new(resp).all().await;
    (token_ids(&events), events.last().unwrap().clone())
}

async fn generate(c: &Cluster, id: &str, p: Vec<u32>, source: KvSource) -> reqwest::Response {
    let req = GenerateRequest {
        request_id: id.into(),
        prompt_tokens: p,
        sampling: sampling(12),
        kv_source: source,
    };
    post(&c.decode, "/v1/internal/generate", &req).await
}

/// Reads the `Reserved` line without consuming the rest of the stream.
async fn reserved_url(resp: &mut reqwest::Response) -> (String, Vec<u8>) {
    let (url, _, rest) = reserved(resp).await;
    (url, rest)
}

/// The `Reserved` line's KV URL and cached tokens, and what followed it.
async fn reserved(resp: &mut reqwest::Response) -> (String, u32, Vec<u8>) {
    let mut buf = Vec::new();
    while !buf.contains(&b'\n') {
        buf.extend_from_slice(&resp.chunk().await.unwrap().unwrap());
    }
    let i = buf.iter().position(|&b| b == b'\n').unwrap();
    let GenerateEvent::Reserved {
        kv_url: Some(url),
        cached_tokens,
        ..
    } = serde_json::from_slice(&buf[..i]).unwrap()
    else {
        panic!("no KV URL")
    };
    (url, cached_tokens, buf[i + 1..].to_vec())
}

async fn prefill(c: &Cluster, id: &str, p: Vec<u32>, url: &str) -> reqwest::Response {
    prefill_after(c, id, p, url, 0).await
}

/// A job for a decode worker that holds the first `cached_tokens` already.
async fn prefill_after(
    c: &Cluster,
    id: &str,
    p: Vec<u32>,
    url: &str,
    cached_tokens: u32,
) -> reqwest::Response {
    let job = PrefillJob {
        request_id: id.into(),
        prompt_tokens: p,
        sampling: sampling(12),
        kv_destination: url.into(),
        deadline_ms: 10_000,
        cached_tokens,
    };
    post(&c.prefill, "/v1/internal/prefill", &job).await
}

/// Token ids of the generate lines in `text`.
fn ids_in(text: &str) -> Vec<u32> {
    text.lines()
        .filter_map(|l| match serde_json::from_str(l).unwrap() {
            GenerateEvent::Token { id, .. } => Some(id),
            _ => None,
        })
        .collect()
}

/// One request through both workers as the router runs it: reserve, then
/// a prefill job that knows what the decode worker holds. Returns the
/// tokens, the decode worker's cached tokens and the KV bytes sent.
async fn through_both(c: &Cluster, id: &str, p: &[u32]) -> (Vec<u32>, u32, u64) {
    let lease = KvSource::Remote { lease_ms: 10_000 };
    let mut resp = generate(c, id, p.to_vec(), lease).await;
    let (url, cached, rest) = reserved(&mut resp).await;
    let done = prefill_after(c, id, p.to_vec(), &url, cached).await;
    let result = prefill_outcome(done).await.expect("the KV was delivered");
    let text = String::from_utf8(rest).unwrap() + &resp.text().await.unwrap();
    (ids_in(&text), cached, result.transfer_bytes)
}

/// KV bytes of one token, every layer, K and V, in f16 (the tiny model;
/// the default cache type, which the wire follows).
const TOKEN_BYTES: u64 = 2 * 2 * 32 * 2;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn disaggregated_gives_exactly_the_aggregated_tokens() {
    // Chunks of 7 on the prefill side, one chunk on the decode side: the same KV either way.
    let c = cluster(&["--prefill-chunk-tokens", "7"]).await;
    // Disaggregated first, while the decode worker's cache is cold.
    let p = prompt(30);
    let mut resp = generate(&c, "dis", p.clone(), KvSource::Remote { lease_ms: 10_000 }).await;
    let (url, rest) = reserved_url(&mut resp).await;
    let done = prefill(&c, "dis", p.clone(), &url).await;
    let result = prefill_outcome(done).await.expect("the KV was delivered");
    assert!(
        result.transfer_bytes > 30 * TOKEN_BYTES,
        "all layers' KV was sent"
    );
    let text = String::from_utf8(rest).unwrap() + &resp.text().await.unwrap();
    let remote = ids_in(&text);
    // Aggregated on a fresh pair of workers: no cache hit either.
    let fresh = cluster(&[]).await;
    let (local, _) = run_stream(generate(&fresh, "agg", p.clone(), KvSource::Local).await).await;
    assert_eq!((result.prompt_tokens, result.first_token), (30, local[0]));
    assert_eq!(
        remote, local,
        "sampled with the same seed, position by position"
    );
    let metrics = metrics(&c.prefill).await;
    assert!(
        metrics.contains("pdserve_prompt_tokens_total 30"),
        "{metrics}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decode_cache_hit_is_sent_only_the_missing_rows_and_gives_the_same_tokens() {
    let c = cluster(&["--prefill-chunk-tokens", "7"]).await;
    let p = prompt(40);
    let (local, _) = run_stream(generate(&c, "agg", p.clone(), KvSource::Local).await).await;
    let other = prompt(41)[1..].to_vec();
    let (miss, cached, miss_bytes) = through_both(&c, "miss", &other).await;
    assert_eq!(cached, 0, "nothing of this prompt was cached");
    assert!(miss_bytes >= 40 * TOKEN_BYTES, "{miss_bytes}");
    assert_eq!(miss.len(), 12);
    // The local run left the prompt's two full blocks (32 tokens) cached on
    // the decode worker: only tokens 32..40 travel.
    let (hit, cached, hit_bytes) = through_both(&c, "hit", &p).await;
    assert_eq!(cached, 32);
    assert_eq!(hit, local, "a hit gives exactly the tokens of a miss");
    assert!(hit_bytes >= 8 * TOKEN_BYTES, "{hit_bytes}");
    assert!(
        hit_bytes < 8 * TOKEN_BYTES + 1024,
        "only the 8 missing rows, and framing: {hit_bytes} bytes"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_prefill_cache_serves_a_decode_worker_that_holds_nothing() {
    // The decode worker caches nothing; the prefill worker keeps its blocks.
    let c = cluster_with(&["--prefix-cache", "off"], &["--prefill-chunk-tokens", "7"]).await;
    let p = prompt(40);
    let (local, _) = run_stream(generate(&c, "agg", p.clone(), KvSource::Local).await).await;
    let (first, cached, first_bytes) = through_both(&c, "first", &p).await;
    let (second, cached_again, second_bytes) = through_both(&c, "second", &p).await;
    assert_eq!((cached, cached_again), (0, 0));
    assert_eq!(first, local);
    assert_eq!(
        second, local,
        "32 rows from the prefill worker's cache, 8 computed"
    );
    assert!(second_bytes >= 40 * TOKEN_BYTES && first_bytes >= 40 * TOKEN_BYTES);
    let m = metrics(&c.prefill).await;
    assert!(
        m.contains("pdserve_prompt_tokens_total 48"),
        "40 computed, then 8: {m}"
    );
    assert!(m.contains("pdserve_prefix_cache_hits_total 32"), "{m}");
}

/// f32 on the wire over the f16 caches: twice the bytes, the same values,
/// so the same tokens as aggregated; an f32 cache on both sides too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_cache_and_wire_type_gives_the_aggregated_tokens() {
    let p = prompt(11);
    for (cache, wire, token_bytes) in [
        ("f16", "f32", 2 * TOKEN_BYTES),
        ("f32", "f32", 2 * TOKEN_BYTES),
        ("f32", "f16", TOKEN_BYTES),
    ] {
        let dtype = ["--kv-cache-dtype", cache];
        let c = cluster_with(&dtype, &[&dtype[..], &["--kv-dtype", wire]].concat()).await;
        let (remote, cached, bytes) = through_both(&c, "wire", &p).await;
        assert_eq!(cached, 0);
        assert!(
            (11 * token_bytes..11 * token_bytes + 1024).contains(&bytes),
            "cache {cache}, wire {wire}: {bytes} bytes"
        );
        let fresh = cluster_with(&dtype, &dtype).await;
        let (local, _) =
            run_stream(generate(&fresh, "agg", p.clone(), KvSource::Local).await).await;
        if (cache, wire) == ("f32", "f16") {
            // Rounded on the wire: close, not necessarily equal.
            assert_eq!(remote.len(), local.len());
        } else {
            assert_eq!(remote, local, "cache {cache}, wire {wire}");
        }
    }
}

/// A cache of another element type holds other values for the same
/// prompt: the decode worker refuses the stream (the fingerprints, which
/// cover the cache type, differ) instead of mixing the two.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn caches_of_different_types_do_not_exchange_kv() {
    let c = cluster_with(&["--kv-cache-dtype", "f32"], &["--kv-dtype", "f32"]).await;
    let p = prompt(11);
    // The reservation waits for a good stream until its lease ends.
    let lease = KvSource::Remote { lease_ms: 500 };
    let mut resp = generate(&c, "mixed", p.clone(), lease).await;
    let (url, _, _) = reserved(&mut resp).await;
    let e = prefill_outcome(prefill(&c, "mixed", p, &url).await)
        .await
        .unwrap_err();
    assert_eq!(
        (e.class, &e.kind),
        (ErrorClass::Fatal, &ErrorKind::Mismatch),
        "{e:?}"
    );
    assert!(e.message.contains("model_fingerprint"), "{e:?}");
    let events = Lines::new(resp).all().await;
    assert!(
        matches!(events.last(), Some(GenerateEvent::Error { .. })),
        "{events:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_decode_worker_is_a_retryable_error() {
    let c = cluster(&["--decode-url", "http://127.0.0.1:9"]).await;
    let resp = prefill(
        &c,
        "lost",
        prompt(5),
        "http://127.0.0.1:9/v1/internal/kv/lost",
    )
    .await;
    // Queued, then failed: an error line, retryable.
    assert_eq!(resp.status(), 200);
    let e = prefill_outcome(resp).await.unwrap_err();
    assert_eq!(
        (e.class, &e.kind),
        (ErrorClass::Retryable, &ErrorKind::KvUploadFailed),
        "{e:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_jobs_are_fatal_errors() {
    let c = cluster(&[]).await;
    for (p, url, kind) in [
        (vec![], "http://127.0.0.1:1/x", ErrorKind::InvalidRequest),
        (
            vec![3, 50_000],
            "http://127.0.0.1:1/x",
            ErrorKind::InvalidRequest,
        ),
        (
            prompt(600),
            "http://127.0.0.1:1/x",
            ErrorKind::ContextLengthExceeded,
        ),
        (prompt(3), "ftp://nowhere", ErrorKind::InvalidRequest),
    ] {
        let resp = prefill(&c, "bad", p, url).await;
        assert_eq!(resp.status(), 400);
        let e: ErrorBody = resp.json().await.unwrap();
        assert_eq!(e.kind, kind);
    }
    let resp = prefill_after(&c, "bad", prompt(8), "http://127.0.0.1:1/x", 8).await;
    assert_eq!(
        resp.status(),
        400,
        "a prompt's last token is always computed"
    );
    let resp = reqwest::Client::new()
        .delete(format!("{}/v1/internal/prefill/nope", c.prefill))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 404);
}
