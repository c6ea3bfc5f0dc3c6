//! Each worker in turn, load ignored.

use std::sync::atomic::{AtomicUsize, Ordering};

use super::{Policy, RequestInfo};
use crate::registry::WorkerView;

#[derive(Default)]
pub struct RoundRobin {
    next: AtomicUsize,
}

impl Policy for RoundRobin {
    fn name(&self) -> &'static str {
        "round_robin"
    }

    fn select(&self, workers: &[WorkerView], _req: &RequestInfo) -> Option<usize> {
        match workers.len() {
            0 => None,
            n => Some(self.next.fetch_add(1, Ordering::Relaxed) % n),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::worker;

    #[test]
    fn cycles_through_workers() {
        let ws = vec![
            worker("a", 0, 0, 0),
            worker("b", 0, 0, 0),
            worker("c", 0, 0, 0),
        ];
        let rr = RoundRobin::default();
        let picks: Vec<_> = (0..4)
            .map(|_| rr.select(&ws, &RequestInfo::default()))
            .collect();
        assert_eq!(picks, vec![Some(0), Some(1), Some(2), Some(0)]);
    }
}
