//! Scraping a Prometheus endpoint during a run: the pool signals (queue
//! depth, workers, active sequences, KV usage, desired replicas) over time.

use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

/// Series kept from each scrape (prefixes of metric names).
const KEEP: &[&str] = &[
    "pdserve_queue_depth",
    "pdserve_active_sequences",
    "pdserve_workers",
    "pdserve_requests_in_flight",
    "pdserve_kv_cache_usage_ratio",
    "pdserve_autoscaler_desired_replicas",
];

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Sample {
    /// Seconds since the run started.
    pub t: f64,
    /// The series: name and labels as exposed, e.g. `pdserve_queue_depth{pool="prefill"}`.
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

pub struct Scraper {
    stop: oneshot::Sender<()>,
    task: JoinHandle<Vec<Sample>>,
}

pub fn spawn(client: reqwest::Client, url: String, every: Duration, origin: Instant) -> Scraper {
    let (stop, mut stopped) = oneshot::channel();
    let task = tokio::spawn(async move {
        let mut samples = Vec::new();
        let mut tick = tokio::time::interval(every.max(Duration::from_millis(50)));
        loop {
            tokio::select! {
                biased;
                _ = &mut stopped => break,
                _ = tick.tick() => {}
            }
            let t = origin.elapsed().as_secs_f64();
            let got = client
                .get(&url)
                .timeout(every.max(Duration::from_millis(500)))
                .send()
                .await;
            if let Ok(text) = match got {
                Ok(r) => r.text().await,
                Err(e) => Err(e),
            } {
                samples.extend(parse(&text, t));
            }
        }
        samples
    });
    Scraper { stop, task }
}

impl Scraper {
    pub async fn finish(self) -> Vec<Sample> {
        let _ = self.stop.send(());
        self.task.await.unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_the_pool_signals() {
        let text = "# HELP x\npdserve_queue_depth{pool=\"prefill\"} 3\npdserve_queue_depth_tokens{pool=\"prefill\"} 700\npdserve_other 1\npdserve_workers{pool=\"decode\",state=\"ready\"} 2\n";
        let s = parse(text, 1.5);
        assert_eq!(s.len(), 3);
        assert_eq!(s[0].series, "pdserve_queue_depth{pool=\"prefill\"}");
        assert_eq!(s[1].value, 700.0);
        assert_eq!(s[2].t, 1.5);
    }
}
