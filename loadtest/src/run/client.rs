//! One request against an OpenAI-compatible server, timed chunk by chunk.

use std::time::{Duration, Instant};

use futures_util::StreamExt;
use serde_json::{json, Value};

use super::stats::Record;
use super::workload::Item;

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
pub enum Endpoint {
    Chat,
    Completions,
}

/// A server under test.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Target {
    pub url: String,
    pub model: String,
    #[serde(skip)]
    pub api_key: Option<String>,
    pub endpoint: Endpoint,
    pub stream: bool,
    /// Send `ignore_eos` so outputs have exactly `max_tokens` tokens.
    pub ignore_eos: bool,
    pub timeout: Duration,
    /// Merged into every request body last (`--extra-body`).
    pub extra: serde_json::Map<String, Value>,
}

/// Parses `--extra-body`: it must be a JSON object.
pub fn json_object(s: &str) -> Result<serde_json::Map<String, Value>, String> {
    match serde_json::from_str(s) {
        Ok(Value::Object(map)) => Ok(map),
        Ok(_) => Err("must be a JSON object".into()),
        Err(e) => Err(format!("not JSON: {e}")),
    }
}

impl Target {
    fn body(&self, item: &Item) -> Value {
        let input = match self.endpoint {
            Endpoint::Chat => json!({"messages": [{"role": "user", "content": item.prompt}]}),
            Endpoint::Completions => json!({"prompt": item.prompt}),
        };
        self.body_with(input, item.max_tokens)
    }

    /// A request body of `input` (`messages` or `prompt`) and this target's settings.
    fn body_with(&self, mut body: Value, max_tokens: u32) -> Value {
        let extra = json!({
            "model": self.model,
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": self.stream,
        });
        let obj = body.as_object_mut().expect("an object");
        obj.extend(extra.as_object().expect("an object").clone());
        if self.stream {
            obj.insert("stream_options".into(), json!({"include_usage": true}));
        }
        if self.ignore_eos {
            obj.insert("ignore_eos".into(), json!(true));
        }
        obj.extend(self.extra.clone());
        body
    }

    fn path(&self) -> &'static str {
        match self.endpoint {
            Endpoint::Chat => "/v1/chat/completions",
            Endpoint::Completions => "/v1/completions",
        }
    }
}

fn class_of_status(status: reqwest::StatusCode) -> String {
    match status.as_u16() {
        429 => "http_429".into(),
        s if s >= 500 => format!("http_{s}"),
        s => format!("http_{s}"),
    }
}

fn class_of_error(e: &reqwest::Error) -> String {
    match (e.is_timeout(), e.is_connect()) {
        (true, _) => "timeout".into(),
        (_, true) => "connect".into(),
        _ => "transport".into(),
    }
}

/// The text a chunk or response carries for its first choice.
fn chunk_text(v: &Value) -> Option<&str> {
    let c = v.get("choices")?.get(0)?;
    c.get("delta")
        .and_then(|d| d.get("content"))
        .or_else(|| c.get("text"))
        .or_else(|| c.get("message").and_then(|m| m.get("content")))
        .and_then(Value::as_str)
}

/// Sends `item`, returning its record (never an `Err`: failures are classified).
pub async fn send(client: &reqwest::Client, target: &Target, item: &Item) -> Record {
    send_body(client, target, &target.body(item)).await.0
}

/// Plays `item`'s conversation: each turn sends the whole history, the
/// server's earlier answers included, as a chat client does. Returns each
/// turn's start and record; a failed turn ends the conversation.
pub async fn converse(
    client: &reqwest::Client,
    target: &Target,
    item: &Item,
) -> Vec<(Instant, Record)> {
    let mut messages = Vec::new();
    if let Some(system) = &item.system {
        messages.push(json!({"role": "system", "content": system}));
    }
    let mut out = Vec::with_capacity(item.turns.len());
    for user in &item.turns {
        messages.push(json!({"role": "user", "content": user}));
        let body = target.body_with(json!({"messages": messages}), item.max_tokens);
        let started = Instant::now();
        let (rec, answer) = send_body(client, target, &body).await;
        let failed = rec.error.is_some();
        out.push((started, rec));
        if failed {
            break;
        }
        messages.push(json!({"role": "assistant", "content": answer}));
    }
    out
}

/// Sends one request body; returns its record and the first choice's text.
async fn send_body(client: &reqwest::Client, target: &Target, body: &Value) -> (Record, String) {
    let started = Instant::now();
    let mut rec = Record::default();
    let mut text = String::new();
    let mut req = client
        .post(format!(
            "{}{}",
            target.url.trim_end_matches('/'),
            target.path()
        ))
        .timeout(target.timeout)
        .json(body);
    if let Some(key) = &target.api_key {
        req = req.bearer_auth(key);
    }
    let result = match send_fresh(req).await {
        Err(e) => Err(class_of_error(&e)),
        Ok(r) if !r.status().is_success() => Err(class_of_status(r.status())),
        Ok(r) if target.stream => read_stream(r, started, &mut rec, &mut text).await,
        Ok(r) => read_whole(r, started, &mut rec, &mut text).await,
    };
    rec.e2e = started.elapsed().as_secs_f64();
    rec.error = result.err();
    (rec, text)
}

/// A request that failed this soon, with no response, most likely went out
/// on a pooled connection the server had just closed; nothing reached it.
const STALE_FAILURE: Duration = Duration::from_millis(50);

/// Sends `req`; a failure to connect, or a failure within
/// [`STALE_FAILURE`] with no response, is retried once on a new connection,
/// so a server's keep-alive policy is not counted as its error.
async fn send_fresh(req: reqwest::RequestBuilder) -> reqwest::Result<reqwest::Response> {
    let retry = req.try_clone();
    let sent = Instant::now();
    match (req.send().await, retry) {
        (Err(e), Some(again))
            if !e.is_timeout() && (e.is_connect() || sent.elapsed() < STALE_FAILURE) =>
        {
            again.send().await
        }
        (result, _) => result,
    }
}

fn take_usage(v: &Value, rec: &mut Record) {
    if rec.id.is_none() {
        rec.id = v.get("id").and_then(Value::as_str).map(str::to_string);
    }
    if let Some(u) = v.get("usage").filter(|u| u.is_object()) {
        rec.prompt_tokens = u["prompt_tokens"].as_u64().unwrap_or(0) as u32;
        rec.completion_tokens = u["completion_tokens"].as_u64().unwrap_or(0) as u32;
    }
}

async fn read_whole(
    r: reqwest::Response,
    started: Instant,
    rec: &mut Record,
    text: &mut String,
) -> Result<(), String> {
    let v: Value = r.json().await.map_err(|_| "protocol".to_string())?;
    rec.ttft = Some(started.elapsed().as_secs_f64());
    take_usage(&v, rec);
    match chunk_text(&v) {
        Some(t) => {
            text.push_str(t);
            Ok(())
        }
        None => Err("protocol".into()),
    }
}

async fn read_stream(
    r: reqwest::Response,
    started: Instant,
    rec: &mut Record,
    text: &mut String,
) -> Result<(), String> {
    let mut body = r.bytes_stream();
    let mut buf: Vec<u8> = Vec::new();
    let mut last: Option<Instant> = None;
    let mut chunks = 0u32;
    loop {
        while let Some(end) = buf.windows(2).position(|w| w == b"\n\n") {
            let event: Vec<u8> = buf.drain(..end + 2).collect();
            let line = String::from_utf8_lossy(&event);
            let Some(data) = line.trim().strip_prefix("data:").map(str::trim) else {
                continue;
            };
            if data == "[DONE]" {
                if rec.completion_tokens == 0 {
                    rec.completion_tokens = chunks;
                }
                return Ok(());
            }
            let v: Value = serde_json::from_str(data).map_err(|_| "protocol".to_string())?;
            if v.get("error").is_some() {
                return Err("stream_error".into());
            }
            take_usage(&v, rec);
            if let Some(t) = chunk_text(&v).filter(|t| !t.is_empty()) {
                text.push_str(t);
                let now = Instant::now();
                match last.replace(now) {
                    None => rec.ttft = Some(now.duration_since(started).as_secs_f64()),
                    Some(prev) => rec.itl.push(now.duration_since(prev).as_secs_f64()),
                }
                chunks += 1;
            }
        }
        match body.next().await {
            Some(Ok(bytes)) => buf.extend_from_slice(&bytes),
            Some(Err(e)) => return Err(class_of_error(&e)),
            None => return Err("truncated".into()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn extra_body_is_an_object_merged_last() {
        assert!(json_object("[1]").is_err());
        assert!(json_object("{").is_err());
        let extra =
            json_object(r#"{"temperature": 0.5, "response_format": {"type": "json_object"}}"#);
        let target = Target {
            url: "http://127.0.0.1:1".into(),
            model: "m".into(),
            api_key: None,
            endpoint: Endpoint::Chat,
            stream: true,
            ignore_eos: true,
            timeout: Duration::from_secs(1),
            extra: extra.unwrap(),
        };
        let body = target.body_with(json!({"prompt": "hi"}), 8);
        assert_eq!(body["temperature"], json!(0.5));
        assert_eq!(body["response_format"]["type"], "json_object");
        assert_eq!(body["max_tokens"], 8);
    }
}
