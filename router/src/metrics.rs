//! The router's Prometheus metrics: what users see (TTFT, inter-token
//! latency, duration), where the time goes (per-stage histograms), and the
//! pools (queue depth, workers by state), refreshed from the registry.

use pdserve_protocol::internal::Pool;
use pdserve_runtime::metrics::{self as m, labels};
use prometheus::{
    Gauge, GaugeVec, Histogram, HistogramVec, IntCounter, IntCounterVec, IntGauge, IntGaugeVec,
    Registry,
};

use crate::registry;

/// What users see, where the time goes, and the calls to workers.
pub struct RouterMetrics {
    pub registry: Registry,
    pub ttft: HistogramVec,
    pub itl: Histogram,
    pub duration: HistogramVec,
    pub stage: HistogramVec,
    pub requests: IntCounterVec,
    pub prompt_tokens: IntCounter,
    pub generation_tokens: IntCounter,
    pub in_flight: IntGauge,
    pub prefill_retries: IntCounter,
    /// Prompts prefilled on their decode worker, by reason.
    pub local_prefills: IntCounterVec,
    pub worker_errors: IntCounterVec,
    /// Streams moved to another decode worker.
    pub migration: MigrationMetrics,
    /// The pools, from the workers' load reports, and the autoscaler.
    pub pools: PoolMetrics,
    /// The load offered to the router (`planned` autoscaling's input).
    pub offered: crate::autoscaler::planned::OfferedLoad,
    tokenizer_cache: TokenizerCacheMetrics,
}

/// The tokenizer's segment cache, copied from its own counts at each scrape.
struct TokenizerCacheMetrics {
    hits: IntCounter,
    misses: IntCounter,
    bytes: IntGauge,
    /// Serialises the copies, so that two scrapes do not add a delta twice.
    copy: std::sync::Mutex<()>,
}

impl TokenizerCacheMetrics {
    fn new(r: &Registry) -> Self {
        Self {
            hits: m::counter(r, m::TOKENIZER_CACHE_HITS_TOTAL, "Long prompt segments whose tokens the router's tokenizer cache held."),
            misses: m::counter(r, m::TOKENIZER_CACHE_MISSES_TOTAL, "Long prompt segments the router tokenized (the cache keeps one on its second sighting)."),
            bytes: m::int_gauge(r, m::TOKENIZER_CACHE_BYTES, "Bytes of text and tokens in the router's tokenizer cache."),
            copy: std::sync::Mutex::default(),
        }
    }

    fn record(&self, s: pdserve_text::segments::SegmentStats) {
        let _copy = self.copy.lock().unwrap_or_else(|p| p.into_inner());
        self.hits.inc_by(s.hits.saturating_sub(self.hits.get()));
        self.misses
            .inc_by(s.misses.saturating_sub(self.misses.get()));
        self.bytes.set(s.bytes as i64);
    }
}

/// Streams moved to another decode worker mid-generation.
pub struct MigrationMetrics {
    /// By reason and outcome.
    pub total: IntCounterVec,
    /// From a migrated stream's last token on the worker it left to its
    /// first token on the one it joined.
    pub lost: Histogram,
}

/// Prompts prefilled on their decode worker, every reason's series present from the start.
fn local_prefills(r: &Registry) -> IntCounterVec {
    let c = m::counter_vec(
        r,
        m::LOCAL_PREFILLS_TOTAL,
        "Prompts prefilled on their decode worker, by reason: aggregated (the mode), short, no_prefill_worker, or spill (the prefill pool was backed up).",
        &["reason"],
    );
    for reason in [
        labels::LOCAL_PREFILL_MODE,
        labels::LOCAL_PREFILL_SHORT,
        labels::LOCAL_PREFILL_NO_WORKER,
        labels::LOCAL_PREFILL_SPILL,
    ] {
        c.with_label_values(&[reason]);
    }
    c
}

impl MigrationMetrics {
    fn new(r: &Registry) -> Self {
        Self {
            total: m::counter_vec(
                r,
                m::MIGRATIONS_TOTAL,
                "Streams moved to another decode worker mid-generation, by reason and outcome.",
                &["reason", "outcome"],
            ),
            lost: m::histogram(
                r,
                m::MIGRATION_LOST_SECONDS,
                "Time a migrated stream lost: from its last token on the worker it left to its first on the one it joined.",
                m::TTFT_BUCKETS,
            ),
        }
    }
}

/// The pools' series: their load, their workers, the autoscaling signals.
pub struct PoolMetrics {
    pub queue_depth: IntGaugeVec,
    pub queue_depth_tokens: IntGaugeVec,
    pub active_sequences: IntGaugeVec,
    pub workers: IntGaugeVec,
    pub prefill_backlog: Gauge,
    pub pool_kv_usage: GaugeVec,
    pub desired_replicas: IntGaugeVec,
    /// `planned` autoscaling: each pool's demand in replicas, and the live
    /// correction factor (measured over modelled time).
    pub demand_replicas: GaugeVec,
    pub correction: GaugeVec,
}

impl PoolMetrics {
    /// Exports one tick of the planned autoscaler.
    pub fn record_plan(&self, d: crate::autoscaler::planned::Demand, correction: [f64; 2]) {
        for (pool, demand, corr) in [
            (Pool::Prefill, d.prefill, correction[0]),
            (Pool::Decode, d.decode, correction[1]),
        ] {
            let label = [pool_label(pool)];
            self.demand_replicas.with_label_values(&label).set(demand);
            self.correction.with_label_values(&label).set(corr);
        }
    }
}

pub fn pool_label(pool: Pool) -> &'static str {
    match pool {
        Pool::Prefill => labels::POOL_PREFILL,
        Pool::Decode => labels::POOL_DECODE,
    }
}

impl RouterMetrics {
    pub fn new() -> Self {
        let r = Registry::new();
        Self {
            ttft: m::histogram_vec(
                &r,
                m::TIME_TO_FIRST_TOKEN_SECONDS,
                "From request arrival to the first generated token, at the router.",
                &["endpoint"],
                m::TTFT_BUCKETS,
            ),
            itl: m::histogram(
                &r,
                m::INTER_TOKEN_LATENCY_SECONDS,
                "Gap between two consecutive generated tokens of one choice.",
                m::ITL_BUCKETS,
            ),
            duration: m::histogram_vec(
                &r,
                m::REQUEST_DURATION_SECONDS,
                "From request arrival to the last byte of the response.",
                &["endpoint"],
                m::REQUEST_BUCKETS,
            ),
            stage: m::histogram_vec(
                &r,
                m::REQUEST_STAGE_SECONDS,
                "Time spent per stage: decode_reserve, prefill_queue, prefill, kv_transfer, first_decode.",
                &["stage"],
                m::TTFT_BUCKETS,
            ),
            requests: m::counter_vec(
                &r,
                m::REQUESTS_TOTAL,
                "Requests by endpoint and outcome (ok, cancelled, or the error code).",
                &["endpoint", "status"],
            ),
            prompt_tokens: m::counter(&r, m::PROMPT_TOKENS_TOTAL, "Prompt tokens of served requests."),
            generation_tokens: m::counter(&r, m::GENERATION_TOKENS_TOTAL, "Tokens generated for clients."),
            in_flight: m::int_gauge(&r, m::REQUESTS_IN_FLIGHT, "Requests the router is serving now."),
            prefill_retries: m::counter(
                &r,
                m::PREFILL_RETRIES_TOTAL,
                "Prefill attempts repeated on another worker after a retryable failure.",
            ),
            local_prefills: local_prefills(&r),
            worker_errors: m::counter_vec(
                &r,
                m::WORKER_ERRORS_TOTAL,
                "Failed calls to workers, by pool and error code.",
                &["pool", "code"],
            ),
            migration: MigrationMetrics::new(&r),
            pools: PoolMetrics::new(&r),
            offered: Default::default(),
            tokenizer_cache: TokenizerCacheMetrics::new(&r),
            registry: r,
        }
    }

    /// Copies the pools' state from the registry (before each scrape).
    pub fn refresh(&self, workers: &registry::Registry) {
        let p = &self.pools;
        for pool in [Pool::Prefill, Pool::Decode] {
            let label = pool_label(pool);
            let load = workers.pool_load(pool);
            p.queue_depth
                .with_label_values(&[label])
                .set(load.queued_requests as i64);
            p.queue_depth_tokens
                .with_label_values(&[label])
                .set(load.queued_tokens as i64);
            p.active_sequences
                .with_label_values(&[label])
                .set(load.active_sequences as i64);
            for (health, n) in workers.counts(pool) {
                p.workers
                    .with_label_values(&[label, health.label()])
                    .set(n as i64);
            }
        }
    }

    /// Copies the tokenizer's segment-cache counts (when it has a cache).
    pub fn record_tokenizer(&self, stats: Option<pdserve_text::segments::SegmentStats>) {
        if let Some(s) = stats {
            self.tokenizer_cache.record(s);
        }
    }

    pub fn render(&self, workers: &registry::Registry) -> String {
        self.refresh(workers);
        m::render(&self.registry)
    }
}

impl PoolMetrics {
    fn new(r: &Registry) -> Self {
        let pool = &["pool"];
        Self {
            queue_depth: m::int_gauge_vec(r, m::QUEUE_DEPTH, "Requests queued in the pool's workers.", pool),
            queue_depth_tokens: m::int_gauge_vec(
                r,
                m::QUEUE_DEPTH_TOKENS,
                "Prompt tokens queued in the pool's workers.",
                pool,
            ),
            active_sequences: m::int_gauge_vec(
                r,
                m::ACTIVE_SEQUENCES,
                "Sequences running in the pool's workers.",
                pool,
            ),
            workers: m::int_gauge_vec(r, m::WORKERS, "Workers by pool and state.", &["pool", "state"]),
            prefill_backlog: m::gauge(
                r,
                m::PREFILL_BACKLOG_SECONDS,
                "Pending prompt tokens over one prefill replica's throughput: the prefill autoscaling signal.",
            ),
            pool_kv_usage: m::gauge_vec(r, m::POOL_KV_USAGE_RATIO, "KV cache in use across the pool's workers.", pool),
            desired_replicas: m::int_gauge_vec(
                r,
                m::AUTOSCALER_DESIRED_REPLICAS,
                "The autoscaler's decision per pool.",
                pool,
            ),
            demand_replicas: m::gauge_vec(
                r,
                m::AUTOSCALER_DEMAND_REPLICAS,
                "Planned autoscaling: the replicas the modelled load needs, per pool (fractional).",
                pool,
            ),
            correction: m::gauge_vec(
                r,
                m::AUTOSCALER_CORRECTION,
                "Planned autoscaling: measured over modelled time (prefill compute, decode step).",
                pool,
            ),
        }
    }
}

impl Default for RouterMetrics {
    fn default() -> Self {
        Self::new()
    }
}
