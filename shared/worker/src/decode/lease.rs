//! Reservations waiting for their KV, each under a lease: one cancellable
//! timer per reservation, keyed by a lease id, releases it if the KV has not
//! arrived in time. The timer stops as soon as the reservation leaves the
//! waiting map for good (KV admitted, client gone), so long leases leave no
//! sleeping task behind at high request rates.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use pdserve_protocol::internal::{ErrorBody, ErrorKind, GenerateEvent, SamplingSpec};
use tokio::sync::mpsc;
use tokio::time::Instant;

use super::{DecodeBackend, DecodeServer};

/// Tells a reservation's lease from a later one's under the same request id.
static NEXT_LEASE: AtomicU64 = AtomicU64::new(0);

/// A sequence whose KV is expected from a prefill worker.
pub(super) struct Pending<Kv> {
    pub prompt: Vec<u32>,
    pub sampling: SamplingSpec,
    pub kv: Kv,
    pub events: mpsc::UnboundedSender<GenerateEvent>,
    pub lease: LeaseTimer,
}

/// The timer of one reservation; dropping it stops the timer.
pub(super) struct LeaseTimer {
    id: u64,
    until: Instant,
    task: tokio::task::AbortHandle,
}

impl LeaseTimer {
    /// Whether the lease has run out (a failed ingest then releases the reservation).
    pub fn expired(&self) -> bool {
        Instant::now() >= self.until
    }
}

impl Drop for LeaseTimer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// The error a reservation ends with when its KV is late.
pub(super) fn expired_error(detail: impl Into<String>) -> GenerateEvent {
    GenerateEvent::Error(ErrorBody::retryable(ErrorKind::KvLeaseExpired, detail))
}

impl<B: DecodeBackend> DecodeServer<B> {
    /// Starts the lease of a reservation about to wait under `request_id`.
    /// Call it with the waiting map locked, so the timer cannot look before
    /// the entry is in.
    pub(super) fn start_lease(self: &Arc<Self>, request_id: &str, within: Duration) -> LeaseTimer {
        let id = NEXT_LEASE.fetch_add(1, Ordering::Relaxed);
        let task = tokio::spawn(
            self.clone()
                .release_late(request_id.to_string(), id, within),
        );
        LeaseTimer {
            id,
            until: Instant::now() + within,
            task: task.abort_handle(),
        }
    }

    /// Releases the reservation if it is still waiting when the lease ends.
    async fn release_late(self: Arc<Self>, request_id: String, lease: u64, within: Duration) {
        tokio::time::sleep(within).await;
        let mut map = self.pending();
        // Absent (or another request's): the KV arrived, or the client left.
        if map.get(&request_id).is_some_and(|p| p.lease.id == lease) {
            if let Some(p) = map.remove(&request_id) {
                tracing::warn!(request_id = %request_id, "KV lease expired: releasing the reservation");
                let ms = within.as_millis();
                let _ = p.events.send(expired_error(format!(
                    "the KV did not arrive within {ms} ms"
                )));
            }
        }
    }

    /// Releases a waiting reservation whose client has gone away.
    pub(super) fn release_abandoned(&self, request_id: &str) {
        let mut map = self.pending();
        // Closed: it is this stream's entry, not a later request's with the same id.
        if map.get(request_id).is_some_and(|p| p.events.is_closed()) {
            map.remove(request_id);
            tracing::info!(request_id = %request_id, "the client left while waiting for KV: reservation released");
        }
    }
}
