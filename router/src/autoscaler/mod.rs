//! Autoscaling each pool on its own signal: signals (from the registry) →
//! policy (a pure function, [`policy`]) → executor (spawn or drain local
//! workers, or only export the decision for KEDA).
//!
//! - Prefill scales on its backlog in seconds: prompt tokens waiting (in
//!   prefill queues, and in decode queues while prompts are prefilled
//!   locally) over the throughput one prefill replica delivers.
//! - Decode scales on active sequences per replica (or KV usage).
//!
//! Or, with `--autoscaler-mode planned`, both pools are sized together
//! from the engine's latency model and the offered load ([`planned`]).

pub mod planned;
pub mod policy;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::{Args, ValueEnum};
use pdserve_protocol::internal::Pool;
use tokio_util::sync::CancellationToken;

use crate::metrics::{pool_label, RouterMetrics};
use crate::registry::{Health, Registry};
use crate::supervisor::Supervisor;
use planned::Planner;
use policy::{Policy, PolicyConfig};

/// How the pools are sized.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum AutoscalerMode {
    /// Each pool on its own signal: prefill backlog, decode sequences or KV.
    Independent,
    /// Both pools from the latency model and the offered load ([`planned`]).
    Planned,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ExecutorKind {
    /// Start and drain local worker processes (needs `--local-*` workers).
    Local,
    /// Compute and export the decision only (Kubernetes: KEDA acts on it).
    None,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum DecodeSignal {
    /// Active sequences per replica.
    ActiveSequences,
    /// KV cache usage (0–1) per replica.
    KvUsage,
}

/// Autoscaler flags, flattened into the router's.
#[derive(Args, Debug, Clone)]
pub struct AutoscalerArgs {
    /// What acts on the decisions (default: `local` when the router runs local workers, else `none`).
    #[arg(long, env = "PDSERVE_AUTOSCALER_EXECUTOR", value_enum)]
    pub autoscaler_executor: Option<ExecutorKind>,
    /// Milliseconds between decisions.
    #[arg(long, env = "PDSERVE_AUTOSCALER_INTERVAL_MS", default_value_t = 1000)]
    pub autoscaler_interval_ms: u64,
    /// Prefill backlog, in seconds of work, one replica should carry.
    #[arg(
        long,
        env = "PDSERVE_PREFILL_TARGET_BACKLOG_SECONDS",
        default_value_t = 2.0
    )]
    pub prefill_target_backlog_seconds: f64,
    /// Prompt tokens per second one prefill replica delivers, until measured.
    #[arg(
        long,
        env = "PDSERVE_PREFILL_TOKENS_PER_SECOND",
        default_value_t = 500.0
    )]
    pub prefill_tokens_per_second: f64,
    #[arg(long, env = "PDSERVE_PREFILL_MIN_REPLICAS", default_value_t = 1)]
    pub prefill_min_replicas: usize,
    #[arg(long, env = "PDSERVE_PREFILL_MAX_REPLICAS", default_value_t = 2)]
    pub prefill_max_replicas: usize,
    /// The decode pool's signal.
    #[arg(long, env = "PDSERVE_DECODE_SIGNAL", value_enum, default_value_t = DecodeSignal::ActiveSequences)]
    pub decode_signal: DecodeSignal,
    /// Decode signal one replica should carry (sequences, or a KV ratio).
    #[arg(long, env = "PDSERVE_DECODE_TARGET", default_value_t = 16.0)]
    pub decode_target: f64,
    #[arg(long, env = "PDSERVE_DECODE_MIN_REPLICAS", default_value_t = 1)]
    pub decode_min_replicas: usize,
    #[arg(long, env = "PDSERVE_DECODE_MAX_REPLICAS", default_value_t = 2)]
    pub decode_max_replicas: usize,
    /// Seconds a higher recommendation must hold before scaling up.
    #[arg(long, env = "PDSERVE_SCALE_UP_WINDOW_SECONDS", default_value_t = 0)]
    pub scale_up_window_seconds: u64,
    /// Seconds a lower recommendation must hold before scaling down.
    #[arg(long, env = "PDSERVE_SCALE_DOWN_WINDOW_SECONDS", default_value_t = 60)]
    pub scale_down_window_seconds: u64,
    /// Replicas added or removed per decision at most.
    #[arg(long, env = "PDSERVE_SCALE_MAX_STEP", default_value_t = 1)]
    pub scale_max_step: usize,
    /// Seconds after a change before the next one.
    #[arg(long, env = "PDSERVE_SCALE_COOLDOWN_SECONDS", default_value_t = 10)]
    pub scale_cooldown_seconds: u64,
    /// Scale down from N to M replicas only while each of the M would carry
    /// at most this share of its target (the window's peak load × N/M per
    /// replica); 1 is no margin. Keeps a flat load from flapping N ↔ N−1.
    #[arg(long, env = "PDSERVE_SCALE_DOWN_HEADROOM", default_value_t = 0.9)]
    pub scale_down_headroom: f64,
    /// `independent`: each pool on its own signal; `planned`: both pools
    /// together from `--autoscaler-model` and the load the router measures.
    #[arg(long, env = "PDSERVE_AUTOSCALER_MODE", value_enum, default_value_t = AutoscalerMode::Independent)]
    pub autoscaler_mode: AutoscalerMode,
    /// The engine's latency model for `planned`: the JSON of
    /// `pdserve-loadtest engine --json` (what the planner fits from).
    #[arg(long, env = "PDSERVE_AUTOSCALER_MODEL")]
    pub autoscaler_model: Option<PathBuf>,
    /// Which weights' result of a multi-result model file to use.
    #[arg(
        long,
        env = "PDSERVE_AUTOSCALER_MODEL_WEIGHTS",
        default_value = "native"
    )]
    pub autoscaler_model_weights: String,
    /// `planned`: the time per output token a decode replica must stay
    /// within, in milliseconds; it caps the batch each replica is planned for.
    #[arg(long, env = "PDSERVE_AUTOSCALER_SLO_TPOT_MS", default_value_t = 50.0)]
    pub autoscaler_slo_tpot_ms: f64,
    /// `planned`: the share of each replica's modelled capacity to fill.
    #[arg(long, env = "PDSERVE_AUTOSCALER_UTILIZATION", default_value_t = 0.8)]
    pub autoscaler_utilization: f64,
    /// `planned`: the largest batch a decode replica is planned for (its
    /// `--max-batch`).
    #[arg(long, env = "PDSERVE_AUTOSCALER_MAX_BATCH", default_value_t = 32)]
    pub autoscaler_max_batch: usize,
    /// `planned`: seconds of finished requests the offered load is measured over.
    #[arg(
        long,
        env = "PDSERVE_AUTOSCALER_LOAD_WINDOW_SECONDS",
        default_value_t = 30
    )]
    pub autoscaler_load_window_seconds: u64,
}

impl AutoscalerArgs {
    pub fn validate(&self) -> Result<(), String> {
        if self.decode_min_replicas == 0 {
            return Err("--decode-min-replicas must be at least 1".into());
        }
        if !(self.scale_down_headroom > 0.0 && self.scale_down_headroom <= 1.0) {
            return Err("--scale-down-headroom must be in (0, 1]".into());
        }
        if self.prefill_min_replicas > self.prefill_max_replicas
            || self.decode_min_replicas > self.decode_max_replicas
        {
            return Err("a pool's min replicas exceed its max".into());
        }
        if self.autoscaler_mode == AutoscalerMode::Planned {
            Planner::from_args(self)?;
            if !(self.autoscaler_utilization > 0.0 && self.autoscaler_utilization <= 1.0) {
                return Err("--autoscaler-utilization must be in (0, 1]".into());
            }
            if self.autoscaler_load_window_seconds == 0 {
                return Err("--autoscaler-load-window-seconds must be at least 1".into());
            }
        }
        let positive = [
            self.prefill_target_backlog_seconds,
            self.prefill_tokens_per_second,
            self.decode_target,
            self.autoscaler_slo_tpot_ms,
        ];
        match positive.iter().all(|v| v.is_finite() && *v > 0.0) {
            true => Ok(()),
            false => Err("autoscaler targets and the prefill throughput must be positive".into()),
        }
    }

    /// The policy of `pool`. In `planned` mode its signal is the demand in
    /// replicas, so its target is one replica.
    pub fn policy(&self, pool: Pool) -> PolicyConfig {
        let (target, min, max) = match pool {
            Pool::Prefill => (
                self.prefill_target_backlog_seconds,
                self.prefill_min_replicas,
                self.prefill_max_replicas,
            ),
            Pool::Decode => (
                self.decode_target,
                self.decode_min_replicas,
                self.decode_max_replicas,
            ),
        };
        let target = match self.autoscaler_mode {
            AutoscalerMode::Independent => target,
            AutoscalerMode::Planned => 1.0,
        };
        PolicyConfig {
            target,
            min,
            max,
            up_window: Duration::from_secs(self.scale_up_window_seconds),
            down_window: Duration::from_secs(self.scale_down_window_seconds),
            max_step: self.scale_max_step,
            cooldown: Duration::from_secs(self.scale_cooldown_seconds),
            down_headroom: self.scale_down_headroom,
        }
    }
}

/// The pools' signals at one instant.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Signals {
    pub prefill_backlog_seconds: f64,
    pub decode: f64,
    pub decode_kv_usage: f64,
}

/// Reads the signals from the registry. `per_replica_tps` is the prefill
/// throughput of one replica: measured (the mean of the workers' reports)
/// when any worker has reported, else the configured estimate.
pub fn signals(registry: &Registry, args: &AutoscalerArgs) -> Signals {
    let prefill = registry.pool_load(Pool::Prefill);
    let decode = registry.pool_load(Pool::Decode);
    let reporting = registry.reporting(Pool::Prefill);
    let per_replica_tps = match reporting {
        0 => args.prefill_tokens_per_second,
        n if prefill.tokens_per_second > 0.0 => prefill.tokens_per_second / n as f64,
        _ => args.prefill_tokens_per_second,
    };
    // Prompts waiting on decode workers are prefill work too (local prefill).
    let pending = prefill.queued_tokens.saturating_add(decode.queued_tokens) as f64;
    let kv_total = (decode.kv_used_tokens + decode.kv_free_tokens) as f64;
    let kv_usage = match kv_total > 0.0 {
        true => decode.kv_used_tokens as f64 / kv_total,
        false => 0.0,
    };
    Signals {
        prefill_backlog_seconds: pending / per_replica_tps.max(1e-9),
        decode: match args.decode_signal {
            DecodeSignal::ActiveSequences => decode.active_sequences as f64,
            DecodeSignal::KvUsage => kv_usage * registry.live(Pool::Decode) as f64,
        },
        decode_kv_usage: kv_usage,
    }
}

/// Acts on decisions.
pub trait Executor: Send + Sync {
    /// Replicas of `pool` now (starting and ready; not draining).
    fn current(&self, pool: Pool) -> usize;
    /// Moves `pool` towards `desired` replicas; scale-down drains.
    fn scale(&self, pool: Pool, desired: usize);
    /// The most replicas `pool` can have now, the other pool's as they are.
    fn ceiling(&self, _pool: Pool) -> usize {
        usize::MAX
    }
}

/// Local worker processes, through the supervisor.
pub struct LocalExecutor(pub Arc<Supervisor>);

impl Executor for LocalExecutor {
    fn current(&self, pool: Pool) -> usize {
        self.0.count(pool)
    }

    /// Only as many workers as have cores of their own
    /// ([`Supervisor::spare_slots`]).
    fn ceiling(&self, pool: Pool) -> usize {
        self.0.count(pool).saturating_add(self.0.spare_slots())
    }

    fn scale(&self, pool: Pool, desired: usize) {
        let now = self.0.count(pool);
        for _ in now..desired {
            self.0.spawn(pool);
        }
        for _ in desired..now {
            self.0.drain_one(pool);
        }
    }
}

/// Exports decisions only; the replicas are whatever the registry sees.
pub struct ExportOnly(pub Arc<Registry>);

impl Executor for ExportOnly {
    fn current(&self, pool: Pool) -> usize {
        self.0
            .counts(pool)
            .iter()
            .filter(|(h, _)| matches!(h, Health::Starting | Health::Ready))
            .map(|(_, n)| n)
            .sum()
    }

    fn scale(&self, _pool: Pool, _desired: usize) {}
}

/// How often the warning that a pool is held below its desired size may
/// repeat. A held pool's desire flickers (the policy asks again after each
/// cooldown), so "once per episode" alone would repeat it every few ticks.
const HELD_WARN_EVERY: Duration = Duration::from_secs(600);

/// Whether a pool is held below its desired size, and when that was last
/// logged.
#[derive(Debug, Default)]
struct Held {
    now: bool,
    warned: Option<Instant>,
}

/// Moves `pool` to `desired` replicas, or as near as the executor's ceiling
/// allows; `held` keeps the warning about a held pool to one per
/// [`HELD_WARN_EVERY`], not one every tick.
fn apply(executor: &dyn Executor, pool: Pool, desired: usize, signal: f64, held: &mut Held) {
    let current = executor.current(pool);
    let ceiling = executor.ceiling(pool).max(current);
    held.now = desired > ceiling;
    let quiet = held.warned.is_some_and(|t| t.elapsed() < HELD_WARN_EVERY);
    if held.now && !quiet {
        held.warned = Some(Instant::now());
        tracing::warn!(
            ?pool,
            current,
            desired,
            ceiling,
            "autoscaling held: no free cores for another local worker \
             (lower --worker-threads to leave room)"
        );
    }
    let desired = desired.min(ceiling);
    if desired != current {
        tracing::info!(?pool, current, desired, signal, "autoscaling");
        executor.scale(pool, desired);
    }
}

/// Runs the decision loop until `stop`.
pub fn spawn(
    registry: Arc<Registry>,
    metrics: Arc<RouterMetrics>,
    executor: Arc<dyn Executor>,
    args: AutoscalerArgs,
    stop: CancellationToken,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let origin = Instant::now();
        let mut policies = [Policy::default(), Policy::default()];
        // Whether each pool is held below its desired size for want of cores.
        let mut held = [Held::default(), Held::default()];
        let configs = [args.policy(Pool::Prefill), args.policy(Pool::Decode)];
        let mut planner = match args.autoscaler_mode {
            AutoscalerMode::Planned => Planner::from_args(&args)
                .map_err(|e| tracing::error!("planned autoscaling off: {e}"))
                .ok(),
            AutoscalerMode::Independent => None,
        };
        if planner.is_some() {
            metrics.offered.enable();
        }
        let window = Duration::from_secs(args.autoscaler_load_window_seconds.max(1));
        let mut tick =
            tokio::time::interval(Duration::from_millis(args.autoscaler_interval_ms.max(10)));
        loop {
            tokio::select! {
                biased;
                _ = stop.cancelled() => break,
                _ = tick.tick() => {}
            }
            let s = signals(&registry, &args);
            metrics.pools.prefill_backlog.set(s.prefill_backlog_seconds);
            metrics
                .pools
                .pool_kv_usage
                .with_label_values(&[pool_label(Pool::Decode)])
                .set(s.decode_kv_usage);
            let now = origin.elapsed();
            let pool_signals = match planner.as_mut() {
                Some(p) => {
                    let offered = metrics.offered.over(window);
                    let decode = registry.candidates(Pool::Decode, None);
                    let d = p.demand(&offered, &decode);
                    metrics.pools.record_plan(d, p.correction);
                    [d.prefill, d.decode]
                }
                None => [s.prefill_backlog_seconds, s.decode],
            };
            for (i, (pool, signal)) in [
                (Pool::Prefill, pool_signals[0]),
                (Pool::Decode, pool_signals[1]),
            ]
            .into_iter()
            .enumerate()
            {
                let current = executor.current(pool);
                let desired = policies[i].decide(&configs[i], now, signal, current);
                metrics
                    .pools
                    .desired_replicas
                    .with_label_values(&[pool_label(pool)])
                    .set(desired as i64);
                apply(executor.as_ref(), pool, desired, signal, &mut held[i]);
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    /// Replicas in memory, and a fixed room for more.
    struct Fake {
        replicas: Mutex<[usize; 2]>,
        spare: usize,
    }

    impl Executor for Fake {
        fn current(&self, pool: Pool) -> usize {
            self.replicas.lock().unwrap()[pool as usize]
        }
        fn scale(&self, pool: Pool, desired: usize) {
            self.replicas.lock().unwrap()[pool as usize] = desired;
        }
        fn ceiling(&self, pool: Pool) -> usize {
            self.current(pool) + self.spare
        }
    }

    /// One replica in each pool, and room for `spare` more.
    fn fake(spare: usize) -> Fake {
        Fake {
            replicas: Mutex::new([1, 1]),
            spare,
        }
    }

    #[test]
    fn a_pool_grows_only_as_far_as_the_executor_has_room() {
        let tight = fake(0);
        let mut held = Held::default();
        apply(&tight, Pool::Prefill, 2, 5.0, &mut held);
        assert_eq!(tight.current(Pool::Prefill), 1);
        let warned = held.warned.expect("the first hold is logged");
        assert!(held.now);
        // Scaling down is never held; a hold again soon after is not logged again.
        apply(&tight, Pool::Decode, 0, 0.0, &mut held);
        assert_eq!(tight.current(Pool::Decode), 0);
        assert!(!held.now);
        apply(&tight, Pool::Prefill, 2, 5.0, &mut held);
        assert!(held.now && held.warned == Some(warned));
        let roomy = fake(1);
        let mut held = Held::default();
        apply(&roomy, Pool::Prefill, 3, 5.0, &mut held);
        assert_eq!(roomy.current(Pool::Prefill), 2);
        assert!(held.now);
    }
}
