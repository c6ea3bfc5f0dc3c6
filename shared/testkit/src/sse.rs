//! Reading the router's server-sent events.

use serde_json::Value;

/// Reads a whole SSE response: the JSON of every `data:` event, and whether
/// it ended with `[DONE]`.
pub async fn sse_events(resp: reqwest::Response) -> (Vec<Value>, bool) {
    assert_eq!(resp.status(), 200);
    assert_eq!(
        resp.headers()["content-type"].to_str().unwrap(),
        "text/event-stream"
    );
    let text = resp.text().await.unwrap();
    let mut events = Vec::new();
    let mut done = false;
    for block in text.split("\n\n").filter(|b| !b.is_empty()) {
        let data = block
            .strip_prefix("data: ")
            .expect("every event is a data line");
        assert!(!done, "nothing may follow [DONE]");
        match data {
            "[DONE]" => done = true,
            json => events.push(serde_json::from_str(json).unwrap()),
        }
    }
    (events, done)
}

/// The text of choice `index` in a stream of chunks.
pub fn streamed_text(events: &[Value], index: u64) -> String {
    events
        .iter()
        .flat_map(|e| e["choices"].as_array().cloned().unwrap_or_default())
        .filter(|c| c["index"] == index)
        .filter_map(|c| {
            c["delta"]["content"]
                .as_str()
                .or(c["text"].as_str())
                .map(str::to_string)
        })
        .collect()
}
