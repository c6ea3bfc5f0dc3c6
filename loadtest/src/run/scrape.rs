//! Sampling during a run: the pool signals of one or more Prometheus
//! endpoints (queue depth, workers, active sequences, KV usage, requests in
//! flight, runtime tasks, desired replicas) and the watched processes
//! ([`procs`]), every interval; and the leak check, which compares what the
//! servers hold after the load with a baseline taken before it.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use serde::{Deserialize, Serialize};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

use super::procs::{self, Watch};

/// Series kept from each scrape (prefixes of metric names).
const KEEP: &[&str] = &[
    "pdserve_queue_depth",
    "pdserve_active_sequences",
    "pdserve_workers",
    "pdserve_requests_in_flight",
    "pdserve_kv_cache_usage_ratio",
    "pdserve_kv_cache_used_tokens",
    "pdserve_runtime_alive_tasks",
    "pdserve_autoscaler_desired_replicas",
];

/// Metrics that must be back at their baseline (or 0) after the load.
const DRAINED: &[&str] = &["pdserve_kv_cache_used_tokens", "pdserve_requests_in_flight"];

/// The label naming the endpoint a scraped series came from.
pub const TARGET_LABEL: &str = "target";

/// Options of what to sample during `run`, flattened into its arguments.
#[derive(clap::Args, Debug, Clone, Default, Serialize)]
pub struct MonitorArgs {
    /// Prometheus `/metrics` URLs (router, workers) to scrape during the run,
    /// comma-separated or repeated; each series gets a `target="host:port"` label.
    #[arg(
        long = "scrape-metrics",
        env = "PDSERVE_LOADTEST_SCRAPE_METRICS",
        value_delimiter = ','
    )]
    pub scrape_metrics: Vec<String>,
    /// Milliseconds between samples (scrapes and process samples).
    #[arg(
        long,
        env = "PDSERVE_LOADTEST_SCRAPE_INTERVAL_MS",
        default_value_t = 1000
    )]
    pub scrape_interval_ms: u64,
    /// Processes whose RSS, open fds and threads are sampled from `/proc`,
    /// comma-separated or repeated.
    #[arg(
        long = "watch-pid",
        env = "PDSERVE_LOADTEST_WATCH_PIDS",
        value_delimiter = ','
    )]
    pub watch_pids: Vec<u32>,
    /// Processes sampled together with every process below them (e.g. a
    /// router and its local workers), re-discovered at each sample.
    #[arg(
        long = "watch-children-of",
        env = "PDSERVE_LOADTEST_WATCH_CHILDREN_OF",
        value_delimiter = ','
    )]
    pub watch_children_of: Vec<u32>,
    /// After the load, wait up to this many seconds for open fds, KV in use
    /// and requests in flight to return to their baseline; fail if they don't.
    #[arg(long, env = "PDSERVE_LOADTEST_LEAK_CHECK_SECONDS")]
    pub leak_check_seconds: Option<f64>,
    /// Leak check: open fds a process may hold above its baseline.
    #[arg(long, env = "PDSERVE_LOADTEST_LEAK_FD_TOLERANCE", default_value_t = 4)]
    pub leak_fd_tolerance: u32,
}

impl MonitorArgs {
    /// Rejects contradictory options.
    pub fn check(&self) -> anyhow::Result<()> {
        let watching = !self.scrape_metrics.is_empty()
            || !self.watch_pids.is_empty()
            || !self.watch_children_of.is_empty();
        match self.leak_check_seconds {
            Some(s) if !(s >= 0.0 && s.is_finite()) => {
                bail!("--leak-check-seconds must be a finite number ≥ 0")
            }
            Some(_) if !watching => bail!(
                "--leak-check-seconds needs --scrape-metrics, --watch-pid or --watch-children-of"
            ),
            _ => Ok(()),
        }
    }

    /// What to sample, or `None` when nothing is asked for.
    pub fn config(&self) -> Option<Config> {
        let mut urls = self.scrape_metrics.clone();
        urls.dedup();
        let watch = Watch {
            pids: self.watch_pids.clone(),
            children_of: self.watch_children_of.clone(),
        };
        (!urls.is_empty() || !watch.is_empty()).then(|| Config {
            urls,
            watch,
            every: Duration::from_millis(self.scrape_interval_ms).max(Duration::from_millis(50)),
            leak_check: self.leak_check_seconds.map(Duration::from_secs_f64),
            fd_tolerance: f64::from(self.leak_fd_tolerance),
        })
    }
}

/// What to sample, how often, and how to check for leaks.
#[derive(Debug, Clone)]
pub struct Config {
    /// Prometheus endpoints.
    pub urls: Vec<String>,
    pub watch: Watch,
    /// Time between samples.
    pub every: Duration,
    /// How long to wait after the load for the leak check (`None`: no check).
    pub leak_check: Option<Duration>,
    /// Open fds a process may hold above its baseline.
    pub fd_tolerance: f64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Sample {
    /// Seconds since the run started.
    pub t: f64,
    /// The series: name and labels, e.g.
    /// `pdserve_queue_depth{target="127.0.0.1:8000",pool="prefill"}` or
    /// `proc_rss_bytes{pid="123",name="pdserve-router"}`.
    pub series: String,
    pub value: f64,
}

/// Parses the kept series of a text exposition.
pub fn parse(text: &str, t: f64) -> Vec<Sample> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter(|l| KEEP.iter().any(|k| l.starts_with(k)))
        .filter_map(|l| {
            let (series, value) = l.rsplit_once(' ')?;
            Some(Sample {
                t,
                series: series.to_string(),
                value: value.parse().ok()?,
            })
        })
        .collect()
}

/// `host:port` of a URL (the URL itself when it does not parse).
pub fn target_of(url: &str) -> String {
    let Ok(u) = reqwest::Url::parse(url) else {
        return url.to_string();
    };
    match (u.host_str(), u.port_or_known_default()) {
        (Some(h), Some(p)) => format!("{h}:{p}"),
        (Some(h), None) => h.to_string(),
        _ => url.to_string(),
    }
}

/// `series` with `key="value"` as its first label.
pub fn with_label(series: &str, key: &str, value: &str) -> String {
    let label = format!("{key}=\"{}\"", procs::label_value(value));
    match series.split_once('{') {
        Some((name, "}")) => format!("{name}{{{label}}}"),
        Some((name, rest)) => format!("{name}{{{label},{rest}"),
        None => format!("{series}{{{label}}}"),
    }
}

/// The metric name of a series: the part before its labels.
fn name_of(series: &str) -> &str {
    series.split('{').next().unwrap_or(series)
}

/// Where one sample comes from: the endpoints and the processes.
struct Sources {
    client: reqwest::Client,
    /// Each endpoint's URL and its `target` label.
    endpoints: Vec<(String, String)>,
    watch: Watch,
    timeout: Duration,
}

impl Sources {
    fn new(cfg: &Config) -> reqwest::Result<Self> {
        // One kept-alive connection per endpoint, the same before, during and
        // after the load, so that it does not move the servers' fd counts.
        let client = reqwest::Client::builder()
            .pool_max_idle_per_host(1)
            .build()?;
        Ok(Self {
            client,
            endpoints: (cfg.urls.iter())
                .map(|u| (u.clone(), target_of(u)))
                .collect(),
            watch: cfg.watch.clone(),
            timeout: cfg.every.max(Duration::from_millis(500)),
        })
    }

    /// Every endpoint's kept series and every watched process, at `t`.
    async fn sample(&self, t: f64) -> Vec<Sample> {
        let scrapes = (self.endpoints.iter()).map(|(url, target)| self.scrape(url, target, t));
        let mut out: Vec<Sample> = futures_util::future::join_all(scrapes)
            .await
            .into_iter()
            .flatten()
            .collect();
        if !self.watch.is_empty() {
            let watch = self.watch.clone();
            let procs = tokio::task::spawn_blocking(move || procs::sample(&watch, t));
            out.extend(procs.await.unwrap_or_default());
        }
        out
    }

    /// One endpoint's kept series, labelled with `target`; none if it fails.
    async fn scrape(&self, url: &str, target: &str, t: f64) -> Vec<Sample> {
        let got = self.client.get(url).timeout(self.timeout).send().await;
        let text = match got.and_then(reqwest::Response::error_for_status) {
            Ok(r) => r.text().await.unwrap_or_default(),
            Err(_) => return Vec::new(),
        };
        let mut samples = parse(&text, t);
        for s in &mut samples {
            s.series = with_label(&s.series, TARGET_LABEL, target);
        }
        samples
    }
}

/// Samples in the background from before the load until after it.
pub struct Monitor {
    probe: Probe,
    stop: oneshot::Sender<()>,
    task: JoinHandle<Vec<Sample>>,
}

/// What the leak check samples with, and what it compares to.
struct Probe {
    sources: Arc<Sources>,
    cfg: Config,
    origin: Instant,
    baseline: Vec<Sample>,
}

/// What the monitor gathered.
#[derive(Debug, Clone, Default)]
pub struct Monitored {
    /// Every sample, baseline and leak-check samples included, in time order.
    pub samples: Vec<Sample>,
    pub leak_check: Option<LeakCheck>,
}

impl Monitor {
    /// Takes the baseline sample, then samples every `cfg.every` until
    /// [`Monitor::finish`]. Fails if a watched pid does not exist.
    pub async fn start(cfg: Config, origin: Instant) -> anyhow::Result<Self> {
        let missing = procs::missing(&cfg.watch);
        if !missing.is_empty() {
            bail!("no such process to watch: {missing:?} (is /proc mounted?)");
        }
        let sources = Arc::new(Sources::new(&cfg).context("building the scrape client")?);
        let baseline = sources.sample(origin.elapsed().as_secs_f64()).await;
        let (stop, stopped) = oneshot::channel();
        let task = tokio::spawn(sample_loop(sources.clone(), cfg.every, origin, stopped));
        let probe = Probe {
            sources,
            cfg,
            origin,
            baseline,
        };
        Ok(Self { probe, stop, task })
    }

    /// Stops the periodic samples (the load is over); with a leak check, goes
    /// on sampling until the checked series are back or the wait is over.
    pub async fn finish(self) -> Monitored {
        let Self { probe, stop, task } = self;
        let _ = stop.send(());
        let during = task.await.unwrap_or_default();
        let mut samples = probe.baseline.clone();
        samples.extend(during);
        let leak_check = match probe.cfg.leak_check {
            Some(wait) => {
                let (check, after) = probe.settle(wait).await;
                samples.extend(after);
                Some(check)
            }
            None => None,
        };
        Monitored {
            samples,
            leak_check,
        }
    }
}

impl Probe {
    /// Samples until no checked series is above its baseline, at most `wait`.
    async fn settle(&self, wait: Duration) -> (LeakCheck, Vec<Sample>) {
        let start = Instant::now();
        let mut taken = Vec::new();
        loop {
            let now = self
                .sources
                .sample(self.origin.elapsed().as_secs_f64())
                .await;
            let verdict = verdict(&self.baseline, &now, self.cfg.fd_tolerance);
            taken.extend(now.iter().cloned());
            let left = wait.saturating_sub(start.elapsed());
            if verdict.leaks.is_empty() || left.is_zero() {
                let check = LeakCheck {
                    passed: verdict.passed(),
                    waited_s: start.elapsed().as_secs_f64(),
                    fd_tolerance: self.cfg.fd_tolerance,
                    checked: verdict.checked,
                    leaks: verdict.leaks,
                    baseline: self.baseline.clone(),
                    last: now,
                };
                return (check, taken);
            }
            tokio::time::sleep(self.cfg.every.min(left)).await;
        }
    }
}

/// Samples every `every` until `stopped` fires.
async fn sample_loop(
    sources: Arc<Sources>,
    every: Duration,
    origin: Instant,
    mut stopped: oneshot::Receiver<()>,
) -> Vec<Sample> {
    let mut samples = Vec::new();
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tick.tick().await; // The first tick is now: the baseline was just taken.
    loop {
        tokio::select! {
            biased;
            _ = &mut stopped => break,
            _ = tick.tick() => {}
        }
        samples.extend(sources.sample(origin.elapsed().as_secs_f64()).await);
    }
    samples
}

/// The leak check's outcome, as written in the JSON.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct LeakCheck {
    pub passed: bool,
    /// Seconds sampled after the load until the series were back (or the wait ran out).
    pub waited_s: f64,
    pub fd_tolerance: f64,
    /// Series compared (open fds, KV in use, requests in flight).
    pub checked: usize,
    /// The series that were not back.
    pub leaks: Vec<Leak>,
    /// Every series before the load.
    pub baseline: Vec<Sample>,
    /// Every series at the last sample.
    pub last: Vec<Sample>,
}

/// A checked series that is not back at its baseline.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Leak {
    pub series: String,
    /// Before the load (`None`: the series appeared during it).
    pub baseline: Option<f64>,
    /// At the last sample (`None`: the series is gone, e.g. the process exited).
    pub now: Option<f64>,
    /// The most it may be.
    pub allowed: f64,
}

/// The leaks found comparing one sample with the baseline.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Verdict {
    /// Series compared.
    pub checked: usize,
    pub leaks: Vec<Leak>,
}

impl Verdict {
    /// Something was compared, and nothing leaked.
    pub fn passed(&self) -> bool {
        self.checked > 0 && self.leaks.is_empty()
    }
}

/// How much a series may exceed its baseline; `None`: it is not checked.
fn allowance(name: &str, fd_tolerance: f64) -> Option<f64> {
    match name {
        procs::OPEN_FDS => Some(fd_tolerance),
        n if DRAINED.contains(&n) => Some(0.0),
        _ => None,
    }
}

/// Compares `now` with `baseline`: each process's open fds must be at most
/// its baseline plus `fd_tolerance`; KV in use and requests in flight at
/// most their baseline, or 0 for a series that appeared during the load. A
/// checked series that disappeared (a process exited, a scrape failed) is a
/// leak too: it cannot be shown to be back. Processes that appeared during
/// the load have no fd baseline and are not checked.
pub fn verdict(baseline: &[Sample], now: &[Sample], fd_tolerance: f64) -> Verdict {
    let before: BTreeMap<&str, f64> = baseline
        .iter()
        .map(|s| (s.series.as_str(), s.value))
        .collect();
    let after: BTreeMap<&str, f64> = now.iter().map(|s| (s.series.as_str(), s.value)).collect();
    let mut v = Verdict::default();
    let series = before.keys().chain(after.keys()).copied();
    let series: std::collections::BTreeSet<&str> = series.collect();
    for s in series {
        let Some(extra) = allowance(name_of(s), fd_tolerance) else {
            continue;
        };
        let (base, got) = (before.get(s).copied(), after.get(s).copied());
        if base.is_none() && name_of(s) == procs::OPEN_FDS {
            continue;
        }
        v.checked += 1;
        let allowed = base.unwrap_or(0.0).max(0.0) + extra;
        if got.is_none_or(|x| x > allowed) {
            v.leaks.push(Leak {
                series: s.to_string(),
                baseline: base,
                now: got,
                allowed,
            });
        }
    }
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_the_pool_signals() {
        let text = "# HELP x\npdserve_queue_depth{pool=\"prefill\"} 3\npdserve_queue_depth_tokens{pool=\"prefill\"} 700\npdserve_other 1\npdserve_workers{pool=\"decode\",state=\"ready\"} 2\npdserve_kv_cache_used_tokens 96\npdserve_runtime_alive_tasks 40\n";
        let s = parse(text, 1.5);
        assert_eq!(s.len(), 5);
        assert_eq!(s[0].series, "pdserve_queue_depth{pool=\"prefill\"}");
        assert_eq!(s[1].value, 700.0);
        assert_eq!(s[2].t, 1.5);
        assert_eq!(
            (name_of(&s[3].series), s[3].value),
            ("pdserve_kv_cache_used_tokens", 96.0)
        );
        assert_eq!(name_of(&s[4].series), "pdserve_runtime_alive_tasks");
    }

    #[test]
    fn series_are_labelled_with_their_endpoint() {
        let t = target_of("http://127.0.0.1:8101/metrics");
        assert_eq!(t, "127.0.0.1:8101");
        assert_eq!(target_of("http://router/metrics"), "router:80");
        assert_eq!(
            with_label("pdserve_queue_depth{pool=\"prefill\"}", "target", &t),
            "pdserve_queue_depth{target=\"127.0.0.1:8101\",pool=\"prefill\"}"
        );
        assert_eq!(
            with_label("pdserve_requests_in_flight", "target", &t),
            "pdserve_requests_in_flight{target=\"127.0.0.1:8101\"}"
        );
        assert_eq!(with_label("x{}", "target", "a"), "x{target=\"a\"}");
    }

    fn at(t: f64, pairs: &[(&str, f64)]) -> Vec<Sample> {
        (pairs.iter())
            .map(|(series, value)| Sample {
                t,
                series: series.to_string(),
                value: *value,
            })
            .collect()
    }

    const FDS: &str = "proc_open_fds{pid=\"7\",name=\"pdserve-router\"}";
    const KV: &str = "pdserve_kv_cache_used_tokens{target=\"h:1\"}";
    const FLIGHT: &str = "pdserve_requests_in_flight{target=\"h:0\"}";
    const RSS: &str = "proc_rss_bytes{pid=\"7\",name=\"pdserve-router\"}";

    #[test]
    fn back_to_baseline_passes_and_rss_is_not_checked() {
        let base = at(0.0, &[(FDS, 20.0), (KV, 0.0), (FLIGHT, 0.0), (RSS, 1e6)]);
        let now = at(9.0, &[(FDS, 24.0), (KV, 0.0), (FLIGHT, 0.0), (RSS, 9e6)]);
        let v = verdict(&base, &now, 4.0);
        assert_eq!(v.checked, 3);
        assert!(v.passed(), "{v:?}");
    }

    #[test]
    fn fds_above_tolerance_and_kv_still_held_fail() {
        let base = at(0.0, &[(FDS, 20.0), (KV, 0.0), (FLIGHT, 0.0)]);
        let now = at(9.0, &[(FDS, 25.0), (KV, 128.0), (FLIGHT, 0.0)]);
        let v = verdict(&base, &now, 4.0);
        assert!(!v.passed());
        let leaked: Vec<(&str, Option<f64>, f64)> = (v.leaks.iter())
            .map(|l| (l.series.as_str(), l.now, l.allowed))
            .collect();
        assert_eq!(
            leaked,
            vec![(KV, Some(128.0), 0.0), (FDS, Some(25.0), 24.0)]
        );
    }

    #[test]
    fn a_series_new_or_gone_is_judged_against_zero_or_missing() {
        let new_worker_fds = "proc_open_fds{pid=\"9\",name=\"w\"}";
        let base = at(0.0, &[(FDS, 20.0)]);
        let now = at(9.0, &[(KV, 16.0), (new_worker_fds, 500.0)]);
        let v = verdict(&base, &now, 4.0);
        let leaked: Vec<(&str, Option<f64>, Option<f64>)> = (v.leaks.iter())
            .map(|l| (l.series.as_str(), l.baseline, l.now))
            .collect();
        assert_eq!(
            leaked,
            vec![(KV, None, Some(16.0)), (FDS, Some(20.0), None)]
        );
        assert_eq!(v.checked, 2, "a process without a baseline is not compared");
    }

    #[test]
    fn nothing_to_compare_does_not_pass() {
        let base = at(0.0, &[(RSS, 1e6)]);
        assert!(!verdict(&base, &base, 4.0).passed());
    }

    #[test]
    fn leak_check_needs_something_to_watch() {
        let mut a = MonitorArgs {
            leak_check_seconds: Some(30.0),
            ..MonitorArgs::default()
        };
        assert!(a.check().is_err());
        a.watch_children_of = vec![1];
        assert!(a.check().is_ok());
        assert_eq!(
            a.config().unwrap().leak_check,
            Some(Duration::from_secs(30))
        );
    }
}
