//! The router over the real worker binaries (`pdserve-prefill`,
//! `pdserve-decode`) on the tiny model, started as processes as in a
//! cluster: aggregated and disaggregated serving give exactly the same
//! tokens, greedy or seeded, and disaggregated requests go through the KV
//! transfer. The in-process tests use mock workers; this one is the real
//! engine end to end.

mod common;

use common::process::workers_built;
use common::*;
use pdserve_testkit::process::{workspace_binary, WorkerProcess};
use pdserve_testkit::tiny::TinyModel;
use serde_json::json;

async fn text(url: &str, prompt: &str, extra: serde_json::Value) -> String {
    let (s, v) = post_json(url, "/v1/completions", &completion_body(prompt, extra)).await;
    assert_eq!(s, 200, "{v}");
    v["choices"][0]["text"].as_str().unwrap().to_string()
}

fn kv_transfers(page: &str) -> f64 {
    metric(
        page,
        "pdserve_request_stage_seconds_count{stage=\"kv_transfer\"}",
    )
}

/// A prefill and a decode worker process on `model`.
async fn worker_pair(model: &TinyModel) -> (WorkerProcess, WorkerProcess) {
    let exe = |name: &str| {
        workspace_binary(name)
            .unwrap()
            .to_str()
            .unwrap()
            .to_string()
    };
    let decode = WorkerProcess::worker(&exe("pdserve-decode"), &model.path, 5).await;
    let known = ["--decode-url", decode.url.as_str()];
    let prefill = WorkerProcess::worker_with(&exe("pdserve-prefill"), &model.path, 5, &known).await;
    (prefill, decode)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn aggregated_and_disaggregated_give_the_same_tokens() {
    if !workers_built() {
        return;
    }
    let model = TinyModel::new();
    let (prefill, decode) = worker_pair(&model).await;
    let (prefills, decodes) = ([prefill.url.clone()], [decode.url.clone()]);
    let mode = |m: &'static str| ["--mode", m];
    let (dis, _) = router(model.arg(), &prefills, &decodes, &mode("disaggregated")).await;
    let (agg, _) = router(model.arg(), &prefills, &decodes, &mode("aggregated")).await;
    let prompts = ["The quick brown fox jumps", "A", &"long prompt ".repeat(40)];
    for (i, prompt) in prompts.iter().enumerate() {
        for extra in [
            json!({"max_tokens": 16, "ignore_eos": true}),
            json!({"max_tokens": 16, "ignore_eos": true, "temperature": 0.9, "seed": i}),
        ] {
            let d = text(&dis, prompt, extra.clone()).await;
            let a = text(&agg, prompt, extra.clone()).await;
            assert_eq!(d, a, "prompt {i}, {extra}");
        }
    }
    assert!(kv_transfers(&metrics(&dis).await) >= 6.0);
    assert_eq!(kv_transfers(&metrics(&agg).await), 0.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_repeated_prompt_reports_its_cached_tokens_and_the_same_text() {
    if !workers_built() {
        return;
    }
    let model = TinyModel::new();
    let exe = workspace_binary("pdserve-decode").unwrap();
    let decode = WorkerProcess::worker(exe.to_str().unwrap(), &model.path, 5).await;
    let (url, _) = router(
        model.arg(),
        &[],
        std::slice::from_ref(&decode.url),
        &["--mode", "aggregated"],
    )
    .await;
    let prompt = "the same long system prompt ".repeat(12);
    let mut seen = Vec::new();
    for _ in 0..2 {
        let body = completion_body(&prompt, json!({"max_tokens": 8, "ignore_eos": true}));
        let (s, v) = post_json(&url, "/v1/completions", &body).await;
        assert_eq!(s, 200, "{v}");
        let cached = v["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap();
        let prompt_tokens = v["usage"]["prompt_tokens"].as_u64().unwrap();
        seen.push((cached, v["choices"][0]["text"].clone(), prompt_tokens));
    }
    assert_eq!(seen[0].0, 0, "the first time, nothing is cached");
    assert!(seen[1].0 >= 16 && seen[1].0 < seen[1].2, "{seen:?}");
    assert_eq!(seen[0].1, seen[1].1, "a hit gives the text of a miss");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn n_choices_prefill_their_prompt_once() {
    if !workers_built() {
        return;
    }
    let model = TinyModel::new();
    let (prefill, decode) = worker_pair(&model).await;
    let (prefills, decodes) = ([prefill.url.clone()], [decode.url.clone()]);
    let (url, _) = router(
        model.arg(),
        &prefills,
        &decodes,
        &["--mode", "disaggregated"],
    )
    .await;
    let prompt = "a prompt long enough for several blocks ".repeat(8);
    let body = completion_body(
        &prompt,
        json!({"max_tokens": 4, "n": 3, "seed": 1, "temperature": 0.9}),
    );
    let (s, v) = post_json(&url, "/v1/completions", &body).await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["choices"].as_array().unwrap().len(), 3);
    let p = v["usage"]["prompt_tokens"].as_f64().unwrap();
    // The first choice computes the prompt; the other two only its last
    // partial block, from the prefill worker's cache.
    let computed = metric(&metrics(&prefill.url).await, "pdserve_prompt_tokens_total");
    assert!(
        computed >= p && computed < p + 2.0 * 17.0,
        "{computed} tokens for a prompt of {p}"
    );
    let hits = metric(
        &metrics(&decode.url).await,
        "pdserve_prefix_cache_hits_total",
    );
    assert!(
        hits >= 2.0 * (p - 17.0),
        "the decode worker shared the prompt's blocks: {hits}"
    );
}
