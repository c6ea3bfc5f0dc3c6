//! One request, one trace: a router, a prefill worker and a decode worker,
//! each its own process exporting to an in-process OTLP/HTTP receiver
//! (`--otlp-endpoint`), join their spans through `traceparent` (the calls'
//! headers and the KV stream's). The test prints the span tree it got.

mod common;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::routing::post;
use common::*;
use pdserve_testkit::process::{workspace_binary, WorkerProcess, WAIT};
use pdserve_testkit::tiny::TinyModel;
use serde_json::{json, Value};

/// The caller's own span: the router's request span must be its child.
const CLIENT_TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const CLIENT_SPAN: &str = "00f067aa0ba902b7";

/// One exported span, flattened.
#[derive(Clone, Debug)]
struct Span {
    service: String,
    trace: String,
    id: String,
    parent: Option<String>,
    name: String,
    kind: u64,
    start: u128,
    end: u128,
    attrs: HashMap<String, Value>,
    events: Vec<String>,
}

/// What a receiver got.
type Received = Arc<Mutex<Vec<Span>>>;

/// A receiver of OTLP/HTTP JSON exports; returns its URL and what it got.
async fn receiver() -> (String, Received) {
    let got = Arc::new(Mutex::new(Vec::new()));
    let sink = got.clone();
    let app = axum::Router::new().route(
        "/v1/traces",
        post(move |body: axum::Json<Value>| {
            let sink = sink.clone();
            async move {
                sink.lock().unwrap().extend(flatten(&body));
                axum::Json(json!({}))
            }
        }),
    );
    (serve(app).await, got)
}

fn flatten(export: &Value) -> Vec<Span> {
    let mut out = Vec::new();
    let nanos = |v: &Value| v.as_str().and_then(|s| s.parse().ok()).unwrap_or(0u128);
    for rs in export["resourceSpans"].as_array().into_iter().flatten() {
        let service = attrs(&rs["resource"]["attributes"])["service.name"].clone();
        for ss in rs["scopeSpans"].as_array().into_iter().flatten() {
            for s in ss["spans"].as_array().into_iter().flatten() {
                out.push(Span {
                    service: service.as_str().unwrap_or("").to_string(),
                    trace: s["traceId"].as_str().unwrap_or("").to_string(),
                    id: s["spanId"].as_str().unwrap_or("").to_string(),
                    parent: s["parentSpanId"].as_str().map(str::to_string),
                    name: s["name"].as_str().unwrap_or("").to_string(),
                    kind: s["kind"].as_u64().unwrap_or(0),
                    start: nanos(&s["startTimeUnixNano"]),
                    end: nanos(&s["endTimeUnixNano"]),
                    attrs: attrs(&s["attributes"]),
                    events: s["events"]
                        .as_array()
                        .into_iter()
                        .flatten()
                        .map(|e| e["name"].as_str().unwrap_or("").to_string())
                        .collect(),
                });
            }
        }
    }
    out
}

/// OTLP key-values as a map of their plain values.
fn attrs(list: &Value) -> HashMap<String, Value> {
    let mut out = HashMap::new();
    for kv in list.as_array().into_iter().flatten() {
        let v = &kv["value"];
        let plain = ["stringValue", "intValue", "doubleValue", "boolValue"]
            .iter()
            .find_map(|k| v.get(*k).cloned());
        let array = v["arrayValue"]["values"].as_array().map(|vs| {
            let strings = vs.iter().map(|v| v["stringValue"].clone());
            Value::Array(strings.collect())
        });
        let plain = plain.or(array).unwrap_or(Value::Null);
        out.insert(kv["key"].as_str().unwrap_or("").to_string(), plain);
    }
    out
}

fn int(v: Option<&Value>) -> i64 {
    match v {
        Some(Value::String(s)) => s.parse().unwrap_or(-1),
        Some(v) => v.as_i64().unwrap_or(-1),
        None => -1,
    }
}

/// Prints the tree under `id`, one span a line: service, name, duration.
fn print_tree(spans: &[Span], id: &str, depth: usize, out: &mut String) {
    let mut children: Vec<&Span> = spans
        .iter()
        .filter(|s| s.parent.as_deref() == Some(id))
        .collect();
    children.sort_by_key(|s| s.start);
    for s in children {
        let ms = (s.end.saturating_sub(s.start)) as f64 / 1e6;
        let line = format!(
            "{}{} [{}] {:.1} ms\n",
            "  ".repeat(depth),
            s.name,
            s.service,
            ms
        );
        out.push_str(&line);
        print_tree(spans, &s.id, depth + 1, out);
    }
}

/// A traced mock worker's flags: `pool`, exporting to `otlp`, its latency
/// model scaled by `scale`.
fn mock_args<'a>(
    pool: &'a str,
    model: &'a TinyModel,
    otlp: &'a str,
    scale: &'a str,
) -> Vec<&'a str> {
    let mut a = vec!["--pool", pool, "--port", "0", "--model", model.arg()];
    a.extend(["--otlp-endpoint", otlp, "--latency-scale", scale]);
    a
}

async fn start(exe: &str, args: &[&str]) -> WorkerProcess {
    WorkerProcess::start(exe, args, WAIT).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_request_is_one_trace_across_the_three_processes() {
    let Some(mock) = workspace_binary("pdserve-mock-worker") else {
        return;
    };
    let mock = mock.to_str().unwrap();
    let model = TinyModel::new();
    let (otlp, got) = receiver().await;
    let worker = |pool| mock_args(pool, &model, &otlp, "0.1");
    let decode = start(mock, &worker("decode")).await;
    let known = format!("--decode-url={}", decode.url);
    let mut prefill_args = worker("prefill");
    prefill_args.push(&known);
    let prefill = start(mock, &prefill_args).await;
    let names = ("pdserve-mock-prefill", "pdserve-mock-decode");
    one_trace(&model, (&otlp, &got), (&prefill, &decode), names).await;
}

/// The same with the real worker binaries (`pdserve-prefill`,
/// `pdserve-decode`) on the tiny model: the engines' own spans join the
/// router's trace the same way.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_real_workers_join_the_trace_too() {
    let (Some(prefill_exe), Some(decode_exe)) = (
        workspace_binary("pdserve-prefill"),
        workspace_binary("pdserve-decode"),
    ) else {
        return;
    };
    let model = TinyModel::new();
    let (otlp, got) = receiver().await;
    let traced = ["--otlp-endpoint", otlp.as_str()];
    let decode = WorkerProcess::worker_with(decode_exe.to_str().unwrap(), &model.path, 5, &traced);
    let decode = decode.await;
    let known = format!("--decode-url={}", decode.url);
    let prefill_args = [traced[0], traced[1], known.as_str()];
    let prefill =
        WorkerProcess::worker_with(prefill_exe.to_str().unwrap(), &model.path, 5, &prefill_args)
            .await;
    let names = ("pdserve-prefill", "pdserve-decode");
    one_trace(&model, (&otlp, &got), (&prefill, &decode), names).await;
}

/// One traced request through a router over `prefill` and `decode`
/// (exporting as the services `names`) makes one trace; prints its tree.
async fn one_trace(
    model: &TinyModel,
    (otlp, got): (&str, &Received),
    (prefill, decode): (&WorkerProcess, &WorkerProcess),
    (prefill_svc, decode_svc): (&str, &str),
) {
    let (p, d) = (
        format!("--prefill-url={}", prefill.url),
        format!("--decode-url={}", decode.url),
    );
    let mut router_args = vec!["--mode", "disaggregated", &p, &d];
    router_args.extend(["--otlp-endpoint", otlp]);
    let router = common::process::router_process(model, &router_args).await;
    wait_ready(&router.url).await;

    let body = json!({
        "model": MODEL,
        "messages": [{"role": "user", "content": "Trace this request, please."}],
        "max_tokens": 5,
        "ignore_eos": true,
        "stream": true,
    });
    let resp = reqwest::Client::new()
        .post(format!("{}/v1/chat/completions", router.url))
        .header("traceparent", format!("00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let text = resp.text().await.unwrap();
    assert!(text.contains("data: [DONE]"), "{text}");

    // Every process exports within its batch delay (0.5 s).
    let wanted = [
        ("pdserve-router", "chat tiny"),
        ("pdserve-router", "decode"),
        ("pdserve-router", "prefill"),
        (prefill_svc, "prefill"),
        (prefill_svc, "queue"),
        (prefill_svc, "compute"),
        (prefill_svc, "kv_transfer"),
        (decode_svc, "kv_receive"),
        (decode_svc, "decode"),
    ];
    let spans = || got.lock().unwrap().clone();
    let has = |all: &[Span], (svc, name): (&str, &str)| {
        all.iter().any(|s| s.service == svc && s.name == name)
    };
    wait_until(Duration::from_secs(10), || async {
        let all = spans();
        wanted.iter().all(|w| has(&all, *w))
    })
    .await;
    let all = spans();
    for w in wanted {
        assert!(has(&all, w), "no {w:?} span in {all:#?}");
    }

    // One trace: the caller's, every span in it, joined into one tree.
    let trace: Vec<Span> = all
        .iter()
        .filter(|s| s.trace == CLIENT_TRACE)
        .cloned()
        .collect();
    assert_eq!(trace.len(), all.len(), "spans outside the trace: {all:#?}");
    let by_id: HashMap<&str, &Span> = trace.iter().map(|s| (s.id.as_str(), s)).collect();
    let get = |svc: &str, name: &str| {
        let found = trace.iter().find(|s| s.service == svc && s.name == name);
        found.unwrap_or_else(|| panic!("no {svc} {name}"))
    };
    let root = get("pdserve-router", "chat tiny");
    assert_eq!(root.parent.as_deref(), Some(CLIENT_SPAN));
    for s in &trace {
        let mut at = s;
        while at.id != root.id {
            let parent = at.parent.as_deref().unwrap_or("");
            at = by_id
                .get(parent)
                .unwrap_or_else(|| panic!("{} [{}] is not under the request", s.name, s.service));
        }
    }
    let parent_of = |s: &Span| by_id[s.parent.as_deref().unwrap()];
    let router_decode = get("pdserve-router", "decode");
    let router_prefill = get("pdserve-router", "prefill");
    assert_eq!(parent_of(get(decode_svc, "decode")).id, router_decode.id);
    assert_eq!(parent_of(get(prefill_svc, "prefill")).id, router_prefill.id);
    let kv_transfer = get(prefill_svc, "kv_transfer");
    assert_eq!(parent_of(get(decode_svc, "kv_receive")).id, kv_transfer.id);
    assert_eq!((root.kind, router_decode.kind, kv_transfer.kind), (2, 3, 3));

    // GenAI attributes and pdserve's stages.
    assert_eq!(root.attrs["gen_ai.operation.name"], "chat");
    assert_eq!(root.attrs["gen_ai.request.model"], MODEL);
    assert_eq!(int(root.attrs.get("gen_ai.request.max_tokens")), 5);
    assert!(int(root.attrs.get("gen_ai.usage.input_tokens")) > 0);
    assert_eq!(int(root.attrs.get("gen_ai.usage.output_tokens")), 5);
    assert_eq!(
        root.attrs["gen_ai.response.finish_reasons"],
        json!(["length"])
    );
    assert_eq!(int(root.attrs.get("pdserve.cached_tokens")), 0);
    assert!(root.events.contains(&"first_token".to_string()), "{root:?}");
    let request_id = root.attrs["request_id"].as_str().unwrap().to_string();
    let worker_decode = get(decode_svc, "decode");
    assert!(request_id.starts_with("chatcmpl-"));
    assert!(worker_decode.attrs["request_id"]
        .as_str()
        .unwrap()
        .starts_with(&request_id));
    assert_eq!(
        int(worker_decode.attrs.get("gen_ai.usage.output_tokens")),
        5
    );
    assert!(int(get(decode_svc, "kv_receive").attrs.get("pdserve.kv_bytes")) > 0);

    // The logs carry the trace and the request id.
    let log = router.log();
    let line = log
        .lines()
        .find(|l| l.contains(" request ") || l.ends_with(" request"));
    let line = line.unwrap_or_else(|| panic!("no request line in {log}"));
    assert!(line.contains(&format!("trace_id={CLIENT_TRACE}")), "{line}");
    assert!(line.contains(&request_id), "{line}");

    // A caller's unsampled trace is not exported; a request without a
    // `traceparent` starts a trace of its own.
    let send = |traceparent: Option<String>| {
        let mut req = reqwest::Client::new()
            .post(format!("{}/v1/chat/completions", router.url))
            .json(&body);
        if let Some(tp) = traceparent {
            req = req.header("traceparent", tp);
        }
        async move { req.send().await.unwrap().text().await.unwrap() }
    };
    let unsampled = "0af7651916cd43dd8448eb211c80319c";
    send(Some(format!("00-{unsampled}-b7ad6b7169203331-00"))).await;
    send(None).await;
    let roots = || {
        let all = spans();
        let new_roots = all
            .iter()
            .filter(|s| s.parent.is_none() && s.name == "chat tiny");
        new_roots.map(|s| s.trace.clone()).collect::<Vec<_>>()
    };
    let in_trace = |t: &str| spans().iter().filter(|s| s.trace == t).count();
    wait_until(Duration::from_secs(10), || async {
        roots().first().is_some_and(|t| in_trace(t) >= wanted.len())
    })
    .await;
    let fresh = roots();
    assert_eq!(fresh.len(), 1, "{fresh:?}");
    assert!(![CLIENT_TRACE, unsampled].contains(&fresh[0].as_str()));
    let fresh_spans = in_trace(&fresh[0]);
    assert!(
        fresh_spans >= wanted.len(),
        "{fresh_spans} spans in the new trace"
    );
    assert!(!spans().iter().any(|s| s.trace == unsampled));

    let mut tree = format!(
        "{} [{}] {:.1} ms\n",
        root.name,
        root.service,
        (root.end - root.start) as f64 / 1e6
    );
    print_tree(&trace, &root.id, 1, &mut tree);
    println!("trace {CLIENT_TRACE}:\n{tree}");
}

/// The KV stream carries the trace in its own header frame too: a prefill
/// worker writes its `kv_transfer` span there, and a decode worker sent that
/// stream with no `traceparent` header still joins the trace from it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_kv_header_frame_carries_the_trace_without_the_http_header() {
    use pdserve_protocol::internal::GenerateEvent;
    use pdserve_protocol::kvwire::{KvEvent, KvLimits, KvStreamDecoder};
    use pdserve_testkit::ndjson::{prefill_outcome, Lines};

    let Some(mock) = workspace_binary("pdserve-mock-worker") else {
        return;
    };
    let mock = mock.to_str().unwrap();
    let model = TinyModel::new();
    let (otlp, got) = receiver().await;
    let worker = |pool| mock_args(pool, &model, &otlp, "0");
    let decode = start(mock, &worker("decode")).await;
    // A stand-in decode worker that keeps the stream the prefill worker sends.
    let kept = Arc::new(Mutex::new(Vec::new()));
    let sink = kept.clone();
    let app = axum::Router::new().route(
        "/v1/internal/kv/{id}",
        post(move |body: axum::body::Bytes| {
            let sink = sink.clone();
            async move {
                sink.lock().unwrap().extend_from_slice(&body);
                axum::Json(json!({"tokens": 6, "bytes": body.len()}))
            }
        }),
    );
    let sink_url = serve(app).await;
    let known = format!("--decode-url={sink_url}");
    let mut prefill_args = worker("prefill");
    prefill_args.push(&known);
    let prefill = start(mock, &prefill_args).await;

    let (id, prompt) = ("kvtrace-1", json!([3, 4, 5, 6, 7, 8]));
    let sampling = json!({"temperature": 0, "max_tokens": 3});
    let job = json!({
        "request_id": id,
        "prompt_tokens": prompt,
        "sampling": sampling,
        "kv_destination": format!("{sink_url}/v1/internal/kv/{id}"),
        "deadline_ms": 30_000,
    });
    let header_of = |stream: &[u8]| {
        let mut decoder = KvStreamDecoder::new(KvLimits::default());
        match decoder.push(stream).unwrap().into_iter().next() {
            Some(KvEvent::Header(h)) => h,
            other => panic!("no header frame: {other:?}"),
        }
    };
    let done = common::post(&prefill.url, "/v1/internal/prefill", &job).await;
    let result = prefill_outcome(done).await.expect("the KV was delivered");
    let stream = std::mem::take(&mut *kept.lock().unwrap());
    assert_eq!(
        result.transfer_bytes,
        stream.len() as u64,
        "the context is counted"
    );
    let carried = header_of(&stream)
        .trace
        .expect("a traced job's header carries its context");

    // `--kv-trace-context false` (for decode workers older than the flag)
    // keeps it in the HTTP header only.
    prefill_args.extend(["--kv-trace-context", "false"]);
    let untraced_frame = start(mock, &prefill_args).await;
    let done = common::post(&untraced_frame.url, "/v1/internal/prefill", &job).await;
    let result = prefill_outcome(done).await.expect("the KV was delivered");
    let plain = std::mem::take(&mut *kept.lock().unwrap());
    assert_eq!(header_of(&plain).trace, None);
    assert_eq!(result.transfer_bytes + 25, stream.len() as u64);
    drop(untraced_frame);

    // The same stream, replayed to a real reservation without the header.
    let generate = json!({
        "request_id": id,
        "prompt_tokens": prompt,
        "sampling": sampling,
        "kv_source": {"kind": "remote", "lease_ms": 30_000},
    });
    let mut events =
        Lines::new(common::post(&decode.url, "/v1/internal/generate", &generate).await);
    let Some(GenerateEvent::Reserved {
        kv_url: Some(kv_url),
        ..
    }) = events.next().await
    else {
        panic!("no reservation")
    };
    let replayed = reqwest::Client::new()
        .post(&kv_url)
        .body(stream)
        .send()
        .await
        .unwrap();
    assert_eq!(replayed.status(), 200, "{:?}", replayed.text().await);
    let tokens = events.all().await;
    assert!(
        matches!(tokens.last(), Some(GenerateEvent::Finished { .. })),
        "{tokens:?}"
    );

    let hex = |b: &[u8]| b.iter().map(|x| format!("{x:02x}")).collect::<String>();
    let (trace, parent) = (hex(&carried.trace_id), hex(&carried.span_id));
    // The first job's `kv_transfer` is the span whose ids the frame carries.
    let spans = || got.lock().unwrap().clone();
    let sent = |all: &[Span]| {
        let found = all
            .iter()
            .find(|s| s.name == "kv_transfer" && s.id == parent);
        found.cloned()
    };
    let received = |all: &[Span]| {
        let found = all.iter().find(|s| s.name == "kv_receive");
        found.cloned()
    };
    wait_until(Duration::from_secs(10), || async {
        let all = spans();
        sent(&all).is_some() && received(&all).is_some()
    })
    .await;
    let all = spans();
    let sent = sent(&all).unwrap_or_else(|| panic!("no kv_transfer {parent} in {all:#?}"));
    assert_eq!(
        (sent.service.as_str(), sent.trace.as_str()),
        ("pdserve-mock-prefill", trace.as_str())
    );
    assert_eq!(carried.trace_flags, 1, "sampled");
    let received = received(&all).expect("kv_receive");
    assert_eq!(received.service, "pdserve-mock-decode");
    assert_eq!(received.trace, trace, "{received:?}");
    assert_eq!(received.parent.as_deref(), Some(parent.as_str()));
    drop((prefill, decode));
}
