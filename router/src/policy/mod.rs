//! Worker selection policies, one file each behind a small trait.
//!
//! The default for both pools is KV-aware ([`prefix`]): the prompt blocks a
//! worker would have to compute plus its load. `least-load` is fewest
//! pending prompt tokens for prefill ([`least_prefill`]) and most free KV
//! among workers that can hold the reservation for decode ([`least_kv`]).

mod least_kv;
mod least_prefill;
mod power_of_two;
pub mod prefix;
mod round_robin;

use pdserve_protocol::internal::Pool;

use crate::config::PolicyKind;
use crate::registry::WorkerView;

/// What a policy knows about the request it places.
#[derive(Debug, Clone, Copy, Default)]
pub struct RequestInfo<'a> {
    /// Prompt tokens to prefill.
    pub prompt_tokens: u64,
    /// KV tokens to reserve on the decode worker (prompt + max_tokens).
    pub reserve_tokens: u64,
    /// The prompt, matched against the workers' prefix caches.
    pub prompt: &'a [u32],
    /// Leading prompt tokens each worker (by its index in the slice the
    /// policy is given) holds by its last digest, when the caller already
    /// knows them from an index over every digest; `None`: the policy
    /// matches the prompt against each worker's digest itself. Either way
    /// the choice is the same; the index makes it cost the workers that
    /// hold the prompt's first block instead of every worker (the
    /// simulator's thousand-worker pools).
    pub known_cached: Option<&'a [u64]>,
}

pub trait Policy: Send + Sync {
    fn name(&self) -> &'static str;
    /// Index of the chosen worker in `workers`; `None` when it is empty.
    fn select(&self, workers: &[WorkerView], req: &RequestInfo) -> Option<usize>;
}

/// A worker's load in the unit its pool is balanced on: pending prompt
/// tokens (prefill) or used KV tokens (decode), including work sent since
/// its last report.
pub fn cost(pool: Pool, w: &WorkerView) -> u64 {
    match pool {
        Pool::Prefill => w.load.queued_tokens + w.assigned_tokens,
        Pool::Decode => w.load.kv_used_tokens + w.assigned_tokens,
    }
}

pub fn build(kind: PolicyKind, pool: Pool, tuning: prefix::PrefixTuning) -> Box<dyn Policy> {
    match (kind, pool) {
        (PolicyKind::Prefix, pool) => Box::new(prefix::PrefixAware::new(pool, tuning)),
        (PolicyKind::LeastLoad, Pool::Prefill) => Box::new(least_prefill::LeastPrefill),
        (PolicyKind::LeastLoad, Pool::Decode) => Box::new(least_kv::LeastKv),
        (PolicyKind::RoundRobin, _) => Box::new(round_robin::RoundRobin::default()),
        (PolicyKind::PowerOfTwo, pool) => Box::new(power_of_two::PowerOfTwo::new(pool)),
    }
}

#[cfg(test)]
pub(crate) fn worker(url: &str, queued_tokens: u64, kv_used: u64, kv_free: u64) -> WorkerView {
    WorkerView {
        url: url.into(),
        assigned_prefill_tokens: 0,
        load: pdserve_protocol::internal::LoadReport {
            queued_tokens,
            kv_used_tokens: kv_used,
            kv_free_tokens: kv_free,
            ready: true,
            ..Default::default()
        },
        assigned_requests: 0,
        assigned_tokens: 0,
        fingerprint: None,
        prefix: None,
    }
}
