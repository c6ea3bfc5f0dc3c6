//! The summary table on stdout and the Markdown report with its plots.

use std::fmt::Write as _;
use std::path::Path;

use anyhow::Context;

use super::scrape::LeakCheck;
use super::stats::{Summary, Trends};
use super::{plots, Point, RunReport};

fn ms(x: f64) -> String {
    format!("{:.1}", x * 1e3)
}

const HEADER: &str = "| target | ok/total | req/s | out tok/s | goodput req/s | TTFT p50 / p99 ms | ITL p50 / p99 ms | TPOT p50 ms | E2E p50 / p99 ms | rate asked / got |";

fn row(label: &str, s: &Summary) -> String {
    let errors: Vec<String> = s.errors.iter().map(|(k, v)| format!("{k}: {v}")).collect();
    let rate = match s.requested_rate {
        Some(r) => format!("{r:.2} / {:.2}", s.achieved_rate),
        None => format!("closed / {:.2}", s.achieved_rate),
    };
    format!(
        "| {label} | {}/{}{} | {:.2} | {:.1} | {:.2} | {} / {} | {} / {} | {} | {} / {} | {rate} |",
        s.ok,
        s.requests,
        match errors.is_empty() {
            true => String::new(),
            false => format!(" ({})", errors.join(", ")),
        },
        s.requests_per_second,
        s.output_tokens_per_second,
        s.goodput,
        ms(s.ttft.p50),
        ms(s.ttft.p99),
        ms(s.itl.p50),
        ms(s.itl.p99),
        ms(s.tpot.p50),
        ms(s.e2e.p50),
        ms(s.e2e.p99),
    )
}

/// Ratios of a target to the first one (lower is better for latencies).
fn ratio_row(label: &str, s: &Summary, base: &Summary) -> String {
    let r = |a: f64, b: f64| match b > 0.0 {
        true => format!("{:.2}×", a / b),
        false => "–".into(),
    };
    format!(
        "| {label} ÷ first | | {} | {} | {} | {} / {} | {} / {} | {} | {} / {} | |",
        r(s.requests_per_second, base.requests_per_second),
        r(s.output_tokens_per_second, base.output_tokens_per_second),
        r(s.goodput, base.goodput),
        r(s.ttft.p50, base.ttft.p50),
        r(s.ttft.p99, base.ttft.p99),
        r(s.itl.p50, base.itl.p50),
        r(s.itl.p99, base.itl.p99),
        r(s.tpot.p50, base.tpot.p50),
        r(s.e2e.p50, base.e2e.p50),
        r(s.e2e.p99, base.e2e.p99),
    )
}

pub fn table(p: &Point) -> String {
    let mut out = format!("{} = {}\n\n{HEADER}\n", p.kind, p.value);
    out.push_str(&"|---".repeat(10));
    out.push_str("|\n");
    for t in &p.targets {
        let _ = writeln!(out, "{}", row(&t.label, &t.summary));
    }
    if let Some(base) = p.targets.first() {
        for t in p.targets.iter().skip(1) {
            let _ = writeln!(out, "{}", ratio_row(&t.label, &t.summary, &base.summary));
        }
    }
    out
}

pub fn print_point(p: &Point) {
    println!("\n{}", table(p));
}

pub fn write_report(dir: &Path, report: &RunReport) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let mut md = String::from("# Load test report\n\n");
    let a = &report.args;
    let load = match (a.rate, a.concurrency) {
        (Some(r), _) => format!("open loop, {r} req/s (burstiness {})", a.burstiness),
        (_, Some(c)) => format!("closed loop, {c} clients"),
        _ => String::new(),
    };
    let _ = writeln!(
        md,
        "Model `{}`, {load}, workload `{:?}` (seed {}), {} endpoint, stream {}.\n",
        report.model,
        a.workload.workload,
        a.workload.seed,
        format!("{:?}", a.endpoint).to_lowercase(),
        !a.no_stream
    );
    for p in &report.points {
        md.push_str(&table(p));
        md.push('\n');
    }
    md.push_str(&monitoring(report));
    for (file, title) in plots::write_all(dir, report)? {
        let _ = writeln!(md, "## {title}\n\n![{title}]({file})\n");
    }
    std::fs::write(dir.join("report.md"), md)?;
    Ok(())
}

/// `x` in few characters: 17, 0.25, 51.2k, 1.4G.
fn compact(x: f64) -> String {
    let a = x.abs();
    let (v, unit) = match a {
        _ if a >= 1e9 => (x / 1e9, "G"),
        _ if a >= 1e6 => (x / 1e6, "M"),
        _ if a >= 1e4 => (x / 1e3, "k"),
        _ => (x, ""),
    };
    match (unit, v.fract() == 0.0) {
        ("", true) => format!("{v:.0}"),
        ("", false) if a >= 100.0 => format!("{v:.0}"),
        ("", false) => format!("{v:.2}"),
        _ => format!("{v:.1}{unit}"),
    }
}

/// One row per sampled series: first, last and largest value over the load
/// and the least-squares slope per hour.
pub fn trend_table(trends: &Trends) -> String {
    let mut out = format!(
        "trends over the load ({:.0} s to {:.0} s)\n\n| series | samples | first | last | max | slope/h |\n|---|---|---|---|---|---|\n",
        trends.from_s, trends.to_s
    );
    for t in &trends.series {
        let slope = match t.slope_per_hour {
            Some(s) if s > 0.0 => format!("+{}", compact(s)),
            Some(s) => compact(s),
            None => "–".into(),
        };
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} | {} | {slope} |",
            t.series,
            t.samples,
            compact(t.first),
            compact(t.last),
            compact(t.max)
        );
    }
    out
}

/// `leak check: passed …` or `leak check: FAILED: <series> (baseline, now, allowed); …`.
pub fn leak_line(c: &LeakCheck) -> String {
    let value = |v: Option<f64>| v.map_or("none".to_string(), compact);
    match (c.passed, c.checked) {
        (true, n) => format!(
            "leak check: passed ({n} series back at baseline after {:.1} s)",
            c.waited_s
        ),
        (false, 0) => "leak check: FAILED: no open-fd, KV or in-flight series to compare".into(),
        (false, _) => {
            let leaks: Vec<String> = (c.leaks.iter())
                .map(|l| {
                    format!(
                        "{} (baseline {}, now {}, allowed {})",
                        l.series,
                        value(l.baseline),
                        value(l.now),
                        compact(l.allowed)
                    )
                })
                .collect();
            format!(
                "leak check: FAILED after {:.1} s: {}",
                c.waited_s,
                leaks.join("; ")
            )
        }
    }
}

/// The trend table and the leak check's verdict (empty when nothing was sampled).
fn monitoring(report: &RunReport) -> String {
    let mut out = String::new();
    if !report.trends.series.is_empty() {
        let _ = writeln!(out, "{}", trend_table(&report.trends));
    }
    if let Some(c) = &report.leak_check {
        let _ = writeln!(out, "{}\n", leak_line(c));
    }
    out
}

/// Prints the trend table and the leak check's verdict.
pub fn print_monitoring(report: &RunReport) {
    let text = monitoring(report);
    if !text.is_empty() {
        println!("\n{}", text.trim_end());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_are_compact() {
        let got: Vec<String> = [17.0, 0.25, 512.4, 51_200.0, 1.5e6, -2.4e9]
            .into_iter()
            .map(compact)
            .collect();
        assert_eq!(got, ["17", "0.25", "512", "51.2k", "1.5M", "-2.4G"]);
    }
}
