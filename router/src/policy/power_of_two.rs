//! Power of two choices: two workers at random, the less loaded of them.
//! Nearly as good as least-load with stale reports, without herding every
//! router onto the same worker.

use std::sync::atomic::{AtomicU64, Ordering};

use pdserve_protocol::internal::Pool;

use super::{cost, Policy, RequestInfo};
use crate::registry::WorkerView;

pub struct PowerOfTwo {
    pool: Pool,
    state: AtomicU64,
}

impl PowerOfTwo {
    pub fn new(pool: Pool) -> Self {
        Self {
            pool,
            state: AtomicU64::new(0x9E37_79B9_7F4A_7C15),
        }
    }

    /// splitmix64 over an atomic counter: cheap and good enough to spread load.
    fn random(&self) -> u64 {
        let mut z = self
            .state
            .fetch_add(0x9E37_79B9_7F4A_7C15, Ordering::Relaxed)
            .wrapping_add(0x9E37_79B9_7F4A_7C15);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
}

impl Policy for PowerOfTwo {
    fn name(&self) -> &'static str {
        "power_of_two"
    }

    fn select(&self, workers: &[WorkerView], _req: &RequestInfo) -> Option<usize> {
        let n = workers.len();
        if n < 2 {
            return (n == 1).then_some(0);
        }
        let a = (self.random() % n as u64) as usize;
        let b = (a + 1 + (self.random() % (n as u64 - 1)) as usize) % n;
        match cost(self.pool, &workers[a]) <= cost(self.pool, &workers[b]) {
            true => Some(a),
            false => Some(b),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::worker;

    #[test]
    fn never_picks_the_most_loaded_of_two_and_spreads_otherwise() {
        let p = PowerOfTwo::new(Pool::Prefill);
        let two = vec![worker("a", 10, 0, 0), worker("b", 0, 0, 0)];
        for _ in 0..50 {
            assert_eq!(p.select(&two, &RequestInfo::default()), Some(1));
        }
        let even: Vec<_> = (0..4).map(|i| worker(&i.to_string(), 0, 0, 0)).collect();
        let mut seen = [0; 4];
        for _ in 0..400 {
            seen[p.select(&even, &RequestInfo::default()).unwrap()] += 1;
        }
        assert!(seen.iter().all(|&s| s > 40), "{seen:?}");
    }
}
