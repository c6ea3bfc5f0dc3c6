//! The decode worker's Prometheus series (names from `pdserve_runtime::metrics`).

use pdserve_runtime::metrics::{self as m, labels};
use prometheus::{Gauge, Histogram, IntCounter, IntCounterVec, IntGaugeVec, Registry};

use crate::kv::{KvMetrics, KvReport};
use crate::queue::EngineStats;

/// Every series a decode worker exports, real or mock.
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
    /// Bytes read per second over the peak (a mock reads no weights: 0).
    pub mbu: Gauge,
    pub kv_transfer_bytes: IntCounter,
    pub kv_transfer_seconds: Histogram,
    /// Blocks, prefix-cache lookups and evictions.
    pub cache: KvMetrics,
    /// Sequences taken out of the batch to free KV, to be recomputed.
    pub preemptions: IntCounter,
}

impl DecodeMetrics {
    pub fn new() -> Self {
        let r = Registry::new();
        let pool = &["pool"];
        Self {
            queue_depth: m::int_gauge_vec(&r, m::QUEUE_DEPTH, "Requests waiting to run.", pool),
            queue_depth_tokens: m::int_gauge_vec(&r, m::QUEUE_DEPTH_TOKENS, "Prompt tokens waiting to be prefilled.", pool),
            active_sequences: m::int_gauge_vec(&r, m::ACTIVE_SEQUENCES, "Sequences in the decode batch.", pool),
            kv_usage_ratio: m::gauge(&r, m::KV_CACHE_USAGE_RATIO, "Reserved share of the KV cache budget."),
            kv_used_tokens: m::gauge(&r, m::KV_CACHE_USED_TOKENS, "KV cache tokens reserved by live sequences."),
            kv_capacity_tokens: m::gauge(&r, m::KV_CACHE_CAPACITY_TOKENS, "KV cache budget in tokens."),
            batch_size: m::histogram(&r, m::DECODE_BATCH_SIZE, "Sequences per decode step.", m::BATCH_BUCKETS),
            step_seconds: m::histogram(&r, m::DECODE_STEP_SECONDS, "Time of one batched decode step.", m::STEP_BUCKETS),
            prefill_seconds: m::histogram(&r, m::PREFILL_SECONDS, "Time of one local prefill chunk.", m::STEP_BUCKETS),
            prompt_tokens: m::counter(&r, m::PROMPT_TOKENS_TOTAL, "Prompt tokens prefilled locally."),
            generation_tokens: m::counter(&r, m::GENERATION_TOKENS_TOTAL, "Tokens generated."),
            requests: m::counter_vec(&r, m::REQUESTS_TOTAL, "Sequences finished, by status.", &["status"]),
            mbu: m::gauge(&r, m::MODEL_BANDWIDTH_UTILIZATION, "Estimated share of peak memory bandwidth the last decode step used (weights plus KV read)."),
            kv_transfer_bytes: m::counter(&r, m::KV_TRANSFER_BYTES_TOTAL, "KV bytes received from prefill workers."),
            kv_transfer_seconds: m::histogram(&r, m::KV_TRANSFER_SECONDS, "Time to receive one sequence's KV.", m::STEP_BUCKETS),
            cache: KvMetrics::new(&r),
            preemptions: m::counter(&r, m::PREEMPTIONS_TOTAL, "Sequences taken out of the batch when the KV ran out, to be recomputed."),
            registry: r,
        }
    }

    /// Counts finished sequences with `status` (a `labels::STATUS_*`).
    pub fn finished(&self, status: &str, n: u64) {
        self.requests.with_label_values(&[status]).inc_by(n);
    }

    /// Sets the KV series from the cache's report.
    pub fn kv(&self, r: &KvReport) {
        self.kv_used_tokens.set(r.used_tokens as f64);
        self.kv_capacity_tokens.set(r.capacity_tokens as f64);
        self.kv_usage_ratio
            .set(r.used_tokens as f64 / r.capacity_tokens.max(1) as f64);
        self.cache.publish(r);
    }

    /// Records one sequence's KV received in `secs`.
    pub fn kv_received(&self, bytes: u64, secs: f64) {
        self.kv_transfer_bytes.inc_by(bytes);
        self.kv_transfer_seconds.observe(secs);
    }

    /// Records one decode step over `batch` sequences.
    pub fn step(&self, batch: usize, secs: f64) {
        self.batch_size.observe(batch as f64);
        self.step_seconds.observe(secs);
    }

    /// Records one local prefill chunk of `tokens`.
    pub fn prefill_chunk(&self, tokens: usize, secs: f64) {
        self.prefill_seconds.observe(secs);
        self.prompt_tokens.inc_by(tokens as u64);
    }

    /// Publishes the engine's state after a scheduling round: `active`
    /// sequences in the batch, `waiting` taken but not in it (prefilling or
    /// waiting for a slot) with `waiting_tokens` prompt tokens still to
    /// prefill. Also the engine's running count, for the drain, and its
    /// waiting sequences, which `/load` reports as queued.
    pub fn publish(&self, stats: &EngineStats, active: usize, waiting: usize, waiting_tokens: u64) {
        let pool = [labels::POOL_DECODE];
        stats.set_running((active + waiting) as u64);
        stats.set_waiting(waiting as u64, waiting_tokens);
        self.active_sequences
            .with_label_values(&pool)
            .set(active as i64);
        let queued = waiting as u64 + stats.queued_requests();
        self.queue_depth.with_label_values(&pool).set(queued as i64);
        self.queue_depth_tokens
            .with_label_values(&pool)
            .set(waiting_tokens as i64);
    }
}

impl Default for DecodeMetrics {
    fn default() -> Self {
        Self::new()
    }
}
