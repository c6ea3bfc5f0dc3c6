//! Structured outputs (`response_format`), tool calls and the sampling
//! controls, through the official `openai` Python SDK against the router
//! binary with its local workers on the real model (whenever its file is
//! present): once aggregated, and once disaggregated, where the first token
//! is sampled on the prefill worker and the grammar state must cross to the
//! decode worker. The checks themselves are in `openai_sdk_structured.py`.
//! `grammar_migration.py` then kills a constrained stream's decode worker
//! and checks that the migrated output still matches its schema.

mod common;

use common::process::*;

use std::path::Path;
use std::time::Duration;

const PASSED: &str = "all structured SDK checks passed";

/// Starts a local cluster in `mode` and runs the script against it.
async fn run_script(python: &str, model: &Path, mode: &str) {
    let name = "smollm2";
    let router = Router::start(model, name, &["--mode", mode]);
    router.wait_ready(Duration::from_secs(120)).await;
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/openai_sdk_structured.py");
    let run = tokio::process::Command::new(python)
        .arg(script)
        .args([&format!("{}/v1", router.url), name])
        .kill_on_drop(true)
        .output();
    let out = tokio::time::timeout(Duration::from_secs(600), run)
        .await
        .unwrap_or_else(|_| panic!("{mode}: the script ran for over 10 minutes"))
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "{mode}: {}\nstdout:\n{stdout}\nstderr:\n{stderr}",
        out.status
    );
    assert!(stdout.contains(PASSED), "{mode}: stdout:\n{stdout}");
    eprintln!("{mode}:\n{stdout}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn structured_outputs_and_tools_work_through_the_openai_sdk_in_both_modes() {
    let Some((model, python)) = real_model_sdk("openai, pydantic") else {
        return;
    };
    // One mode after the other: two clusters at once would share the CI's
    // two cores.
    for mode in ["aggregated", "disaggregated"] {
        run_script(&python, &model, mode).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_constrained_stream_survives_its_decode_worker_dying() {
    let Some((model, python)) = real_model_sdk("openai") else {
        return;
    };
    let Some(decode) = workspace_binary("pdserve-decode") else {
        return;
    };
    let bin = decode.parent().expect("the binaries' folder").to_path_buf();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/grammar_migration.py");
    let ports = [free_port(), free_port(), free_port()].map(|p| p.to_string());
    let run = tokio::process::Command::new(python)
        .arg(script)
        .arg(&bin)
        .arg(&model)
        .args(&ports)
        .kill_on_drop(true)
        .output();
    let out = tokio::time::timeout(Duration::from_secs(300), run)
        .await
        .expect("the script ran for over 5 minutes")
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && stdout.contains("grammar migration passed"),
        "{}\nstdout:\n{stdout}\nstderr:\n{stderr}",
        out.status
    );
}
