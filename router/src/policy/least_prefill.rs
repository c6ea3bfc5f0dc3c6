//! Prefill default: the worker with the fewest pending prompt tokens, so a
//! long prompt queued on one worker does not hold up the short ones.

use pdserve_protocol::internal::Pool;

use super::{cost, Policy, RequestInfo};
use crate::registry::WorkerView;

pub struct LeastPrefill;

impl Policy for LeastPrefill {
    fn name(&self) -> &'static str {
        "least_prefill_tokens"
    }

    fn select(&self, workers: &[WorkerView], _req: &RequestInfo) -> Option<usize> {
        (0..workers.len()).min_by_key(|&i| {
            let w = &workers[i];
            (
                cost(Pool::Prefill, w),
                w.load.queued_requests + w.assigned_requests,
            )
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::worker;

    #[test]
    fn picks_the_fewest_pending_tokens_including_assigned_work() {
        let mut ws = vec![
            worker("a", 500, 0, 0),
            worker("b", 100, 0, 0),
            worker("c", 300, 0, 0),
        ];
        assert_eq!(LeastPrefill.select(&ws, &RequestInfo::default()), Some(1));
        ws[1].assigned_tokens = 1000;
        assert_eq!(LeastPrefill.select(&ws, &RequestInfo::default()), Some(2));
        assert_eq!(LeastPrefill.select(&[], &RequestInfo::default()), None);
    }
}
