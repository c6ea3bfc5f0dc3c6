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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn aggregated_and_disaggregated_give_the_same_tokens() {
    if !workers_built() {
        return;
    }
    let model = TinyModel::new();
    let exe = |name: &str| {
        workspace_binary(name)
            .unwrap()
            .to_str()
            .unwrap()
            .to_string()
    };
    let prefill = WorkerProcess::worker(&exe("pdserve-prefill"), &model.path, 5).await;
    let decode = WorkerProcess::worker(&exe("pdserve-decode"), &model.path, 5).await;
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
