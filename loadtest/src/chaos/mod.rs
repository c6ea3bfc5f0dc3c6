//! `pdserve-loadtest chaos`: drives a local cluster under load and injects
//! faults, one case at a time, each on a fresh cluster of child processes on
//! 127.0.0.1, bounded in time, signalling only its own processes by PID.
//! Prints a table and an `N passed, M failed` line, and writes JSON.
//! The cases are listed in [`cases::CASES`]; docs/chaos.md says what each
//! checks and why.

mod cases;
mod client;
mod cluster;
mod proxy;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::Context;
use serde::Serialize;

pub use cluster::Engine;

/// The flags of `pdserve-loadtest chaos`.
#[derive(clap::Args, Debug, Clone)]
pub struct ChaosArgs {
    /// GGUF model: the router's tokenizer, and the workers' weights (real
    /// engine) or shape (mock engine).
    #[arg(long, env = "PDSERVE_MODEL")]
    pub model: PathBuf,
    /// Which workers to run: the mock engine (fast, CI) or the real one.
    #[arg(long, env = "PDSERVE_CHAOS_ENGINE", value_enum, default_value_t = Engine::Mock)]
    pub engine: Engine,
    /// Cases to run (numbers, comma-separated; default: all).
    #[arg(long, env = "PDSERVE_CHAOS_CASES", value_delimiter = ',')]
    pub cases: Vec<usize>,
    /// Directory of the pdserve binaries (default: this binary's own).
    #[arg(long, env = "PDSERVE_CHAOS_BIN_DIR")]
    pub bin_dir: Option<PathBuf>,
    /// Concurrent streams of the load cases.
    #[arg(long, env = "PDSERVE_CHAOS_STREAMS", default_value_t = 16)]
    pub streams: usize,
    /// Completion tokens per stream.
    #[arg(long, env = "PDSERVE_CHAOS_MAX_TOKENS", default_value_t = 64)]
    pub max_tokens: u32,
    /// Case 3: how long the decode worker stays stopped (SIGSTOP), seconds.
    #[arg(long, env = "PDSERVE_CHAOS_STOP_SECONDS", default_value_t = 15)]
    pub stop_seconds: u64,
    /// The router's --stream-idle-timeout-ms in every case.
    #[arg(long, env = "PDSERVE_CHAOS_IDLE_TIMEOUT_MS", default_value_t = 2000)]
    pub idle_timeout_ms: u64,
    /// Where to write the results as JSON.
    #[arg(long, env = "PDSERVE_CHAOS_JSON")]
    pub json: Option<PathBuf>,
}

/// One case's result.
#[derive(Debug, Clone, Serialize)]
pub struct CaseResult {
    pub case: usize,
    pub name: &'static str,
    pub passed: bool,
    pub seconds: f64,
    /// What was measured, as `name=value` pairs.
    pub measured: Vec<(String, String)>,
    /// Why it failed.
    pub failure: Option<String>,
}

#[derive(Debug, Serialize)]
struct Report<'a> {
    engine: Engine,
    model: String,
    passed: usize,
    failed: usize,
    cases: &'a [CaseResult],
}

/// Runs the selected cases; an error when any failed.
pub async fn run(args: ChaosArgs) -> anyhow::Result<()> {
    let bin_dir = match &args.bin_dir {
        Some(d) => d.clone(),
        None => std::env::current_exe()?
            .parent()
            .context("the binary's directory")?
            .to_path_buf(),
    };
    let selected: Vec<usize> = match args.cases.is_empty() {
        true => (1..=cases::CASES.len()).collect(),
        false => args.cases.clone(),
    };
    let mut results = Vec::new();
    for n in selected {
        let Some(case) = cases::CASES.get(n.wrapping_sub(1)) else {
            anyhow::bail!("no case {n}: cases are 1..={}", cases::CASES.len());
        };
        eprintln!("chaos case {n}: {} ...", case.name);
        let result = run_case(n, case, &args, &bin_dir).await;
        eprintln!(
            "chaos case {n}: {}",
            if result.passed { "passed" } else { "FAILED" }
        );
        results.push(result);
    }
    report(&args, &results)
}

async fn run_case(
    n: usize,
    case: &cases::Case,
    args: &ChaosArgs,
    bin_dir: &std::path::Path,
) -> CaseResult {
    let started = Instant::now();
    let ctx = cases::Ctx::new(args, bin_dir);
    let limit = Duration::from_secs(case.limit_seconds);
    let outcome = tokio::time::timeout(limit, (case.run)(ctx)).await;
    let (passed, measured, failure) = match outcome {
        Ok(Ok(m)) => (true, m, None),
        Ok(Err(e)) => (false, Vec::new(), Some(format!("{e:#}"))),
        Err(_) => (
            false,
            Vec::new(),
            Some(format!("timed out after {limit:?}")),
        ),
    };
    CaseResult {
        case: n,
        name: case.name,
        passed,
        seconds: started.elapsed().as_secs_f64(),
        measured,
        failure,
    }
}

fn report(args: &ChaosArgs, results: &[CaseResult]) -> anyhow::Result<()> {
    println!(
        "{:<4} {:<44} {:<7} {:>7}  measured",
        "case", "name", "result", "secs"
    );
    for r in results {
        let m: Vec<String> = r.measured.iter().map(|(k, v)| format!("{k}={v}")).collect();
        let result = if r.passed { "passed" } else { "FAILED" };
        println!(
            "{:<4} {:<44} {:<7} {:>7.1}  {}",
            r.case,
            r.name,
            result,
            r.seconds,
            m.join(" ")
        );
        if let Some(f) = &r.failure {
            println!("     failure: {f}");
        }
    }
    let passed = results.iter().filter(|r| r.passed).count();
    let failed = results.len() - passed;
    println!("{passed} passed, {failed} failed");
    if let Some(path) = &args.json {
        let report = Report {
            engine: args.engine,
            model: args.model.to_string_lossy().into_owned(),
            passed,
            failed,
            cases: results,
        };
        std::fs::write(path, serde_json::to_vec_pretty(&report)?)?;
    }
    match failed {
        0 => Ok(()),
        _ => anyhow::bail!("{failed} chaos case(s) failed"),
    }
}

/// The sum over every series of metric `name` in a text exposition.
pub fn sum_metric(text: &str, name: &str) -> f64 {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter(|l| {
            l.strip_prefix(name)
                .is_some_and(|rest| rest.starts_with(' ') || rest.starts_with('{'))
        })
        .filter_map(|l| l.rsplit_once(' ')?.1.parse::<f64>().ok())
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metric_sums_add_every_series_of_one_name_only() {
        let text = "# HELP x\nm_total{a=\"1\"} 2\nm_total{a=\"2\"} 3\nm_total_other 7\nm_total 1\n";
        assert_eq!(sum_metric(text, "m_total"), 6.0);
        assert_eq!(sum_metric(text, "absent"), 0.0);
    }
}
