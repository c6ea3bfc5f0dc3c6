//! Every Prometheus metric name pdserve exports, in one place, and helpers to
//! register them. Rules: `pdserve_` prefix, `_total` on counters, a unit
//! suffix, label values from constants.

use prometheus::{Encoder, HistogramOpts, Opts, Registry, TextEncoder};

pub const KV_CACHE_USAGE_RATIO: &str = "pdserve_kv_cache_usage_ratio";
pub const KV_CACHE_USED_TOKENS: &str = "pdserve_kv_cache_used_tokens";
pub const KV_CACHE_CAPACITY_TOKENS: &str = "pdserve_kv_cache_capacity_tokens";
pub const ACTIVE_SEQUENCES: &str = "pdserve_active_sequences";
pub const QUEUE_DEPTH: &str = "pdserve_queue_depth";
pub const QUEUE_DEPTH_TOKENS: &str = "pdserve_queue_depth_tokens";
pub const DECODE_BATCH_SIZE: &str = "pdserve_decode_batch_size";
pub const DECODE_STEP_SECONDS: &str = "pdserve_decode_step_seconds";
pub const PREFILL_SECONDS: &str = "pdserve_prefill_seconds";
pub const PREFILL_BATCH_SIZE: &str = "pdserve_prefill_batch_size";
pub const PROMPT_TOKENS_TOTAL: &str = "pdserve_prompt_tokens_total";
pub const GENERATION_TOKENS_TOTAL: &str = "pdserve_generation_tokens_total";
pub const KV_TRANSFER_BYTES_TOTAL: &str = "pdserve_kv_transfer_bytes_total";
pub const KV_TRANSFER_SECONDS: &str = "pdserve_kv_transfer_seconds";
pub const KV_TRANSFER_TAIL_SECONDS: &str = "pdserve_kv_transfer_tail_seconds";
pub const REQUESTS_TOTAL: &str = "pdserve_requests_total";
// The paged KV cache and its prefix cache (workers).
pub const KV_CACHE_BLOCKS: &str = "pdserve_kv_cache_blocks";
pub const KV_CACHE_EVICTIONS_TOTAL: &str = "pdserve_kv_cache_evictions_total";
pub const PREFIX_CACHE_QUERIES_TOTAL: &str = "pdserve_prefix_cache_queries_total";
pub const PREFIX_CACHE_HITS_TOTAL: &str = "pdserve_prefix_cache_hits_total";
pub const PREEMPTIONS_TOTAL: &str = "pdserve_preemptions_total";
pub const MODEL_FLOPS_UTILIZATION: &str = "pdserve_model_flops_utilization_ratio";
pub const MODEL_BANDWIDTH_UTILIZATION: &str = "pdserve_model_bandwidth_utilization_ratio";
// The router's user-facing and dispatch metrics.
pub const TIME_TO_FIRST_TOKEN_SECONDS: &str = "pdserve_time_to_first_token_seconds";
pub const INTER_TOKEN_LATENCY_SECONDS: &str = "pdserve_inter_token_latency_seconds";
pub const REQUEST_DURATION_SECONDS: &str = "pdserve_request_duration_seconds";
pub const REQUEST_STAGE_SECONDS: &str = "pdserve_request_stage_seconds";
pub const REQUESTS_IN_FLIGHT: &str = "pdserve_requests_in_flight";
pub const WORKERS: &str = "pdserve_workers";
pub const PREFILL_RETRIES_TOTAL: &str = "pdserve_prefill_retries_total";
pub const WORKER_ERRORS_TOTAL: &str = "pdserve_worker_errors_total";
pub const MIGRATIONS_TOTAL: &str = "pdserve_migrations_total";
pub const RUNTIME_ALIVE_TASKS: &str = "pdserve_runtime_alive_tasks";
pub const MIGRATION_LOST_SECONDS: &str = "pdserve_migration_lost_seconds";
pub const LOCAL_PREFILLS_TOTAL: &str = "pdserve_local_prefills_total";
// The autoscaler's signals and decision (router).
pub const PREFILL_BACKLOG_SECONDS: &str = "pdserve_prefill_backlog_seconds";
/// The router's tokenizer segment cache (`--tokenizer-cache-mb`).
pub const TOKENIZER_CACHE_HITS_TOTAL: &str = "pdserve_tokenizer_cache_hits_total";
pub const TOKENIZER_CACHE_MISSES_TOTAL: &str = "pdserve_tokenizer_cache_misses_total";
pub const TOKENIZER_CACHE_BYTES: &str = "pdserve_tokenizer_cache_bytes";
pub const POOL_KV_USAGE_RATIO: &str = "pdserve_pool_kv_usage_ratio";
pub const AUTOSCALER_DESIRED_REPLICAS: &str = "pdserve_autoscaler_desired_replicas";
pub const AUTOSCALER_DEMAND_REPLICAS: &str = "pdserve_autoscaler_demand_replicas";
pub const AUTOSCALER_CORRECTION: &str = "pdserve_autoscaler_correction";

/// Label values.
pub mod labels {
    pub const POOL_PREFILL: &str = "prefill";
    pub const POOL_DECODE: &str = "decode";
    pub const DIRECTION_IN: &str = "in";
    pub const DIRECTION_OUT: &str = "out";
    pub const STATUS_OK: &str = "ok";
    pub const STATUS_ERROR: &str = "error";
    pub const STATUS_CANCELLED: &str = "cancelled";
    /// A draining decode worker gave the stream back to the router.
    pub const STATUS_HANDED_BACK: &str = "handed_back";
    /// KV block states.
    pub const KV_BLOCKS_USED: &str = "used";
    pub const KV_BLOCKS_CACHED: &str = "cached";
    pub const KV_BLOCKS_FREE: &str = "free";
    pub const ENDPOINT_CHAT: &str = "chat";
    pub const ENDPOINT_COMPLETIONS: &str = "completions";
    /// Request stages timed by the router.
    // Why a prompt was prefilled on its decode worker (`reason`).
    pub const LOCAL_PREFILL_MODE: &str = "aggregated";
    pub const LOCAL_PREFILL_SHORT: &str = "short";
    pub const LOCAL_PREFILL_NO_WORKER: &str = "no_prefill_worker";
    pub const LOCAL_PREFILL_SPILL: &str = "spill";
    pub const STAGE_DECODE_RESERVE: &str = "decode_reserve";
    pub const STAGE_PREFILL_QUEUE: &str = "prefill_queue";
    pub const STAGE_PREFILL: &str = "prefill";
    pub const STAGE_KV_TRANSFER: &str = "kv_transfer";
    pub const STAGE_FIRST_DECODE: &str = "first_decode";
}

/// Buckets for per-step and per-token times (1 ms .. 10 s).
pub const STEP_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.5, 5.0, 10.0,
];
/// Buckets for request-level times (10 ms .. 5 min).
pub const REQUEST_BUCKETS: &[f64] = &[
    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
];
/// Buckets for time to first token (5 ms .. 60 s).
pub const TTFT_BUCKETS: &[f64] = &[
    0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0,
    20.0, 60.0,
];
/// Buckets for the gap between two streamed tokens (1 ms .. 2.5 s).
pub const ITL_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5,
    1.0, 2.5,
];
/// Buckets for batch sizes.
pub const BATCH_BUCKETS: &[f64] = &[1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0];

/// Registers a collector, panicking on a duplicate name: that is a
/// programming error found by the first test that builds the metrics.
fn register<C: prometheus::core::Collector + Clone + 'static>(registry: &Registry, c: C) -> C {
    registry
        .register(Box::new(c.clone()))
        .expect("metric registered twice");
    c
}

pub fn gauge(registry: &Registry, name: &str, help: &str) -> prometheus::Gauge {
    register(
        registry,
        prometheus::Gauge::with_opts(Opts::new(name, help)).expect("valid metric"),
    )
}

pub fn gauge_vec(
    registry: &Registry,
    name: &str,
    help: &str,
    labels: &[&str],
) -> prometheus::GaugeVec {
    let g = prometheus::GaugeVec::new(Opts::new(name, help), labels).expect("valid metric");
    register(registry, g)
}

pub fn int_gauge(registry: &Registry, name: &str, help: &str) -> prometheus::IntGauge {
    register(
        registry,
        prometheus::IntGauge::with_opts(Opts::new(name, help)).expect("valid metric"),
    )
}

pub fn int_gauge_vec(
    registry: &Registry,
    name: &str,
    help: &str,
    labels: &[&str],
) -> prometheus::IntGaugeVec {
    let g = prometheus::IntGaugeVec::new(Opts::new(name, help), labels).expect("valid metric");
    register(registry, g)
}

pub fn counter(registry: &Registry, name: &str, help: &str) -> prometheus::IntCounter {
    register(
        registry,
        prometheus::IntCounter::with_opts(Opts::new(name, help)).expect("valid metric"),
    )
}

pub fn counter_vec(
    registry: &Registry,
    name: &str,
    help: &str,
    labels: &[&str],
) -> prometheus::IntCounterVec {
    let c = prometheus::IntCounterVec::new(Opts::new(name, help), labels).expect("valid metric");
    register(registry, c)
}

pub fn histogram_vec(
    registry: &Registry,
    name: &str,
    help: &str,
    labels: &[&str],
    buckets: &[f64],
) -> prometheus::HistogramVec {
    let opts = HistogramOpts::new(name, help).buckets(buckets.to_vec());
    register(
        registry,
        prometheus::HistogramVec::new(opts, labels).expect("valid metric"),
    )
}

pub fn histogram(
    registry: &Registry,
    name: &str,
    help: &str,
    buckets: &[f64],
) -> prometheus::Histogram {
    let opts = HistogramOpts::new(name, help).buckets(buckets.to_vec());
    register(
        registry,
        prometheus::Histogram::with_opts(opts).expect("valid metric"),
    )
}

/// The registry in Prometheus text format.
pub fn render(registry: &Registry) -> String {
    let mut families = registry.gather();
    families.extend(runtime_families());
    let mut out = Vec::new();
    // Encoding into a Vec cannot fail for well-formed metrics.
    let _ = TextEncoder::new().encode(&families, &mut out);
    String::from_utf8_lossy(&out).into_owned()
}

/// The process's own tokio runtime, read at each scrape: its live tasks
/// (a leak of tasks shows as a rising count at a flat load).
fn runtime_families() -> Vec<prometheus::proto::MetricFamily> {
    let Ok(handle) = tokio::runtime::Handle::try_current() else {
        return Vec::new();
    };
    let r = Registry::new();
    let tasks = int_gauge(
        &r,
        RUNTIME_ALIVE_TASKS,
        "Tasks alive in the process's tokio runtime.",
    );
    tasks.set(handle.metrics().num_alive_tasks() as i64);
    r.gather()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_registered_metrics() {
        let r = Registry::new();
        let c = counter_vec(&r, REQUESTS_TOTAL, "Requests.", &["status"]);
        c.with_label_values(&[labels::STATUS_OK]).inc();
        let h = histogram(&r, DECODE_STEP_SECONDS, "Step time.", STEP_BUCKETS);
        h.observe(0.003);
        let text = render(&r);
        assert!(
            text.contains("pdserve_requests_total{status=\"ok\"} 1"),
            "{text}"
        );
        assert!(
            text.contains("pdserve_decode_step_seconds_bucket{le=\"0.005\"} 1"),
            "{text}"
        );
    }
}
