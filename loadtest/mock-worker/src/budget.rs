//! KV admission control as integer bookkeeping: a budget in tokens, and a
//! reservation that gives its tokens back when dropped, so a sequence that
//! ends for any reason (finished, cancelled, lease expired) frees its KV.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use pdserve_protocol::internal::{ErrorBody, ErrorKind};
use pdserve_worker::decode::{KvImport, KvRows};

/// Why a reservation was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BudgetError {
    /// Not enough free tokens now; another worker, or later, may do.
    #[error("KV cache exhausted: {requested} tokens requested, {free} free")]
    Exhausted { requested: u64, free: u64 },
    /// More than the whole budget: no retry can help.
    #[error("{requested} tokens exceed the KV cache budget of {capacity}")]
    CapacityExceeded { requested: u64, capacity: u64 },
}

impl BudgetError {
    /// The wire `kind`, as the real decode worker names it.
    pub fn kind(&self) -> ErrorKind {
        match self {
            Self::Exhausted { .. } => ErrorKind::KvExhausted,
            Self::CapacityExceeded { .. } => ErrorKind::KvCapacityExceeded,
        }
    }
}

impl From<BudgetError> for ErrorBody {
    fn from(e: BudgetError) -> Self {
        match e {
            BudgetError::Exhausted { .. } => ErrorBody::retryable(e.kind(), e.to_string()),
            BudgetError::CapacityExceeded { .. } => ErrorBody::fatal(e.kind(), e.to_string()),
        }
    }
}

/// A KV budget in tokens.
#[derive(Debug)]
pub struct KvBudget {
    capacity: u64,
    used: AtomicU64,
}

impl KvBudget {
    pub fn new(capacity: u64) -> Arc<Self> {
        Arc::new(Self {
            capacity,
            used: AtomicU64::new(0),
        })
    }

    /// Reserves `tokens`, or refuses without changing anything.
    pub fn reserve(self: &Arc<Self>, tokens: u64) -> Result<Reservation, BudgetError> {
        if tokens > self.capacity {
            return Err(BudgetError::CapacityExceeded {
                requested: tokens,
                capacity: self.capacity,
            });
        }
        let take = |used: u64| used.checked_add(tokens).filter(|&u| u <= self.capacity);
        match self
            .used
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, take)
        {
            Ok(_) => Ok(Reservation {
                budget: self.clone(),
                tokens,
                cached: 0,
            }),
            Err(used) => Err(BudgetError::Exhausted {
                requested: tokens,
                free: self.capacity - used,
            }),
        }
    }

    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    pub fn used(&self) -> u64 {
        self.used.load(Ordering::Acquire)
    }

    pub fn free(&self) -> u64 {
        self.capacity.saturating_sub(self.used())
    }
}

/// Tokens held in a [`KvBudget`] until dropped.
#[derive(Debug)]
pub struct Reservation {
    budget: Arc<KvBudget>,
    tokens: u64,
    /// Leading prompt tokens the (simulated) prefix cache holds.
    cached: usize,
}

impl Reservation {
    /// The reservation, holding the first `cached` prompt tokens already.
    pub fn with_cached(mut self, cached: usize) -> Self {
        self.cached = cached;
        self
    }
}

/// A mock keeps no KV: the worker layer has decoded and checked every
/// frame (place, size, CRC) before handing it here, and the bytes are dropped.
impl KvImport for Reservation {
    fn import(&mut self, _rows: KvRows<'_>) -> Result<(), ErrorBody> {
        Ok(())
    }

    fn finish(&mut self, _tokens: &[u32]) -> Result<(), ErrorBody> {
        Ok(())
    }

    fn reset(&mut self) {}

    fn cached(&self) -> usize {
        self.cached
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        self.budget.used.fetch_sub(self.tokens, Ordering::AcqRel);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reservations_are_refused_when_full_and_freed_on_drop() {
        let budget = KvBudget::new(100);
        let a = budget.reserve(60).unwrap();
        assert_eq!((budget.used(), budget.free()), (60, 40));
        let err = budget.reserve(41).unwrap_err();
        assert_eq!(
            err,
            BudgetError::Exhausted {
                requested: 41,
                free: 40
            }
        );
        assert_eq!(
            ErrorBody::from(err).class,
            pdserve_protocol::internal::ErrorClass::Retryable
        );
        let b = budget.reserve(40).unwrap();
        assert_eq!(budget.free(), 0);
        drop(a);
        assert_eq!(budget.used(), 40);
        drop(b);
        assert_eq!(budget.used(), 0);
    }

    #[test]
    fn more_than_the_budget_is_fatal() {
        let budget = KvBudget::new(10);
        let err = budget.reserve(11).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::KvCapacityExceeded);
        assert_eq!(
            ErrorBody::from(err).class,
            pdserve_protocol::internal::ErrorClass::Fatal
        );
        assert_eq!(budget.used(), 0);
    }
}
