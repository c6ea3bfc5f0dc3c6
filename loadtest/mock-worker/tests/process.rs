//! The `pdserve-mock-worker` binary as operators run it: it registers with
//! the router, heartbeats its load, and on SIGTERM drains, deregisters and
//! exits 0.

mod common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::routing::post;
use axum::{Json, Router};
use common::*;
use serde_json::Value;

/// Kills the worker if the test fails before it exits.
struct KillOnDrop(std::process::Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

type Seen = Arc<Mutex<Vec<(String, Value)>>>;

/// A stand-in router that records what workers post to it.
async fn recording_router() -> (String, Seen) {
    let seen: Seen = Arc::default();
    let mut app = Router::new();
    for what in ["register", "heartbeat", "deregister"] {
        let seen = seen.clone();
        let record = post(move |Json(v): Json<Value>| async move {
            seen.lock().unwrap().push((what.to_string(), v));
        });
        app = app.route(&format!("/v1/internal/workers/{what}"), record);
    }
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (url, seen)
}

fn count(seen: &Seen, what: &str) -> usize {
    seen.lock()
        .unwrap()
        .iter()
        .filter(|(w, _)| w == what)
        .count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_binary_registers_heartbeats_and_exits_cleanly_on_sigterm() {
    let model = tiny_model();
    let (router, seen) = recording_router().await;
    let child = std::process::Command::new(env!("CARGO_BIN_EXE_pdserve-mock-worker"))
        .args(["--pool", "prefill", "--port", "0", "--heartbeat-ms", "20"])
        .arg("--model")
        .arg(&model.path)
        .args(["--router-url", &router])
        .env("PDSERVE_LOG", "warn")
        .spawn()
        .unwrap();
    let mut child = KillOnDrop(child);
    wait_until(Duration::from_secs(10), || async {
        count(&seen, "heartbeat") >= 2
    })
    .await;
    let registration = seen.lock().unwrap()[0].clone();
    assert_eq!(registration.0, "register");
    assert_eq!(registration.1["pool"], "prefill");
    assert_eq!(registration.1["weights"], "mock");
    let url = registration.1["url"].as_str().unwrap().to_string();
    assert!(load(&url).await.ready);
    let pid = child.0.id().to_string();
    let killed = std::process::Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .unwrap();
    assert!(killed.success());
    let mut status = None;
    wait_until(Duration::from_secs(10), || {
        status = child.0.try_wait().unwrap();
        std::future::ready(status.is_some())
    })
    .await;
    assert!(status.unwrap().success(), "{status:?}");
    assert_eq!(count(&seen, "deregister"), 1);
}
