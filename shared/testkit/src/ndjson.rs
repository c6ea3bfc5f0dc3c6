//! Reading a worker's generate stream: one JSON object per line.

use pdserve_protocol::internal::{ErrorBody, GenerateEvent, PrefillEvent, PrefillResult};

/// Reads the lines of a streamed response one by one, buffering partial ones.
pub struct Lines {
    resp: reqwest::Response,
    buf: Vec<u8>,
}

impl Lines {
    pub fn new(resp: reqwest::Response) -> Self {
        Self {
            resp,
            buf: Vec::new(),
        }
    }

    /// The next event; `None` once the stream has ended.
    pub async fn next(&mut self) -> Option<GenerateEvent> {
        self.next_as().await
    }

    /// The next line as a `T`; `None` once the stream has ended.
    pub async fn next_as<T: serde::de::DeserializeOwned>(&mut self) -> Option<T> {
        self.try_next_as().await.unwrap()
    }

    /// The next line as a `T`; `None` once the stream has ended, an error
    /// when it broke off (the server went away).
    pub async fn try_next_as<T: serde::de::DeserializeOwned>(
        &mut self,
    ) -> Result<Option<T>, reqwest::Error> {
        loop {
            if let Some(i) = self.buf.iter().position(|&b| b == b'\n') {
                let line: Vec<u8> = self.buf.drain(..=i).collect();
                return Ok(Some(serde_json::from_slice(&line).unwrap()));
            }
            match self.resp.chunk().await? {
                Some(c) => self.buf.extend_from_slice(&c),
                None => return Ok(None),
            }
        }
    }

    /// Every event until the stream ends.
    pub async fn all(mut self) -> Vec<GenerateEvent> {
        let mut out = Vec::new();
        while let Some(e) = self.next().await {
            out.push(e);
        }
        out
    }

    /// The whole events until the stream ends or breaks (a worker that went away).
    pub async fn try_all(mut self) -> Vec<GenerateEvent> {
        while let Ok(Some(c)) = self.resp.chunk().await {
            self.buf.extend_from_slice(&c);
        }
        self.buf
            .split(|&b| b == b'\n')
            .filter_map(|line| serde_json::from_slice(line).ok())
            .collect()
    }
}

/// Reads a whole generate stream, which must have started with 200.
pub async fn events(resp: reqwest::Response) -> Vec<GenerateEvent> {
    assert_eq!(resp.status(), 200);
    Lines::new(resp).all().await
}

/// The token ids of a stream's events.
pub fn token_ids(events: &[GenerateEvent]) -> Vec<u32> {
    events
        .iter()
        .filter_map(|e| match e {
            GenerateEvent::Token { id, .. } => Some(*id),
            _ => None,
        })
        .collect()
}

/// A prefill job's answer: its result, or the error it was refused with
/// (an HTTP error before it was queued, an `error` line after).
pub async fn prefill_outcome(resp: reqwest::Response) -> Result<PrefillResult, ErrorBody> {
    if !resp.status().is_success() {
        return Err(resp.json().await.unwrap());
    }
    let mut lines = Lines::new(resp);
    match lines.next_as().await {
        Some(PrefillEvent::Queued { .. }) => {}
        other => panic!("a prefill answer starts with `queued`: {other:?}"),
    }
    match lines.next_as().await {
        Some(PrefillEvent::Done(r)) => Ok(r),
        Some(PrefillEvent::Error(e)) => Err(e),
        other => panic!("a queued job ends with `done` or `error`: {other:?}"),
    }
}
