//! The mock workers' Prometheus series: the real workers' names (from
//! `pdserve_runtime::metrics`), so dashboards and the router's scraping work
//! unchanged. The MFU/MBU estimates are exported but stay 0: the mock moves
//! no weights.

use pdserve_runtime::metrics::{self as m, labels};
use prometheus::{Gauge, Histogram, IntCounter, IntCounterVec, IntGaugeVec, Registry};

/// Series both pools export.
pub struct Common {
    pub registry: Registry,
    pub queue_depth: IntGaugeVec,
    pub queue_depth_tokens: IntGaugeVec,
    pub prompt_tokens: IntCounter,
    pub kv_transfer_bytes: IntCounter,
    pub kv_transfer_seconds: Histogram,
    pub requests: IntCounterVec,
}

impl Common {
    fn new(transfer: &str) -> Self {
        let r = Registry::new();
        let pool = &["pool"];
        Self {
            queue_depth: m::int_gauge_vec(&r, m::QUEUE_DEPTH, "Requests waiting to run.", pool),
            queue_depth_tokens: m::int_gauge_vec(
                &r,
                m::QUEUE_DEPTH_TOKENS,
                "Prompt tokens waiting to be prefilled.",
                pool,
            ),
            prompt_tokens: m::counter(&r, m::PROMPT_TOKENS_TOTAL, "Prompt tokens prefilled."),
            kv_transfer_bytes: m::counter(&r, m::KV_TRANSFER_BYTES_TOTAL, transfer),
            kv_transfer_seconds: m::histogram(
                &r,
                m::KV_TRANSFER_SECONDS,
                "Time to move one sequence's KV.",
                m::STEP_BUCKETS,
            ),
            requests: m::counter_vec(
                &r,
                m::REQUESTS_TOTAL,
                "Sequences or jobs finished, by status.",
                &["status"],
            ),
            registry: r,
        }
    }

    /// Counts one finished request with `status` (a `labels::STATUS_*`).
    pub fn finished(&self, status: &str) {
        self.requests.with_label_values(&[status]).inc();
    }
}

/// The decode worker's series.
pub struct DecodeMetrics {
    pub common: Common,
    pub active_sequences: IntGaugeVec,
    pub kv_usage_ratio: Gauge,
    pub kv_used_tokens: Gauge,
    pub kv_capacity_tokens: Gauge,
    pub batch_size: Histogram,
    pub step_seconds: Histogram,
    pub prefill_seconds: Histogram,
    pub generation_tokens: IntCounter,
    pub mbu: Gauge,
}

impl DecodeMetrics {
    pub fn new() -> Self {
        let common = Common::new("KV bytes received from prefill workers.");
        let r = &common.registry;
        Self {
            active_sequences: m::int_gauge_vec(
                r,
                m::ACTIVE_SEQUENCES,
                "Sequences in the decode batch.",
                &["pool"],
            ),
            kv_usage_ratio: m::gauge(
                r,
                m::KV_CACHE_USAGE_RATIO,
                "Reserved share of the KV cache budget.",
            ),
            kv_used_tokens: m::gauge(
                r,
                m::KV_CACHE_USED_TOKENS,
                "KV cache tokens reserved by live sequences.",
            ),
            kv_capacity_tokens: m::gauge(
                r,
                m::KV_CACHE_CAPACITY_TOKENS,
                "KV cache budget in tokens.",
            ),
            batch_size: m::histogram(
                r,
                m::DECODE_BATCH_SIZE,
                "Sequences per decode step.",
                m::BATCH_BUCKETS,
            ),
            step_seconds: m::histogram(
                r,
                m::DECODE_STEP_SECONDS,
                "Time of one batched decode step.",
                m::STEP_BUCKETS,
            ),
            prefill_seconds: m::histogram(
                r,
                m::PREFILL_SECONDS,
                "Time of one local prefill chunk.",
                m::STEP_BUCKETS,
            ),
            generation_tokens: m::counter(r, m::GENERATION_TOKENS_TOTAL, "Tokens generated."),
            mbu: m::gauge(
                r,
                m::MODEL_BANDWIDTH_UTILIZATION,
                "Estimated share of peak memory bandwidth (0: a mock reads no weights).",
            ),
            common,
        }
    }

    pub fn pool() -> [&'static str; 1] {
        [labels::POOL_DECODE]
    }
}

impl Default for DecodeMetrics {
    fn default() -> Self {
        Self::new()
    }
}

/// The prefill worker's series.
pub struct PrefillMetrics {
    pub common: Common,
    pub prefill_seconds: Histogram,
    pub mfu: Gauge,
    pub transfer_tail_seconds: Histogram,
}

impl PrefillMetrics {
    pub fn new() -> Self {
        let common = Common::new("KV bytes sent to decode workers.");
        let r = &common.registry;
        Self {
            prefill_seconds: m::histogram(
                r,
                m::PREFILL_SECONDS,
                "Compute time of one prompt.",
                m::REQUEST_BUCKETS,
            ),
            mfu: m::gauge(
                r,
                m::MODEL_FLOPS_UTILIZATION,
                "Estimated share of peak FLOP/s (0: a mock computes nothing).",
            ),
            transfer_tail_seconds: m::histogram(
                r,
                m::KV_TRANSFER_TAIL_SECONDS,
                "KV transfer time left after the prompt's compute ended.",
                m::STEP_BUCKETS,
            ),
            common,
        }
    }

    pub fn pool() -> [&'static str; 1] {
        [labels::POOL_PREFILL]
    }
}

impl Default for PrefillMetrics {
    fn default() -> Self {
        Self::new()
    }
}
