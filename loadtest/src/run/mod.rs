//! `pdserve-loadtest run`: load against one or more OpenAI-compatible
//! servers, with percentile reports, goodput, JSON and plots.

pub(crate) mod arrivals;
pub(crate) mod client;
mod plots;
mod procs;
pub(crate) mod report;
pub(crate) mod runner;
mod scrape;
pub mod stats;
pub(crate) mod workload;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use serde::Serialize;

use client::{Endpoint, Target};
use runner::{Load, Slice};
use stats::{Record, Slo, Summary};
use workload::{Item, WorkloadArgs};

/// Options of `pdserve-loadtest run`.
#[derive(clap::Args, Debug, Clone, Serialize)]
pub struct RunArgs {
    /// Base URL of the server under test (OpenAI-compatible; `/v1/...` is appended).
    #[arg(
        long,
        env = "PDSERVE_LOADTEST_URL",
        default_value = "http://127.0.0.1:8000"
    )]
    pub url: String,
    /// More servers to run the same workload against, interleaved with
    /// `--url` in slices (A, B, A, B …); the report gives ratios to `--url`.
    #[arg(
        long = "compare",
        env = "PDSERVE_LOADTEST_COMPARE",
        value_delimiter = ','
    )]
    pub compare: Vec<String>,
    /// Names of the targets in reports, comma-separated (default: the URLs).
    #[arg(long = "label", env = "PDSERVE_LOADTEST_LABELS", value_delimiter = ',')]
    pub labels: Vec<String>,
    /// Model name to request (default: the first of the target's `/v1/models`).
    #[arg(long, env = "PDSERVE_LOADTEST_MODEL")]
    pub model: Option<String>,
    /// Bearer key sent to every target.
    #[arg(long, env = "PDSERVE_LOADTEST_API_KEY")]
    #[serde(skip)]
    pub api_key: Option<String>,
    /// API to load.
    #[arg(long, env = "PDSERVE_LOADTEST_ENDPOINT", value_enum, default_value_t = Endpoint::Chat)]
    pub endpoint: Endpoint,
    /// Ask for whole responses instead of streams (TTFT is then the whole request).
    #[arg(long, env = "PDSERVE_LOADTEST_NO_STREAM")]
    pub no_stream: bool,
    /// Do not send `ignore_eos` (outputs may end before `max_tokens`).
    #[arg(long, env = "PDSERVE_LOADTEST_NO_IGNORE_EOS")]
    pub no_ignore_eos: bool,
    /// Open loop: arrivals per second.
    #[arg(long, env = "PDSERVE_LOADTEST_RATE", conflicts_with = "concurrency")]
    pub rate: Option<f64>,
    /// Closed loop: clients, each sending its next request when the last ends.
    #[arg(long, env = "PDSERVE_LOADTEST_CONCURRENCY")]
    pub concurrency: Option<usize>,
    /// Open loop: gamma shape of the gaps (1 = Poisson, < 1 bursty).
    #[arg(long, env = "PDSERVE_LOADTEST_BURSTINESS", default_value_t = 1.0)]
    pub burstiness: f64,
    /// A sweep: comma-separated rates (with `--rate`) or concurrencies (with `--concurrency`).
    #[arg(long, env = "PDSERVE_LOADTEST_SWEEP", value_delimiter = ',')]
    pub sweep: Vec<f64>,
    /// Seconds of load per target (per sweep point).
    #[arg(long, env = "PDSERVE_LOADTEST_DURATION")]
    pub duration: Option<f64>,
    /// Requests per target (per sweep point); default 100 without `--duration`.
    #[arg(long, env = "PDSERVE_LOADTEST_REQUESTS")]
    pub requests: Option<usize>,
    /// Seconds at the start whose requests are not measured.
    #[arg(long, env = "PDSERVE_LOADTEST_WARMUP", default_value_t = 0.0)]
    pub warmup: f64,
    /// With `--compare`: seconds per slice of one target.
    #[arg(long, env = "PDSERVE_LOADTEST_COMPARE_SLICE", default_value_t = 10.0)]
    pub compare_slice: f64,
    /// Goodput: time-to-first-token objective in milliseconds.
    #[arg(long, env = "PDSERVE_LOADTEST_SLO_TTFT_MS")]
    pub slo_ttft: Option<f64>,
    /// Goodput: time-per-output-token objective in milliseconds.
    #[arg(long, env = "PDSERVE_LOADTEST_SLO_TPOT_MS")]
    pub slo_tpot: Option<f64>,
    /// One request's timeout in seconds.
    #[arg(long, env = "PDSERVE_LOADTEST_TIMEOUT", default_value_t = 300.0)]
    pub timeout: f64,
    /// A JSON object merged into every request body; its fields win over the
    /// harness's own (e.g. `{"response_format": {"type": "json_object"}}`).
    #[arg(long, env = "PDSERVE_LOADTEST_EXTRA_BODY", value_parser = client::json_object)]
    pub extra_body: Option<serde_json::Map<String, serde_json::Value>>,
    /// Open loop: requests in flight at most before arrivals count as `client_overload`.
    #[arg(long, env = "PDSERVE_LOADTEST_MAX_IN_FLIGHT", default_value_t = 4096)]
    pub max_in_flight: usize,
    /// Write every figure and every request's record as JSON here.
    #[arg(long, env = "PDSERVE_LOADTEST_JSON")]
    pub json: Option<PathBuf>,
    /// Write a Markdown report with SVG plots into this folder.
    #[arg(long, env = "PDSERVE_LOADTEST_REPORT")]
    pub report: Option<PathBuf>,
    /// Scraping `/metrics`, sampling processes and the leak check.
    #[command(flatten)]
    #[serde(flatten)]
    pub monitor: scrape::MonitorArgs,
    /// No progress bar.
    #[arg(long, env = "PDSERVE_LOADTEST_NO_PROGRESS")]
    pub no_progress: bool,
    #[command(flatten)]
    pub workload: WorkloadArgs,
}

/// One target's results at one sweep point.
#[derive(Debug, Clone, Serialize)]
pub struct TargetResult {
    pub label: String,
    pub url: String,
    pub summary: Summary,
    pub records: Vec<Record>,
}

/// One sweep point (or the only point).
#[derive(Debug, Clone, Serialize)]
pub struct Point {
    /// `rate` or `concurrency`.
    pub kind: &'static str,
    pub value: f64,
    pub targets: Vec<TargetResult>,
}

#[derive(Debug, Clone, Serialize)]
pub struct RunReport {
    pub args: RunArgs,
    pub model: String,
    pub started_unix: u64,
    pub points: Vec<Point>,
    /// Every scraped and process sample, from the baseline to the leak check.
    pub scrape: Vec<scrape::Sample>,
    /// Each sampled series over the load (after the warm-up).
    pub trends: stats::Trends,
    pub leak_check: Option<scrape::LeakCheck>,
    /// `simulate`: each point's simulated and wall time and event counts.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub simulation: Option<serde_json::Value>,
}

impl RunArgs {
    pub(crate) fn check(&self) -> anyhow::Result<()> {
        if self.rate.is_none() && self.concurrency.is_none() {
            bail!("give --rate (open loop) or --concurrency (closed loop)");
        }
        if self.duration.is_none() && self.requests.is_none() && !self.compare.is_empty() {
            bail!("--compare needs --duration (its slices are timed)");
        }
        if self.sweep.iter().any(|v| *v <= 0.0) {
            bail!("sweep values must be positive");
        }
        if self.compare_slice <= 0.0 || self.timeout <= 0.0 {
            bail!("--compare-slice and --timeout must be positive");
        }
        if self.workload.workload == workload::Kind::Chat && self.endpoint != Endpoint::Chat {
            bail!("--workload chat needs --endpoint chat");
        }
        self.monitor.check()
    }

    pub(crate) fn points(&self) -> Vec<(Load, &'static str, f64)> {
        let open = self.rate.is_some();
        let values = match self.sweep.is_empty() {
            true => vec![self
                .rate
                .unwrap_or_else(|| self.concurrency.unwrap_or(1) as f64)],
            false => self.sweep.clone(),
        };
        values
            .into_iter()
            .map(|v| match open {
                true => (Load::Open { rate: v }, "rate", v),
                false => (
                    Load::Closed {
                        concurrency: v.round().max(1.0) as usize,
                    },
                    "concurrency",
                    v,
                ),
            })
            .collect()
    }

    /// Workload items needed per target at one point.
    pub(crate) fn items_needed(&self, load: Load) -> usize {
        if let Some(n) = self.requests {
            return n;
        }
        let secs = self.duration.unwrap_or(60.0);
        let n = match load {
            Load::Open { rate } => rate * secs * 1.3 + 50.0,
            Load::Closed { concurrency } => concurrency as f64 * secs * 20.0 + 100.0,
        };
        (n.ceil() as usize).min(200_000)
    }

    fn targets(&self, model: &str) -> Vec<(String, Target)> {
        let urls: Vec<&String> = std::iter::once(&self.url).chain(&self.compare).collect();
        urls.iter()
            .enumerate()
            .map(|(i, url)| {
                let label = self
                    .labels
                    .get(i)
                    .cloned()
                    .unwrap_or_else(|| url.to_string());
                let target = Target {
                    url: url.trim_end_matches('/').to_string(),
                    model: model.to_string(),
                    api_key: self.api_key.clone(),
                    endpoint: self.endpoint,
                    stream: !self.no_stream,
                    ignore_eos: !self.no_ignore_eos,
                    timeout: Duration::from_secs_f64(self.timeout),
                    extra: self.extra_body.clone().unwrap_or_default(),
                };
                (label, target)
            })
            .collect()
    }
}

async fn discover_model(client: &reqwest::Client, args: &RunArgs) -> anyhow::Result<String> {
    if let Some(m) = &args.model {
        return Ok(m.clone());
    }
    let url = format!("{}/v1/models", args.url.trim_end_matches('/'));
    let mut req = client.get(&url);
    if let Some(k) = &args.api_key {
        req = req.bearer_auth(k);
    }
    let v: serde_json::Value = req.send().await?.error_for_status()?.json().await?;
    v["data"][0]["id"]
        .as_str()
        .map(str::to_string)
        .with_context(|| format!("{url} lists no model; pass --model"))
}

/// One point's workload and schedule, from which its slices are cut.
struct PointPlan {
    /// The whole workload, shared by every slice.
    workload: Arc<[Item]>,
    /// Open loop: the arrival offset of every item (closed loop: none).
    arrivals: Vec<f64>,
    load: Load,
    targets: usize,
    /// Wall time of load per target (`--duration`).
    duration: Option<Duration>,
    /// Length of one slice (`None`: until the items run out).
    slice_len: Option<Duration>,
    /// Rounds of slices, each giving every target one slice.
    rounds: usize,
    /// Seconds of warm-up at the start of each target's first slice.
    warmup: f64,
    max_in_flight: usize,
}

impl PointPlan {
    fn new(args: &RunArgs, load: Load, targets: usize) -> anyhow::Result<Self> {
        let n = args.items_needed(load);
        let workload: Arc<[Item]> = workload::build(&args.workload, n)?.into();
        let arrivals = match load {
            Load::Open { rate } => {
                arrivals::schedule(rate, args.burstiness, args.workload.seed, n)?
            }
            Load::Closed { .. } => Vec::new(),
        };
        let duration = args.duration.map(Duration::from_secs_f64);
        let slice_len = match targets {
            1 => duration,
            _ => Some(Duration::from_secs_f64(args.compare_slice)),
        };
        let rounds = match (duration, slice_len) {
            (Some(d), Some(s)) => (d.as_secs_f64() / s.as_secs_f64()).ceil().max(1.0) as usize,
            _ => 1,
        };
        Ok(Self {
            workload,
            arrivals,
            load,
            targets,
            duration,
            slice_len,
            rounds,
            warmup: args.warmup,
            max_in_flight: args.max_in_flight,
        })
    }

    /// Target `t`'s slice in `round`, starting at workload item `first_item`.
    fn slice(&self, round: usize, t: usize, target: &Target, first_item: usize) -> Slice {
        let base = self.arrivals.get(first_item).copied().unwrap_or(0.0);
        Slice {
            index: round * self.targets + t,
            target_index: t,
            target: target.clone(),
            workload: self.workload.clone(),
            first_item,
            arrivals: self
                .arrivals
                .iter()
                .skip(first_item)
                .map(|a| a - base)
                .collect(),
            load: self.load,
            duration: self.slice_duration(round),
            warmup: match round {
                0 => Duration::from_secs_f64(self.warmup),
                _ => Duration::ZERO,
            },
            max_in_flight: self.max_in_flight,
        }
    }

    /// How long slices of `round` last: the last one only what remains.
    fn slice_duration(&self, round: usize) -> Option<Duration> {
        match (self.duration, self.slice_len) {
            (Some(d), Some(s)) => Some(s.min(d.saturating_sub(s * round as u32))),
            _ => None,
        }
    }
}

/// Runs one point: every target in slices, interleaved.
async fn run_point(
    args: &RunArgs,
    client: &reqwest::Client,
    targets: &[(String, Target)],
    load: Load,
    run_start: Instant,
) -> anyhow::Result<Vec<Vec<Record>>> {
    let plan = PointPlan::new(args, load, targets.len())?;
    let n = plan.workload.len();
    let pb = runner::progress((n * targets.len()) as u64, args.no_progress);
    // Each target's next unsent item.
    let mut positions = vec![0usize; targets.len()];
    let mut records: Vec<Vec<Record>> = vec![Vec::new(); targets.len()];
    for round in 0..plan.rounds {
        for (t, (_, target)) in targets.iter().enumerate() {
            if positions[t] >= n {
                continue;
            }
            let slice = plan.slice(round, t, target, positions[t]);
            let got = runner::run_slice(client, slice, run_start, &pb).await;
            positions[t] += got.len();
            records[t].extend(got);
        }
    }
    pb.finish_and_clear();
    Ok(records)
}

/// Runs the load and writes its outputs; fails if the leak check does.
pub async fn run(args: RunArgs) -> anyhow::Result<RunReport> {
    args.check()?;
    let client = http_client()?;
    let model = discover_model(&client, &args).await?;
    let targets = args.targets(&model);
    let started_unix = unix_now();
    let run_start = Instant::now();
    let monitor = match args.monitor.config() {
        Some(cfg) => Some(scrape::Monitor::start(cfg, run_start).await?),
        None => None,
    };
    let load_start = run_start.elapsed().as_secs_f64();
    let points = run_points(&args, &client, &targets, run_start).await?;
    // Its idle connections would count as open fds at the servers.
    drop(client);
    let load_end = run_start.elapsed().as_secs_f64();
    let monitored = match monitor {
        Some(m) => m.finish().await,
        None => scrape::Monitored::default(),
    };
    let trend_start = (load_start + args.warmup).min(load_end);
    let report = RunReport {
        args: args.clone(),
        model,
        started_unix,
        points,
        trends: stats::trends(&monitored.samples, trend_start, load_end),
        scrape: monitored.samples,
        leak_check: monitored.leak_check,
        simulation: None,
    };
    report::print_monitoring(&report);
    write_outputs(&args, &report)?;
    match &report.leak_check {
        Some(check) if !check.passed => bail!(report::leak_line(check)),
        _ => Ok(report),
    }
}

/// Idle pooled connections are dropped after this, below the keep-alive of
/// common servers (`llama-server` and uvicorn close idle ones after 5 s), so
/// no request goes out on a connection the server has closed while another
/// target's slice ran.
const POOL_IDLE: std::time::Duration = std::time::Duration::from_secs(2);

fn http_client() -> reqwest::Result<reqwest::Client> {
    reqwest::Client::builder()
        .pool_max_idle_per_host(1024)
        .pool_idle_timeout(POOL_IDLE)
        .tcp_nodelay(true)
        .build()
}

/// Seconds since the Unix epoch (0 if the clock is before it).
pub(crate) fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or_default()
}

/// Runs every point in turn, printing each one's results as it ends.
async fn run_points(
    args: &RunArgs,
    client: &reqwest::Client,
    targets: &[(String, Target)],
    run_start: Instant,
) -> anyhow::Result<Vec<Point>> {
    let slo = Slo {
        ttft: args.slo_ttft.map(|ms| ms / 1e3),
        tpot: args.slo_tpot.map(|ms| ms / 1e3),
    };
    let mut points = Vec::new();
    for (load, kind, value) in args.points() {
        let per_target = run_point(args, client, targets, load, run_start).await?;
        let point = Point {
            kind,
            value,
            targets: target_results(targets, per_target, &slo, load),
        };
        report::print_point(&point);
        points.push(point);
    }
    Ok(points)
}

/// Each target's summary and records at one point.
fn target_results(
    targets: &[(String, Target)],
    per_target: Vec<Vec<Record>>,
    slo: &Slo,
    load: Load,
) -> Vec<TargetResult> {
    let requested = match load {
        Load::Open { rate } => Some(rate),
        Load::Closed { .. } => None,
    };
    targets
        .iter()
        .zip(per_target)
        .map(|((label, t), records)| TargetResult {
            label: label.clone(),
            url: t.url.clone(),
            summary: stats::summarize(&records, slo, requested),
            records,
        })
        .collect()
}

/// Writes the JSON (`--json`) and the Markdown report (`--report`) asked for.
pub(crate) fn write_outputs(args: &RunArgs, report: &RunReport) -> anyhow::Result<()> {
    if let Some(path) = &args.json {
        std::fs::write(path, serde_json::to_vec_pretty(report)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    if let Some(dir) = &args.report {
        report::write_report(dir, report)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        run: RunArgs,
    }

    fn args(flags: &[&str]) -> RunArgs {
        let argv = std::iter::once("pdserve-loadtest").chain(flags.iter().copied());
        Cli::try_parse_from(argv).unwrap().run
    }

    #[test]
    fn slices_share_one_workload_and_see_only_their_own_items() {
        let args = args(&[
            "--rate=2",
            "--requests=6",
            "--duration=25",
            "--compare=http://b",
            "--compare-slice=10",
            "--warmup=1",
            "--input-len=4",
        ]);
        args.check().unwrap();
        let targets = args.targets("m");
        let load = Load::Open { rate: 2.0 };
        let plan = PointPlan::new(&args, load, targets.len()).unwrap();
        assert_eq!(
            (plan.workload.len(), plan.arrivals.len(), plan.rounds),
            (6, 6, 3)
        );

        let first = plan.slice(0, 0, &targets[0].1, 0);
        let other = plan.slice(0, 1, &targets[1].1, 0);
        let last = plan.slice(2, 1, &targets[1].1, 4);
        for s in [&first, &other, &last] {
            assert!(Arc::ptr_eq(&s.workload, &plan.workload));
        }
        assert_eq!(
            Arc::strong_count(&plan.workload),
            4,
            "no slice has its own copy"
        );

        assert_eq!(first.items(), &plan.workload[..]);
        assert_eq!((last.index, last.target_index, last.first_item), (5, 1, 4));
        assert_eq!(last.items(), &plan.workload[4..]);
        assert!(std::ptr::eq(&last.items()[0], &plan.workload[4]));
        let rebased: Vec<f64> = plan.arrivals[4..]
            .iter()
            .map(|a| a - plan.arrivals[4])
            .collect();
        assert_eq!(last.arrivals, rebased);

        assert_eq!(first.duration, Some(Duration::from_secs(10)));
        assert_eq!(last.duration, Some(Duration::from_secs(5)), "what remains");
        assert_eq!(first.warmup, Duration::from_secs(1));
        assert_eq!(last.warmup, Duration::ZERO);
    }
}
