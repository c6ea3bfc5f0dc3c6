//! A worker whose connection failed, or whose stream broke, stays out of
//! placement for a backoff that doubles with each failure in a row (0.5 s,
//! 1 s, 2 s, … at most 30 s), even if it keeps reporting: a worker that
//! heartbeats but cannot serve does not flap back in after every report.
//! A minute without failures forgives the past ones. A worker that has never
//! reported is starting, not failing: its failures take no strike.

use std::time::{Duration, Instant};

const BASE: Duration = Duration::from_millis(500);
const MAX: Duration = Duration::from_secs(30);
const FORGIVE: Duration = Duration::from_secs(60);

#[derive(Debug, Clone, Default)]
pub(super) struct Quarantine {
    strikes: u32,
    until: Option<Instant>,
    last: Option<Instant>,
}

impl Quarantine {
    /// Records a failure at `now`; returns how long the worker is out.
    pub fn strike(&mut self, now: Instant) -> Duration {
        if self.last.is_some_and(|t| now.duration_since(t) > FORGIVE) {
            self.strikes = 0;
        }
        self.strikes = self.strikes.saturating_add(1);
        let backoff = BASE
            .saturating_mul(1 << (self.strikes - 1).min(10))
            .min(MAX);
        self.until = Some(now + backoff);
        self.last = Some(now);
        backoff
    }

    /// Whether the worker is still out at `now`.
    pub fn active(&self, now: Instant) -> bool {
        self.until.is_some_and(|u| now < u)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_backoff_doubles_is_capped_and_is_forgiven() {
        let mut q = Quarantine::default();
        let t0 = Instant::now();
        assert!(!q.active(t0));
        assert_eq!(q.strike(t0), BASE);
        assert!(q.active(t0 + BASE / 2));
        assert!(!q.active(t0 + BASE));
        assert_eq!(q.strike(t0 + BASE), BASE * 2);
        let mut last = Duration::ZERO;
        for _ in 0..10 {
            last = q.strike(t0 + BASE);
        }
        assert_eq!(last, MAX);
        let later = t0 + BASE + FORGIVE + Duration::from_secs(1);
        assert_eq!(q.strike(later), BASE);
    }
}
