//! Reading a worker's generate stream: one JSON object per line.

use pdserve_protocol::internal::GenerateEvent;

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
        loop {
            if let Some(i) = self.buf.iter().position(|&b| b == b'\n') {
                let line: Vec<u8> = self.buf.drain(..=i).collect();
                return Some(serde_json::from_slice(&line).unwrap());
            }
            match self.resp.chunk().await.unwrap() {
                Some(c) => self.buf.extend_from_slice(&c),
                None => return None,
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
