//! The bounded intake queue in front of an engine, and the counters that
//! `/load`, the metrics and the drain read.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use pdserve_protocol::internal::{ErrorBody, ErrorKind, KvReport, LoadReport};
use pdserve_protocol::prefix::PrefixDigest;
use tokio::sync::mpsc;

/// An engine's load: what waits in its queue, what it runs, how fast.
#[derive(Debug, Default)]
pub struct EngineStats {
    queued_requests: AtomicU64,
    queued_tokens: AtomicU64,
    /// Requests taken off the queue and not finished.
    running: AtomicU64,
    /// Of those, the ones the engine holds but does not run yet (a decode
    /// engine's prefilling or waiting sequences), and their prompt tokens
    /// still to prefill: reported as queued.
    waiting_requests: AtomicU64,
    waiting_tokens: AtomicU64,
    /// Tokens per second of the last step or job, as f64 bits.
    tokens_per_second: AtomicU64,
    /// Numbers the load reports (see [`EngineStats::acknowledge`]).
    report_seq: AtomicU64,
    /// When the worker's drain ends, once it drains.
    drain_deadline: Mutex<Option<Instant>>,
}

impl EngineStats {
    /// The worker drains until `deadline`: the engine hands back what
    /// cannot finish by then.
    pub fn start_drain(&self, deadline: Instant) {
        *self
            .drain_deadline
            .lock()
            .unwrap_or_else(|p| p.into_inner()) = Some(deadline);
    }

    /// The drain's deadline, while draining.
    pub fn drain_deadline(&self) -> Option<Instant> {
        *self
            .drain_deadline
            .lock()
            .unwrap_or_else(|p| p.into_inner())
    }

    pub fn queued_requests(&self) -> u64 {
        self.queued_requests.load(Ordering::Relaxed)
    }

    pub fn queued_tokens(&self) -> u64 {
        self.queued_tokens.load(Ordering::Relaxed)
    }

    pub fn running(&self) -> u64 {
        self.running.load(Ordering::Relaxed)
    }

    pub fn set_running(&self, n: u64) {
        self.running.store(n, Ordering::Relaxed);
    }

    /// Of the running requests, `n` wait inside the engine with `tokens`
    /// prompt tokens still to prefill.
    pub fn set_waiting(&self, n: u64, tokens: u64) {
        self.waiting_requests.store(n, Ordering::Relaxed);
        self.waiting_tokens.store(tokens, Ordering::Relaxed);
    }

    /// Queued plus running.
    pub fn in_flight(&self) -> u64 {
        self.queued_requests() + self.running()
    }

    /// An item of `tokens` left the queue. With `running`, it is counted
    /// running first, so a drain polling `in_flight` never sees zero while
    /// the engine holds it.
    pub fn taken(&self, tokens: u64, running: bool) {
        if running {
            self.running.fetch_add(1, Ordering::Relaxed);
        }
        saturating_sub(&self.queued_requests, 1);
        saturating_sub(&self.queued_tokens, tokens);
    }

    pub fn tokens_per_second(&self) -> f64 {
        f64::from_bits(self.tokens_per_second.load(Ordering::Relaxed))
    }

    /// Records a rate: `tokens` processed in `secs`.
    pub fn record_rate(&self, tokens: usize, secs: f64) {
        let rate = tokens as f64 / secs.max(1e-9);
        self.tokens_per_second
            .store(rate.to_bits(), Ordering::Relaxed);
    }

    /// The number to acknowledge work with, once it is counted (queued, or
    /// its KV reserved): every report built from now on is numbered above it,
    /// and counts the work. The router counts work it sent until a report
    /// numbered above its acknowledgement arrives, so nothing is counted
    /// twice (its own tally and the report) or dropped early.
    pub fn acknowledge(&self) -> u64 {
        // A read-modify-write, so that a report numbered above it
        // synchronizes with it and sees the counters it follows.
        self.report_seq.fetch_add(0, Ordering::AcqRel)
    }

    /// The load report with the KV cache's state and prefix digest.
    pub fn report_with_kv(
        &self,
        ready: bool,
        kv: &KvReport,
        prefix_cache: Option<PrefixDigest>,
    ) -> LoadReport {
        LoadReport {
            kv_used_tokens: kv.used_tokens,
            kv_free_tokens: kv.free_tokens(),
            prefix_cache,
            ..self.report(ready)
        }
    }

    /// The load report the router balances and scales on, without KV.
    pub fn report(&self, ready: bool) -> LoadReport {
        // Numbered before the counters are read: it counts all work
        // acknowledged with a lower number.
        let report_seq = self.report_seq.fetch_add(1, Ordering::AcqRel) + 1;
        let waiting = self.waiting_requests.load(Ordering::Relaxed);
        let waiting_tokens = self.waiting_tokens.load(Ordering::Relaxed);
        LoadReport {
            report_seq,
            queued_requests: self.queued_requests().saturating_add(waiting),
            queued_tokens: self.queued_tokens().saturating_add(waiting_tokens),
            active_sequences: self.running().saturating_sub(waiting),
            kv_used_tokens: 0,
            kv_free_tokens: 0,
            tokens_per_second: self.tokens_per_second(),
            ready,
            prefix_cache: None,
        }
    }
}

/// Subtracts without wrapping: a count that went wrong reads 0, not 2^64.
fn saturating_sub(counter: &AtomicU64, n: u64) {
    let _ = counter.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |v| {
        Some(v.saturating_sub(n))
    });
}

/// The sending side of an engine's bounded queue.
pub struct EngineQueue<T> {
    tx: mpsc::Sender<T>,
    stats: Arc<EngineStats>,
}

impl<T> Clone for EngineQueue<T> {
    fn clone(&self) -> Self {
        Self {
            tx: self.tx.clone(),
            stats: self.stats.clone(),
        }
    }
}

impl<T> EngineQueue<T> {
    /// A queue of `capacity` items (at least 1); the engine reads the receiver.
    pub fn new(capacity: usize) -> (Self, mpsc::Receiver<T>) {
        let (tx, rx) = mpsc::channel(capacity.max(1));
        let stats = Arc::new(EngineStats::default());
        (Self { tx, stats }, rx)
    }

    pub fn stats(&self) -> &Arc<EngineStats> {
        &self.stats
    }

    /// Queues `item` of `tokens` without waiting: a full queue is
    /// `overloaded` and a closed one `engine_stopped`, both retryable.
    pub fn submit(&self, item: T, tokens: u64) -> Result<(), ErrorBody> {
        // Counted before it is sent: the engine may take it at once.
        self.stats.queued_requests.fetch_add(1, Ordering::Relaxed);
        self.stats
            .queued_tokens
            .fetch_add(tokens, Ordering::Relaxed);
        let refused = match self.tx.try_send(item) {
            Ok(()) => return Ok(()),
            Err(mpsc::error::TrySendError::Full(_)) => {
                ErrorBody::retryable(ErrorKind::Overloaded, "the queue is full")
            }
            Err(mpsc::error::TrySendError::Closed(_)) => {
                ErrorBody::retryable(ErrorKind::EngineStopped, "the model thread has stopped")
            }
        };
        self.stats.taken(tokens, false);
        Err(refused)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn full_and_closed_queues_are_retryable_and_leave_the_counts_alone() {
        let (q, mut rx) = EngineQueue::new(1);
        q.submit(1, 10).unwrap();
        let s = q.stats().clone();
        assert_eq!((s.queued_requests(), s.queued_tokens()), (1, 10));
        assert_eq!(q.submit(2, 5).unwrap_err().kind, ErrorKind::Overloaded);
        assert_eq!((s.queued_requests(), s.queued_tokens()), (1, 10));
        rx.try_recv().unwrap();
        s.taken(10, true);
        assert_eq!(
            (s.queued_requests(), s.queued_tokens(), s.running()),
            (0, 0, 1)
        );
        assert_eq!(s.in_flight(), 1);
        drop(rx);
        assert_eq!(q.submit(3, 5).unwrap_err().kind, ErrorKind::EngineStopped);
        assert_eq!(s.queued_requests(), 0);
    }
}
