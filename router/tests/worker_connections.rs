//! The router multiplexes its streams to a worker over one HTTP/2
//! connection: 300 concurrent streams (more than hyper's default limit of
//! 200 streams per connection) on one mock decode worker all finish, while
//! the router process holds one connection to it; with `--worker-protocol
//! http1` it holds one per stream.

mod common;

use std::collections::HashSet;
use std::time::Duration;

use common::*;
use pdserve_testkit::process::{workspace_binary, WorkerProcess, WAIT};
use pdserve_testkit::tiny::TinyModel;
use serde_json::json;

const STREAMS: usize = 300;

/// The router's established TCP connections to `port`: its socket inodes
/// (from `/proc/<pid>/fd`) matched against `/proc/net/tcp`.
fn connections_to(pid: u32, port: u16) -> usize {
    let inodes: HashSet<String> = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|dir| {
            dir.filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
                .filter_map(|l| {
                    let l = l.to_string_lossy().to_string();
                    let inode = l.strip_prefix("socket:[")?.strip_suffix(']')?;
                    Some(inode.to_string())
                })
                .collect()
        })
        .unwrap_or_default();
    let table = std::fs::read_to_string("/proc/net/tcp").unwrap_or_default();
    let port = format!(":{port:04X}");
    table
        .lines()
        .skip(1)
        .map(|l| l.split_whitespace().collect::<Vec<_>>())
        .filter(|f| f.len() > 9 && f[2].ends_with(&port) && f[3] == "01")
        .filter(|f| inodes.contains(f[9]))
        .count()
}

/// Runs `STREAMS` concurrent streams through a router speaking `protocol`
/// to one paced mock decode worker; returns the router's connections to the
/// worker while they ran.
async fn streams_over(protocol: &str, exe: &str, model: &TinyModel) -> usize {
    let decode_args = [
        "--pool",
        "decode",
        "--port",
        "0",
        "--model",
        model.arg(),
        "--prefill-fixed-ms",
        "0",
        "--prefill-ms-per-token",
        "0",
        "--step-fixed-ms",
        "20",
        "--step-ms-per-seq",
        "0",
        "--max-batch",
        "1000",
        "--max-queue",
        "1000",
    ];
    let decode = WorkerProcess::start(exe, &decode_args, WAIT).await;
    let port: u16 = decode.url.rsplit(':').next().unwrap().parse().unwrap();
    let router_args = [
        "--mode",
        "aggregated",
        "--decode-url",
        &decode.url,
        "--health-interval-ms",
        "100",
        "--worker-protocol",
        protocol,
    ];
    let router = common::process::router_process(model, &router_args).await;
    wait_until(WAIT, || async {
        let r = reqwest::get(format!("{}/ready", router.url)).await;
        r.is_ok_and(|r| r.status() == 200)
    })
    .await;
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(0)
        .build()
        .unwrap();
    let mut streams = Vec::new();
    for i in 0..STREAMS {
        let body = json!({
            "model": MODEL,
            "messages": [{"role": "user", "content": format!("Stream {i}.")}],
            "max_tokens": 150,
            "ignore_eos": true,
            "stream": true,
        });
        let req = client
            .post(format!("{}/v1/chat/completions", router.url))
            .json(&body);
        streams.push(tokio::spawn(async move {
            let resp = req.send().await.expect("the router answers");
            if resp.status() != 200 {
                panic!(
                    "{}: {}",
                    resp.status(),
                    resp.text().await.unwrap_or_default()
                );
            }
            sse_events(resp).await
        }));
    }
    // The mock admits one sequence per 20 ms round and each then runs for
    // 150 steps (3 s): the first to finish does so long after the last has
    // arrived, so for a while every stream is open on the worker.
    let mut open = 0;
    for _ in 0..150 {
        let l = pdserve_testkit::http::load(&decode.url).await;
        open = open.max(l.queued_requests + l.active_sequences);
        if open as usize == STREAMS {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let pid = router_pid(&router.url);
    let held = connections_to(pid, port);
    if protocol == "http2" {
        assert_eq!(
            open as usize, STREAMS,
            "every stream reaches the worker at once"
        );
    }
    for s in streams {
        let (events, done) = s.await.unwrap();
        assert!(done, "{protocol}: a stream did not end with [DONE]");
        assert!(!streamed_text(&events, 0).is_empty());
    }
    held
}

/// The pid listening on the router's port (the test's child).
fn router_pid(url: &str) -> u32 {
    let port: u16 = url.rsplit(':').next().unwrap().parse().unwrap();
    let table = std::fs::read_to_string("/proc/net/tcp").unwrap();
    let local = format!(":{port:04X}");
    let inode = table
        .lines()
        .skip(1)
        .map(|l| l.split_whitespace().collect::<Vec<_>>())
        .find(|f| f.len() > 9 && f[1].ends_with(&local) && f[3] == "0A")
        .map(|f| f[9].to_string())
        .expect("the router listens");
    let link = format!("socket:[{inode}]");
    std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .find(|pid| {
            std::fs::read_dir(format!("/proc/{pid}/fd")).is_ok_and(|fds| {
                fds.filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
                    .any(|l| l.to_string_lossy() == link)
            })
        })
        .expect("the router's process")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_to_a_worker_share_one_connection() {
    let Some(exe) = workspace_binary("pdserve-mock-worker") else {
        return;
    };
    if !std::path::Path::new("/proc/net/tcp").exists() {
        eprintln!("skipped: no /proc/net/tcp to count connections in");
        return;
    }
    let exe = exe.to_str().unwrap();
    let model = TinyModel::new();
    let h2 = streams_over("http2", exe, &model).await;
    assert_eq!(h2, 1, "HTTP/2: {STREAMS} streams over one connection");
    let h1 = streams_over("http1", exe, &model).await;
    assert!(
        h1 >= STREAMS / 2,
        "HTTP/1.1: a connection per stream, got {h1}"
    );
}
