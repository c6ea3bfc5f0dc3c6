//! Paged KV on the decode worker: a prefix-cache hit gives exactly the
//! tokens of a miss, a sequence preempted when the KV runs out is recomputed
//! and gives the same tokens, eviction under pressure keeps them right, and
//! every block comes back after a storm of disconnects.

mod common;

use common::*;
use pdserve_protocol::internal::{GenerateRequest, KvSource, SamplingSpec};
use pdserve_testkit::http::{fetch_metric, wait_until};

fn seeded(id: &str, prompt: Vec<u32>, max_tokens: u32) -> GenerateRequest {
    GenerateRequest {
        sampling: SamplingSpec {
            temperature: 0.8,
            seed: 7,
            max_tokens,
            ignore_eos: true,
            ..Default::default()
        },
        ..request(id, prompt, max_tokens, KvSource::Local)
    }
}

async fn run(url: &str, req: &GenerateRequest) -> Vec<u32> {
    tokens(&Lines::new(post(url, req).await).all().await)
}

/// Runs `req`, sending it again while the worker answers 503 (its KV is
/// full for now), as the router would.
async fn run_when_admitted(url: &str, req: &GenerateRequest) -> Vec<u32> {
    for _ in 0..500 {
        let resp = post(url, req).await;
        if resp.status() != 503 {
            assert_eq!(resp.status(), 200);
            return tokens(&Lines::new(resp).all().await);
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    panic!("{} was never admitted", req.request_id)
}

const HITS: &str = "pdserve_prefix_cache_hits_total";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefix_cache_hits_give_exactly_the_tokens_of_misses() {
    let w = start(&[]).await;
    let p = prompt(50, 1); // three full blocks of 16, and 2
    let mut other = p[..40].to_vec(); // the same first two blocks, another tail
    other.extend(prompt(9, 5));
    for req in [
        |id: &str, p: &[u32]| request(id, p.to_vec(), 12, KvSource::Local),
        |id: &str, p: &[u32]| seeded(id, p.to_vec(), 12),
    ] {
        for (i, p) in [&p, &p, &other, &other].into_iter().enumerate() {
            let r = req(&format!("r{i}"), p);
            let want = reference_with(&w.model, p, &r.sampling, 12);
            assert_eq!(run(&w.url, &r).await, want, "run {i}");
        }
    }
    // Misses: p (0), other (32 of its blocks were p's); then hits.
    assert!(fetch_metric(&w.url, HITS).await >= 48.0 + 32.0);
    let off = start(&["--prefix-cache", "off"]).await;
    let r = request("off", p.clone(), 12, KvSource::Local);
    for _ in 0..2 {
        assert_eq!(run(&off.url, &r).await, reference(&off.model, &p, 12));
    }
    assert_eq!(fetch_metric(&off.url, HITS).await, 0.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_preempted_sequence_is_recomputed_and_gives_the_same_tokens() {
    // 10 blocks of 16; four sequences of 20 + 44 tokens need 16.
    let w = start(&["--kv-cache-tokens", "160", "--prefill-chunk-tokens", "8"]).await;
    let reqs: Vec<GenerateRequest> = (0..4)
        .map(|i| match i % 2 {
            0 => request(&format!("g{i}"), prompt(20, i), 44, KvSource::Local),
            _ => seeded(&format!("s{i}"), prompt(20, i), 44),
        })
        .collect();
    let runs = reqs.iter().map(|r| {
        let url = w.url.clone();
        let r = r.clone();
        tokio::spawn(async move { run_when_admitted(&url, &r).await })
    });
    let got = futures_util::future::join_all(runs).await;
    for (r, got) in reqs.iter().zip(got) {
        let want = reference_with(&w.model, &r.prompt_tokens, &r.sampling, 44);
        assert_eq!(got.unwrap(), want, "{}", r.request_id);
    }
    assert!(fetch_metric(&w.url, "pdserve_preemptions_total").await >= 1.0);
    assert!(wait_kv_free(&w.url).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eviction_under_pressure_keeps_the_tokens_right() {
    // 6 blocks: each 40-token prompt leaves 2 cached blocks behind.
    let w = start(&["--kv-cache-tokens", "96"]).await;
    let prompts: Vec<Vec<u32>> = (0..4).map(|i| prompt(40, 10 + i)).collect();
    for round in 0..2 {
        for (i, p) in prompts.iter().enumerate() {
            let r = request(&format!("e{round}{i}"), p.clone(), 8, KvSource::Local);
            assert_eq!(run(&w.url, &r).await, reference(&w.model, p, 8));
        }
    }
    assert!(fetch_metric(&w.url, "pdserve_kv_cache_evictions_total").await >= 1.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_block_comes_back_after_a_disconnect_storm() {
    let w = start(&[]).await;
    let mut streams = Vec::new();
    for i in 0..20 {
        let source = match i % 2 {
            0 => KvSource::Local,
            _ => KvSource::Remote { lease_ms: 60_000 },
        };
        let req = request(&format!("d{i}"), prompt(30 + i, i as u32), 200, source);
        let mut lines = Lines::new(post(&w.url, &req).await);
        lines.next().await.unwrap();
        streams.push(lines);
    }
    assert!(load(&w.url).await.kv_used_tokens > 0);
    drop(streams);
    let url = w.url.clone();
    wait_until(std::time::Duration::from_secs(10), || {
        let url = url.clone();
        async move {
            let used = "pdserve_kv_cache_blocks{state=\"used\"}";
            load(&url).await.kv_used_tokens == 0 && fetch_metric(&url, used).await == 0.0
        }
    })
    .await;
}
