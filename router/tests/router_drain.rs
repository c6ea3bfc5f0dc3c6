//! The router binary's own limits: SIGTERM ends it within `--drain-seconds`
//! even while a stream would run far longer, and it starts with its
//! open-files limit raised to the hard limit.

mod common;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::process::*;
use common::*;
use futures_util::StreamExt;
use serde_json::json;

/// The soft and hard `Max open files` of a process.
fn open_files_limits(pid: u32) -> (String, String) {
    let limits = std::fs::read_to_string(format!("/proc/{pid}/limits")).unwrap();
    let line = limits
        .lines()
        .find(|l| l.starts_with("Max open files"))
        .unwrap();
    let mut f = line["Max open files".len()..].split_whitespace();
    (f.next().unwrap().to_string(), f.next().unwrap().to_string())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_ends_the_router_within_its_drain_even_mid_stream() {
    if workspace_binary("pdserve-mock-worker").is_none() {
        return;
    }
    let model = pdserve_testkit::tiny::TinyModel::new();
    let port = free_port().to_string();
    let mut child = Command::new(env!("CARGO_BIN_EXE_pdserve-router"))
        .args(["--port", &port, "--served-model-name", MODEL, "--model"])
        .arg(&model.path)
        .args([
            "--local-engine",
            "mock",
            "--local-prefill",
            "0",
            "--local-decode",
            "1",
        ])
        .args(["--drain-seconds", "1", "--health-interval-ms", "100"])
        // 100 ms a step: 300 tokens would take 30 s.
        .env("PDSERVE_MOCK_STEP_FIXED_MS", "100")
        .env("PDSERVE_LOG", "warn")
        .stdin(Stdio::null())
        .spawn()
        .unwrap();
    let url = format!("http://127.0.0.1:{port}");
    wait_until(Duration::from_secs(30), || async {
        let r = reqwest::get(format!("{url}/ready")).await;
        r.map(|r| r.status() == 200).unwrap_or(false)
    })
    .await;
    let (soft, hard) = open_files_limits(child.id());
    assert_eq!(
        soft, hard,
        "the soft open-files limit is raised to the hard one"
    );
    let body = completion_body(
        "a long story",
        json!({"max_tokens": 300, "ignore_eos": true, "stream": true}),
    );
    let resp = post(&url, "/v1/completions", &body).await;
    let mut stream = resp.bytes_stream();
    let first = tokio::time::timeout(Duration::from_secs(10), stream.next()).await;
    assert!(matches!(first, Ok(Some(Ok(_)))), "the stream started");
    let status = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let signalled = Instant::now();
    let exited = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break Some(status);
        }
        if signalled.elapsed() > Duration::from_secs(15) {
            break None;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    // A router that did not stop leaves no workers behind.
    let workers = children_of(child.id());
    let _ = child.kill();
    for pid in workers {
        let _ = Command::new("kill")
            .args(["-KILL", &pid.to_string()])
            .status();
    }
    assert!(
        exited.is_some(),
        "the router still runs 15 s after SIGTERM with a 1 s drain"
    );
    assert!(
        signalled.elapsed() < Duration::from_secs(10),
        "{:?}",
        signalled.elapsed()
    );
}
