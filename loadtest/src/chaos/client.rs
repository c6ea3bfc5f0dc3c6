//! The chaos suite's client: streamed completions whose whole text is kept,
//! to compare a run under faults with a fault-free one.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use serde_json::{json, Value};

/// One request of a case.
#[derive(Debug, Clone)]
pub struct Ask {
    pub prompt: String,
    pub max_tokens: u32,
    /// `None`: greedy; `Some(seed)`: temperature 1 with that seed.
    pub seed: Option<u64>,
    /// Choices (`n`).
    pub n: u32,
}

impl Ask {
    /// `n` requests, greedy and seeded in turn, on distinct prompts of
    /// about `words` words; every fourth asks for two choices.
    pub fn batch(n: usize, words: usize, max_tokens: u32) -> Vec<Ask> {
        (0..n)
            .map(|i| Ask {
                prompt: prompt(i, words),
                max_tokens,
                seed: (i % 2 == 1).then_some(1000 + i as u64),
                n: if i % 4 == 3 { 2 } else { 1 },
            })
            .collect()
    }
}

fn prompt(i: usize, words: usize) -> String {
    const WORDS: &[&str] = &[
        "river", "stone", "light", "garden", "window", "paper", "cloud", "engine", "winter",
        "market", "silver", "forest", "letter", "bridge", "summer", "signal",
    ];
    let mut out = format!("Story {i}:");
    for k in 0..words {
        out.push(' ');
        out.push_str(WORDS[(i * 7 + k * 3 + k / 5) % WORDS.len()]);
    }
    out
}

/// How a request ended.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct Answer {
    pub status: u16,
    /// Each choice's text, by index.
    pub texts: Vec<String>,
    /// Choices that finished.
    pub finished: usize,
    /// Chunks with text received.
    pub chunks: usize,
    pub finish_reason: Option<String>,
    pub completion_tokens: Option<u64>,
    pub prompt_tokens: Option<u64>,
    /// Each choice's token log-probabilities, in order.
    pub logprobs: Vec<Vec<f64>>,
    /// The error, for a request that failed.
    pub error: Option<String>,
    /// `Retry-After` of a refusal.
    pub retry_after: Option<String>,
}

impl Answer {
    pub fn ok(&self) -> bool {
        self.error.is_none() && self.status == 200 && self.finished == self.texts.len()
    }
}

/// The router's client for one case.
#[derive(Clone)]
pub struct Client {
    pub http: reqwest::Client,
    pub url: String,
    pub model: String,
}

impl Client {
    /// Streams `ask`; counts each chunk with text into `progress`. With
    /// `drop_after_first`, goes away after the first text chunk.
    pub async fn stream(
        &self,
        ask: &Ask,
        progress: Option<Arc<AtomicUsize>>,
        drop_after_first: bool,
    ) -> Answer {
        let mut body = json!({
            "model": self.model, "prompt": ask.prompt, "max_tokens": ask.max_tokens,
            "stream": true, "ignore_eos": true, "logprobs": 1, "n": ask.n,
            "stream_options": {"include_usage": true},
            "temperature": if ask.seed.is_some() { 1.0 } else { 0.0 },
        });
        if let Some(seed) = ask.seed {
            body["seed"] = json!(seed);
        }
        let url = format!("{}/v1/completions", self.url);
        let sent = self
            .http
            .post(url)
            .json(&body)
            .timeout(Duration::from_secs(120))
            .send();
        let resp = match sent.await {
            Ok(r) => r,
            Err(e) => return failed(0, format!("request: {e}")),
        };
        let status = resp.status().as_u16();
        if status != 200 {
            let retry_after = resp
                .headers()
                .get("retry-after")
                .map(|v| v.to_str().unwrap_or("").to_string());
            let text = resp.text().await.unwrap_or_default();
            let mut a = failed(status, text);
            a.retry_after = retry_after;
            return a;
        }
        read_events(resp, ask.n, progress, drop_after_first).await
    }
}

fn failed(status: u16, error: String) -> Answer {
    Answer {
        status,
        error: Some(error),
        ..Answer::default()
    }
}

/// Reads the SSE events of a streamed completion into an [`Answer`].
async fn read_events(
    resp: reqwest::Response,
    n: u32,
    progress: Option<Arc<AtomicUsize>>,
    drop_after_first: bool,
) -> Answer {
    let mut answer = Answer {
        status: 200,
        texts: vec![String::new(); n as usize],
        logprobs: vec![Vec::new(); n as usize],
        ..Answer::default()
    };
    let mut body = resp.bytes_stream();
    let mut buf = String::new();
    while let Some(chunk) = body.next().await {
        let Ok(chunk) = chunk else {
            answer.error = Some("the response broke off".into());
            return answer;
        };
        buf.push_str(&String::from_utf8_lossy(&chunk));
        while let Some(end) = buf.find("\n\n") {
            let event: String = buf.drain(..end + 2).collect();
            let Some(data) = event.trim().strip_prefix("data: ") else {
                continue;
            };
            if data == "[DONE]" {
                return answer;
            }
            let had = answer.chunks;
            apply(&mut answer, data);
            if answer.chunks > had {
                if let Some(p) = &progress {
                    p.fetch_add(1, Ordering::Relaxed);
                }
                if drop_after_first {
                    return answer;
                }
            }
        }
    }
    if answer.error.is_none() {
        answer.error = Some("the stream ended without [DONE]".into());
    }
    answer
}

/// Applies one event's JSON to the answer.
fn apply(answer: &mut Answer, data: &str) {
    let Ok(v) = serde_json::from_str::<Value>(data) else {
        answer.error = Some(format!("bad event: {data}"));
        return;
    };
    if let Some(e) = v.get("error") {
        answer.error = Some(e.to_string());
        return;
    }
    if let Some(n) = v["usage"]["completion_tokens"].as_u64() {
        answer.completion_tokens = Some(n);
        answer.prompt_tokens = v["usage"]["prompt_tokens"].as_u64();
    }
    for choice in v["choices"].as_array().into_iter().flatten() {
        apply_choice(answer, choice);
    }
}

/// Applies one choice's delta to the answer.
fn apply_choice(answer: &mut Answer, choice: &Value) {
    let i = choice["index"].as_u64().unwrap_or(0) as usize;
    if i >= answer.texts.len() {
        answer.error = Some(format!("a choice index {i} beyond n"));
        return;
    }
    if let Some(lps) = choice["logprobs"]["token_logprobs"].as_array() {
        answer.logprobs[i].extend(lps.iter().filter_map(Value::as_f64));
    }
    if let Some(t) = choice["text"].as_str().filter(|t| !t.is_empty()) {
        answer.texts[i].push_str(t);
        answer.chunks += 1;
    }
    if let Some(r) = choice["finish_reason"].as_str() {
        answer.finish_reason = Some(r.to_string());
        answer.finished += 1;
    }
}
