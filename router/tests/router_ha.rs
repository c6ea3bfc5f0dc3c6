//! Two routers in front of one set of workers, sharing nothing but what the
//! workers report to each (`--router-url A,B`): both place a shared prefix
//! on the same decode worker, and killing one router loses only the streams
//! it carried while the other keeps serving, disaggregated requests
//! included (the prefill worker learns its KV destinations from the router
//! that is still up).

mod common;

use std::time::Duration;

use common::*;
use pdserve_testkit::process::{workspace_binary, WorkerProcess, WAIT};
use pdserve_testkit::tiny::TinyModel;
use serde_json::{json, Value};

async fn router(model: &TinyModel) -> WorkerProcess {
    let args = ["--mode", "disaggregated", "--health-interval-ms", "100"];
    common::process::router_process(model, &args).await
}

async fn mock(exe: &str, model: &TinyModel, pool: &str, routers: &str) -> WorkerProcess {
    let args = [
        "--pool",
        pool,
        "--port",
        "0",
        "--model",
        model.arg(),
        "--router-url",
        routers,
        "--heartbeat-ms",
        "50",
    ];
    WorkerProcess::start(exe, &args, WAIT).await
}

/// The ready workers a router lists.
async fn ready_workers(router: &str) -> usize {
    let list: Value = match reqwest::get(format!("{router}/v1/internal/workers")).await {
        Ok(r) => r.json().await.unwrap_or_default(),
        Err(_) => return 0,
    };
    let workers = list["workers"].as_array().cloned().unwrap_or_default();
    workers.iter().filter(|w| w["health"] == "ready").count()
}

/// Sequences each decode worker has finished.
async fn finished(decode: &[WorkerProcess]) -> Vec<f64> {
    let mut out = Vec::new();
    for d in decode {
        let page = metrics(&d.url).await;
        let n: f64 = page
            .lines()
            .filter(|l| l.starts_with("pdserve_requests_total{"))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum();
        out.push(n);
    }
    out
}

/// Reads a stream until it ends or breaks: whether it ended with `[DONE]`,
/// and how many bytes came.
async fn read_stream(mut resp: reqwest::Response) -> (bool, usize) {
    let mut body = Vec::new();
    while let Ok(Some(chunk)) = resp.chunk().await {
        body.extend_from_slice(&chunk);
    }
    let done = String::from_utf8_lossy(&body).contains("data: [DONE]");
    (done, body.len())
}

fn chat(prompt: &str, max_tokens: u32, stream: bool) -> Value {
    json!({
        "model": MODEL,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": true,
        "stream": stream,
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_routers_agree_and_losing_one_loses_only_its_own_streams() {
    let Some(exe) = workspace_binary("pdserve-mock-worker") else {
        return;
    };
    let exe = exe.to_str().unwrap();
    let model = TinyModel::new();
    let (mut a, b) = (router(&model).await, router(&model).await);
    let both = format!("{},{}", a.url, b.url);
    let prefill = mock(exe, &model, "prefill", &both).await;
    let decode = [
        mock(exe, &model, "decode", &both).await,
        mock(exe, &model, "decode", &both).await,
    ];
    for r in [&a.url, &b.url] {
        wait_until(WAIT, || async { ready_workers(r).await == 3 }).await;
    }

    // One prompt through A, then through B and A again: the prefix the
    // first left on a decode worker draws the others to it on both routers.
    let prompt = "You are a careful assistant. ".repeat(8);
    let before = finished(&decode).await;
    // Between requests, both routers hear the workers' reports (heartbeats
    // every 50 ms): the new prefix digest, and that the worker is idle again.
    for r in [&a.url, &b.url, &a.url] {
        let (s, v) = post_json(r, "/v1/chat/completions", &chat(&prompt, 4, false)).await;
        assert_eq!(s, 200, "{v}");
        tokio::time::sleep(Duration::from_millis(400)).await;
    }
    let after = finished(&decode).await;
    let served: Vec<f64> = after.iter().zip(&before).map(|(x, y)| x - y).collect();
    assert!(
        served.contains(&3.0) && served.contains(&0.0),
        "the shared prefix went to one decode worker through both routers: {served:?}"
    );

    // Long streams through each router; then A dies.
    let mut streams = Vec::new();
    for (i, r) in [&a.url, &a.url, &b.url, &b.url].into_iter().enumerate() {
        let body = chat(&format!("Story number {i}."), 150, true);
        let resp = post(r, "/v1/chat/completions", &body).await;
        assert_eq!(resp.status(), 200);
        streams.push(tokio::spawn(read_stream(resp)));
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    a.kill();
    let mut done = Vec::new();
    for s in streams {
        done.push(s.await.unwrap());
    }
    assert!(
        !done[0].0 && !done[1].0,
        "the dead router's streams cannot finish: {done:?}"
    );
    assert!(
        done[2].0 && done[3].0,
        "the live router's streams finish: {done:?}"
    );
    assert!(done[2].1 > 0 && done[3].1 > 0, "{done:?}");

    // B keeps serving, streaming and not, through the prefill pool.
    for i in 0..4 {
        let (s, v) = post_json(
            &b.url,
            "/v1/chat/completions",
            &chat(&format!("After {i}."), 8, false),
        )
        .await;
        assert_eq!(s, 200, "{v}");
        assert_eq!(v["usage"]["completion_tokens"], 8, "{v}");
    }
    let resp = post(&b.url, "/v1/chat/completions", &chat("One more.", 8, true)).await;
    assert_eq!(resp.status(), 200);
    let (_, ended) = sse_events(resp).await;
    assert!(ended);
    let prefilled = finished(std::slice::from_ref(&prefill)).await[0];
    assert!(
        prefilled >= 8.0,
        "every prompt went through the prefill worker: {prefilled}"
    );
}
