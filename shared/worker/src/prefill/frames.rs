//! The KV frames between a prefill engine and the upload to the decode
//! worker. Sending never waits: a job's frames queue up to a byte cap, and a
//! receiver that reads slower than that fails its own job only, never the
//! model thread and the rest of its batch.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use pdserve_protocol::internal::{ErrorBody, ErrorKind};
use tokio::sync::mpsc;

use super::upload_stopped;

/// Default bytes of KV frames one job may have queued for its upload.
pub const DEFAULT_BUFFER_BYTES: u64 = 64 << 20;

/// The engine's end: [`FrameSender::send`] queues without blocking.
#[derive(Debug, Clone)]
pub struct FrameSender {
    tx: mpsc::UnboundedSender<Bytes>,
    queued: Arc<AtomicU64>,
    cap: u64,
    started: Arc<AtomicBool>,
}

/// The upload's end.
#[derive(Debug)]
pub struct FrameReceiver {
    rx: mpsc::UnboundedReceiver<Bytes>,
    queued: Arc<AtomicU64>,
    started: Arc<AtomicBool>,
}

/// A frame channel holding at most `cap` bytes not yet taken by the upload.
pub fn channel(cap: u64) -> (FrameSender, FrameReceiver) {
    let (tx, rx) = mpsc::unbounded_channel();
    let queued = Arc::new(AtomicU64::new(0));
    let started = Arc::new(AtomicBool::new(false));
    let sender = FrameSender {
        tx,
        queued: queued.clone(),
        cap: cap.max(1),
        started: started.clone(),
    };
    let receiver = FrameReceiver {
        rx,
        queued,
        started,
    };
    (sender, receiver)
}

impl FrameSender {
    /// Queues `frame` for the upload. Fails, at once, when the upload has
    /// stopped or when the receiver is so slow that the frames would exceed
    /// the cap (the first frame is always taken).
    pub fn send(&self, frame: Bytes) -> Result<(), ErrorBody> {
        self.started.store(true, Ordering::Release);
        let n = frame.len() as u64;
        let before = self.queued.fetch_add(n, Ordering::AcqRel);
        if before > 0 && before.saturating_add(n) > self.cap {
            self.queued.fetch_sub(n, Ordering::AcqRel);
            return Err(ErrorBody::retryable(
                ErrorKind::KvUploadFailed,
                format!(
                    "the decode worker reads KV too slowly: {before} bytes still queued (cap {})",
                    self.cap
                ),
            ));
        }
        self.tx.send(frame).map_err(|_| {
            self.queued.fetch_sub(n, Ordering::AcqRel);
            upload_stopped()
        })
    }

    /// Whether the upload has stopped taking frames.
    pub fn is_closed(&self) -> bool {
        self.tx.is_closed()
    }
}

impl FrameReceiver {
    /// Becomes true once the engine has sent the first frame: the job is
    /// being computed, no longer queued.
    pub fn started(&self) -> Arc<AtomicBool> {
        self.started.clone()
    }

    pub fn poll_recv(&mut self, cx: &mut Context<'_>) -> Poll<Option<Bytes>> {
        let polled = self.rx.poll_recv(cx);
        if let Poll::Ready(Some(frame)) = &polled {
            self.queued.fetch_sub(frame.len() as u64, Ordering::AcqRel);
        }
        polled
    }

    pub async fn recv(&mut self) -> Option<Bytes> {
        std::future::poll_fn(|cx| self.poll_recv(cx)).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_slow_receiver_fails_the_sender_without_blocking_it() {
        let (tx, mut rx) = channel(10);
        tx.send(Bytes::from(vec![0; 8])).unwrap();
        assert!(tx.send(Bytes::from(vec![0; 8])).is_err());
        assert_eq!(rx.recv().await.unwrap().len(), 8);
        tx.send(Bytes::from(vec![0; 8])).unwrap();
        // The first frame of an empty queue passes even above the cap.
        let (big, _rx2) = channel(4);
        big.send(Bytes::from(vec![0; 16])).unwrap();
        drop(rx);
        assert!(tx.send(Bytes::from_static(b"x")).is_err());
    }
}
