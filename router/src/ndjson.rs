//! Reading a decode worker's stream: one JSON object per line, with a bound
//! on the line length so a broken peer cannot make the router buffer forever.

use bytes::{Buf, Bytes, BytesMut};
use futures_util::stream::BoxStream;
use futures_util::StreamExt;
use serde::de::DeserializeOwned;

/// Longest accepted line.
const MAX_LINE_BYTES: usize = 1 << 20;

#[derive(Debug, thiserror::Error)]
pub enum LineError {
    #[error("the connection failed: {0}")]
    Transport(String),
    #[error("a line is longer than {MAX_LINE_BYTES} bytes")]
    TooLong,
    #[error("a line is not valid JSON: {0}")]
    Json(String),
    #[error("the stream ended in the middle of a line")]
    Truncated,
}

pub struct LineReader {
    body: BoxStream<'static, Result<Bytes, reqwest::Error>>,
    buf: BytesMut,
}

impl LineReader {
    pub fn new(resp: reqwest::Response) -> Self {
        Self::from_stream(resp.bytes_stream().boxed())
    }

    pub fn from_stream(body: BoxStream<'static, Result<Bytes, reqwest::Error>>) -> Self {
        Self {
            body,
            buf: BytesMut::new(),
        }
    }

    /// The next object; `Ok(None)` at a clean end of stream.
    pub async fn next<T: DeserializeOwned>(&mut self) -> Result<Option<T>, LineError> {
        loop {
            if let Some(pos) = self.buf.iter().position(|&b| b == b'\n') {
                let line = self.buf.split_to(pos);
                self.buf.advance(1);
                if line.iter().all(u8::is_ascii_whitespace) {
                    continue;
                }
                return serde_json::from_slice(&line)
                    .map(Some)
                    .map_err(|e| LineError::Json(e.to_string()));
            }
            if self.buf.len() > MAX_LINE_BYTES {
                return Err(LineError::TooLong);
            }
            match self.body.next().await {
                Some(Ok(chunk)) => self.buf.extend_from_slice(&chunk),
                Some(Err(e)) => return Err(LineError::Transport(e.to_string())),
                None if self.buf.iter().all(u8::is_ascii_whitespace) => return Ok(None),
                None => return Err(LineError::Truncated),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reader(chunks: Vec<&'static [u8]>) -> LineReader {
        let s = futures_util::stream::iter(chunks.into_iter().map(|c| Ok(Bytes::from_static(c))));
        LineReader::from_stream(s.boxed())
    }

    #[tokio::test]
    async fn lines_split_across_chunks_are_joined() {
        let mut r = reader(vec![b"{\"a\":", b"1}\n\n{\"a\"", b":2}\n"]);
        let a: serde_json::Value = r.next().await.unwrap().unwrap();
        assert_eq!(a["a"], 1);
        let b: serde_json::Value = r.next().await.unwrap().unwrap();
        assert_eq!(b["a"], 2);
        assert!(r.next::<serde_json::Value>().await.unwrap().is_none());
    }

    #[tokio::test]
    async fn truncation_and_garbage_are_errors() {
        let mut r = reader(vec![b"{\"a\":1"]);
        assert!(matches!(
            r.next::<serde_json::Value>().await,
            Err(LineError::Truncated)
        ));
        let mut r = reader(vec![b"nope\n"]);
        assert!(matches!(
            r.next::<serde_json::Value>().await,
            Err(LineError::Json(_))
        ));
    }
}
