//! The discrete-event model of one router over a prefill pool and a decode
//! pool.
//!
//! Time only moves from one event to the next, so a simulated hour of a
//! thousand workers costs what its events cost. The parts are pdserve's
//! own where they can be:
//! - placement is the router's [`Policy`] code, fed the load reports a
//!   worker would send (its prefix digest refreshed once per heartbeat);
//! - the local-versus-remote rule is the router's `--mode` rule on the
//!   *uncached* length;
//! - each worker's prefix cache is the mock worker's ([`PrefixCache`]);
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
//! Links do not contend with one another.

use std::cmp::Ordering;
use std::collections::{BinaryHeap, HashMap, VecDeque};
use std::sync::Arc;

use pdserve_mock_worker::latency::LatencyModel;
use pdserve_mock_worker::prefix::PrefixCache;
use pdserve_protocol::hash::Prehashed;
use pdserve_protocol::internal::{LoadReport, Pool};
use pdserve_protocol::prefix::{block_hash, digest_key, PrefixSet};
use pdserve_router::config::{Mode, PolicyKind};
use pdserve_router::policy::{self, prefix::PrefixTuning, Policy, RequestInfo};
use pdserve_router::registry::WorkerView;
use pdserve_worker::kv::KvArgs;

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
    /// The KV's arrival time once its prefill job runs.
    kv_at: f64,
}

impl Seq {
    fn position(&self) -> u64 {
        (self.req.prompt.len() + self.generated as usize) as u64
    }
}

/// A worker's prefix cache, with the store and evict events its next
/// digest will carry to the router.
struct Cache {
    blocks: PrefixCache,
    pending: Vec<(u64, bool)>,
}

impl Cache {
    fn new(cfg: &ClusterCfg) -> Self {
        Self {
            blocks: PrefixCache::new(&cfg.kv, cfg.kv_cache_tokens, SEED),
            pending: Vec::new(),
        }
    }

    fn insert(&mut self, hashes: &[u64]) {
        let Self { blocks, pending } = self;
        blocks.insert_hashed(hashes, |h, present| pending.push((h, present)));
    }

    fn lookup(&self, seq: &Seq) -> usize {
        self.blocks.lookup_hashed(seq.req.prompt.len(), &seq.hashes)
    }
}

/// What the router sees of one pool, and its policy. Workers a request has
/// already tried are moved to the end of `views` and left out of the next
/// choice, so a retry costs no copy of the pool.
struct Placement {
    views: Vec<WorkerView>,
    worker_at: Vec<usize>,
    pos_of: Vec<usize>,
    policy: Box<dyn Policy>,
    /// Whether the policy reads digests (`prefix`, with the cache on).
    indexed: bool,
    block_tokens: usize,
    /// Digest key → the workers whose last digest lists it: the prefix
    /// policy is told each worker's cached tokens
    /// ([`RequestInfo::known_cached`]) at the cost of the workers holding
    /// the prompt's first block, not of the whole pool.
    index: HashMap<u32, Vec<usize>, Prehashed>,
    /// Leading prompt tokens each view holds, for the request being placed.
    known: Vec<u64>,
}

impl Placement {
    fn new(
        pool: &str,
        n: usize,
        policy: Box<dyn Policy>,
        indexed: bool,
        block_tokens: usize,
    ) -> Self {
        Self {
            views: (0..n).map(|i| view(pool, i)).collect(),
            worker_at: (0..n).collect(),
            pos_of: (0..n).collect(),
            policy,
            indexed,
            block_tokens,
            index: HashMap::default(),
            known: vec![0; n],
        }
    }

    fn view_mut(&mut self, w: usize) -> &mut WorkerView {
        &mut self.views[self.pos_of[w]]
    }

    /// Worker `w`'s digest reaches the router: its view and the index take
    /// the blocks stored and evicted since the last one.
    fn report(&mut self, w: usize, changes: &[(u64, bool)]) {
        let block = self.block_tokens as u32;
        let view = &mut self.views[self.pos_of[w]];
        let set = view
            .prefix
            .get_or_insert_with(|| Arc::new(PrefixSet::from_hashes(block, SEED, [])));
        let set = Arc::make_mut(set);
        for &(h, present) in changes {
            if !set.update(h, present) {
                continue;
            }
            let key = digest_key(h);
            match present {
                true => self.index.entry(key).or_default().push(w),
                false => {
                    let holders = self.index.entry(key).or_default();
                    if let Some(i) = holders.iter().position(|&x| x == w) {
                        holders.swap_remove(i);
                    }
                    if holders.is_empty() {
                        self.index.remove(&key);
                    }
                }
            }
        }
    }

    /// Fills `known` for a prompt of `len` tokens whose full blocks hash to
    /// `hashes`, from the index: what the policy would find in each digest.
    fn prepare(&mut self, len: usize, hashes: &[u64]) {
        if !self.indexed {
            return;
        }
        self.known.iter_mut().for_each(|k| *k = 0);
        let usable = &hashes[..(len.saturating_sub(1) / self.block_tokens).min(hashes.len())];
        let Some(first) = usable.first() else { return };
        for &w in self.index.get(&digest_key(*first)).into_iter().flatten() {
            let pos = self.pos_of[w];
            if let Some(set) = &self.views[pos].prefix {
                self.known[pos] = (set.leading_blocks(usable) * self.block_tokens) as u64;
            }
        }
    }

    /// The policy's choice among all but the last `excluded` views; the
    /// chosen one joins the excluded.
    fn pick(&mut self, base: RequestInfo, excluded: usize) -> Option<usize> {
        let n = self.views.len().checked_sub(excluded).filter(|&n| n > 0)?;
        let info = RequestInfo {
            known_cached: self.indexed.then_some(&self.known[..n]),
            ..base
        };
        let pos = self.policy.select(&self.views[..n], &info)?;
        let w = self.worker_at[pos];
        let last = n - 1;
        self.views.swap(pos, last);
        self.worker_at.swap(pos, last);
        self.known.swap(pos, last);
        self.pos_of[self.worker_at[pos]] = pos;
        self.pos_of[self.worker_at[last]] = last;
        Some(w)
    }
}

struct PrefillWorker {
    queue: VecDeque<usize>,
    running: Option<usize>,
    queued_tokens: u64,
    cache: Cache,
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
}

const PREFILL: usize = 0;
const DECODE: usize = 1;

fn view(pool: &str, i: usize) -> WorkerView {
    WorkerView {
        url: format!("sim://{pool}/{i}"),
        load: LoadReport {
            ready: true,
            ..Default::default()
        },
        assigned_requests: 0,
        assigned_tokens: 0,
        fingerprint: Some(SEED),
        prefix: None,
    }
}

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
        let mut sim = Self {
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
            kv_at: t,
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
            match ev.kind {
                Kind::Dispatch(s) => self.dispatch(s),
                Kind::Wake(token) => self.out.push_back(Output::Wake(token)),
                Kind::PrefillDone(p) => self.prefill_done(p),
                Kind::KvArrived(s) => self.kv_arrived(s),
                Kind::ChunkDone(w) => self.chunk_done(w),
                Kind::StepDone(w) => self.step_done(w),
                Kind::Heartbeat => self.heartbeat(),
            }
        }
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

    /// The router: a decode worker with room for the reservation, then
    /// local prefill there or a prefill worker.
    fn dispatch(&mut self, s: usize) {
        let prompt = std::mem::take(&mut self.seq_mut(s).req.prompt);
        let reserve = (prompt.len() + self.seq(s).req.max_tokens as usize) as u64;
        let budget = self.cfg.kv_cache_tokens as u64;
        if reserve > budget || prompt.is_empty() {
            self.seq_mut(s).req.prompt = prompt;
            return self.fail(s, "http_400");
        }
        let mut hashes = Vec::new();
        if self.cfg.kv.prefix_cache.is_on() {
            extend_hashes(&mut hashes, &prompt, self.block_tokens());
        }
        let placement = &mut self.placement[DECODE];
        placement.prepare(prompt.len(), &hashes);
        let base = RequestInfo {
            prompt_tokens: prompt.len() as u64,
            reserve_tokens: reserve,
            prompt: &prompt,
            known_cached: None,
        };
        let mut chosen = None;
        for k in 0..self.cfg.decode_attempts.max(1) {
            let Some(w) = placement.pick(base, k) else {
                break;
            };
            let d = &self.decode[w];
            if d.used + reserve <= budget && d.waiting.len() < self.cfg.max_queue.max(1) {
                chosen = Some(w);
                break;
            }
        }
        let seq = self.seq_mut(s);
        (seq.req.prompt, seq.hashes) = (prompt, hashes);
        match chosen {
            Some(w) => self.reserve(s, w, reserve),
            None => self.fail(s, "http_503"),
        }
    }

    fn reserve(&mut self, s: usize, w: usize, reserve: u64) {
        let cached = self.decode[w].cache.lookup(self.seq(s));
        self.decode[w].used += reserve;
        self.totals.decode_cache_hit_tokens += cached as u64;
        let prompt_len = {
            let seq = self.seq_mut(s);
            (seq.decode, seq.reserve, seq.cached, seq.prefilled) = (w, reserve, cached, cached);
            seq.req.prompt.len()
        };
        let uncached = prompt_len - cached;
        let local = match self.cfg.mode {
            Mode::Aggregated => true,
            Mode::Auto => uncached < self.cfg.local_prefill_max_tokens || self.prefill.is_empty(),
            Mode::Disaggregated => false,
        };
        if local {
            self.totals.local_prefills += 1;
            self.intake(w, s);
        } else if self.send_to_prefill(s) {
            self.decode[w].importing += 1;
        } else {
            self.release(s);
            self.fail(s, "http_503");
        }
        self.sync_decode(w);
    }

    /// Queues the prompt on a prefill worker; false when none takes it.
    fn send_to_prefill(&mut self, s: usize) -> bool {
        let seq = self.seq_mut(s);
        let (prompt, hashes) = (
            std::mem::take(&mut seq.req.prompt),
            std::mem::take(&mut seq.hashes),
        );
        let placement = &mut self.placement[PREFILL];
        placement.prepare(prompt.len(), &hashes);
        let base = RequestInfo {
            prompt_tokens: prompt.len() as u64,
            reserve_tokens: 0,
            prompt: &prompt,
            known_cached: None,
        };
        let mut chosen = None;
        for k in 0..self.cfg.prefill_attempts.max(1) {
            let Some(p) = placement.pick(base, k) else {
                break;
            };
            if self.prefill[p].queue.len() < self.cfg.max_queue.max(1) {
                chosen = Some(p);
                break;
            }
        }
        let n = prompt.len() as u64;
        let seq = self.seq_mut(s);
        (seq.req.prompt, seq.hashes) = (prompt, hashes);
        let Some(p) = chosen else { return false };
        let worker = &mut self.prefill[p];
        worker.queue.push_back(s);
        worker.queued_tokens += n;
        self.totals.remote_prefills += 1;
        if worker.running.is_none() {
            self.start_prefill(p);
        }
        self.sync_prefill(p);
        true
    }

    fn start_prefill(&mut self, p: usize) {
        let Some(s) = self.prefill[p].queue.pop_front() else {
            return;
        };
        let (n, from) = {
            let seq = self.seq(s);
            (seq.req.prompt.len(), seq.cached)
        };
        let own = self.prefill[p].cache.lookup(self.seq(s));
        let compute = self.cfg.latency.prefill(n - own).as_secs_f64();
        let finish = self.now + compute;
        // Rows from `from` on: cached ones at once, computed ones as they come.
        let sent = n - from;
        let last_chunk = match (n - own) % self.cfg.chunk_tokens.max(1) {
            0 => self.cfg.chunk_tokens.max(1),
            r => r,
        };
        let kv_at = self.cfg.link.arrival((self.now, finish), sent, last_chunk);
        self.totals.prefill_tokens_computed += (n - own) as u64;
        self.totals.kv_bytes_sent += sent as f64 * self.cfg.link.kv_bytes_per_token;
        self.seq_mut(s).kv_at = kv_at;
        self.prefill[p].running = Some(s);
        self.schedule(finish, Kind::PrefillDone(p));
    }

    fn prefill_done(&mut self, p: usize) {
        let Some(s) = self.prefill[p].running.take() else {
            return;
        };
        let seq = self.seqs[s].as_ref().expect("a live sequence");
        self.prefill[p].cache.insert(&seq.hashes);
        let (n, kv_at) = (seq.req.prompt.len() as u64, seq.kv_at);
        self.prefill[p].queued_tokens -= n;
        self.schedule(kv_at, Kind::KvArrived(s));
        self.start_prefill(p);
        self.sync_prefill(p);
    }

    /// The decode worker takes the imported KV with the first token.
    fn kv_arrived(&mut self, s: usize) {
        let w = self.seq(s).decode;
        let n = self.seq(s).req.prompt.len();
        self.seq_mut(s).prefilled = n;
        self.decode[w].importing -= 1;
        self.cache_prompt(w, s);
        if self.emit(s) {
            self.enqueue(w, s);
        }
        self.sync_decode(w);
    }

    /// A sequence's prompt counts as cached on its decode worker from the
    /// moment the worker takes it, as in the mock.
    fn cache_prompt(&mut self, w: usize, s: usize) {
        let seq = self.seqs[s].as_ref().expect("a live sequence");
        self.decode[w].cache.insert(&seq.hashes);
    }

    /// A locally prefilled sequence joins the decode worker's queue.
    fn intake(&mut self, w: usize, s: usize) {
        self.cache_prompt(w, s);
        self.enqueue(w, s);
    }

    fn enqueue(&mut self, w: usize, s: usize) {
        self.decode[w].waiting.push_back(s);
        if self.decode[w].phase == Phase::Idle {
            self.iterate(w);
        }
    }

    /// One token out for `s`; false (and `s` retired) once it is the last.
    fn emit(&mut self, s: usize) -> bool {
        let now = self.now;
        let keep_itl = self.cfg.keep_itl;
        let seq = self.seq_mut(s);
        match seq.first {
            None => seq.first = Some(now),
            Some(_) if keep_itl => seq.itl.push(now - seq.last),
            Some(_) => {}
        }
        seq.last = now;
        seq.started = true;
        seq.generated += 1;
        if seq.generated < seq.req.max_tokens {
            return true;
        }
        let w = seq.decode;
        let d = &mut self.decode[w];
        d.waiting.retain(|&x| x != s);
        self.finish(s);
        false
    }

    /// Starts the decode worker's next iteration: a local prefill chunk while
    /// the batch has room, else admission and a step.
    fn iterate(&mut self, w: usize) {
        let d = &self.decode[w];
        if d.active.len() < self.cfg.max_batch.max(1) {
            let next = d.waiting.iter().copied().find(|&s| !self.seq(s).started);
            if let Some(s) = next {
                let seq = self.seq(s);
                let chunk =
                    (seq.req.prompt.len() - seq.prefilled).min(self.cfg.chunk_tokens.max(1));
                let t = self.cfg.latency.prefill(chunk).as_secs_f64();
                self.decode[w].phase = Phase::Chunk(s, chunk);
                self.totals.local_tokens_computed += chunk as u64;
                return self.schedule(self.now + t, Kind::ChunkDone(w));
            }
        }
        self.admit_and_step(w);
    }

    fn chunk_done(&mut self, w: usize) {
        let Phase::Chunk(s, chunk) = self.decode[w].phase else {
            return;
        };
        let done = {
            let seq = self.seq_mut(s);
            seq.prefilled += chunk;
            seq.prefilled >= seq.req.prompt.len()
        };
        if done {
            self.emit(s);
        }
        self.admit_and_step(w);
        self.sync_decode(w);
    }

    fn admit_and_step(&mut self, w: usize) {
        let max = self.cfg.max_batch.max(1);
        let d = &mut self.decode[w];
        let mut i = 0;
        while d.active.len() < max && i < d.waiting.len() {
            let s = d.waiting[i];
            match self.seqs[s].as_ref().is_some_and(|q| q.started) {
                true => {
                    d.waiting.remove(i);
                    d.active.push(s);
                }
                false => i += 1,
            }
        }
        let d = &self.decode[w];
        if d.active.is_empty() {
            self.decode[w].phase = Phase::Idle;
            return;
        }
        let ctx: u64 = d.active.iter().map(|&s| self.seq(s).position()).sum();
        let t = self.cfg.latency.step(d.active.len(), ctx).as_secs_f64() + self.cfg.step_overhead;
        self.decode[w].phase = Phase::Step;
        self.totals.decode_steps += 1;
        self.schedule(self.now + t, Kind::StepDone(w));
    }

    fn step_done(&mut self, w: usize) {
        let mut batch = std::mem::take(&mut self.decode[w].active);
        batch.retain(|&s| self.emit(s));
        let d = &mut self.decode[w];
        d.active = batch;
        d.phase = Phase::Idle;
        if !(d.active.is_empty() && d.waiting.is_empty()) {
            self.iterate(w);
        }
        self.sync_decode(w);
    }

    /// Gives the sequence's KV reservation back.
    fn release(&mut self, s: usize) {
        let (w, reserve) = {
            let seq = self.seq(s);
            (seq.decode, seq.reserve)
        };
        self.decode[w].used -= reserve;
        self.seq_mut(s).reserve = 0;
    }

    fn finish(&mut self, s: usize) {
        self.release(s);
        let mut seq = self.seqs[s].take().expect("a live sequence");
        self.free.push(s);
        let prompt_tokens = seq.req.prompt.len() as u32;
        if self.cfg.cache_generated && self.cfg.kv.prefix_cache.is_on() {
            // The prompt and its answer, as the next turn will resend them.
            let mut all = std::mem::take(&mut seq.req.prompt);
            all.extend(super::answer(seq.req.id, seq.generated));
            extend_hashes(&mut seq.hashes, &all, self.block_tokens());
            self.decode[seq.decode].cache.insert(&seq.hashes);
        }
        self.out.push_back(Output::Done(Finished {
            id: seq.req.id,
            start: seq.start,
            first: seq.first,
            end: self.now,
            prompt_tokens,
            completion_tokens: seq.generated,
            cached_tokens: seq.cached as u32,
            itl: seq.itl,
            error: None,
        }));
    }

    fn fail(&mut self, s: usize, class: &'static str) {
        let seq = self.seqs[s].take().expect("a live sequence");
        self.free.push(s);
        self.out.push_back(Output::Done(Finished {
            id: seq.req.id,
            start: seq.start,
            first: None,
            end: self.now,
            prompt_tokens: seq.req.prompt.len() as u32,
            completion_tokens: 0,
            cached_tokens: 0,
            itl: Vec::new(),
            error: Some(class),
        }));
    }

    /// The load report the prefill worker would send now.
    fn sync_prefill(&mut self, p: usize) {
        let w = &self.prefill[p];
        let load = &mut self.placement[PREFILL].view_mut(p).load;
        load.queued_requests = w.queue.len() as u64;
        load.queued_tokens = w.queued_tokens;
        load.active_sequences = w.queue.len() as u64 + u64::from(w.running.is_some());
    }

    /// The load report the decode worker would send now.
    fn sync_decode(&mut self, w: usize) {
        let d = &self.decode[w];
        let queued: u64 = d
            .waiting
            .iter()
            .filter_map(|&s| self.seqs[s].as_ref())
            .map(|q| (q.req.prompt.len() - q.prefilled.min(q.req.prompt.len())) as u64)
            .sum();
        let load = &mut self.placement[DECODE].view_mut(w).load;
        load.queued_requests = d.waiting.len() as u64;
        load.queued_tokens = queued;
        load.active_sequences = (d.active.len() + d.waiting.len() + d.importing) as u64;
        load.kv_used_tokens = d.used;
        load.kv_free_tokens = (self.cfg.kv_cache_tokens as u64).saturating_sub(d.used);
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

/// Appends to `hashes` (those of the leading full blocks of `tokens`) the
/// chained hashes of the full blocks after them.
fn extend_hashes(hashes: &mut Vec<u64>, tokens: &[u32], block_tokens: usize) {
    let mut parent = hashes.last().copied().unwrap_or(0);
    let done = hashes.len() * block_tokens;
    for chunk in tokens[done.min(tokens.len())..].chunks_exact(block_tokens) {
        parent = block_hash(parent, chunk, SEED);
        hashes.push(parent);
    }
}
