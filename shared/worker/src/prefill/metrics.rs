//! The prefill worker's Prometheus series (names from `pdserve_runtime::metrics`).

use pdserve_runtime::metrics::{self as m, labels};
use prometheus::{Gauge, Histogram, IntCounter, IntCounterVec, IntGaugeVec, Registry};

use crate::kv::KvMetrics;
use crate::queue::EngineStats;

/// Every series a prefill worker exports, real or mock.
pub struct PrefillMetrics {
    pub registry: Registry,
    pub queue_depth: IntGaugeVec,
    pub queue_depth_tokens: IntGaugeVec,
    pub prefill_seconds: Histogram,
    pub batch_size: Histogram,
    pub prompt_tokens: IntCounter,
    pub kv_transfer_bytes: IntCounter,
    pub kv_transfer_seconds: Histogram,
    pub requests: IntCounterVec,
    /// Matmul FLOP/s of the last batch over the peak (a mock computes nothing: 0).
    pub mfu: Gauge,
    pub transfer_tail_seconds: Histogram,
    /// Blocks, prefix-cache lookups and evictions.
    pub cache: KvMetrics,
}

impl PrefillMetrics {
    pub fn new() -> Self {
        let r = Registry::new();
        let pool = &["pool"];
        Self {
            queue_depth: m::int_gauge_vec(&r, m::QUEUE_DEPTH, "Prefill jobs waiting or running.", pool),
            queue_depth_tokens: m::int_gauge_vec(&r, m::QUEUE_DEPTH_TOKENS, "Prompt tokens waiting.", pool),
            prefill_seconds: m::histogram(&r, m::PREFILL_SECONDS, "Compute time of one prompt.", m::REQUEST_BUCKETS),
            batch_size: m::histogram(&r, m::PREFILL_BATCH_SIZE, "Prompts run together in one batch of forward passes.", m::BATCH_BUCKETS),
            prompt_tokens: m::counter(&r, m::PROMPT_TOKENS_TOTAL, "Prompt tokens prefilled."),
            kv_transfer_bytes: m::counter(&r, m::KV_TRANSFER_BYTES_TOTAL, "KV bytes sent to decode workers."),
            kv_transfer_seconds: m::histogram(&r, m::KV_TRANSFER_SECONDS, "From the first KV byte sent to the decode worker's acknowledgement.", m::STEP_BUCKETS),
            requests: m::counter_vec(&r, m::REQUESTS_TOTAL, "Prefill jobs finished, by status.", &["status"]),
            mfu: m::gauge(&r, m::MODEL_FLOPS_UTILIZATION, "Estimated share of peak FLOP/s the last prompt used (matmuls only)."),
            transfer_tail_seconds: m::histogram(&r, m::KV_TRANSFER_TAIL_SECONDS, "KV transfer time left after the prompt's compute ended (transfer not hidden by compute).", m::STEP_BUCKETS),
            cache: KvMetrics::new(&r),
            registry: r,
        }
    }

    /// Publishes the queue gauges from the engine's counters.
    pub fn publish(&self, stats: &EngineStats) {
        let pool = [labels::POOL_PREFILL];
        self.queue_depth
            .with_label_values(&pool)
            .set(stats.in_flight() as i64);
        self.queue_depth_tokens
            .with_label_values(&pool)
            .set(stats.queued_tokens() as i64);
    }

    /// Counts a finished job, delivered or failed.
    pub fn finished(&self, ok: bool) {
        let status = match ok {
            true => labels::STATUS_OK,
            false => labels::STATUS_ERROR,
        };
        self.requests.with_label_values(&[status]).inc();
    }

    /// Records a finished prompt of `tokens` that took `secs` to compute.
    pub fn prompt_done(&self, tokens: usize, secs: f64) {
        self.prefill_seconds.observe(secs);
        self.prompt_tokens.inc_by(tokens as u64);
    }
}

impl Default for PrefillMetrics {
    fn default() -> Self {
        Self::new()
    }
}
