//! Ratio-aware autoscaling (`--autoscaler-mode planned`): both pools sized
//! together, from one latency model of the engine (the planner's, read
//! from `pdserve-loadtest engine --json`) and the load the router measures.
//!
//! Each tick:
//! - **the offered load** over the last `--autoscaler-load-window-seconds`:
//!   requests admitted per second (counted on arrival, so an overloaded
//!   cluster does not hide its load), and per finished request the prompt
//!   tokens that needed computing (not in a prefix cache) and the tokens
//!   generated;
//! - **the live correction factors**: measured over modelled time, for each
//!   pool. Prefill: the prefill workers' own compute time for each job the
//!   router sent (`compute_seconds`) over the model's time for its tokens.
//!   Decode: each busy decode worker's last step time (its batch over its
//!   tokens per second) over the model's step at that batch. Both are
//!   smoothed and held when nothing was measured;
//! - **the demand**, in replicas (fractional):
//!   - prefill: requests/s × corrected prefill time of the mean prompt,
//!     over `--autoscaler-utilization`;
//!   - decode: tokens/s generated, over what one replica delivers at the
//!     largest batch (≤ `--autoscaler-max-batch`) whose corrected step time
//!     stays within `--autoscaler-slo-tpot-ms`, times the utilization.
//!
//! The demand then goes through each pool's [`super::policy`] with a target
//! of one replica: the same windows, step limit, cooldown and the
//! load × N/(N−1) scale-down check, so a flat load does not oscillate.
//! A step in load moves both pools in the same tick.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use pdserve_protocol::latency::{read_profile, LatencyModel};
use pdserve_protocol::openai::Usage;

use super::AutoscalerArgs;
use crate::registry::WorkerView;

/// How each tick's measured correction moves the smoothed one.
const SMOOTHING: f64 = 0.3;
/// Corrections are kept within these bounds: beyond them the model is wrong.
const CORRECTION_RANGE: (f64, f64) = (0.1, 10.0);
/// Samples kept at most (the oldest go first).
const MAX_SAMPLES: usize = 100_000;

/// What the router measures of the load it is offered, over a sliding window.
/// It records nothing (no lock on the request path) until the planned
/// autoscaler turns it on.
#[derive(Default)]
pub struct OfferedLoad {
    on: AtomicBool,
    inner: Mutex<Samples>,
}

#[derive(Default)]
struct Samples {
    /// When each admitted request arrived.
    arrivals: VecDeque<Instant>,
    requests: VecDeque<Finished>,
    /// (when, compute seconds, prompt tokens computed) of each prefill job.
    prefills: VecDeque<(Instant, f64, u32)>,
}

/// A finished request's tokens.
struct Finished {
    at: Instant,
    /// Prompt tokens computed (not from a prefix cache).
    computed: u32,
    output: u32,
    prompt: u32,
}

/// The offered load over one window.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Offered {
    /// Requests admitted per second.
    pub requests_per_second: f64,
    /// Mean prompt tokens that needed computing, per request.
    pub computed_prompt_tokens: f64,
    /// Mean tokens generated per request.
    pub output_tokens: f64,
    /// Mean context of a sequence while it decodes (prompt + half its output).
    pub context_tokens: f64,
    /// (compute seconds, prompt tokens computed) of the window's prefill jobs.
    pub prefills: Vec<(f64, u32)>,
}

impl OfferedLoad {
    /// Starts recording (the planned autoscaler's first tick).
    pub fn enable(&self) {
        self.on.store(true, Ordering::Relaxed);
    }

    /// A request was admitted.
    pub fn arrived(&self) {
        if !self.on.load(Ordering::Relaxed) {
            return;
        }
        let mut s = self.lock();
        s.arrivals.push_back(Instant::now());
        if s.arrivals.len() > MAX_SAMPLES {
            s.arrivals.pop_front();
        }
    }

    /// A finished request's tokens.
    pub fn request(&self, usage: &Usage) {
        let computed = usage
            .prompt_tokens
            .saturating_sub(usage.prompt_tokens_details.cached_tokens);
        if !self.on.load(Ordering::Relaxed) {
            return;
        }
        let mut s = self.lock();
        s.requests.push_back(Finished {
            at: Instant::now(),
            computed,
            output: usage.completion_tokens,
            prompt: usage.prompt_tokens,
        });
        if s.requests.len() > MAX_SAMPLES {
            s.requests.pop_front();
        }
    }

    /// A prefill job's compute time for `tokens` computed prompt tokens.
    pub fn prefill(&self, compute_seconds: f64, tokens: u32) {
        let measurable = compute_seconds.is_finite() && compute_seconds > 0.0 && tokens > 0;
        if !(measurable && self.on.load(Ordering::Relaxed)) {
            return;
        }
        let mut s = self.lock();
        s.prefills
            .push_back((Instant::now(), compute_seconds, tokens));
        if s.prefills.len() > MAX_SAMPLES {
            s.prefills.pop_front();
        }
    }

    /// The load over the last `window`, dropping older samples.
    pub fn over(&self, window: Duration) -> Offered {
        let mut s = self.lock();
        let now = Instant::now();
        let old = |t: &Instant| now.saturating_duration_since(*t) > window;
        while s.arrivals.front().is_some_and(old) {
            s.arrivals.pop_front();
        }
        while s.requests.front().is_some_and(|r| old(&r.at)) {
            s.requests.pop_front();
        }
        while s.prefills.front().is_some_and(|p| old(&p.0)) {
            s.prefills.pop_front();
        }
        let n = s.requests.len() as f64;
        let mean = |f: fn(&Finished) -> u32| match n > 0.0 {
            true => s.requests.iter().map(|r| f64::from(f(r))).sum::<f64>() / n,
            false => 0.0,
        };
        let output = mean(|r| r.output);
        Offered {
            requests_per_second: s.arrivals.len() as f64 / window.as_secs_f64().max(1e-3),
            computed_prompt_tokens: mean(|r| r.computed),
            output_tokens: output,
            context_tokens: mean(|r| r.prompt) + output / 2.0,
            prefills: s.prefills.iter().map(|p| (p.1, p.2)).collect(),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Samples> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Both pools' demand, in replicas.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Demand {
    pub prefill: f64,
    pub decode: f64,
}

/// The model and its live corrections.
#[derive(Debug, Clone)]
pub struct Planner {
    pub model: LatencyModel,
    /// Seconds per output token a decode replica is planned to stay within.
    pub slo_tpot: f64,
    /// The share of a replica's capacity the plan fills.
    pub utilization: f64,
    /// The largest batch one decode replica is planned for.
    pub max_batch: usize,
    /// Measured over modelled time: prefill, decode.
    pub correction: [f64; 2],
}

impl Planner {
    /// The planner of `--autoscaler-mode planned`, from its flags.
    pub fn from_args(args: &AutoscalerArgs) -> Result<Self, String> {
        let path = args
            .autoscaler_model
            .as_ref()
            .ok_or("--autoscaler-mode planned needs --autoscaler-model (the JSON of `pdserve-loadtest engine --json`)")?;
        let profile =
            read_profile(path, &args.autoscaler_model_weights).map_err(|e| e.to_string())?;
        let zero = LatencyModel {
            prefill_per_token: 0.0,
            prefill_fixed: 0.0,
            step_fixed: 0.0,
            step_per_seq: 0.0,
            step_per_context_token: 0.0,
            scale: 1.0,
        };
        let model = zero.fitted(&profile).map_err(|e| e.to_string())?;
        model.validate().map_err(|e| e.to_string())?;
        Ok(Self {
            model,
            slo_tpot: args.autoscaler_slo_tpot_ms / 1e3,
            utilization: args.autoscaler_utilization,
            max_batch: args.autoscaler_max_batch.max(1),
            correction: [1.0, 1.0],
        })
    }

    /// Updates the corrections from what was measured, then returns the demand.
    pub fn demand(&mut self, offered: &Offered, decode_workers: &[WorkerView]) -> Demand {
        self.correct(offered, decode_workers);
        let util = self.utilization.clamp(0.05, 1.0);
        let prefill_secs = self.prefill_secs(offered.computed_prompt_tokens);
        let (batch, step) = self.decode_batch(offered.context_tokens);
        let per_replica = batch as f64 / step.max(1e-9);
        let generated = offered.requests_per_second * offered.output_tokens;
        Demand {
            prefill: offered.requests_per_second * prefill_secs / util,
            decode: generated / (per_replica * util),
        }
    }

    /// Corrected prefill time of a prompt with `tokens` to compute.
    fn prefill_secs(&self, tokens: f64) -> f64 {
        let m = &self.model;
        (m.prefill_per_token * tokens + m.prefill_fixed) * self.correction[0]
    }

    /// Corrected step time over `batch` sequences of `context` tokens each.
    fn step_secs(&self, batch: usize, context: f64) -> f64 {
        let m = &self.model;
        let b = batch as f64;
        let modelled = m.step_fixed + m.step_per_seq * b + m.step_per_context_token * b * context;
        modelled * self.correction[1]
    }

    /// The largest batch (at least 1) whose corrected step stays within the
    /// TPOT target, and that step's time.
    pub fn decode_batch(&self, context: f64) -> (usize, f64) {
        let mut best = (1, self.step_secs(1, context));
        for b in 2..=self.max_batch {
            let step = self.step_secs(b, context);
            if step > self.slo_tpot {
                break;
            }
            best = (b, step);
        }
        best
    }

    fn correct(&mut self, offered: &Offered, decode_workers: &[WorkerView]) {
        let m = &self.model;
        let (measured, modelled) = offered.prefills.iter().fold((0.0, 0.0), |acc, (s, t)| {
            let model = m.prefill_per_token * f64::from(*t) + m.prefill_fixed;
            (acc.0 + s, acc.1 + model)
        });
        self.correction[0] = smooth(self.correction[0], measured, modelled);
        let (measured, modelled) = decode_workers
            .iter()
            .filter(|w| w.load.active_sequences > 0 && w.load.tokens_per_second > 0.0)
            .fold((0.0, 0.0), |acc, w| {
                let batch = w.load.active_sequences as f64;
                let step = batch / w.load.tokens_per_second;
                let model = m.step_fixed
                    + m.step_per_seq * batch
                    + m.step_per_context_token * batch * offered.context_tokens;
                (acc.0 + step, acc.1 + model)
            });
        self.correction[1] = smooth(self.correction[1], measured, modelled);
    }
}

/// The correction after one tick's measurement (held without one).
fn smooth(old: f64, measured: f64, modelled: f64) -> f64 {
    if !(measured > 0.0 && modelled > 0.0 && measured.is_finite() && modelled.is_finite()) {
        return old;
    }
    let now = (measured / modelled).clamp(CORRECTION_RANGE.0, CORRECTION_RANGE.1);
    old + SMOOTHING * (now - old)
}

#[cfg(test)]
#[path = "planned_tests.rs"]
mod tests;
