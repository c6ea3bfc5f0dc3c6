//! The bounded intake queue in front of a model thread, with the counters
//! `/load` and the queue-depth metrics report.

use std::sync::atomic::{AtomicU64, Ordering};

use pdserve_protocol::internal::ErrorBody;
use tokio::sync::mpsc;

/// Requests and prompt tokens waiting in a queue.
#[derive(Debug, Default)]
pub struct QueueGauge {
    pub requests: AtomicU64,
    pub tokens: AtomicU64,
}

impl QueueGauge {
    /// Counts an item taken off the queue.
    pub fn taken(&self, tokens: u64) {
        self.requests.fetch_sub(1, Ordering::Relaxed);
        self.tokens.fetch_sub(tokens, Ordering::Relaxed);
    }

    pub fn requests(&self) -> u64 {
        self.requests.load(Ordering::Relaxed)
    }

    pub fn tokens(&self) -> u64 {
        self.tokens.load(Ordering::Relaxed)
    }
}

/// Queues `item` without waiting: a full queue is `overloaded` and a closed
/// one `engine_stopped`, both retryable.
pub fn try_submit<T>(
    tx: &mpsc::Sender<T>,
    gauge: &QueueGauge,
    item: T,
    tokens: u64,
) -> Result<(), ErrorBody> {
    match tx.try_send(item) {
        Ok(()) => {
            gauge.requests.fetch_add(1, Ordering::Relaxed);
            gauge.tokens.fetch_add(tokens, Ordering::Relaxed);
            Ok(())
        }
        Err(mpsc::error::TrySendError::Full(_)) => {
            Err(ErrorBody::retryable("overloaded", "the queue is full"))
        }
        Err(mpsc::error::TrySendError::Closed(_)) => Err(ErrorBody::retryable(
            "engine_stopped",
            "the model thread has stopped",
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn full_and_closed_queues_are_retryable() {
        let (tx, mut rx) = mpsc::channel(1);
        let gauge = QueueGauge::default();
        try_submit(&tx, &gauge, 1, 10).unwrap();
        assert_eq!((gauge.requests(), gauge.tokens()), (1, 10));
        assert_eq!(
            try_submit(&tx, &gauge, 2, 5).unwrap_err().kind,
            "overloaded"
        );
        rx.try_recv().unwrap();
        gauge.taken(10);
        assert_eq!((gauge.requests(), gauge.tokens()), (0, 0));
        drop(rx);
        assert_eq!(
            try_submit(&tx, &gauge, 3, 5).unwrap_err().kind,
            "engine_stopped"
        );
    }
}
