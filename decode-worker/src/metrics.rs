//! The decode worker's Prometheus metrics.

use pdserve_runtime::metrics::{self as m, labels};
use prometheus::{Gauge, Histogram, IntCounter, IntCounterVec, IntGaugeVec, Registry};

/// Every series the decode worker exports.
pub struct DecodeMetrics {
    pub registry: Registry,
    pub queue_depth: IntGaugeVec,
    pub queue_depth_tokens: IntGaugeVec,
    pub active_sequences: IntGaugeVec,
    pub kv_usage_ratio: Gauge,
    pub kv_used_tokens: Gauge,
    pub kv_capacity_tokens: Gauge,
    pub batch_size: Histogram,
    pub step_seconds: Histogram,
    pub prefill_seconds: Histogram,
    pub prompt_tokens: IntCounter,
    pub generation_tokens: IntCounter,
    pub requests: IntCounterVec,
    pub mbu: prometheus::Gauge,
    pub kv_transfer_bytes: IntCounter,
    pub kv_transfer_seconds: Histogram,
}

impl DecodeMetrics {
    pub fn new() -> Self {
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
            active_sequences: m::int_gauge_vec(
                &r,
                m::ACTIVE_SEQUENCES,
                "Sequences in the decode batch.",
                pool,
            ),
            kv_usage_ratio: m::gauge(
                &r,
                m::KV_CACHE_USAGE_RATIO,
                "Reserved share of the KV cache budget.",
            ),
            kv_used_tokens: m::gauge(
                &r,
                m::KV_CACHE_USED_TOKENS,
                "KV cache tokens reserved by live sequences.",
            ),
            kv_capacity_tokens: m::gauge(
                &r,
                m::KV_CACHE_CAPACITY_TOKENS,
                "KV cache budget in tokens.",
            ),
            batch_size: m::histogram(
                &r,
                m::DECODE_BATCH_SIZE,
                "Sequences per decode step.",
                m::BATCH_BUCKETS,
            ),
            step_seconds: m::histogram(
                &r,
                m::DECODE_STEP_SECONDS,
                "Time of one batched decode step.",
                m::STEP_BUCKETS,
            ),
            prefill_seconds: m::histogram(
                &r,
                m::PREFILL_SECONDS,
                "Time of one local prefill chunk.",
                m::STEP_BUCKETS,
            ),
            prompt_tokens: m::counter(
                &r,
                m::PROMPT_TOKENS_TOTAL,
                "Prompt tokens prefilled locally.",
            ),
            generation_tokens: m::counter(&r, m::GENERATION_TOKENS_TOTAL, "Tokens generated."),
            requests: m::counter_vec(
                &r,
                m::REQUESTS_TOTAL,
                "Sequences finished, by status.",
                &["status"],
            ),
            mbu: m::gauge(&r, m::MODEL_BANDWIDTH_UTILIZATION, "Estimated share of peak memory bandwidth the last decode step used (weights plus KV read)."),
            kv_transfer_bytes: m::counter(
                &r,
                m::KV_TRANSFER_BYTES_TOTAL,
                "KV bytes received from prefill workers.",
            ),
            kv_transfer_seconds: m::histogram(
                &r,
                m::KV_TRANSFER_SECONDS,
                "Time to receive one sequence's KV.",
                m::STEP_BUCKETS,
            ),
            registry: r,
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
