//! SVG plots of a run: latency CDFs per target, latency and throughput
//! against the swept rate or concurrency, and scraped pool signals over time.

use std::collections::BTreeMap;
use std::path::Path;

use plotters::prelude::*;

use super::stats::Percentiles;
use super::RunReport;

type Series = (String, Vec<(f64, f64)>);
/// A latency measure: file stem, description, and how to read it off a record.
type Measure = (
    &'static str,
    &'static str,
    fn(&super::stats::Record) -> Vec<f64>,
);

fn bounds(series: &[Series]) -> (f64, f64, f64, f64) {
    let pts = series.iter().flat_map(|(_, p)| p.iter());
    let (mut x0, mut x1, mut y0, mut y1) =
        (f64::INFINITY, f64::NEG_INFINITY, 0.0f64, f64::NEG_INFINITY);
    for &(x, y) in pts {
        x0 = x0.min(x);
        x1 = x1.max(x);
        y0 = y0.min(y);
        y1 = y1.max(y);
    }
    if !x0.is_finite() {
        return (0.0, 1.0, 0.0, 1.0);
    }
    let pad = |a: f64, b: f64| if b > a { (a, b) } else { (a, a + 1.0) };
    let (x0, x1) = pad(x0, x1);
    let (y0, y1) = pad(y0, y1 * 1.05);
    (x0, x1, y0, y1)
}

/// A line chart of `series` into `dir/file`.
fn chart(
    dir: &Path,
    file: &str,
    title: &str,
    x_desc: &str,
    y_desc: &str,
    series: &[Series],
) -> anyhow::Result<()> {
    let path = dir.join(file);
    let root = SVGBackend::new(&path, (900, 520)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| anyhow::anyhow!("{e}"))?;
    let (x0, x1, y0, y1) = bounds(series);
    let mut c = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 22))
        .margin(12)
        .x_label_area_size(45)
        .y_label_area_size(70)
        .build_cartesian_2d(x0..x1, y0..y1)
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    c.configure_mesh()
        .x_desc(x_desc)
        .y_desc(y_desc)
        .draw()
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    for (i, (label, points)) in series.iter().enumerate() {
        let color = Palette99::pick(i).to_rgba();
        c.draw_series(LineSeries::new(
            points.iter().copied(),
            color.stroke_width(2),
        ))
        .map_err(|e| anyhow::anyhow!("{e}"))?
        .label(label.as_str())
        .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2)));
    }
    c.configure_series_labels()
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .position(SeriesLabelPosition::LowerRight)
        .draw()
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    root.present().map_err(|e| anyhow::anyhow!("{e}"))?;
    Ok(())
}

/// Empirical CDF points (value in ms, fraction).
fn cdf(values: &[f64]) -> Vec<(f64, f64)> {
    let mut v: Vec<f64> = values.iter().copied().filter(|x| x.is_finite()).collect();
    v.sort_by(f64::total_cmp);
    let n = v.len() as f64;
    v.iter()
        .enumerate()
        .map(|(i, x)| (x * 1e3, (i + 1) as f64 / n))
        .collect()
}

/// Writes every plot; returns (file, title) pairs for the report.
pub fn write_all(dir: &Path, report: &RunReport) -> anyhow::Result<Vec<(String, String)>> {
    let mut out = Vec::new();
    let Some(point) = report.points.last() else {
        return Ok(out);
    };
    let suffix = format!("{} = {}", point.kind, point.value);
    let measures: [Measure; 3] = [
        ("ttft", "time to first token", |r| {
            r.ttft.into_iter().collect()
        }),
        ("itl", "inter-token latency", |r| r.itl.clone()),
        ("e2e", "end-to-end latency", |r| vec![r.e2e]),
    ];
    for (name, what, get) in measures {
        let series: Vec<Series> = point
            .targets
            .iter()
            .map(|t| {
                let ok = t.records.iter().filter(|r| !r.warmup && r.error.is_none());
                (t.label.clone(), cdf(&ok.flat_map(get).collect::<Vec<_>>()))
            })
            .collect();
        let file = format!("cdf_{name}.svg");
        let title = format!("CDF of {what} ({suffix})");
        chart(
            dir,
            &file,
            &title,
            &format!("{what} (ms)"),
            "fraction of requests",
            &series,
        )?;
        out.push((file, title));
    }
    if report.points.len() > 1 {
        out.extend(sweep_plots(dir, report)?);
    }
    if !report.scrape.is_empty() {
        out.extend(scrape_plots(dir, report)?);
    }
    Ok(out)
}

fn sweep_plots(dir: &Path, report: &RunReport) -> anyhow::Result<Vec<(String, String)>> {
    let kind = report.points[0].kind;
    let n_targets = report.points[0].targets.len();
    let series = |f: &dyn Fn(&super::stats::Summary) -> f64, tag: &str| -> Vec<Series> {
        (0..n_targets)
            .map(|t| {
                let label = format!("{} {tag}", report.points[0].targets[t].label);
                let pts = report
                    .points
                    .iter()
                    .filter_map(|p| p.targets.get(t).map(|r| (p.value, f(&r.summary))))
                    .collect();
                (label, pts)
            })
            .collect()
    };
    let p = |sel: fn(&Percentiles) -> f64, m: fn(&super::stats::Summary) -> Percentiles| {
        move |s: &super::stats::Summary| sel(&m(s)) * 1e3
    };
    let mut out = Vec::new();
    let mut latency = |name: &str,
                       what: &str,
                       m: fn(&super::stats::Summary) -> Percentiles|
     -> anyhow::Result<()> {
        let mut s = series(&p(|x| x.p50, m), "p50");
        s.extend(series(&p(|x| x.p99, m), "p99"));
        let file = format!("{name}_vs_{kind}.svg");
        let title = format!("{what} vs {kind}");
        chart(dir, &file, &title, kind, &format!("{what} (ms)"), &s)?;
        out.push((file, title));
        Ok(())
    };
    latency("ttft", "TTFT", |s| s.ttft)?;
    latency("tpot", "TPOT", |s| s.tpot)?;
    let mut s = series(&|s| s.output_tokens_per_second, "output tok/s");
    let file = format!("throughput_vs_{kind}.svg");
    chart(
        dir,
        &file,
        &format!("throughput vs {kind}"),
        kind,
        "output tokens/s",
        &s,
    )?;
    out.push((file, format!("throughput vs {kind}")));
    s = series(&|s| s.requests_per_second, "requests/s");
    s.extend(series(&|s| s.goodput, "goodput"));
    let file = format!("goodput_vs_{kind}.svg");
    chart(
        dir,
        &file,
        &format!("requests/s and goodput vs {kind}"),
        kind,
        "requests/s",
        &s,
    )?;
    out.push((file, format!("requests/s and goodput vs {kind}")));
    Ok(out)
}

fn scrape_plots(dir: &Path, report: &RunReport) -> anyhow::Result<Vec<(String, String)>> {
    // Group series by metric name.
    let mut families: BTreeMap<String, BTreeMap<String, Vec<(f64, f64)>>> = BTreeMap::new();
    for s in &report.scrape {
        let name = s.series.split('{').next().unwrap_or(&s.series).to_string();
        families
            .entry(name)
            .or_default()
            .entry(s.series.clone())
            .or_default()
            .push((s.t, s.value));
    }
    let mut out = Vec::new();
    for (name, series) in families {
        let series: Vec<Series> = series.into_iter().collect();
        let file = format!("scrape_{name}.svg");
        chart(
            dir,
            &file,
            &format!("{name} over time"),
            "seconds",
            &name,
            &series,
        )?;
        out.push((file, format!("{name} over time")));
    }
    Ok(out)
}
