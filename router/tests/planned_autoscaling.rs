//! Planned autoscaling on a local mock cluster: the router runs its own
//! mock worker processes (`--local-engine mock`) on the same latency model
//! it plans with (`--autoscaler-model`, the mocks' `PDSERVE_MOCK_FIT_FROM`).
//! A step in the offered load moves both pools, in the same tick, to the
//! sizes the model plans for it; while the load stays flat, neither pool
//! changes; when it stops, both drain back.

mod common;

use std::time::{Duration, Instant};

use common::*;
use pdserve_testkit::process::{workspace_binary, WAIT};
use pdserve_testkit::tiny::TinyModel;
use serde_json::json;

/// An engine benchmark whose fit is exactly: prefill 0.5 ms a token + 5 ms;
/// a decode step 5 ms + 1 ms a sequence.
fn engine_json() -> String {
    let prefill = |n: f64| n / (0.0005 * n + 0.005);
    let decode = |b: f64| b / (0.005 + 0.001 * b);
    json!({
        "weights": "native",
        "prefill_tok_s": {"64": prefill(64.0), "256": prefill(256.0)},
        "decode_tok_s": {"1": decode(1.0), "8": decode(8.0)},
    })
    .to_string()
}

/// Each pool's desired and ready replicas, and its demand and correction.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Pools {
    desired: [f64; 2],
    ready: [f64; 2],
    demand: [f64; 2],
    correction: [f64; 2],
}

async fn pools(router: &str) -> Pools {
    let page = metrics(router).await;
    // 0 until the series exists (before the autoscaler's first tick).
    let value = |series: String| {
        let prefix = format!("{series} ");
        page.lines()
            .find_map(|l| l.strip_prefix(&prefix)?.parse().ok())
            .unwrap_or(0.0)
    };
    let per = |name: &str, extra: &str| {
        ["prefill", "decode"].map(|p| value(format!("{name}{{pool=\"{p}\"{extra}}}")))
    };
    Pools {
        desired: per("pdserve_autoscaler_desired_replicas", ""),
        ready: per("pdserve_workers", ",state=\"ready\""),
        demand: per("pdserve_autoscaler_demand_replicas", ""),
        correction: per("pdserve_autoscaler_correction", ""),
    }
}

/// Sends completions at `rate` per second for `secs`, open loop; returns
/// how many failed.
async fn offer(router: &str, rate: f64, secs: f64) -> usize {
    let client = reqwest::Client::new();
    let start = Instant::now();
    let mut sent = Vec::new();
    let mut i = 0.0;
    while start.elapsed().as_secs_f64() < secs {
        let at = start + Duration::from_secs_f64(i / rate);
        tokio::time::sleep_until(at.into()).await;
        // Unique prompts: a prefix cache would otherwise hold them.
        let body = json!({
            "model": MODEL,
            "prompt": format!("{i} {}", "tell me a story about the sea ".repeat(5)),
            "max_tokens": 20,
            "ignore_eos": true,
        });
        let req = client
            .post(format!("{router}/v1/completions"))
            .json(&body)
            .send();
        sent.push(tokio::spawn(async move {
            matches!(req.await, Ok(r) if r.status().is_success())
        }));
        i += 1.0;
    }
    let mut failed = 0;
    for s in sent {
        failed += usize::from(!s.await.unwrap_or(false));
    }
    failed
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_step_moves_both_pools_to_the_plan_and_a_flat_load_holds_them() {
    if workspace_binary("pdserve-mock-worker").is_none() {
        return;
    }
    let model = TinyModel::new();
    let dir = tempfile::tempdir().unwrap();
    let engine = dir.path().join("engine.json");
    std::fs::write(&engine, engine_json()).unwrap();
    let engine = engine.to_str().unwrap();
    // The router hands its environment to the mock workers it starts.
    std::env::set_var("PDSERVE_MOCK_FIT_FROM", engine);
    std::env::set_var("PDSERVE_MOCK_FIT_WEIGHTS", "native");
    let args = [
        "--local-engine",
        "mock",
        "--local-prefill",
        "1",
        "--local-decode",
        "1",
        "--mode",
        "disaggregated",
        "--autoscaler-mode",
        "planned",
        "--autoscaler-model",
        engine,
        "--autoscaler-max-batch",
        "10",
        "--autoscaler-utilization",
        "0.8",
        "--autoscaler-load-window-seconds",
        "3",
        "--autoscaler-interval-ms",
        "250",
        "--scale-cooldown-seconds",
        "0",
        "--scale-max-step",
        "4",
        "--scale-down-window-seconds",
        "4",
        "--prefill-max-replicas",
        "6",
        "--decode-max-replicas",
        "6",
    ];
    let mut router = common::process::router_process(&model, &args).await;
    let url = router.url.clone();
    wait_until(WAIT, || async { pools(&url).await.ready == [1.0, 1.0] }).await;

    // A light load: one replica each.
    assert_eq!(offer(&url, 3.0, 4.0).await, 0);
    let light = pools(&url).await;
    assert_eq!(light.desired, [1.0, 1.0], "{light:?}");

    // A step to 30 requests/s of ~125-token prompts (for the tiny
    // model's byte-level tokenizer) and 20-token answers: prefill 30 × 67 ms / 0.8 = 2.5
    // replicas; decode 600 tokens/s over a batch of 10 (the cap) per 15 ms
    // step × 0.8 = 1.1, up to 1.8 as the mocks' measured overhead (the
    // decode correction, 1.1 to 1.6 here) slows the step.
    let step = tokio::spawn({
        let url = url.clone();
        async move { offer(&url, 30.0, 12.0).await }
    });
    let mut seen = Vec::new();
    let started = Instant::now();
    while started.elapsed() < Duration::from_secs(12) {
        seen.push((started.elapsed(), pools(&url).await));
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let trace: Vec<_> = seen
        .iter()
        .step_by(4)
        .map(|(t, p)| (t.as_secs(), p.desired, p.demand, p.correction))
        .collect();
    println!("step trace (s, desired, demand, correction): {trace:?}");
    assert_eq!(step.await.unwrap(), 0, "requests failed during the step");
    let grew = |pool: usize| seen.iter().position(|(_, p)| p.desired[pool] > 1.0);
    let (first_p, first_d) = (
        grew(0).expect("prefill grew"),
        grew(1).expect("decode grew"),
    );
    // Both pools move together: within a second of each other.
    assert!(
        first_p.abs_diff(first_d) <= 4,
        "prefill at {first_p}, decode at {first_d}"
    );
    // The flat part (the last 5 s): the plan's sizes, and no change at all.
    let flat: Vec<&Pools> = seen
        .iter()
        .filter(|(t, _)| t.as_secs() >= 7)
        .map(|(_, p)| p)
        .collect();
    let last = *flat.last().unwrap();
    for (pool, name) in [(0, "prefill"), (1, "decode")] {
        let planned = last.demand[pool].ceil().max(1.0);
        assert_eq!(last.desired[pool], planned, "{name}: {last:?}");
        assert!(last.desired[pool] >= 2.0, "{name} did not grow: {last:?}");
        let changes = flat
            .windows(2)
            .filter(|w| w[0].desired[pool] != w[1].desired[pool])
            .count();
        assert_eq!(changes, 0, "{name} changed under a flat load: {flat:?}");
        // The model is the mocks' own: the correction stays near 1.
        let c = last.correction[pool];
        assert!((0.7..1.6).contains(&c), "{name} correction {c}");
    }
    // The worker processes really started.
    wait_until(WAIT, || async { pools(&url).await.ready == last.desired }).await;

    // The load stops: both pools drain back to one replica each.
    wait_until(Duration::from_secs(30), || async {
        pools(&url).await.desired == [1.0, 1.0]
    })
    .await;
    // SIGTERM, not the kill of a drop: the router drains and stops the
    // worker processes it started.
    router.terminate();
    router.exits_cleanly().await;
}
