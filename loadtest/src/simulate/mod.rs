//! `pdserve-loadtest simulate`: the load of `run` offered to a simulated
//! cluster instead of a real one (docs/simulator.md).
//!
//! The workload and the arrival process are `run`'s own, built from the same
//! flags and seed; each prompt word becomes one token id and a chat message
//! adds `--template-tokens` ids, so shared prefixes and resent chat history
//! hit the simulated caches as they would the real ones. The records,
//! summary, JSON and report are `run`'s, with the target labelled
//! `simulated`.

pub mod cluster;
#[cfg(test)]
mod tests;

use std::time::Instant;

use anyhow::{bail, Context};
use pdserve_mock_worker::config::LatencyArgs;
use pdserve_protocol::kvwire::KvDtype;
use pdserve_router::config::{Mode, PolicyKind, Spill};
use pdserve_router::policy::prefix::PrefixTuning;
use pdserve_worker::decode::DecodeArgs;
use pdserve_worker::kv::{budget_tokens, Switch};
use serde::Serialize;

use crate::run::runner::Load;
use crate::run::stats::{self, Record, Slo};
use crate::run::workload::{self, Item};
use crate::run::{arrivals, report, Point, RunArgs, RunReport, TargetResult};
use cluster::{ClusterCfg, Finished, Link, Output, Request, Sim, Totals};

/// K and V elements per token over all layers in SmolLM2-135M (30 layers ×
/// 3 KV heads × 64 dims × 2), the default model.
const SMOLLM2_KV_ELEMENTS_PER_TOKEN: usize = 11_520;
const SMOLLM2_LAYERS: u32 = 30;

/// Above this many generated tokens in a point, inter-token gaps are not
/// kept (each costs 8 bytes); ITL percentiles are then left empty.
const MAX_KEPT_GAPS: usize = 20_000_000;

/// Options of `pdserve-loadtest simulate`: `run`'s (the load) and the
/// cluster's. `--url`, `--compare`, `--api-key` and the monitoring flags do
/// not apply.
#[derive(clap::Args, Debug, Clone)]
pub struct SimArgs {
    #[command(flatten)]
    pub run: RunArgs,
    #[command(flatten)]
    pub cluster: ClusterArgs,
}

/// The simulated cluster. Worker flags are the workers' own (with their
/// variables); router flags are the router's, with `PDSERVE_SIM_*`
/// variables so a router's environment does not leak in.
#[derive(clap::Args, Debug, Clone)]
pub struct ClusterArgs {
    /// Prefill workers (0: every prompt is prefilled on its decode worker).
    #[arg(long, env = "PDSERVE_SIM_PREFILL_WORKERS", default_value_t = 1)]
    pub prefill_workers: usize,
    /// Decode workers.
    #[arg(long, env = "PDSERVE_SIM_DECODE_WORKERS", default_value_t = 1)]
    pub decode_workers: usize,
    /// The router's `--mode`.
    #[arg(long, env = "PDSERVE_SIM_MODE", value_enum, default_value_t = Mode::Auto)]
    pub mode: Mode,
    /// The router's `--local-prefill-max-tokens` (auto mode, on the uncached length).
    #[arg(
        long,
        env = "PDSERVE_SIM_LOCAL_PREFILL_MAX_TOKENS",
        default_value_t = 32
    )]
    pub local_prefill_max_tokens: usize,
    /// As the router's `--local-prefill-spill-tokens`: in `auto` mode,
    /// longer prompts go to their decode worker's own prefill while the
    /// least-loaded prefill worker has more than this many prompt tokens
    /// queued and the decode worker fewer; `off` never.
    #[arg(
        long,
        env = "PDSERVE_SIM_LOCAL_PREFILL_SPILL_TOKENS",
        default_value_t = Spill::Above(512)
    )]
    pub local_prefill_spill_tokens: Spill,
    #[arg(long, env = "PDSERVE_SIM_PREFILL_POLICY", value_enum, default_value_t = PolicyKind::Prefix)]
    pub prefill_policy: PolicyKind,
    #[arg(long, env = "PDSERVE_SIM_DECODE_POLICY", value_enum, default_value_t = PolicyKind::Prefix)]
    pub decode_policy: PolicyKind,
    /// The router's `--prefix-weight`.
    #[arg(long, env = "PDSERVE_SIM_PREFIX_WEIGHT", default_value_t = 1.0)]
    pub prefix_weight: f64,
    /// The router's `--prefix-balance-abs-tokens`.
    #[arg(
        long,
        env = "PDSERVE_SIM_PREFIX_BALANCE_ABS_TOKENS",
        default_value_t = 8192
    )]
    pub prefix_balance_abs_tokens: u64,
    /// The router's `--prefix-balance-rel`.
    #[arg(long, env = "PDSERVE_SIM_PREFIX_BALANCE_REL", default_value_t = 2.0)]
    pub prefix_balance_rel: f64,
    /// The router's `--decode-attempts`.
    #[arg(long, env = "PDSERVE_SIM_DECODE_ATTEMPTS", default_value_t = 3)]
    pub decode_attempts: usize,
    /// The router's `--prefill-retries`.
    #[arg(long, env = "PDSERVE_SIM_PREFILL_RETRIES", default_value_t = 2)]
    pub prefill_retries: usize,
    /// Milliseconds the router adds before a request reaches a worker.
    #[arg(long, env = "PDSERVE_SIM_ROUTER_OVERHEAD_MS", default_value_t = 2.4)]
    pub router_overhead_ms: f64,
    /// Milliseconds each decode step takes beyond the latency model: the
    /// worker's own loop and timer rounding (the mock worker's steps run
    /// about 2 ms over its model, docs/simulator.md).
    #[arg(long, env = "PDSERVE_SIM_STEP_OVERHEAD_MS", default_value_t = 0.0)]
    pub step_overhead_ms: f64,
    /// Cores all the workers share, as local workers on one machine do: a
    /// worker's compute slows to `cores / busy` of its speed while more
    /// workers than cores compute at once (default: each worker has cores
    /// of its own; the latency model is one worker's alone).
    #[arg(long, env = "PDSERVE_SIM_CORES")]
    pub cores: Option<f64>,
    /// With `--cores`: worker `k` (decode workers first, then prefill
    /// workers) is pinned to core `k mod cores` and shares only that one, as
    /// `sim_validate.sh` starts real workers.
    #[arg(long, env = "PDSERVE_SIM_PIN_WORKERS", requires = "cores")]
    pub pin_workers: bool,
    /// Milliseconds between a worker's prefix digests (the router's health poll).
    #[arg(long, env = "PDSERVE_SIM_HEARTBEAT_MS", default_value_t = 1000.0)]
    pub heartbeat_ms: f64,
    /// Bandwidth of each prefill-to-decode link in Gbit/s (default: never the bottleneck).
    #[arg(long, env = "PDSERVE_SIM_LINK_GBPS")]
    pub link_gbps: Option<f64>,
    /// One-way latency of a link in milliseconds.
    #[arg(long, env = "PDSERVE_SIM_LINK_LATENCY_MS", default_value_t = 0.0)]
    pub link_latency_ms: f64,
    /// KV bytes per token on the wire and in the budget (default:
    /// SmolLM2-135M's, 11,520 elements of `--kv-cache-dtype`).
    #[arg(long, env = "PDSERVE_SIM_KV_BYTES_PER_TOKEN")]
    pub kv_bytes_per_token: Option<usize>,
    /// Model layers (KV streams layer by layer).
    #[arg(long, env = "PDSERVE_SIM_LAYERS", default_value_t = SMOLLM2_LAYERS)]
    pub layers: u32,
    /// Chat endpoint: token ids each message's template adds (role header
    /// and separators; 5 in SmolLM2's ChatML).
    #[arg(long, env = "PDSERVE_SIM_TEMPLATE_TOKENS", default_value_t = 5)]
    pub template_tokens: usize,
    /// Whether generated tokens enter the decode worker's prefix cache (the
    /// real engine's behaviour; `off` is the mock worker's).
    #[arg(
        long,
        env = "PDSERVE_SIM_CACHE_GENERATED",
        value_enum,
        default_value = "on"
    )]
    pub cache_generated: Switch,
    /// The decode workers' scheduler and KV flags; a prefill worker uses
    /// `--prefill-chunk-tokens`, `--max-queue` and the cache flags.
    #[command(flatten)]
    pub decode: DecodeArgs,
    /// The latency model (the mock worker's flags, `--fit-from` included).
    #[command(flatten)]
    pub latency: LatencyArgs,
}

impl ClusterArgs {
    pub fn config(&self) -> anyhow::Result<ClusterCfg> {
        if self.decode_workers == 0 {
            bail!("--decode-workers must be at least 1");
        }
        if self.mode == Mode::Disaggregated && self.prefill_workers == 0 {
            bail!("--mode disaggregated needs --prefill-workers of at least 1");
        }
        let positive = [
            self.router_overhead_ms,
            self.link_latency_ms,
            self.step_overhead_ms,
        ];
        if positive.iter().any(|v| !v.is_finite() || *v < 0.0) {
            bail!("--router-overhead-ms, --link-latency-ms and --step-overhead-ms must be finite and not negative");
        }
        if !(self.heartbeat_ms.is_finite() && self.heartbeat_ms > 0.0) {
            bail!("--heartbeat-ms must be positive");
        }
        if self.link_gbps.is_some_and(|g| !(g.is_finite() && g > 0.0)) {
            bail!("--link-gbps must be positive");
        }
        if self.cores.is_some_and(|c| !(c.is_finite() && c > 0.0)) {
            bail!("--cores must be positive");
        }
        let latency = self.latency.model().context("the latency model")?;
        let dtype: KvDtype = self.decode.kv.kv_cache_dtype;
        let per_token = self
            .kv_bytes_per_token
            .unwrap_or(SMOLLM2_KV_ELEMENTS_PER_TOKEN * dtype.size() as usize);
        let kv_cache_tokens = budget_tokens(
            self.decode.kv_cache_tokens,
            self.decode.kv_cache_bytes,
            per_token,
        );
        Ok(ClusterCfg {
            prefill_workers: self.prefill_workers,
            decode_workers: self.decode_workers,
            latency,
            max_batch: self.decode.max_batch,
            kv_cache_tokens,
            chunk_tokens: self.decode.prefill_chunk_tokens,
            max_queue: self.decode.max_queue,
            kv: self.decode.kv.clone(),
            mode: self.mode,
            local_prefill_max_tokens: self.local_prefill_max_tokens,
            local_prefill_spill: self.local_prefill_spill_tokens,
            prefill_policy: self.prefill_policy,
            decode_policy: self.decode_policy,
            tuning: PrefixTuning {
                weight: self.prefix_weight,
                balance_abs_tokens: self.prefix_balance_abs_tokens,
                balance_rel: self.prefix_balance_rel,
            },
            decode_attempts: self.decode_attempts,
            prefill_attempts: self.prefill_retries + 1,
            link: Link {
                bytes_per_second: self.link_gbps.map(|g| g * 1e9 / 8.0),
                latency: self.link_latency_ms / 1e3,
                kv_bytes_per_token: per_token as f64,
                layers: self.layers,
            },
            router_overhead: self.router_overhead_ms / 1e3,
            step_overhead: self.step_overhead_ms / 1e3,
            heartbeat: self.heartbeat_ms / 1e3,
            cache_generated: self.cache_generated.is_on(),
            keep_itl: true,
            cores: self.cores,
            pin_workers: self.pin_workers,
        })
    }
}

/// The token ids a simulated request of id `id` generates (`n` of them):
/// the same every time, so a later turn resends exactly what was cached.
pub fn answer(id: usize, n: u32) -> impl Iterator<Item = u32> {
    (0..n).map(move |i| 60_000 + (mix((id as u64) << 20 | u64::from(i)) % 40_000) as u32)
}

/// splitmix64's finaliser.
fn mix(mut x: u64) -> u64 {
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// One word's token id (FNV-1a): the same word, the same id.
fn word_token(word: &str) -> u32 {
    let h = word.bytes().fold(0x811c_9dc5u32, |h, b| {
        (h ^ u32::from(b)).wrapping_mul(0x0100_0193)
    });
    1_000 + h % 50_000
}

/// The ids a chat template adds for a message of `role`.
fn header(role: u32, n: usize) -> impl Iterator<Item = u32> {
    (0..n as u32).map(move |i| 100 + role * 16 + i)
}

const SYSTEM: u32 = 0;
const USER: u32 = 1;
const ASSISTANT: u32 = 2;

/// A workload item as token ids: the opening (system message), each turn's
/// user message and the header that asks for the answer.
#[derive(Debug, Clone)]
struct Conversation {
    opening: Vec<u32>,
    turns: Vec<Vec<u32>>,
    ask: Vec<u32>,
    max_tokens: u32,
}

fn tokens(text: &str) -> impl Iterator<Item = u32> + '_ {
    text.split_whitespace().map(word_token)
}

fn conversation(item: &Item, template: usize) -> Conversation {
    let message = |role, text: &str| header(role, template).chain(tokens(text)).collect();
    let turns: Vec<Vec<u32>> = match item.turns.is_empty() {
        true => vec![message(USER, &item.prompt)],
        false => item.turns.iter().map(|t| message(USER, t)).collect(),
    };
    Conversation {
        opening: item
            .system
            .as_deref()
            .map(|s| message(SYSTEM, s))
            .unwrap_or_default(),
        turns,
        ask: header(ASSISTANT, template).collect(),
        max_tokens: item.max_tokens,
    }
}

/// A request of a conversation in flight.
struct Turn {
    item: usize,
    turn: usize,
    /// Everything sent so far (the prompt of this turn).
    history: Vec<u32>,
}

/// Offers one point's load to a [`Sim`] and collects `run`'s records.
struct Driver<'a> {
    sim: Sim,
    convs: &'a [Conversation],
    arrivals: Vec<f64>,
    load: Load,
    /// No new conversation starts at or after this (`--duration`).
    end: f64,
    warmup: f64,
    timeout: f64,
    max_in_flight: usize,
    next_item: usize,
    in_flight: usize,
    turns: Vec<Option<Turn>>,
    records: Vec<Record>,
}

impl<'a> Driver<'a> {
    fn start(&mut self, item: usize) {
        self.in_flight += 1;
        let history = self.convs[item].opening.clone();
        self.send(item, 0, history);
    }

    fn send(&mut self, item: usize, turn: usize, mut history: Vec<u32>) {
        let c = &self.convs[item];
        history.extend_from_slice(&c.turns[turn]);
        history.extend_from_slice(&c.ask);
        let id = self.turns.len();
        let req = Request {
            id,
            prompt: history.clone(),
            max_tokens: c.max_tokens,
        };
        self.turns.push(Some(Turn {
            item,
            turn,
            history,
        }));
        self.sim.submit_at(self.sim.now(), req);
    }

    /// The next conversation of a closed-loop client, if there is one.
    fn next_closed(&mut self) {
        if self.next_item < self.convs.len() && self.sim.now() < self.end {
            self.next_item += 1;
            self.start(self.next_item - 1);
        }
    }

    fn arrive(&mut self, i: usize) {
        let at = self.arrivals[i];
        if at >= self.end {
            return;
        }
        match self.in_flight >= self.max_in_flight.max(1) {
            true => self.records.push(Record {
                item: i,
                start: at,
                error: Some("client_overload".into()),
                warmup: at < self.warmup,
                ..Default::default()
            }),
            false => self.start(i),
        }
        if i + 1 < self.arrivals.len().min(self.convs.len()) {
            self.sim.wake_at(self.arrivals[i + 1], i + 1);
        }
    }

    fn record(&mut self, f: Finished, turn: &Turn) -> bool {
        let e2e = f.end - f.start;
        let timed_out = e2e > self.timeout;
        let error = match (f.error, timed_out) {
            (Some(e), _) => Some(e.to_string()),
            (None, true) => Some("timeout".to_string()),
            (None, false) => None,
        };
        let ok = error.is_none();
        self.records.push(Record {
            target: 0,
            item: turn.item,
            slice: 0,
            start: f.start,
            ttft: f.first.map(|t| t - f.start).filter(|_| ok),
            itl: f.itl,
            e2e: e2e.min(self.timeout),
            prompt_tokens: f.prompt_tokens,
            completion_tokens: if ok { f.completion_tokens } else { 0 },
            error,
            warmup: f.start < self.warmup,
            id: None,
        });
        ok
    }

    fn done(&mut self, f: Finished) {
        let Some(turn) = self.turns.get_mut(f.id).and_then(Option::take) else {
            return;
        };
        let id = f.id;
        let generated = f.completion_tokens;
        let ok = self.record(f, &turn);
        let c = &self.convs[turn.item];
        if ok && turn.turn + 1 < c.turns.len() {
            let mut history = turn.history;
            history.extend(answer(id, generated));
            return self.send(turn.item, turn.turn + 1, history);
        }
        self.in_flight -= 1;
        if matches!(self.load, Load::Closed { .. }) {
            self.next_closed();
        }
    }

    fn run(mut self) -> (Vec<Record>, Totals, f64) {
        match self.load {
            Load::Closed { concurrency } => {
                for _ in 0..concurrency.max(1) {
                    self.next_closed();
                }
            }
            Load::Open { .. } => {
                if !self.arrivals.is_empty() && !self.convs.is_empty() {
                    self.sim.wake_at(self.arrivals[0], 0);
                }
            }
        }
        while let Some(out) = self.sim.next() {
            match out {
                Output::Done(f) => self.done(f),
                Output::Wake(i) => self.arrive(i),
            }
        }
        self.records.sort_by(|a, b| a.start.total_cmp(&b.start));
        (self.records, self.sim.totals().clone(), self.sim.now())
    }
}

/// What one point's simulation cost and counted, for the report.
#[derive(Debug, Clone, Serialize)]
pub struct PointStats {
    pub simulated_seconds: f64,
    pub wall_seconds: f64,
    pub totals: Totals,
}

/// Simulates one point; the records as `run` would have measured them.
pub(crate) fn simulate_point(
    args: &SimArgs,
    cfg: &ClusterCfg,
    load: Load,
) -> anyhow::Result<(Vec<Record>, PointStats)> {
    let wall = Instant::now();
    let n = args.run.items_needed(load);
    let chat = args.run.endpoint == crate::run::client::Endpoint::Chat;
    let template = if chat {
        args.cluster.template_tokens
    } else {
        0
    };
    let convs: Vec<Conversation> = workload::build(&args.run.workload, n)?
        .iter()
        .map(|item| conversation(item, template))
        .collect();
    let arrivals = match load {
        Load::Open { rate } => {
            arrivals::schedule(rate, args.run.burstiness, args.run.workload.seed, n)?
        }
        Load::Closed { .. } => Vec::new(),
    };
    let requests: usize = convs.iter().map(|c| c.turns.len()).sum();
    let mut cfg = cfg.clone();
    let gaps: usize = convs
        .iter()
        .map(|c| c.turns.len() * c.max_tokens as usize)
        .sum();
    cfg.keep_itl = gaps <= MAX_KEPT_GAPS;
    if !cfg.keep_itl {
        eprintln!(
            "simulate: {gaps} generated tokens; inter-token gaps are not kept (ITL left empty)"
        );
    }
    let driver = Driver {
        sim: Sim::new(cfg),
        convs: &convs,
        arrivals,
        load,
        end: args.run.duration.unwrap_or(f64::INFINITY),
        warmup: args.run.warmup,
        timeout: args.run.timeout,
        max_in_flight: args.run.max_in_flight,
        next_item: 0,
        in_flight: 0,
        turns: Vec::with_capacity(requests),
        records: Vec::with_capacity(requests),
    };
    let (records, totals, simulated_seconds) = driver.run();
    let stats = PointStats {
        simulated_seconds,
        wall_seconds: wall.elapsed().as_secs_f64(),
        totals,
    };
    Ok((records, stats))
}

/// Runs every point and writes `run`'s outputs.
pub fn run(args: SimArgs) -> anyhow::Result<RunReport> {
    args.run.check()?;
    if !args.run.compare.is_empty() {
        bail!("simulate runs one cluster: --compare does not apply");
    }
    let cfg = args.cluster.config()?;
    let slo = Slo {
        ttft: args.run.slo_ttft.map(|ms| ms / 1e3),
        tpot: args.run.slo_tpot.map(|ms| ms / 1e3),
    };
    let started_unix = crate::run::unix_now();
    let mut points = Vec::new();
    let mut sims = Vec::new();
    for (load, kind, value) in args.run.points() {
        let (records, stats) = simulate_point(&args, &cfg, load)?;
        let requested = match load {
            Load::Open { rate } => Some(rate),
            Load::Closed { .. } => None,
        };
        let point = Point {
            kind,
            value,
            targets: vec![TargetResult {
                label: "simulated".into(),
                url: "sim://".into(),
                summary: stats::summarize(&records, &slo, requested),
                records,
            }],
        };
        report::print_point(&point);
        let t = &stats.totals;
        println!(
            "simulated {:.1} s in {:.2} s of wall time: {} events ({:.2} M/s); prefills {} remote, {} local; {} decode steps",
            stats.simulated_seconds,
            stats.wall_seconds,
            t.events,
            t.events as f64 / stats.wall_seconds.max(1e-9) / 1e6,
            t.remote_prefills,
            t.local_prefills,
            t.decode_steps,
        );
        points.push(point);
        sims.push(stats);
    }
    let report = RunReport {
        args: args.run.clone(),
        model: args.run.model.clone().unwrap_or_else(|| "simulated".into()),
        started_unix,
        points,
        scrape: Vec::new(),
        trends: stats::trends(&[], 0.0, 0.0),
        leak_check: None,
        simulation: Some(serde_json::to_value(&sims)?),
    };
    crate::run::write_outputs(&args.run, &report)?;
    Ok(report)
}
