//! The worker registry: every known worker of both pools, with its last load
//! report and health, fed by registrations and heartbeats, static lists, DNS
//! and health polls. One lock around one map.

mod assignment;
mod quarantine;

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use pdserve_protocol::internal::{Heartbeat, LoadReport, Pool, WorkerRegistration};
use pdserve_protocol::prefix::{PrefixDigest, PrefixSet};

use assignment::InFlight;
pub use assignment::{Assignment, PrefillHold};
use quarantine::Quarantine;

/// How the router learnt about a worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    /// The worker registered itself and heartbeats.
    Registered,
    /// `--prefill-url` / `--decode-url`: polled, never removed.
    Static,
    /// Resolved from a headless service: polled, removed when it no longer resolves.
    Dns,
}

/// A worker's state as the router sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Health {
    /// Registered or listed, not yet reporting ready.
    Starting,
    Ready,
    /// Not ready any more (draining): no new work.
    Draining,
    /// Unreachable or failing: no new work until a good poll or heartbeat.
    Down,
}

impl Health {
    pub const ALL: [Health; 4] = [
        Health::Starting,
        Health::Ready,
        Health::Draining,
        Health::Down,
    ];

    pub fn label(self) -> &'static str {
        match self {
            Health::Starting => "starting",
            Health::Ready => "ready",
            Health::Draining => "draining",
            Health::Down => "down",
        }
    }
}

#[derive(Debug, Clone)]
struct Entry {
    pool: Pool,
    source: Source,
    /// The id it registered with, if it registered.
    worker_id: Option<String>,
    fingerprint: Option<u64>,
    load: LoadReport,
    health: Health,
    last_seen: Instant,
    /// Work the router has sent that the last load report does not count.
    in_flight: InFlight,
    /// Health polls failed in a row.
    failed_polls: u32,
    /// Out of placement after a failed connection or stream.
    quarantine: Quarantine,
    /// Whether it has ever reported (poll or heartbeat). Before its first
    /// report a worker is still starting: failures then are not an outage
    /// and take no quarantine strike, so a slow start is not punished by a
    /// backoff that outlasts it.
    reported: bool,
    /// The blocks its prefix cache holds, as last reported (the digest is
    /// kept to skip parsing an unchanged one).
    prefix: Option<(PrefixDigest, Arc<PrefixSet>)>,
}

/// Health polls that must fail in a row before a worker counts as down: one
/// slow answer from a busy worker is not an outage.
pub const POLL_FAILURES_DOWN: u32 = 3;

/// What a scheduling policy sees of a worker.
#[derive(Debug, Clone, PartialEq)]
pub struct WorkerView {
    pub url: String,
    pub load: LoadReport,
    pub assigned_requests: u64,
    pub assigned_tokens: u64,
    /// Prompt tokens sent for the worker to prefill itself (a decode
    /// worker's local prefill) that its last report does not count.
    pub assigned_prefill_tokens: u64,
    pub fingerprint: Option<u64>,
    /// The blocks its prefix cache holds; `None` when it reports none.
    pub prefix: Option<Arc<PrefixSet>>,
}

#[derive(Default)]
pub struct Registry {
    workers: Mutex<BTreeMap<String, Entry>>,
    /// Registered workers removed for going silent, and when: their
    /// streams are lost too (see [`Registry::is_lost`]).
    expired: Mutex<HashMap<String, Instant>>,
    /// Prompt tokens bound for the prefill pool whose prefill worker is not
    /// chosen yet ([`Registry::hold_prefill`]).
    held_prefill: AtomicU64,
}

/// How long a worker removed for silence still counts as lost.
const LOST_FOR: Duration = Duration::from_secs(60);

fn health_of(load: &LoadReport) -> Health {
    match load.ready {
        true => Health::Ready,
        false => Health::Draining,
    }
}

/// A worker's digest, parsed; one that does not parse is ignored (the
/// worker is then routed as if its cache were empty).
fn parse_digest(url: &str, d: PrefixDigest) -> Option<(PrefixDigest, Arc<PrefixSet>)> {
    match d.parse() {
        Ok(set) => Some((d, Arc::new(set))),
        Err(e) => {
            tracing::warn!(%url, "ignoring the worker's prefix digest: {e}");
            None
        }
    }
}

impl Registry {
    fn lock(&self) -> MutexGuard<'_, BTreeMap<String, Entry>> {
        self.workers.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn insert(&self, pool: Pool, url: &str, source: Source, fingerprint: Option<u64>) {
        let mut map = self.lock();
        let entry = map.entry(url.to_string()).or_insert_with(|| Entry {
            pool,
            source,
            worker_id: None,
            fingerprint,
            load: LoadReport::default(),
            health: Health::Starting,
            last_seen: Instant::now(),
            in_flight: InFlight::default(),
            failed_polls: 0,
            quarantine: Quarantine::default(),
            reported: false,
            prefix: None,
        });
        entry.pool = pool;
        entry.fingerprint = fingerprint.or(entry.fingerprint);
        entry.last_seen = Instant::now();
        // A registration upgrades a polled entry: the worker now heartbeats.
        if source == Source::Registered {
            entry.source = source;
        }
    }

    /// Registers a worker at `reg.url` (already checked and normalised).
    /// Refused: a URL known in the other pool, a URL another worker id
    /// registered, an id registered at another URL.
    pub fn register(&self, reg: &WorkerRegistration) -> Result<(), String> {
        let map = self.lock();
        if let Some(e) = map.get(&reg.url) {
            if e.pool != reg.pool {
                return Err(format!("{} is a {:?} worker", reg.url, e.pool));
            }
            if e.worker_id.is_some() && e.worker_id != reg.worker_id {
                return Err(format!("{} is registered by another worker", reg.url));
            }
        }
        if let Some(id) = &reg.worker_id {
            let elsewhere = map
                .iter()
                .find(|(url, e)| e.worker_id.as_ref() == Some(id) && **url != reg.url);
            if let Some((url, _)) = elsewhere {
                return Err(format!("worker id {id:?} is registered at {url}"));
            }
        }
        drop(map);
        self.expired().remove(&reg.url);
        tracing::info!(url = %reg.url, pool = ?reg.pool, weights = %reg.weights, "worker registered");
        self.insert(
            reg.pool,
            &reg.url,
            Source::Registered,
            Some(reg.model_fingerprint),
        );
        if let Some(e) = self.lock().get_mut(&reg.url) {
            e.worker_id = reg.worker_id.clone();
        }
        Ok(())
    }

    /// Records a heartbeat; false when the worker is unknown (it should register again).
    pub fn heartbeat(&self, hb: &Heartbeat) -> bool {
        self.record_load(&hb.url, hb.load.clone())
    }

    /// Forgets a registered worker; static and DNS workers stay (their
    /// list, not a request, says whether they exist).
    pub fn deregister(&self, url: &str) {
        let mut map = self.lock();
        if map.get(url).is_some_and(|e| e.source == Source::Registered) {
            map.remove(url);
            tracing::info!(%url, "worker deregistered");
        }
    }

    /// Every worker: its URL, pool and health.
    pub fn list(&self) -> Vec<(String, Pool, Health)> {
        let map = self.lock();
        map.iter()
            .map(|(url, e)| (url.clone(), e.pool, e.health))
            .collect()
    }

    pub fn add_static(&self, pool: Pool, url: &str) {
        self.insert(pool, url.trim_end_matches('/'), Source::Static, None);
    }

    /// Makes the DNS-discovered workers of `pool` exactly `urls`.
    pub fn sync_dns(&self, pool: Pool, urls: &[String]) {
        self.lock()
            .retain(|url, e| e.source != Source::Dns || e.pool != pool || urls.contains(url));
        for url in urls {
            self.insert(pool, url, Source::Dns, None);
        }
    }

    /// A good load report (poll or heartbeat); false when the worker is unknown.
    pub fn record_load(&self, url: &str, load: LoadReport) -> bool {
        let mut load = load.sanitized();
        let digest = load.prefix_cache.take();
        let mut map = self.lock();
        let Some(e) = map.get_mut(url) else {
            return false;
        };
        e.health = match e.quarantine.active(Instant::now()) {
            true => Health::Down,
            false => health_of(&load),
        };
        e.failed_polls = 0;
        e.reported = true;
        e.in_flight.reported(load.report_seq);
        e.load = load;
        e.last_seen = Instant::now();
        e.prefix = match (digest, e.prefix.take()) {
            (Some(d), Some(last)) if d == last.0 => Some(last),
            (Some(d), _) => parse_digest(url, d),
            (None, _) => None,
        };
        true
    }

    /// A health poll failed; the worker is down after [`POLL_FAILURES_DOWN`] in a row.
    pub fn poll_failed(&self, url: &str) {
        let down = match self.lock().get_mut(url) {
            Some(e) => {
                e.failed_polls += 1;
                e.failed_polls >= POLL_FAILURES_DOWN
            }
            None => false,
        };
        if down {
            self.mark_down(url);
        }
    }

    /// The worker refused a connection or broke a stream: no new work until
    /// its quarantine is over and it reports again.
    pub fn mark_down(&self, url: &str) {
        let now = Instant::now();
        if let Some(e) = self.lock().get_mut(url) {
            // Failures during a quarantine are the same outage: one strike.
            // A worker that never reported is starting, not failing.
            if e.reported && !e.quarantine.active(now) {
                let backoff = e.quarantine.strike(now);
                let ms = backoff.as_millis() as u64;
                tracing::warn!(%url, backoff_ms = ms, "worker marked down: quarantined");
            }
            e.health = Health::Down;
        }
    }

    /// Whether the streams running on the worker at `url` are lost: it is
    /// down (a connection or stream to it failed, or its polls did), or it
    /// was removed for going silent. A worker that deregistered to drain is
    /// not lost: its streams finish or are handed back.
    pub fn is_lost(&self, url: &str) -> bool {
        let down = self
            .lock()
            .get(url)
            .is_some_and(|e| e.health == Health::Down);
        down || self.expired().contains_key(url)
    }

    /// Whether the worker at `url` reported (heartbeat or poll) within `within`.
    pub fn heard_within(&self, url: &str, within: Duration) -> bool {
        let map = self.lock();
        map.get(url).is_some_and(|e| e.last_seen.elapsed() < within)
    }

    fn expired(&self) -> MutexGuard<'_, HashMap<String, Instant>> {
        self.expired.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Workers to poll: those without heartbeats.
    pub fn pollable(&self) -> Vec<String> {
        let map = self.lock();
        map.iter()
            .filter(|(_, e)| e.source != Source::Registered)
            .map(|(u, _)| u.clone())
            .collect()
    }

    /// Forgets registered workers silent for longer than `timeout`, and
    /// takes polled workers silent for longer than `polled` out of
    /// placement (a report brings them back).
    pub fn expire(&self, timeout: Duration, polled: Duration) {
        let now = Instant::now();
        let mut map = self.lock();
        let mut expired = self.expired();
        expired.retain(|_, at| now.duration_since(*at) < LOST_FOR);
        map.retain(|url, e| {
            let silent_for = now.duration_since(e.last_seen);
            if e.source == Source::Registered && silent_for > timeout {
                tracing::warn!(%url, "worker stopped heartbeating: removed");
                expired.insert(url.clone(), now);
                return false;
            }
            if e.source != Source::Registered && silent_for > polled {
                e.health = Health::Down;
            }
            true
        });
    }

    /// Ready workers of `pool`, optionally only those with `fingerprint`.
    pub fn candidates(&self, pool: Pool, fingerprint: Option<u64>) -> Vec<WorkerView> {
        let map = self.lock();
        map.iter()
            .filter(|(_, e)| e.pool == pool && e.health == Health::Ready)
            .filter(|(_, e)| match (fingerprint, e.fingerprint) {
                (Some(a), Some(b)) => a == b,
                _ => true,
            })
            .map(|(url, e)| {
                let sent = e.in_flight.totals();
                WorkerView {
                    url: url.clone(),
                    load: e.load.clone(),
                    assigned_requests: sent.requests,
                    assigned_tokens: sent.tokens,
                    assigned_prefill_tokens: sent.prefill_tokens,
                    fingerprint: e.fingerprint,
                    prefix: e.prefix.as_ref().map(|(_, set)| set.clone()),
                }
            })
            .collect()
    }

    /// The fewest pending prompt tokens of a ready prefill worker (its
    /// report plus work sent since, as `policy::cost` counts it), and how
    /// many ready ones there are; optionally only those with `fingerprint`.
    /// No views are built: the spill rule asks on every placement.
    pub fn least_prefill_pending(&self, fingerprint: Option<u64>) -> Option<(u64, usize)> {
        let map = self.lock();
        let pending = map
            .values()
            .filter(|e| e.pool == Pool::Prefill && e.health == Health::Ready)
            .filter(|e| match (fingerprint, e.fingerprint) {
                (Some(a), Some(b)) => a == b,
                _ => true,
            })
            .map(|e| e.load.queued_tokens + e.in_flight.totals().tokens);
        pending.fold(None, |acc, p| match acc {
            None => Some((p, 1)),
            Some((least, n)) => Some((least.min(p), n + 1)),
        })
    }

    /// The KV cache size (used + free tokens) each ready worker of `pool`
    /// last reported.
    pub fn kv_sizes(&self, pool: Pool) -> Vec<u64> {
        let map = self.lock();
        map.values()
            .filter(|e| e.pool == pool && e.health == Health::Ready)
            .map(|e| e.load.kv_used_tokens.saturating_add(e.load.kv_free_tokens))
            .collect()
    }

    pub fn has_ready(&self, pool: Pool) -> bool {
        let map = self.lock();
        map.values()
            .any(|e| e.pool == pool && e.health == Health::Ready)
    }

    /// Live (not down) workers of `pool`.
    pub fn live(&self, pool: Pool) -> usize {
        let map = self.lock();
        map.values()
            .filter(|e| e.pool == pool && e.health != Health::Down)
            .count()
    }

    /// Live workers of `pool` that have measured their throughput.
    pub fn reporting(&self, pool: Pool) -> usize {
        let map = self.lock();
        map.values()
            .filter(|e| {
                e.pool == pool && e.health != Health::Down && e.load.tokens_per_second > 0.0
            })
            .count()
    }

    /// Counts work of `tokens` sent to `url` until the worker's report
    /// counts it (see [`Assignment::acknowledged`]) or the guard is dropped.
    pub fn assign(self: &Arc<Self>, url: &str, tokens: u64) -> Assignment {
        self.assign_with_prefill(url, tokens, 0)
    }

    /// [`Self::assign`] for work that also has the worker prefill
    /// `prefill` prompt tokens itself (a decode worker's local prefill).
    pub fn assign_with_prefill(
        self: &Arc<Self>,
        url: &str,
        tokens: u64,
        prefill: u64,
    ) -> Assignment {
        let id = assignment::next_id();
        self.with_in_flight(url, |f| f.add(id, tokens, prefill));
        Assignment {
            registry: self.clone(),
            url: url.to_string(),
            id,
        }
    }

    /// Counts `tokens` bound for the prefill pool from the moment a request
    /// decides to send them until the guard is dropped (once a prefill
    /// worker's assignment counts them): requests deciding meanwhile see
    /// them ([`Self::held_prefill`]).
    pub fn hold_prefill(self: &Arc<Self>, tokens: u64) -> PrefillHold {
        self.held_prefill.fetch_add(tokens, Ordering::Relaxed);
        PrefillHold {
            registry: self.clone(),
            tokens,
        }
    }

    /// Prompt tokens held for the prefill pool, not yet on any worker.
    pub fn held_prefill(&self) -> u64 {
        self.held_prefill.load(Ordering::Relaxed)
    }

    fn with_in_flight(&self, url: &str, f: impl FnOnce(&mut InFlight)) {
        if let Some(e) = self.lock().get_mut(url) {
            f(&mut e.in_flight);
        }
    }

    /// Workers per health state, for the metrics.
    pub fn counts(&self, pool: Pool) -> [(Health, usize); 4] {
        let map = self.lock();
        Health::ALL.map(|h| {
            let n = map
                .values()
                .filter(|e| e.pool == pool && e.health == h)
                .count();
            (h, n)
        })
    }

    /// The pool's load: the sum of its live workers' reports.
    pub fn pool_load(&self, pool: Pool) -> LoadReport {
        let map = self.lock();
        let mut sum = LoadReport::default();
        for e in map
            .values()
            .filter(|e| e.pool == pool && e.health != Health::Down)
        {
            let l = &e.load;
            sum.queued_requests = sum.queued_requests.saturating_add(l.queued_requests);
            sum.queued_tokens = sum.queued_tokens.saturating_add(l.queued_tokens);
            sum.active_sequences = sum.active_sequences.saturating_add(l.active_sequences);
            sum.kv_used_tokens = sum.kv_used_tokens.saturating_add(l.kv_used_tokens);
            sum.kv_free_tokens = sum.kv_free_tokens.saturating_add(l.kv_free_tokens);
            sum.tokens_per_second += l.tokens_per_second;
            sum.ready |= e.health == Health::Ready;
        }
        sum
    }
}

#[cfg(test)]
mod tests;
