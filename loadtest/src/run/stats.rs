//! Per-request records and the statistics over them: percentiles,
//! throughput, goodput and the achieved arrival rate.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::scrape::Sample;

/// What one request measured. Times are seconds; `start` is from the run's start.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Record {
    /// Index of the target in `--url` / `--compare` order.
    pub target: usize,
    /// Index of the workload item.
    pub item: usize,
    /// The slice of the run it belongs to (with `--compare`, targets take
    /// turns in slices; rates are computed within slices).
    pub slice: usize,
    pub start: f64,
    /// Time to the first generated text (the whole response when not streaming).
    pub ttft: Option<f64>,
    /// Gaps between successive streamed chunks.
    pub itl: Vec<f64>,
    pub e2e: f64,
    pub prompt_tokens: u32,
    pub completion_tokens: u32,
    /// The error class, when the request failed.
    pub error: Option<String>,
    /// Started during the warm-up: excluded from the statistics.
    pub warmup: bool,
    /// The response's `id`, where it had one: it pairs the request with
    /// the server's own logs (`loadtest/scripts/router_overhead.sh`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
}

impl Record {
    /// Time per output token after the first.
    pub fn tpot(&self) -> Option<f64> {
        let ttft = self.ttft?;
        (self.completion_tokens > 1)
            .then(|| (self.e2e - ttft) / (self.completion_tokens - 1) as f64)
    }
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Percentiles {
    pub n: usize,
    pub mean: f64,
    pub p50: f64,
    pub p90: f64,
    pub p95: f64,
    pub p99: f64,
    pub max: f64,
}

/// Linear interpolation between closest ranks (numpy's default).
pub fn quantile(sorted: &[f64], q: f64) -> f64 {
    match sorted.len() {
        0 => 0.0,
        1 => sorted[0],
        n => {
            let pos = q.clamp(0.0, 1.0) * (n - 1) as f64;
            let (lo, hi) = (pos.floor() as usize, pos.ceil() as usize);
            sorted[lo] + (sorted[hi] - sorted[lo]) * (pos - lo as f64)
        }
    }
}

pub fn percentiles(values: &[f64]) -> Percentiles {
    let mut v: Vec<f64> = values.iter().copied().filter(|x| x.is_finite()).collect();
    v.sort_by(f64::total_cmp);
    if v.is_empty() {
        return Percentiles::default();
    }
    Percentiles {
        n: v.len(),
        mean: v.iter().sum::<f64>() / v.len() as f64,
        p50: quantile(&v, 0.50),
        p90: quantile(&v, 0.90),
        p95: quantile(&v, 0.95),
        p99: quantile(&v, 0.99),
        max: v[v.len() - 1],
    }
}

/// Service-level objectives for goodput (seconds).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Slo {
    pub ttft: Option<f64>,
    pub tpot: Option<f64>,
}

impl Slo {
    pub fn met(&self, r: &Record) -> bool {
        let ttft_ok = match (self.ttft, r.ttft) {
            (Some(limit), Some(t)) => t <= limit,
            (Some(_), None) => false,
            (None, _) => true,
        };
        let tpot_ok = match (self.tpot, r.tpot()) {
            (Some(limit), Some(t)) => t <= limit,
            _ => true,
        };
        r.error.is_none() && ttft_ok && tpot_ok
    }
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Summary {
    /// Measured requests (warm-up excluded).
    pub requests: usize,
    pub ok: usize,
    pub errors: BTreeMap<String, usize>,
    /// Seconds over which the measured requests ran (first start to last end).
    pub duration: f64,
    pub requests_per_second: f64,
    pub output_tokens_per_second: f64,
    pub total_tokens_per_second: f64,
    /// Requests per second that succeeded within the SLOs.
    pub goodput: f64,
    /// Share of requests that met the SLOs.
    pub slo_attainment: f64,
    pub requested_rate: Option<f64>,
    /// Arrivals per second actually achieved (open loop).
    pub achieved_rate: f64,
    pub ttft: Percentiles,
    pub itl: Percentiles,
    pub tpot: Percentiles,
    pub e2e: Percentiles,
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
}

pub fn summarize<'a>(
    records: impl IntoIterator<Item = &'a Record>,
    slo: &Slo,
    requested_rate: Option<f64>,
) -> Summary {
    let measured: Vec<&Record> = records.into_iter().filter(|r| !r.warmup).collect();
    let mut s = Summary {
        requests: measured.len(),
        requested_rate,
        ..Default::default()
    };
    if measured.is_empty() {
        return s;
    }
    let spans = slice_spans(&measured);
    s.duration = time_under_load(&spans);
    s.achieved_rate = achieved_rate(&spans);
    count_outcomes(&mut s, &measured);
    let good = measured.iter().filter(|r| slo.met(r)).count();
    s.requests_per_second = s.ok as f64 / s.duration;
    s.output_tokens_per_second = s.completion_tokens as f64 / s.duration;
    s.total_tokens_per_second = (s.prompt_tokens + s.completion_tokens) as f64 / s.duration;
    s.goodput = good as f64 / s.duration;
    s.slo_attainment = good as f64 / measured.len() as f64;
    latencies(&mut s, &measured);
    s
}

/// The measured requests of one slice: when they started and ended.
#[derive(Debug, Clone, Copy)]
struct SliceSpan {
    first_start: f64,
    last_start: f64,
    last_end: f64,
    requests: usize,
}

impl Default for SliceSpan {
    fn default() -> Self {
        Self {
            first_start: f64::INFINITY,
            last_start: f64::NEG_INFINITY,
            last_end: f64::NEG_INFINITY,
            requests: 0,
        }
    }
}

/// Each slice's span, by slice index.
fn slice_spans(measured: &[&Record]) -> BTreeMap<usize, SliceSpan> {
    let mut spans: BTreeMap<usize, SliceSpan> = BTreeMap::new();
    for r in measured {
        let span = spans.entry(r.slice).or_default();
        span.first_start = span.first_start.min(r.start);
        span.last_start = span.last_start.max(r.start);
        span.last_end = span.last_end.max(r.start + r.e2e);
        span.requests += 1;
    }
    spans
}

/// Time under load: the span of each slice (first start to last end),
/// summed, so other targets' turns in between do not count.
fn time_under_load(spans: &BTreeMap<usize, SliceSpan>) -> f64 {
    spans
        .values()
        .map(|v| v.last_end - v.first_start)
        .sum::<f64>()
        .max(1e-9)
}

/// Arrivals per second within slices: n arrivals span n - 1 gaps, per slice.
fn achieved_rate(spans: &BTreeMap<usize, SliceSpan>) -> f64 {
    let gaps: usize = spans.values().map(|v| v.requests - 1).sum();
    let arrival_span: f64 = spans.values().map(|v| v.last_start - v.first_start).sum();
    match arrival_span > 0.0 {
        true => gaps as f64 / arrival_span,
        false => 0.0,
    }
}

/// Successes, errors by class, and token counts.
fn count_outcomes(s: &mut Summary, measured: &[&Record]) {
    for r in measured {
        match &r.error {
            None => s.ok += 1,
            Some(class) => *s.errors.entry(class.clone()).or_default() += 1,
        }
        s.prompt_tokens += r.prompt_tokens as u64;
        s.completion_tokens += r.completion_tokens as u64;
    }
}

/// Latency percentiles over the successful requests.
fn latencies(s: &mut Summary, measured: &[&Record]) {
    let ok: Vec<&&Record> = measured.iter().filter(|r| r.error.is_none()).collect();
    s.ttft = percentiles(&ok.iter().filter_map(|r| r.ttft).collect::<Vec<_>>());
    s.itl = percentiles(
        &ok.iter()
            .flat_map(|r| r.itl.iter().copied())
            .collect::<Vec<_>>(),
    );
    s.tpot = percentiles(&ok.iter().filter_map(|r| r.tpot()).collect::<Vec<_>>());
    s.e2e = percentiles(&ok.iter().map(|r| r.e2e).collect::<Vec<_>>());
}

/// A sampled series' course over the load.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Trend {
    pub series: String,
    /// Samples within the window.
    pub samples: usize,
    pub first: f64,
    pub last: f64,
    pub max: f64,
    /// Least-squares slope in the series' unit per hour (`None` with fewer
    /// than two sample times).
    pub slope_per_hour: Option<f64>,
}

/// Every sampled series' trend over one window of the run.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Trends {
    /// Start of the window, seconds since the run started (after the warm-up).
    pub from_s: f64,
    /// End of the window: the end of the load.
    pub to_s: f64,
    pub series: Vec<Trend>,
}

/// Least-squares slope of `(t, y)` points, in `y` per unit of `t`; `None`
/// with fewer than two distinct times.
pub fn slope(points: &[(f64, f64)]) -> Option<f64> {
    let n = points.len() as f64;
    if points.len() < 2 {
        return None;
    }
    let mean_t = points.iter().map(|p| p.0).sum::<f64>() / n;
    let mean_y = points.iter().map(|p| p.1).sum::<f64>() / n;
    let (mut cov, mut var) = (0.0, 0.0);
    for (t, y) in points {
        cov += (t - mean_t) * (y - mean_y);
        var += (t - mean_t) * (t - mean_t);
    }
    (var > 1e-12).then(|| cov / var)
}

/// The trend of every series among `samples` between `from` and `to` seconds.
pub fn trends(samples: &[Sample], from: f64, to: f64) -> Trends {
    let mut by_series: BTreeMap<&str, Vec<(f64, f64)>> = BTreeMap::new();
    for s in samples.iter().filter(|s| s.t >= from && s.t <= to) {
        (by_series.entry(&s.series).or_default()).push((s.t, s.value));
    }
    let series = by_series
        .into_iter()
        .map(|(series, mut points)| {
            points.sort_by(|a, b| a.0.total_cmp(&b.0));
            Trend {
                series: series.to_string(),
                samples: points.len(),
                first: points[0].1,
                last: points[points.len() - 1].1,
                max: points.iter().map(|p| p.1).fold(f64::MIN, f64::max),
                slope_per_hour: slope(&points).map(|per_s| per_s * 3600.0),
            }
        })
        .collect();
    Trends {
        from_s: from,
        to_s: to,
        series,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(start: f64, ttft: f64, e2e: f64, tokens: u32) -> Record {
        Record {
            start,
            ttft: Some(ttft),
            e2e,
            completion_tokens: tokens,
            prompt_tokens: 10,
            itl: vec![(e2e - ttft) / (tokens.max(2) - 1) as f64; tokens.saturating_sub(1) as usize],
            ..Default::default()
        }
    }

    #[test]
    fn percentiles_interpolate_like_numpy() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        let p = percentiles(&v);
        assert_eq!(p.n, 100);
        assert!((p.p50 - 50.5).abs() < 1e-9);
        assert!((p.p90 - 90.1).abs() < 1e-9);
        assert!((p.p99 - 99.01).abs() < 1e-9);
        assert_eq!(p.max, 100.0);
        assert!((p.mean - 50.5).abs() < 1e-9);
        assert_eq!(percentiles(&[]).n, 0);
        assert_eq!(percentiles(&[3.0]).p99, 3.0);
    }

    #[test]
    fn goodput_counts_only_requests_within_both_slos() {
        let records = vec![
            rec(0.0, 0.1, 1.1, 11), // tpot 0.1
            rec(1.0, 0.5, 1.5, 11), // ttft too slow
            rec(2.0, 0.1, 3.1, 11), // tpot 0.3: too slow
            Record {
                start: 3.0,
                e2e: 0.1,
                error: Some("http_5xx".into()),
                ..Default::default()
            },
        ];
        let slo = Slo {
            ttft: Some(0.2),
            tpot: Some(0.2),
        };
        let s = summarize(&records, &slo, Some(1.0));
        assert_eq!((s.requests, s.ok), (4, 3));
        assert_eq!(s.errors["http_5xx"], 1);
        // First start 0, last end 5.1 (the third request).
        assert!((s.duration - 5.1).abs() < 1e-9);
        assert!((s.goodput - 1.0 / 5.1).abs() < 1e-9);
        assert!((s.slo_attainment - 0.25).abs() < 1e-9);
        assert!((s.achieved_rate - 1.0).abs() < 1e-9);
        assert_eq!(s.completion_tokens, 33);
        assert!((s.tpot.p50 - 0.1).abs() < 1e-9);
    }

    #[test]
    fn rates_count_only_time_inside_slices() {
        // Two slices of 2 s each, 100 s apart (another target ran between).
        let mut records = vec![rec(0.0, 0.1, 1.0, 2), rec(1.0, 0.1, 1.0, 2)];
        let mut later = vec![rec(100.0, 0.1, 1.0, 2), rec(101.0, 0.1, 1.0, 2)];
        later.iter_mut().for_each(|r| r.slice = 1);
        records.extend(later);
        let s = summarize(&records, &Slo::default(), Some(1.0));
        assert!((s.duration - 4.0).abs() < 1e-9, "{}", s.duration);
        assert!((s.achieved_rate - 1.0).abs() < 1e-9);
        assert!((s.requests_per_second - 1.0).abs() < 1e-9);
    }

    #[test]
    fn warmup_requests_are_excluded() {
        let mut a = rec(0.0, 0.1, 1.0, 5);
        a.warmup = true;
        let s = summarize(&[a, rec(1.0, 0.2, 1.0, 5)], &Slo::default(), None);
        assert_eq!(s.requests, 1);
        assert!((s.ttft.p50 - 0.2).abs() < 1e-9);
    }

    #[test]
    fn slope_is_the_least_squares_fit() {
        // Worked by hand: mean t 1.5, mean y 6, covariance 9.5, variance 5.
        let pts = [(0.0, 3.0), (1.0, 5.5), (2.0, 6.5), (3.0, 9.0)];
        let got = slope(&pts).unwrap();
        assert!((got - 1.9).abs() < 1e-9, "{got}");
        let line: Vec<(f64, f64)> = (0..10).map(|i| (i as f64, 7.0 - 0.5 * i as f64)).collect();
        assert!((slope(&line).unwrap() + 0.5).abs() < 1e-9);
        assert_eq!(slope(&[(1.0, 1.0)]), None);
        assert_eq!(slope(&[(1.0, 1.0), (1.0, 5.0)]), None, "one time only");
    }

    #[test]
    fn trends_per_series_in_the_window_per_hour() {
        let sample = |t: f64, series: &str, value: f64| Sample {
            t,
            series: series.into(),
            value,
        };
        let mut samples = vec![sample(0.0, "rss", 1e9)]; // before the window
        for i in 1..=10 {
            let t = i as f64;
            samples.push(sample(t, "rss", 1000.0 + 2.0 * t)); // 2 B/s
            samples.push(sample(t, "fds", 30.0));
        }
        let tr = trends(&samples, 1.0, 10.0);
        assert_eq!((tr.from_s, tr.to_s), (1.0, 10.0));
        let names: Vec<&str> = tr.series.iter().map(|t| t.series.as_str()).collect();
        assert_eq!(names, vec!["fds", "rss"]);
        let rss = &tr.series[1];
        assert_eq!(
            (rss.samples, rss.first, rss.last, rss.max),
            (10, 1002.0, 1020.0, 1020.0)
        );
        assert!((rss.slope_per_hour.unwrap() - 7200.0).abs() < 1e-6);
        assert_eq!(tr.series[0].slope_per_hour, Some(0.0));
    }
}
