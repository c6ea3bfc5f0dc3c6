//! Decode default: among workers whose free KV can hold the reservation, the
//! one with the least KV in use; when none can, the one with the most free
//! KV (it may have freed some since its last report, and refuses otherwise).

use pdserve_protocol::internal::Pool;

use super::{cost, Policy, RequestInfo};
use crate::registry::WorkerView;

pub struct LeastKv;

fn free(w: &WorkerView) -> u64 {
    w.load.kv_free_tokens.saturating_sub(w.assigned_tokens)
}

impl Policy for LeastKv {
    fn name(&self) -> &'static str {
        "least_kv_usage"
    }

    fn select(&self, workers: &[WorkerView], req: &RequestInfo) -> Option<usize> {
        let fits = (0..workers.len())
            .filter(|&i| free(&workers[i]) >= req.reserve_tokens)
            .min_by_key(|&i| {
                (
                    cost(Pool::Decode, &workers[i]),
                    workers[i].load.active_sequences,
                )
            });
        fits.or_else(|| (0..workers.len()).max_by_key(|&i| free(&workers[i])))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::worker;

    #[test]
    fn prefers_the_least_used_worker_that_fits() {
        let ws = vec![
            worker("a", 0, 900, 100),
            worker("b", 0, 500, 500),
            worker("c", 0, 700, 300),
        ];
        let req = |t| RequestInfo {
            prompt_tokens: 0,
            reserve_tokens: t,
            prompt: &[],
            known_cached: None,
        };
        assert_eq!(LeastKv.select(&ws, &req(50)), Some(1));
        // Nothing fits 600: the one with the most free KV.
        assert_eq!(LeastKv.select(&ws, &req(600)), Some(1));
        let mut ws = ws;
        ws[1].assigned_tokens = 450;
        assert_eq!(LeastKv.select(&ws, &req(200)), Some(2));
    }
}
