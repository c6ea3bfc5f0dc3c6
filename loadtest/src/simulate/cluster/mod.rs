//! The discrete-event model of one router over a prefill pool and a decode
//! pool.
//!
//! Time only moves from one event to the next, so a simulated hour of a
//! thousand workers costs what its events cost. The parts are pdserve's
//! own where they can be:
//! - placement is the router's [`Policy`](pdserve_router::policy::Policy)
//!   code, fed the load reports a worker would send (its prefix digest
//!   refreshed once per heartbeat; `placement.rs`);
//! - the local-versus-remote rule is the router's `--mode` rule on the
//!   *uncached* length;
//! - each worker's prefix cache is the mock worker's
//!   ([`PrefixCache`](pdserve_mock_worker::prefix::PrefixCache));
//! - each pool's engine runs the mock worker's schedule on its
//!   [`LatencyModel`]: a prefill worker runs one prompt at a time, FIFO; a
//!   decode worker runs the mock batcher's iteration (a prefill chunk of the
//!   oldest local sequence while the batch has room, admission up to
//!   `--max-batch`, one decode step over the batch) and reserves KV for
//!   prompt + `max_tokens` at admission, as the mock does.
//!
//! KV crosses a link of `bandwidth` and one-way `latency`: it streams layer
//! by layer while the prompt is computed, so what shows is the last layer's
//! share (or the whole transfer, when the link is slower than the compute).
//! Links do not contend with one another. Workers compute on cores of
//! their own, or with `--cores` share that many cores among all of them
//! (`cores.rs`). The router's dispatch and each pool's schedule, event by
//! event, are in `pools.rs`.

mod cores;
mod placement;
mod pools;

use std::cmp::Ordering;
use std::collections::{BinaryHeap, VecDeque};

use pdserve_mock_worker::latency::LatencyModel;
use pdserve_protocol::internal::Pool;
use pdserve_router::config::{Mode, PolicyKind, Spill};
use pdserve_router::policy::{self, prefix::PrefixTuning};
use pdserve_worker::kv::KvArgs;

use cores::SharedCores;
use placement::{Cache, Placement};

/// The fingerprint the simulated caches hash blocks with (any constant:
/// every simulated worker serves the same model).
const SEED: u64 = 0x5111_0001;

/// The cluster to simulate.
#[derive(Debug, Clone)]
pub struct ClusterCfg {
    pub prefill_workers: usize,
    pub decode_workers: usize,
    pub latency: LatencyModel,
    /// Decode: sequences per step at most.
    pub max_batch: usize,
    /// Decode: the KV budget in tokens (also each prefill worker's cache).
    pub kv_cache_tokens: usize,
    /// Decode: prompt tokens per local prefill chunk; prefill: per KV chunk.
    pub chunk_tokens: usize,
    /// Requests either pool lets wait before refusing (503).
    pub max_queue: usize,
    pub kv: KvArgs,
    pub mode: Mode,
    pub local_prefill_max_tokens: usize,
    pub local_prefill_spill: Spill,
    pub prefill_policy: PolicyKind,
    pub decode_policy: PolicyKind,
    pub tuning: PrefixTuning,
    pub decode_attempts: usize,
    pub prefill_attempts: usize,
    pub link: Link,
    /// Seconds the router adds before a request reaches a worker.
    pub router_overhead: f64,
    /// Seconds each decode step takes beyond the latency model.
    pub step_overhead: f64,
    /// Seconds between a worker's load reports (its prefix digest).
    pub heartbeat: f64,
    /// Whether a finished sequence's generated tokens enter the decode
    /// worker's prefix cache (the real engine's behaviour; the mock's cache
    /// holds prompts only).
    pub cache_generated: bool,
    /// Keep every inter-token gap (memory grows with the tokens generated).
    pub keep_itl: bool,
    /// Cores every worker shares (`None`: each worker has its own).
    pub cores: Option<f64>,
    /// With `cores`: worker `k` (decode workers first, then prefill) is
    /// pinned to core `k % cores` and shares only that one.
    pub pin_workers: bool,
}

/// The network between the pools.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Link {
    /// `None`: never the bottleneck (loopback).
    pub bytes_per_second: Option<f64>,
    /// One-way seconds.
    pub latency: f64,
    pub kv_bytes_per_token: f64,
    pub layers: u32,
}

impl Link {
    /// When the last KV byte of a prompt computed over `[start, finish]`
    /// lands, `tokens` of it on the wire and `last_chunk` in the last chunk.
    fn arrival(&self, (start, finish): (f64, f64), tokens: usize, last_chunk: usize) -> f64 {
        let Some(bw) = self.bytes_per_second else {
            return finish + self.latency;
        };
        let total = tokens as f64 * self.kv_bytes_per_token;
        let tail =
            last_chunk.min(tokens) as f64 * self.kv_bytes_per_token / self.layers.max(1) as f64;
        (finish + tail / bw).max(start + total / bw) + self.latency
    }
}

/// One request as the driver hands it in.
#[derive(Debug, Clone)]
pub struct Request {
    /// The driver's own id, given back in [`Finished`].
    pub id: usize,
    pub prompt: Vec<u32>,
    pub max_tokens: u32,
}

/// A request's outcome. Times are simulated seconds.
#[derive(Debug, Clone, PartialEq)]
pub struct Finished {
    pub id: usize,
    pub start: f64,
    pub first: Option<f64>,
    pub end: f64,
    pub prompt_tokens: u32,
    pub completion_tokens: u32,
    /// Prompt tokens the decode worker's prefix cache held.
    pub cached_tokens: u32,
    pub itl: Vec<f64>,
    /// The error class the load generator would record (`http_503`, ...).
    pub error: Option<&'static str>,
}

/// What [`Sim::next`] hands back to the driver.
#[derive(Debug)]
pub enum Output {
    Done(Finished),
    /// A timer the driver set with [`Sim::wake_at`].
    Wake(usize),
}

/// Totals over a run, for the report.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct Totals {
    pub events: u64,
    pub local_prefills: u64,
    pub remote_prefills: u64,
    /// Prompt tokens computed by prefill workers and by decode workers.
    pub prefill_tokens_computed: u64,
    pub local_tokens_computed: u64,
    /// Prompt tokens the decode workers' caches held at reservation.
    pub decode_cache_hit_tokens: u64,
    pub kv_bytes_sent: f64,
    pub decode_steps: u64,
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Kind {
    Dispatch(usize),
    Wake(usize),
    PrefillDone(usize),
    KvArrived(usize),
    ChunkDone(usize),
    StepDone(usize),
    /// The next compute on shared cores ends (this generation's event).
    CoresDone(u64),
    Heartbeat,
}

#[derive(Debug, Clone, Copy)]
struct Ev {
    t: f64,
    /// Ties go in scheduling order.
    n: u64,
    kind: Kind,
}

impl PartialEq for Ev {
    fn eq(&self, o: &Self) -> bool {
        self.cmp(o) == Ordering::Equal
    }
}
impl Eq for Ev {}
impl PartialOrd for Ev {
    fn partial_cmp(&self, o: &Self) -> Option<Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for Ev {
    /// Reversed: the heap pops the earliest event.
    fn cmp(&self, o: &Self) -> Ordering {
        o.t.total_cmp(&self.t).then(o.n.cmp(&self.n))
    }
}

/// One sequence in flight.
struct Seq {
    req: Request,
    /// The chained hashes of the prompt's full blocks (none with the cache
    /// off), computed once.
    hashes: Vec<u64>,
    start: f64,
    decode: usize,
    reserve: u64,
    /// Prompt tokens the decode worker's cache held.
    cached: usize,
    /// Prompt tokens whose prefill is done (local prefill).
    prefilled: usize,
    started: bool,
    generated: u32,
    first: Option<f64>,
    last: f64,
    itl: Vec<f64>,
}

impl Seq {
    fn position(&self) -> u64 {
        (self.req.prompt.len() + self.generated as usize) as u64
    }
}

struct PrefillWorker {
    queue: VecDeque<usize>,
    running: Option<Running>,
    queued_tokens: u64,
    cache: Cache,
}

/// A prefill job in progress.
struct Running {
    seq: usize,
    started: f64,
    /// Prompt tokens its KV stream carries.
    sent: usize,
    /// Tokens in its last chunk (the last layer's frame follows the compute).
    last_chunk: usize,
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Phase {
    Idle,
    /// A local prefill chunk of this many tokens for this sequence.
    Chunk(usize, usize),
    Step,
}

struct DecodeWorker {
    used: u64,
    /// Sequences reserved here whose KV is still on its way.
    importing: usize,
    waiting: VecDeque<usize>,
    active: Vec<usize>,
    phase: Phase,
    cache: Cache,
}

/// The simulation: the cluster's state and the event queue.
pub struct Sim {
    cfg: ClusterCfg,
    now: f64,
    counter: u64,
    events: BinaryHeap<Ev>,
    heartbeat_pending: bool,
    seqs: Vec<Option<Seq>>,
    free: Vec<usize>,
    prefill: Vec<PrefillWorker>,
    decode: Vec<DecodeWorker>,
    /// What the router's policies see of each pool.
    placement: [Placement; 2],
    out: VecDeque<Output>,
    totals: Totals,
    cores: Option<SharedCores>,
}

const PREFILL: usize = 0;
const DECODE: usize = 1;

impl Sim {
    pub fn new(cfg: ClusterCfg) -> Self {
        let prefill = (0..cfg.prefill_workers)
            .map(|_| PrefillWorker {
                queue: VecDeque::new(),
                running: None,
                queued_tokens: 0,
                cache: Cache::new(&cfg),
            })
            .collect();
        let decode = (0..cfg.decode_workers)
            .map(|_| DecodeWorker {
                used: 0,
                importing: 0,
                waiting: VecDeque::new(),
                active: Vec::new(),
                phase: Phase::Idle,
                cache: Cache::new(&cfg),
            })
            .collect();
        let block = cfg.kv.kv_block_tokens.max(1);
        let indexed = |kind| kind == PolicyKind::Prefix && cfg.kv.prefix_cache.is_on();
        let placement = [
            Placement::new(
                "prefill",
                cfg.prefill_workers,
                policy::build(cfg.prefill_policy, Pool::Prefill, cfg.tuning),
                indexed(cfg.prefill_policy),
                block,
            ),
            Placement::new(
                "decode",
                cfg.decode_workers,
                policy::build(cfg.decode_policy, Pool::Decode, cfg.tuning),
                indexed(cfg.decode_policy),
                block,
            ),
        ];
        let cores = cfg.cores.map(|n| SharedCores::new(n, cfg.pin_workers));
        let mut sim = Self {
            cores,
            cfg,
            now: 0.0,
            counter: 0,
            events: BinaryHeap::new(),
            heartbeat_pending: false,
            seqs: Vec::new(),
            free: Vec::new(),
            prefill,
            decode,
            placement,
            out: VecDeque::new(),
            totals: Totals::default(),
        };
        for w in 0..sim.decode.len() {
            sim.sync_decode(w);
        }
        sim
    }

    pub fn now(&self) -> f64 {
        self.now
    }

    pub fn totals(&self) -> &Totals {
        &self.totals
    }

    fn schedule(&mut self, t: f64, kind: Kind) {
        self.counter += 1;
        self.events.push(Ev {
            t,
            n: self.counter,
            kind,
        });
    }

    /// Hands `req` to the router at `t` (not before now).
    pub fn submit_at(&mut self, t: f64, req: Request) {
        let t = t.max(self.now);
        let gaps = match self.cfg.keep_itl {
            true => req.max_tokens.saturating_sub(1) as usize,
            false => 0,
        };
        let seq = Seq {
            req,
            hashes: Vec::new(),
            start: t,
            decode: 0,
            reserve: 0,
            cached: 0,
            prefilled: 0,
            started: false,
            generated: 0,
            first: None,
            last: t,
            itl: Vec::with_capacity(gaps),
        };
        let slot = match self.free.pop() {
            Some(i) => {
                self.seqs[i] = Some(seq);
                i
            }
            None => {
                self.seqs.push(Some(seq));
                self.seqs.len() - 1
            }
        };
        self.schedule(t + self.cfg.router_overhead, Kind::Dispatch(slot));
        if !self.heartbeat_pending && self.digests_matter() {
            self.heartbeat_pending = true;
            self.schedule(self.now + self.cfg.heartbeat, Kind::Heartbeat);
        }
    }

    /// Gives [`Output::Wake`]`(token)` back at `t`.
    pub fn wake_at(&mut self, t: f64, token: usize) {
        self.schedule(t.max(self.now), Kind::Wake(token));
    }

    /// Runs events until the driver has something to act on; `None` once
    /// nothing is left to happen.
    pub fn next(&mut self) -> Option<Output> {
        loop {
            if let Some(o) = self.out.pop_front() {
                return Some(o);
            }
            let ev = self.events.pop()?;
            self.now = ev.t;
            self.totals.events += 1;
            self.fire(ev.kind);
        }
    }

    fn fire(&mut self, kind: Kind) {
        match kind {
            Kind::Dispatch(s) => self.dispatch(s),
            Kind::Wake(token) => self.out.push_back(Output::Wake(token)),
            Kind::PrefillDone(p) => self.prefill_done(p),
            Kind::KvArrived(s) => self.kv_arrived(s),
            Kind::ChunkDone(w) => self.chunk_done(w),
            Kind::StepDone(w) => self.step_done(w),
            Kind::CoresDone(generation) => self.cores_done(generation),
            Kind::Heartbeat => self.heartbeat(),
        }
    }

    /// `done` after `secs` of a worker's compute: on cores of its own, or
    /// on the shared ones (`--cores`), as fast as their sharing allows.
    fn compute(&mut self, secs: f64, done: Kind) {
        let now = self.now;
        // Decode workers take the first slots, prefill workers the next.
        let slot = match done {
            Kind::PrefillDone(p) => self.decode.len() + p,
            Kind::ChunkDone(w) | Kind::StepDone(w) => w,
            _ => 0,
        };
        match self.cores.as_mut() {
            None => self.schedule(now + secs, done),
            Some(cores) => {
                cores.start(now, secs, done, slot);
                self.next_on_cores();
            }
        }
    }

    fn next_on_cores(&mut self) {
        let now = self.now;
        if let Some((t, generation)) = self.cores.as_mut().and_then(|c| c.next_completion(now)) {
            self.schedule(t, Kind::CoresDone(generation));
        }
    }

    fn cores_done(&mut self, generation: u64) {
        let now = self.now;
        let done = match self.cores.as_mut() {
            Some(c) if c.is_current(generation) => c.finished(now),
            _ => return,
        };
        for kind in done {
            self.fire(kind);
        }
        self.next_on_cores();
    }

    fn seq(&self, s: usize) -> &Seq {
        self.seqs[s].as_ref().expect("a live sequence")
    }

    fn seq_mut(&mut self, s: usize) -> &mut Seq {
        self.seqs[s].as_mut().expect("a live sequence")
    }

    /// Whether the policies read the digests (otherwise no heartbeats run).
    fn digests_matter(&self) -> bool {
        self.cfg.kv.prefix_cache.is_on()
            && (self.cfg.prefill_policy == PolicyKind::Prefix
                || self.cfg.decode_policy == PolicyKind::Prefix)
    }

    /// Every worker whose cache moved since its last report sends a new digest.
    fn heartbeat(&mut self) {
        self.heartbeat_pending = false;
        let caches = [
            self.prefill
                .iter_mut()
                .map(|w| &mut w.cache)
                .collect::<Vec<_>>(),
            self.decode.iter_mut().map(|w| &mut w.cache).collect(),
        ];
        for (pool, caches) in caches.into_iter().enumerate() {
            for (w, cache) in caches.into_iter().enumerate() {
                if !cache.pending.is_empty() {
                    self.placement[pool].report(w, &cache.pending);
                    cache.pending.clear();
                }
            }
        }
        if !self.events.is_empty() {
            self.heartbeat_pending = true;
            self.schedule(self.now + self.cfg.heartbeat, Kind::Heartbeat);
        }
    }

    fn block_tokens(&self) -> usize {
        self.cfg.kv.kv_block_tokens.max(1)
    }

    /// Every worker's KV in use (tokens), decode pool first: for tests.
    #[cfg(test)]
    pub fn kv_used(&self) -> Vec<u64> {
        self.decode.iter().map(|d| d.used).collect()
    }
}
