//! The soak's CI version: two minutes of load on a router over mock
//! workers, sampled from `/metrics` and `/proc`; after the load, open file
//! descriptors, KV in use and requests in flight must go back to their
//! baseline (`--leak-check-seconds`), or the run fails.

mod common;

use pdserve_testkit::tiny::TinyModel;
use serde_json::Value;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_minutes_of_load_leave_no_fds_or_kv_behind() {
    let tiny = TinyModel::new();
    let model = tiny.arg();
    let (router, prefill, decode) = common::cluster(model).await;
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("soak.json");
    let scrape = format!("{router}/metrics,{decode}/metrics,{prefill}/metrics");
    let seconds = std::env::var("PDSERVE_SOAK_SECONDS").unwrap_or_else(|_| "120".into());
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_pdserve-loadtest"))
        .args([
            "run",
            "--url",
            &router,
            "--model",
            "tiny",
            "--concurrency",
            "8",
        ])
        .args([
            "--duration",
            &seconds,
            "--input-len",
            "64",
            "--output-len",
            "32",
        ])
        .args(["--scrape-metrics", &scrape, "--scrape-interval-ms", "1000"])
        .args(["--watch-pid", &std::process::id().to_string()])
        .args(["--leak-check-seconds", "30", "--no-progress"])
        .arg("--json")
        .arg(&json)
        .output()
        .await
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(stdout.contains("leak check: passed"), "{stdout}");
    let report: Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    assert_eq!(
        report["leak_check"]["passed"], true,
        "{}",
        report["leak_check"]
    );
    let checked = report["leak_check"]["checked"].as_u64().unwrap_or(0);
    assert!(
        checked > 0,
        "the leak check compared nothing: {}",
        report["leak_check"]
    );
}
