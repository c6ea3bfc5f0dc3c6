//! Sends finished spans to an OTLP/HTTP collector, JSON-encoded, in
//! batches, from a thread of its own: tracing never waits on the network,
//! and a full queue drops spans (counted in the log) rather than block.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use serde_json::{json, Value};
use tokio::sync::mpsc;

use super::layer::{attrs_json, AttrValue};

/// Finished spans waiting to be sent.
const QUEUE: usize = 16_384;
/// Spans in one request to the collector.
const BATCH: usize = 512;
/// How long a finished span waits for its batch to fill.
const LINGER: Duration = Duration::from_millis(500);
/// One POST to the collector.
const POST_TIMEOUT: Duration = Duration::from_secs(10);

enum Msg {
    Span(Value),
    /// Send everything queued, then answer.
    Flush(std::sync::mpsc::Sender<()>),
}

/// The sending side, shared by the layer and [`super::emit`].
#[derive(Clone)]
pub(crate) struct Exporter {
    tx: mpsc::Sender<Msg>,
    dropped: Arc<AtomicU64>,
}

impl Exporter {
    /// Starts the export thread for `endpoint` (the collector's base URL,
    /// or its full `/v1/traces` URL).
    pub(crate) fn start(endpoint: &str, resource: Vec<(String, AttrValue)>) -> Self {
        let url = traces_url(endpoint);
        let (tx, rx) = mpsc::channel(QUEUE);
        let dropped = Arc::new(AtomicU64::new(0));
        let body = Batch {
            url,
            resource: json!({ "attributes": attrs_json(&resource) }),
            dropped: dropped.clone(),
        };
        let spawned = std::thread::Builder::new()
            .name("otlp-export".into())
            .spawn(move || body.run(rx));
        if let Err(e) = spawned {
            eprintln!("cannot start the OTLP export thread: {e}");
        }
        Self { tx, dropped }
    }

    pub(crate) fn send(&self, span: Value) {
        if self.tx.try_send(Msg::Span(span)).is_err() {
            self.dropped.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Sends what is queued; waits at most `within`.
    pub(crate) fn flush(&self, within: Duration) {
        let (done_tx, done_rx) = std::sync::mpsc::channel();
        if self.tx.try_send(Msg::Flush(done_tx)).is_ok() {
            let _ = done_rx.recv_timeout(within);
        }
    }
}

/// `<endpoint>/v1/traces`, unless the endpoint already names that path.
fn traces_url(endpoint: &str) -> String {
    let base = endpoint.trim_end_matches('/');
    match base.ends_with("/v1/traces") {
        true => base.to_string(),
        false => format!("{base}/v1/traces"),
    }
}

struct Batch {
    url: String,
    resource: Value,
    dropped: Arc<AtomicU64>,
}

impl Batch {
    fn run(self, mut rx: mpsc::Receiver<Msg>) {
        let rt = match tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
        {
            Ok(rt) => rt,
            Err(e) => return eprintln!("cannot start the OTLP export runtime: {e}"),
        };
        let client = reqwest::Client::builder()
            .timeout(POST_TIMEOUT)
            .build()
            .unwrap_or_default();
        rt.block_on(async move {
            let mut spans = Vec::new();
            let mut failing = false;
            loop {
                let msg = match spans.is_empty() {
                    true => rx.recv().await,
                    false => match tokio::time::timeout(LINGER, rx.recv()).await {
                        Ok(m) => m,
                        Err(_) => {
                            self.post(&client, &mut spans, &mut failing).await;
                            continue;
                        }
                    },
                };
                match msg {
                    Some(Msg::Span(s)) => {
                        spans.push(s);
                        if spans.len() >= BATCH {
                            self.post(&client, &mut spans, &mut failing).await;
                        }
                    }
                    Some(Msg::Flush(done)) => {
                        self.post(&client, &mut spans, &mut failing).await;
                        let _ = done.send(());
                    }
                    None => return self.post(&client, &mut spans, &mut failing).await,
                }
            }
        });
    }

    /// Sends `spans` (emptying it). The first failure in a row is logged at
    /// warn, later ones at debug.
    async fn post(&self, client: &reqwest::Client, spans: &mut Vec<Value>, failing: &mut bool) {
        let dropped = self.dropped.swap(0, Ordering::Relaxed);
        if dropped > 0 {
            tracing::warn!(dropped, "the OTLP queue was full: spans dropped");
        }
        if spans.is_empty() {
            return;
        }
        let body = json!({ "resourceSpans": [{
            "resource": self.resource,
            "scopeSpans": [{
                "scope": { "name": "pdserve", "version": env!("CARGO_PKG_VERSION") },
                "spans": std::mem::take(spans),
            }],
        }]});
        let sent = client.post(&self.url).json(&body).send().await;
        let error = match sent {
            Ok(r) if r.status().is_success() => None,
            Ok(r) => Some(format!("the collector answered {}", r.status())),
            Err(e) => Some(e.to_string()),
        };
        match (error, *failing) {
            (None, _) => *failing = false,
            (Some(e), false) => {
                tracing::warn!(url = %self.url, "cannot export spans: {e}");
                *failing = true;
            }
            (Some(e), true) => tracing::debug!(url = %self.url, "cannot export spans: {e}"),
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_traces_path_is_added_once() {
        assert_eq!(
            super::traces_url("http://c:4318/"),
            "http://c:4318/v1/traces"
        );
        assert_eq!(
            super::traces_url("http://c:4318/v1/traces"),
            "http://c:4318/v1/traces"
        );
    }
}
