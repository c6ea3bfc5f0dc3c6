//! The system as `deploy/local/up.sh` runs it: the router binary with its
//! local supervisor starting real worker processes. On the tiny model: a
//! killed worker is survived and restarted, and SIGTERM stops everything.
//! On the real model (whenever its file is present): the official `openai`
//! Python SDK against the cluster.

mod common;

use common::process::*;

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use common::*;
use serde_json::json;

use pdserve_testkit::{real_model, REAL_MODEL_FILE as REAL_MODEL};

async fn chat_ok(url: &str, model: &str) -> String {
    let body = json!({
        "model": model,
        "messages": [{"role": "user", "content": "Write a long story about a dog."}],
        "max_tokens": 6,
        "temperature": 0,
    });
    let (s, v) = post_json(url, "/v1/chat/completions", &body).await;
    assert_eq!(s, 200, "{v}");
    v["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_local_cluster_survives_a_killed_worker_and_stops_on_sigterm() {
    if !workers_built() {
        return;
    }
    let model = pdserve_testkit::tiny::TinyModel::new();
    let router = Router::start(
        &model.path,
        MODEL,
        &["--mode", "auto", "--local-prefill-max-tokens", "4"],
    );
    router.wait_ready(Duration::from_secs(60)).await;
    wait_until(Duration::from_secs(30), || async {
        router.workers().len() == 2
    })
    .await;
    let before = chat_ok(&router.url, MODEL).await;

    // Kill one worker outright: requests keep succeeding (in auto mode the
    // decode worker prefills while the prefill pool is empty), and the
    // supervisor starts a new one.
    let victims = router.workers();
    router.signal(victims[0], "-KILL");
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let now = router.workers();
        if now.len() == 2 && !now.contains(&victims[0]) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the killed worker was not restarted"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    router.wait_ready(Duration::from_secs(60)).await;
    wait_until(Duration::from_secs(30), || async {
        let body = json!({"model": MODEL, "messages": [{"role": "user", "content": "Write a long story about a dog."}], "max_tokens": 6, "temperature": 0});
        post(&router.url, "/v1/chat/completions", &body).await.status() == 200
    })
    .await;
    assert_eq!(chat_ok(&router.url, MODEL).await, before);

    // SIGTERM: the router drains, stops its workers, and exits cleanly.
    let mut router = router;
    let workers = router.workers();
    router.signal(router.child.id(), "-TERM");
    let until = Instant::now() + Duration::from_secs(30);
    let status = loop {
        if let Some(s) = router.child.try_wait().unwrap() {
            break s;
        }
        assert!(Instant::now() < until, "the router did not stop");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(status.success(), "{status}");
    for pid in workers {
        let proc_dir = format!("/proc/{pid}");
        wait_until(Duration::from_secs(5), || {
            let gone = !Path::new(&proc_dir).exists();
            async move { gone }
        })
        .await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_openai_python_sdk_works_against_the_real_model() {
    let Some((model, python)) = real_model_sdk("openai") else {
        return;
    };
    let name = "smollm2";
    let router = Router::start(&model, name, &[]);
    router.wait_ready(Duration::from_secs(120)).await;
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/openai_sdk.py");
    let out = tokio::process::Command::new(python)
        .arg(script)
        .args([&format!("{}/v1", router.url), name])
        .output()
        .await
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "stdout:\n{stdout}\nstderr:\n{stderr}");
    assert!(stdout.contains("all openai SDK checks passed"), "{stdout}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_binary_exports_metrics_promtool_accepts() {
    // deploy/validate.sh starts the three binaries on loopback, sends one
    // request, runs `promtool check metrics` on each /metrics and checks
    // every name is one of shared/runtime's constants.
    let Some(model) = real_model() else {
        eprintln!("skipped: {REAL_MODEL} is not present");
        return;
    };
    let has_promtool = Command::new("promtool").arg("--version").output().is_ok();
    assert!(
        has_promtool || !in_ci(),
        "CI installs promtool (Debian's prometheus package)"
    );
    if !has_promtool || !workers_built() {
        eprintln!("skipped: promtool is not installed");
        return;
    }
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let bin_dir = Path::new(env!("CARGO_BIN_EXE_pdserve-router"))
        .parent()
        .unwrap()
        .to_path_buf();
    let out = tokio::process::Command::new("bash")
        .arg(root.join("deploy/validate.sh"))
        .arg("--only-metrics")
        .arg(&bin_dir)
        .env("PDSERVE_MODEL", &model)
        .output()
        .await
        .unwrap();
    assert!(
        out.status.success(),
        "stdout:\n{}\nstderr:\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}
