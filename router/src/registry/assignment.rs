//! Work the router has sent to a worker, counted until the worker's own
//! load report includes it, so a burst does not pile onto one worker
//! between two reports, and nothing is counted twice (here and in a report)
//! or dropped early.
//!
//! A worker acknowledges work with the number of its latest load report at
//! that moment (`report_seq` of `GenerateEvent::Reserved` or
//! `PrefillEvent::Queued`); every report numbered above it includes the
//! work. Until then, and until the request ends, the router adds it to the
//! worker's report.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use super::Registry;

/// One piece of work in flight on a worker.
#[derive(Debug, Clone)]
pub(super) struct Sent {
    id: u64,
    tokens: u64,
    /// Prompt tokens the worker prefills itself (a decode worker's local
    /// prefill), part of its queue once its report counts the work.
    prefill: u64,
    /// The worker's acknowledgement, once it answered.
    acked: Option<u64>,
}

impl Sent {
    /// Whether a report numbered `report_seq` counts this work already.
    fn reported_by(&self, report_seq: u64) -> bool {
        self.acked.is_some_and(|a| a < report_seq)
    }
}

/// The work in flight on one worker that its last report does not count.
#[derive(Debug, Clone, Default)]
pub(super) struct InFlight {
    sent: Vec<Sent>,
}

impl InFlight {
    pub(super) fn add(&mut self, id: u64, tokens: u64, prefill: u64) {
        self.sent.push(Sent {
            id,
            tokens,
            prefill,
            acked: None,
        });
    }

    pub(super) fn acknowledge(&mut self, id: u64, report_seq: u64) {
        if let Some(s) = self.sent.iter_mut().find(|s| s.id == id) {
            s.acked = Some(report_seq);
        }
    }

    pub(super) fn remove(&mut self, id: u64) {
        self.sent.retain(|s| s.id != id);
    }

    /// A report numbered `report_seq` arrived: forget what it counts.
    pub(super) fn reported(&mut self, report_seq: u64) {
        self.sent.retain(|s| !s.reported_by(report_seq));
    }

    /// Requests, tokens and local-prefill tokens not in the last report.
    pub(super) fn totals(&self) -> InFlightTotals {
        InFlightTotals {
            requests: self.sent.len() as u64,
            tokens: self.sent.iter().map(|s| s.tokens).sum(),
            prefill_tokens: self.sent.iter().map(|s| s.prefill).sum(),
        }
    }
}

/// What [`InFlight::totals`] counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct InFlightTotals {
    pub requests: u64,
    pub tokens: u64,
    pub prefill_tokens: u64,
}

/// Numbers the work the router sends.
pub(super) static NEXT_ID: AtomicU64 = AtomicU64::new(1);

pub(super) fn next_id() -> u64 {
    NEXT_ID.fetch_add(1, Ordering::Relaxed)
}

/// Work in flight on a worker: counted in the router's view of it until the
/// worker's report counts it or the guard is dropped (the request ended).
pub struct Assignment {
    pub(super) registry: Arc<Registry>,
    pub(super) url: String,
    pub(super) id: u64,
}

impl Assignment {
    /// The worker acknowledged the work with `report_seq`.
    pub fn acknowledged(&self, report_seq: u64) {
        self.registry
            .with_in_flight(&self.url, |f| f.acknowledge(self.id, report_seq));
    }
}

/// Prompt tokens bound for the prefill pool before a prefill worker is
/// chosen for them (see [`Registry::hold_prefill`]).
pub struct PrefillHold {
    pub(super) registry: Arc<Registry>,
    pub(super) tokens: u64,
}

impl Drop for PrefillHold {
    fn drop(&mut self) {
        self.registry
            .held_prefill
            .fetch_sub(self.tokens, Ordering::Relaxed);
    }
}

impl Drop for Assignment {
    fn drop(&mut self) {
        self.registry
            .with_in_flight(&self.url, |f| f.remove(self.id));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn totals(f: &InFlight) -> (u64, u64, u64) {
        let t = f.totals();
        (t.requests, t.tokens, t.prefill_tokens)
    }

    #[test]
    fn work_counts_until_a_later_report_or_its_end() {
        let mut f = InFlight::default();
        f.add(1, 100, 0);
        f.add(2, 50, 0);
        f.add(3, 10, 4);
        f.acknowledge(1, 7);
        f.acknowledge(2, 9);
        // Report 8 was built after work 1 was acknowledged (at 7): it counts it.
        f.reported(8);
        assert_eq!(totals(&f), (2, 60, 4));
        // Report 9 may predate work 2's acknowledgement (at 9): still ours.
        f.reported(9);
        assert_eq!(totals(&f), (2, 60, 4));
        f.reported(10);
        assert_eq!(totals(&f), (1, 10, 4), "work 3 is not acknowledged yet");
        f.remove(3);
        assert_eq!(totals(&f), (0, 0, 0));
    }
}
