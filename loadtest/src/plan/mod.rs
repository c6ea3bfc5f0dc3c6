//! `pdserve-loadtest plan`: the cheapest cluster that meets the SLOs for a
//! load, found by simulating candidates (docs/planner.md).
//!
//! The load is `run`'s (rate or concurrency, workload, ISL/OSL, seed) and
//! the cluster is `simulate`'s; the planner varies the pool sizes and,
//! where asked, the chunk size, the batch cap and the local-prefill
//! threshold. For each choice of those knobs and each prefill pool size it
//! bisects the decode pool for the smallest one that meets the SLOs
//! (attainment grows with decode workers), so a space of P prefill sizes
//! costs about P · log2(D) simulations per knob choice, not P · D.

mod show;
#[cfg(test)]
mod tests;

use std::path::PathBuf;
use std::sync::Mutex;

use anyhow::{bail, Context};
use pdserve_router::config::Mode;
use serde::Serialize;

use crate::run::stats::{self, Slo};
use crate::simulate::cluster::ClusterCfg;
use crate::simulate::{simulate_point, SimArgs};

/// Options of `pdserve-loadtest plan`: `simulate`'s (the load and the
/// cluster; its pool sizes are the search's), the SLO target, the costs and
/// the space to search.
#[derive(clap::Args, Debug, Clone)]
pub struct PlanArgs {
    #[command(flatten)]
    pub sim: SimArgs,
    #[command(flatten)]
    pub space: Space,
}

/// What the planner may choose and what it pays.
#[derive(clap::Args, Debug, Clone, Serialize)]
pub struct Space {
    /// Share of measured requests that must meet every given SLO (TTFT and
    /// TPOT; a failed request meets none). 0.99 reads as "p99 within the SLOs".
    #[arg(long, env = "PDSERVE_PLAN_ATTAINMENT", default_value_t = 0.99)]
    pub attainment: f64,
    /// Fewest prefill workers to consider (0: prefill on the decode workers).
    #[arg(long, env = "PDSERVE_PLAN_MIN_PREFILL_WORKERS", default_value_t = 0)]
    pub min_prefill_workers: usize,
    /// Most prefill workers to consider.
    #[arg(long, env = "PDSERVE_PLAN_MAX_PREFILL_WORKERS", default_value_t = 8)]
    pub max_prefill_workers: usize,
    /// Fewest decode workers to consider.
    #[arg(long, env = "PDSERVE_PLAN_MIN_DECODE_WORKERS", default_value_t = 1)]
    pub min_decode_workers: usize,
    /// Most decode workers to consider.
    #[arg(long, env = "PDSERVE_PLAN_MAX_DECODE_WORKERS", default_value_t = 8)]
    pub max_decode_workers: usize,
    /// Most workers of both pools together (the cores of a machine that runs
    /// one single-threaded worker per core): larger clusters are not tried.
    #[arg(long, env = "PDSERVE_PLAN_MAX_WORKERS")]
    pub max_workers: Option<usize>,
    /// What one prefill worker costs (cores, dollars an hour: any unit, the same as --decode-cost).
    #[arg(long, env = "PDSERVE_PLAN_PREFILL_COST", default_value_t = 1.0)]
    pub prefill_cost: f64,
    /// What one decode worker costs.
    #[arg(long, env = "PDSERVE_PLAN_DECODE_COST", default_value_t = 1.0)]
    pub decode_cost: f64,
    /// `--prefill-chunk-tokens` values to try, comma-separated (default: the cluster's one).
    #[arg(long, env = "PDSERVE_PLAN_CHUNK_TOKENS", value_delimiter = ',')]
    pub search_chunk_tokens: Vec<usize>,
    /// `--max-batch` values to try, comma-separated (default: the cluster's one).
    #[arg(long, env = "PDSERVE_PLAN_MAX_BATCH", value_delimiter = ',')]
    pub search_max_batch: Vec<usize>,
    /// `--local-prefill-max-tokens` values to try, comma-separated (default: the cluster's one).
    #[arg(
        long,
        env = "PDSERVE_PLAN_LOCAL_PREFILL_MAX_TOKENS",
        value_delimiter = ','
    )]
    pub search_local_prefill_max_tokens: Vec<usize>,
    /// Multiplies the latency model's prefill terms: the live correction of
    /// a model measured elsewhere (measured prefill time over predicted).
    #[arg(long, env = "PDSERVE_PLAN_PREFILL_CORRECTION", default_value_t = 1.0)]
    pub prefill_correction: f64,
    /// Multiplies the latency model's decode-step terms (measured step time over predicted).
    #[arg(long, env = "PDSERVE_PLAN_DECODE_CORRECTION", default_value_t = 1.0)]
    pub decode_correction: f64,
    /// Simulations run at once (default: the machine's cores).
    #[arg(long, env = "PDSERVE_PLAN_THREADS")]
    pub threads: Option<usize>,
}

impl Space {
    fn check(&self, mode: Mode) -> anyhow::Result<()> {
        if !(self.attainment > 0.0 && self.attainment <= 1.0) {
            bail!("--attainment must be in (0, 1]");
        }
        if self.min_prefill_workers > self.max_prefill_workers {
            bail!("--min-prefill-workers is above --max-prefill-workers");
        }
        if self.min_decode_workers == 0 || self.min_decode_workers > self.max_decode_workers {
            bail!("--min-decode-workers must be at least 1 and at most --max-decode-workers");
        }
        if self
            .max_workers
            .is_some_and(|m| m < self.min_decode_workers + self.min_prefill_workers)
        {
            bail!("--max-workers is below the smallest cluster of the space");
        }
        if mode == Mode::Disaggregated && self.max_prefill_workers == 0 {
            bail!("--mode disaggregated needs --max-prefill-workers of at least 1");
        }
        let costs = [self.prefill_cost, self.decode_cost];
        if costs.iter().any(|c| !(c.is_finite() && *c >= 0.0)) {
            bail!("--prefill-cost and --decode-cost must be finite and not negative");
        }
        let corrections = [self.prefill_correction, self.decode_correction];
        if corrections.iter().any(|c| !(c.is_finite() && *c > 0.0)) {
            bail!("--prefill-correction and --decode-correction must be positive");
        }
        let knobs = [&self.search_chunk_tokens, &self.search_max_batch];
        if knobs.iter().any(|k| k.contains(&0)) {
            bail!("--search-chunk-tokens and --search-max-batch values must be at least 1");
        }
        Ok(())
    }

    fn cost(&self, prefill: usize, decode: usize) -> f64 {
        prefill as f64 * self.prefill_cost + decode as f64 * self.decode_cost
    }
}

/// The knobs besides the pool sizes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Knobs {
    pub chunk_tokens: usize,
    pub max_batch: usize,
    pub local_prefill_max_tokens: usize,
}

/// One simulated candidate.
#[derive(Debug, Clone, Serialize)]
pub struct Candidate {
    pub prefill_workers: usize,
    pub decode_workers: usize,
    #[serde(flatten)]
    pub knobs: Knobs,
    pub cost: f64,
    pub meets: bool,
    /// On the cost/attainment Pareto front of what was simulated.
    pub pareto: bool,
    pub slo_attainment: f64,
    pub goodput: f64,
    pub requests: usize,
    pub errors: usize,
    /// Seconds.
    pub ttft_p50: f64,
    pub ttft_p99: f64,
    pub tpot_p50: f64,
    pub tpot_p99: f64,
}

/// What `plan` found: every candidate simulated (by cost) and the choice.
#[derive(Debug, Clone, Serialize)]
pub struct Plan {
    pub load: String,
    pub slo_ttft_ms: Option<f64>,
    pub slo_tpot_ms: Option<f64>,
    pub space: Space,
    pub candidates: Vec<Candidate>,
    /// Index into `candidates` of the cheapest that meets the SLOs.
    pub chosen: Option<usize>,
    pub wall_seconds: f64,
}

impl Plan {
    pub fn chosen(&self) -> Option<&Candidate> {
        self.chosen.map(|i| &self.candidates[i])
    }
}

/// Simulates candidates; shared by the search's threads.
struct Evaluator<'a> {
    args: &'a SimArgs,
    base: ClusterCfg,
    slo: Slo,
    space: &'a Space,
    load: crate::run::runner::Load,
    requested: Option<f64>,
    done: Mutex<Vec<Candidate>>,
}

impl Evaluator<'_> {
    fn evaluate(&self, knobs: Knobs, prefill: usize, decode: usize) -> anyhow::Result<bool> {
        let mut cfg = self.base.clone();
        cfg.prefill_workers = prefill;
        cfg.decode_workers = decode;
        cfg.chunk_tokens = knobs.chunk_tokens;
        cfg.max_batch = knobs.max_batch;
        cfg.local_prefill_max_tokens = knobs.local_prefill_max_tokens;
        cfg.keep_itl = false;
        let (records, _) = simulate_point(self.args, &cfg, self.load)?;
        let s = stats::summarize(&records, &self.slo, self.requested);
        let meets = s.requests > 0 && s.slo_attainment >= self.space.attainment;
        self.done
            .lock()
            .expect("no panics under the lock")
            .push(Candidate {
                prefill_workers: prefill,
                decode_workers: decode,
                knobs,
                cost: self.space.cost(prefill, decode),
                meets,
                pareto: false,
                slo_attainment: s.slo_attainment,
                goodput: s.goodput,
                requests: s.requests,
                errors: s.errors.values().sum(),
                ttft_p50: s.ttft.p50,
                ttft_p99: s.ttft.p99,
                tpot_p50: s.tpot.p50,
                tpot_p99: s.tpot.p99,
            });
        Ok(meets)
    }

    /// Bisects the decode pool for `prefill` prefill workers: the smallest
    /// that meets the SLOs, if the largest does.
    fn smallest_decode(&self, knobs: Knobs, prefill: usize) -> anyhow::Result<()> {
        let (mut lo, mut hi) = (self.space.min_decode_workers, self.space.max_decode_workers);
        if let Some(max) = self.space.max_workers {
            hi = hi.min(max.saturating_sub(prefill));
        }
        if hi < lo || !self.evaluate(knobs, prefill, hi)? {
            return Ok(());
        }
        // Invariant: `hi` meets; everything below `lo` does not.
        while lo < hi {
            let mid = lo + (hi - lo) / 2;
            match self.evaluate(knobs, prefill, mid)? {
                true => hi = mid,
                false => lo = mid + 1,
            }
        }
        Ok(())
    }
}

fn or_one(values: &[usize], default: usize) -> Vec<usize> {
    match values.is_empty() {
        true => vec![default],
        false => values.to_vec(),
    }
}

/// Every knob choice the space holds.
fn knob_choices(space: &Space, cfg: &ClusterCfg) -> Vec<Knobs> {
    let mut out = Vec::new();
    for &chunk_tokens in &or_one(&space.search_chunk_tokens, cfg.chunk_tokens) {
        for &max_batch in &or_one(&space.search_max_batch, cfg.max_batch) {
            for &local in &or_one(
                &space.search_local_prefill_max_tokens,
                cfg.local_prefill_max_tokens,
            ) {
                out.push(Knobs {
                    chunk_tokens,
                    max_batch,
                    local_prefill_max_tokens: local,
                });
            }
        }
    }
    out
}

/// Marks the candidates no cheaper-or-equal one beats on attainment.
fn mark_pareto(candidates: &mut [Candidate]) {
    candidates.sort_by(|a, b| {
        a.cost
            .total_cmp(&b.cost)
            .then(b.slo_attainment.total_cmp(&a.slo_attainment))
            .then(a.ttft_p99.total_cmp(&b.ttft_p99))
            .then(a.prefill_workers.cmp(&b.prefill_workers))
    });
    let mut best = f64::NEG_INFINITY;
    for c in candidates.iter_mut() {
        c.pareto = c.slo_attainment > best;
        best = best.max(c.slo_attainment);
    }
}

/// Searches the space; the plan with every candidate it simulated.
pub fn search(args: &PlanArgs) -> anyhow::Result<Plan> {
    let wall = std::time::Instant::now();
    let sim = &args.sim;
    sim.run.check()?;
    if !sim.run.compare.is_empty() || !sim.run.sweep.is_empty() {
        bail!("plan sizes a cluster for one load: --compare and --sweep do not apply");
    }
    if sim.run.slo_ttft.is_none() && sim.run.slo_tpot.is_none() {
        bail!("give the SLOs to plan for: --slo-ttft and/or --slo-tpot (ms)");
    }
    let space = &args.space;
    space.check(sim.cluster.mode)?;
    let mut base = sim.cluster.config()?;
    base.latency.prefill_per_token *= space.prefill_correction;
    base.latency.prefill_fixed *= space.prefill_correction;
    base.latency.step_fixed *= space.decode_correction;
    base.latency.step_per_seq *= space.decode_correction;
    base.latency.step_per_context_token *= space.decode_correction;
    let (load, kind, value) = sim.run.points()[0];
    let eval = Evaluator {
        args: sim,
        base: base.clone(),
        slo: Slo {
            ttft: sim.run.slo_ttft.map(|ms| ms / 1e3),
            tpot: sim.run.slo_tpot.map(|ms| ms / 1e3),
        },
        space,
        load,
        requested: matches!(load, crate::run::runner::Load::Open { .. }).then_some(value),
        done: Mutex::new(Vec::new()),
    };
    let min_prefill = match sim.cluster.mode {
        Mode::Disaggregated => space.min_prefill_workers.max(1),
        _ => space.min_prefill_workers,
    };
    let tasks: Vec<(Knobs, usize)> = knob_choices(space, &base)
        .into_iter()
        .flat_map(|k| (min_prefill..=space.max_prefill_workers).map(move |p| (k, p)))
        .collect();
    let threads = space
        .threads
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
        .clamp(1, tasks.len().max(1));
    let next = std::sync::atomic::AtomicUsize::new(0);
    std::thread::scope(|s| -> anyhow::Result<()> {
        let workers: Vec<_> = (0..threads)
            .map(|_| {
                s.spawn(|| -> anyhow::Result<()> {
                    loop {
                        let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        let Some(&(knobs, prefill)) = tasks.get(i) else {
                            return Ok(());
                        };
                        eval.smallest_decode(knobs, prefill)?;
                    }
                })
            })
            .collect();
        for w in workers {
            w.join().expect("a search thread panicked")?;
        }
        Ok(())
    })?;
    let mut candidates = eval.done.into_inner().expect("no panics under the lock");
    mark_pareto(&mut candidates);
    // Sorted by cost, then attainment: the first that meets is the plan.
    let chosen = candidates.iter().position(|c| c.meets);
    Ok(Plan {
        load: format!("{kind} {value}"),
        slo_ttft_ms: sim.run.slo_ttft,
        slo_tpot_ms: sim.run.slo_tpot,
        space: space.clone(),
        candidates,
        chosen,
        wall_seconds: wall.elapsed().as_secs_f64(),
    })
}

/// `pdserve-loadtest plan`: search, print, write `--json` and `--report`.
pub fn run(args: PlanArgs) -> anyhow::Result<Plan> {
    let plan = search(&args)?;
    show::print(&plan, &args);
    if let Some(path) = &args.sim.run.json {
        std::fs::write(path, serde_json::to_vec_pretty(&plan)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    if let Some(dir) = &args.sim.run.report {
        show::write_report(dir, &plan, &args)?;
    }
    if plan.chosen.is_none() {
        bail!(
            "no configuration in the space meets the SLOs at {}: widen --max-prefill-workers/--max-decode-workers or relax the SLOs",
            plan.load
        );
    }
    Ok(plan)
}

/// The command that starts the chosen cluster on one machine: the router
/// with local workers, which inherit the scheduler's variables.
pub fn up_command(c: &Candidate, mode: Mode) -> String {
    let mode = match (c.prefill_workers, mode) {
        (0, _) => Mode::Aggregated,
        (_, m) => m,
    };
    let mode = clap::ValueEnum::to_possible_value(&mode)
        .map(|v| v.get_name().to_string())
        .unwrap_or_default();
    format!(
        "PDSERVE_MAX_BATCH={} PDSERVE_PREFILL_CHUNK_TOKENS={} pdserve-router --model MODEL.gguf --local-prefill {} --local-decode {} --mode {mode} --local-prefill-max-tokens {}",
        c.knobs.max_batch,
        c.knobs.chunk_tokens,
        c.prefill_workers,
        c.decode_workers,
        c.knobs.local_prefill_max_tokens,
    )
}

/// Where `--report` writes the plot.
pub fn plot_path(dir: &std::path::Path) -> PathBuf {
    dir.join("pareto.svg")
}
