//! Where a prompt is prefilled: on a prefill worker, whose KV then streams
//! to the decode worker, or on the decode worker itself (a *local*
//! prefill). In `auto` mode a prompt goes local when it is short, when no
//! prefill worker is up, or when the prefill pool is backed up and the
//! decode worker has less prefill work waiting (a *spill*): a burst of
//! prompts then uses the decode workers' cores too instead of queueing
//! behind one prefill worker.

use pdserve_protocol::internal::Pool;
use pdserve_runtime::metrics::labels;

use crate::config::{Mode, Spill};
use crate::error::ApiError;
use crate::registry::{Registry, WorkerView};

/// Where one prompt is prefilled, and why (the metric's label).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Placement {
    Remote,
    Local(&'static str),
}

impl Placement {
    pub fn is_local(self) -> bool {
        matches!(self, Self::Local(_))
    }
}

/// The rule's inputs that do not come from the registry.
pub(super) struct Rule {
    pub mode: Mode,
    pub local_prefill_max_tokens: usize,
    pub spill: Spill,
}

impl Rule {
    /// Where a prompt of which decode worker `w` lacks `uncached` tokens is
    /// prefilled.
    pub fn place(
        &self,
        registry: &Registry,
        w: &WorkerView,
        uncached: u64,
    ) -> Result<Placement, ApiError> {
        let prefill_up = || registry.has_ready(Pool::Prefill);
        match self.mode {
            Mode::Aggregated => Ok(Placement::Local(labels::LOCAL_PREFILL_MODE)),
            Mode::Disaggregated if prefill_up() => Ok(Placement::Remote),
            Mode::Disaggregated => Err(ApiError::NoWorker(Pool::Prefill)),
            Mode::Auto if uncached < self.local_prefill_max_tokens as u64 => {
                Ok(Placement::Local(labels::LOCAL_PREFILL_SHORT))
            }
            Mode::Auto if !prefill_up() => Ok(Placement::Local(labels::LOCAL_PREFILL_NO_WORKER)),
            Mode::Auto if self.spills(registry, w) => {
                Ok(Placement::Local(labels::LOCAL_PREFILL_SPILL))
            }
            Mode::Auto => Ok(Placement::Remote),
        }
    }

    /// Whether a request can be placed at all: a decode worker is ready
    /// and, in `disaggregated` mode, a prefill worker too (`auto` prefills
    /// on the decode worker while the prefill pool is empty).
    pub fn can_serve(&self, registry: &Registry) -> bool {
        registry.has_ready(Pool::Decode)
            && (self.mode != Mode::Disaggregated || registry.has_ready(Pool::Prefill))
    }

    /// Whether the prefill pool is backed up past the threshold and `w`
    /// has less prefill work waiting than its least-loaded worker.
    fn spills(&self, registry: &Registry, w: &WorkerView) -> bool {
        let Spill::Above(limit) = self.spill else {
            return false;
        };
        let Some((least, ready)) = registry.least_prefill_pending(w.fingerprint) else {
            return false;
        };
        // Prompts that chose the pool but have no prefill worker yet spread
        // over it as the least-load policy will place them.
        let pool_pending = least + registry.held_prefill() / ready as u64;
        let local_pending = w.load.queued_tokens + w.assigned_prefill_tokens;
        spills(limit, pool_pending, local_pending)
    }
}

impl super::Dispatcher {
    /// What `/ready` reports: whether a request could be placed now.
    pub fn can_serve(&self) -> bool {
        self.placement_rule().can_serve(&self.registry)
    }
}

/// The spill rule on its numbers: the pool's least pending prompt tokens
/// over `limit`, and the decode worker's own fewer. The simulator applies
/// it to its own pools.
pub fn spills(limit: u64, pool_pending: u64, local_pending: u64) -> bool {
    pool_pending > limit && local_pending < pool_pending
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use pdserve_protocol::internal::{LoadReport, WorkerRegistration};

    use super::*;

    #[test]
    fn spills_only_past_the_limit_and_onto_less_work() {
        assert!(!spills(256, 256, 0), "at the limit the pool keeps it");
        assert!(spills(256, 384, 0));
        assert!(spills(256, 384, 383));
        assert!(!spills(256, 384, 384), "equal work: the pool keeps it");
        assert!(!spills(256, 1000, 2000));
    }

    fn registry_with(prefill_queued: u64) -> Arc<Registry> {
        let r = Arc::new(Registry::default());
        for (url, pool) in [("http://p", Pool::Prefill), ("http://d", Pool::Decode)] {
            r.register(&WorkerRegistration {
                url: url.into(),
                pool,
                model_fingerprint: 1,
                weights: "native".into(),
                worker_id: None,
            })
            .unwrap();
        }
        let load = |queued_tokens| LoadReport {
            queued_tokens,
            ready: true,
            report_seq: 1,
            ..Default::default()
        };
        r.record_load("http://p", load(prefill_queued));
        r.record_load("http://d", load(0));
        r
    }

    fn decode_view(r: &Registry) -> WorkerView {
        r.candidates(Pool::Decode, None).remove(0)
    }

    fn rule(mode: Mode, spill: Spill) -> Rule {
        Rule {
            mode,
            local_prefill_max_tokens: 32,
            spill,
        }
    }

    #[test]
    fn auto_mode_places_short_prompts_locally_and_spills_a_backed_up_pool() {
        let auto = rule(Mode::Auto, Spill::Above(256));
        let r = registry_with(100);
        let place = |r: &Registry, n| auto.place(r, &decode_view(r), n).unwrap();
        assert_eq!(place(&r, 10), Placement::Local(labels::LOCAL_PREFILL_SHORT));
        assert_eq!(place(&r, 128), Placement::Remote);
        // Prompts bound for the pool but not yet on a worker count: 100 +
        // 200 held is past 256.
        let hold = r.hold_prefill(200);
        assert_eq!(
            place(&r, 128),
            Placement::Local(labels::LOCAL_PREFILL_SPILL)
        );
        // The decode worker's own prefill work, sent but not yet reported,
        // counts against it: 300 is not less than 300.
        let _sent = r.assign_with_prefill("http://d", 1000, 300);
        assert_eq!(place(&r, 128), Placement::Remote);
        drop(hold);
        assert_eq!(place(&r, 128), Placement::Remote);
        // Off: never.
        let r = registry_with(10_000);
        let off = rule(Mode::Auto, Spill::Off);
        assert_eq!(
            off.place(&r, &decode_view(&r), 128).unwrap(),
            Placement::Remote
        );
        assert!(auto.place(&r, &decode_view(&r), 128).unwrap().is_local());
    }

    #[test]
    fn fixed_modes_do_not_spill() {
        let r = registry_with(10_000);
        let w = decode_view(&r);
        let dis = rule(Mode::Disaggregated, Spill::Above(0));
        assert_eq!(dis.place(&r, &w, 128).unwrap(), Placement::Remote);
        let agg = rule(Mode::Aggregated, Spill::Off);
        assert_eq!(
            agg.place(&r, &w, 128).unwrap(),
            Placement::Local(labels::LOCAL_PREFILL_MODE)
        );
    }

    #[test]
    fn a_disaggregated_router_cannot_serve_without_a_prefill_worker() {
        let r = Registry::default();
        r.register(&WorkerRegistration {
            url: "http://d".into(),
            pool: Pool::Decode,
            model_fingerprint: 1,
            weights: "native".into(),
            worker_id: None,
        })
        .unwrap();
        let dis = rule(Mode::Disaggregated, Spill::Off);
        assert!(!dis.can_serve(&r), "no worker has answered a poll yet");
        r.record_load(
            "http://d",
            LoadReport {
                ready: true,
                report_seq: 1,
                ..Default::default()
            },
        );
        assert!(!dis.can_serve(&r), "the prefill pool is empty");
        assert!(rule(Mode::Auto, Spill::Off).can_serve(&r));
        assert!(rule(Mode::Aggregated, Spill::Off).can_serve(&r));
        assert!(dis.can_serve(&registry_with(0)));
    }
}
