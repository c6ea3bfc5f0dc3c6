//! The scaling decision, like the Kubernetes HPA: a pure function of the
//! signal's history and the configuration.
//!
//! Each tick the raw recommendation is `ceil(signal / target)` clamped to
//! `[min, max]`. Scaling up takes the *smallest* recommendation of the
//! scale-up window, scaling down the *largest* of the scale-down window, so
//! a brief dip never removes a replica and a long enough burst always adds
//! one. A change is at most `max_step` replicas, and none happens within
//! `cooldown` of the previous change.
//!
//! Scaling down from N to M replicas also checks what the M left would
//! carry: the window's peak load per replica × N/M (the load of the removed
//! ones moves to the others) must stay within `down_headroom` × `target`.
//! Without that margin a load just under the boundary of N−1 replicas
//! removes one, the others cross the boundary and it comes back: the N ↔
//! N−1 oscillation.

use std::collections::VecDeque;
use std::time::Duration;

#[derive(Debug, Clone, PartialEq)]
pub struct PolicyConfig {
    /// Signal one replica should carry.
    pub target: f64,
    pub min: usize,
    pub max: usize,
    pub up_window: Duration,
    pub down_window: Duration,
    /// Replicas added or removed per decision at most.
    pub max_step: usize,
    /// No change within this time of the previous one.
    pub cooldown: Duration,
    /// Scale down only while the replicas left carry at most this share of
    /// `target` each (1: no margin).
    pub down_headroom: f64,
}

/// The history one pool's decisions depend on. Times are offsets from any
/// fixed origin (the tests use synthetic ones).
#[derive(Debug, Default)]
pub struct Policy {
    /// (time, raw recommendation, signal), newest last.
    history: VecDeque<(Duration, usize, f64)>,
    last_change: Option<Duration>,
}

impl Policy {
    /// The raw recommendation for one signal value.
    pub fn recommend(cfg: &PolicyConfig, signal: f64) -> usize {
        let want = match signal.is_finite() && signal > 0.0 {
            true => (signal / cfg.target.max(1e-9)).ceil() as usize,
            false => 0,
        };
        want.clamp(cfg.min, cfg.max.max(cfg.min))
    }

    /// Records `signal` at `now` and returns the desired replicas given
    /// `current` ones.
    pub fn decide(
        &mut self,
        cfg: &PolicyConfig,
        now: Duration,
        signal: f64,
        current: usize,
    ) -> usize {
        let raw = Self::recommend(cfg, signal);
        let load = if signal.is_finite() {
            signal.max(0.0)
        } else {
            0.0
        };
        self.history.push_back((now, raw, load));
        let keep = cfg.up_window.max(cfg.down_window);
        while self
            .history
            .front()
            .is_some_and(|(t, _, _)| now.saturating_sub(*t) > keep)
        {
            self.history.pop_front();
        }
        let within = |w: Duration| {
            self.history
                .iter()
                .filter(move |(t, _, _)| now.saturating_sub(*t) <= w)
        };
        let up = within(cfg.up_window).map(|h| h.1).min().unwrap_or(raw);
        let down = within(cfg.down_window).map(|h| h.1).max().unwrap_or(raw);
        let target = match (up > current, down < current) {
            (true, _) => up.min(current + cfg.max_step.max(1)),
            (_, true) => {
                let peak = within(cfg.down_window).map(|h| h.2).fold(load, f64::max);
                let mut left = down.max(current.saturating_sub(cfg.max_step.max(1)));
                while left < current && !carries(cfg, peak, current, left) {
                    left += 1;
                }
                left
            }
            _ => current,
        };
        let target = target.clamp(cfg.min, cfg.max.max(cfg.min));
        let cooling = self
            .last_change
            .is_some_and(|t| now.saturating_sub(t) < cfg.cooldown);
        // Bounds are enforced even while cooling down.
        if target == current || (cooling && (cfg.min..=cfg.max).contains(&current)) {
            return current;
        }
        self.last_change = Some(now);
        target
    }
}

/// Whether `left` replicas carry a pool load of `peak` that `current` carry
/// now: each takes its share × current/left, within the headroom.
fn carries(cfg: &PolicyConfig, peak: f64, current: usize, left: usize) -> bool {
    if left == 0 {
        return peak <= 0.0;
    }
    let per_replica = peak / current.max(1) as f64;
    per_replica * current as f64 / left as f64 <= cfg.target * cfg.down_headroom
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> PolicyConfig {
        PolicyConfig {
            target: 10.0,
            min: 1,
            max: 5,
            up_window: Duration::ZERO,
            down_window: Duration::from_secs(30),
            max_step: 1,
            cooldown: Duration::from_secs(5),
            down_headroom: 0.9,
        }
    }

    fn s(secs: u64) -> Duration {
        Duration::from_secs(secs)
    }

    /// Runs the policy on one signal value per second, applying each decision.
    fn simulate(cfg: &PolicyConfig, signals: &[f64], start: usize) -> Vec<usize> {
        let mut p = Policy::default();
        let mut current = start;
        signals
            .iter()
            .enumerate()
            .map(|(i, &sig)| {
                current = p.decide(cfg, s(i as u64), sig, current);
                current
            })
            .collect()
    }

    #[test]
    fn recommendations_are_ceil_of_signal_over_target_within_bounds() {
        let c = cfg();
        assert_eq!(Policy::recommend(&c, 0.0), 1);
        assert_eq!(Policy::recommend(&c, 10.0), 1);
        assert_eq!(Policy::recommend(&c, 10.5), 2);
        assert_eq!(Policy::recommend(&c, 1000.0), 5);
        assert_eq!(Policy::recommend(&c, f64::NAN), 1);
        let zero = PolicyConfig { min: 0, ..cfg() };
        assert_eq!(Policy::recommend(&zero, 0.0), 0);
    }

    #[test]
    fn a_burst_scales_up_within_the_window_one_step_per_cooldown() {
        let mut signals = vec![0.0; 3];
        signals.extend(vec![45.0; 30]);
        let r = simulate(&cfg(), &signals, 1);
        assert_eq!(r[3], 2, "the first burst tick already scales up");
        // One step per 5 s cooldown: 2 at t=3, 3 at t=8, 4 at t=13, 5 at t=18.
        assert_eq!(r[8], 3);
        assert_eq!(r[18], 5);
        assert_eq!(*r.last().unwrap(), 5);
        assert!(
            r.windows(2).all(|w| w[1] >= w[0]),
            "no step down during the burst"
        );
    }

    #[test]
    fn scale_down_waits_for_the_whole_window() {
        let mut signals = vec![45.0; 10];
        signals.extend(vec![0.0; 60]);
        let r = simulate(&cfg(), &signals, 5);
        // The last high recommendation was at t=9: nothing falls before t=40.
        assert!(r[..40].iter().all(|&x| x == 5), "{r:?}");
        assert!(r[40] < 5);
        assert_eq!(*r.last().unwrap(), 1, "ends at the minimum");
    }

    #[test]
    fn flapping_inputs_do_not_oscillate() {
        // High and low alternate every second for two minutes.
        let signals: Vec<f64> = (0..120)
            .map(|i| if i % 2 == 0 { 35.0 } else { 0.0 })
            .collect();
        let r = simulate(
            &PolicyConfig {
                up_window: s(3),
                ..cfg()
            },
            &signals,
            1,
        );
        let changes = r.windows(2).filter(|w| w[0] != w[1]).count();
        assert_eq!(
            changes, 0,
            "a 3 s up-window ignores one-second spikes: {r:?}"
        );
        // Without an up-window it scales up once and then holds: the
        // down-window always contains a high sample.
        let r = simulate(&cfg(), &signals, 1);
        let downs = r.windows(2).filter(|w| w[1] < w[0]).count();
        assert_eq!(downs, 0, "{r:?}");
        assert_eq!(*r.last().unwrap(), 4);
    }

    #[test]
    fn bounds_hold_even_during_cooldown() {
        let c = cfg();
        let mut p = Policy::default();
        assert_eq!(p.decide(&c, s(0), 15.0, 1), 2);
        // Replicas below the minimum (a crash) are restored at once.
        assert_eq!(p.decide(&c, s(1), 15.0, 0), 1);
    }

    /// A flat load just under the boundary of 3 replicas (target 10): samples
    /// in [27, 29), and one in fifty a spike over 30 that asks for a fourth.
    fn noisy_flat(ticks: usize) -> Vec<f64> {
        let mut x = 0x2545_f491_4f6c_dd1du64;
        let mut unit = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 11) as f64 / (1u64 << 53) as f64
        };
        (0..ticks)
            .map(|_| {
                let level = 27.0 + 1.9 * unit();
                match unit() < 0.02 {
                    true => level + 3.5,
                    false => level,
                }
            })
            .collect()
    }

    #[test]
    fn a_flat_load_at_a_boundary_does_not_oscillate() {
        let windowed = PolicyConfig {
            down_window: s(10),
            ..cfg()
        };
        let signals = noisy_flat(1200);
        let r = simulate(&windowed, &signals, 3);
        let changes = r.windows(2).filter(|w| w[0] != w[1]).count();
        assert!(changes <= 1, "{changes} changes: {r:?}");
        assert_eq!(*r.last().unwrap(), 4, "the spikes need a fourth replica");
        // Without the headroom the same load flaps between 3 and 4: what
        // the check prevents.
        let bare = PolicyConfig {
            down_headroom: 1.0,
            ..windowed
        };
        let r = simulate(&bare, &signals, 3);
        let changes = r.windows(2).filter(|w| w[0] != w[1]).count();
        assert!(changes >= 4, "{changes} changes: {r:?}");
    }

    #[test]
    fn scale_down_assumes_the_others_absorb_the_removed_share() {
        let c = PolicyConfig {
            down_window: Duration::ZERO,
            cooldown: Duration::ZERO,
            ..cfg()
        };
        let mut p = Policy::default();
        // 4 replicas at 26: 3 would carry 8.67 each, within 9: one goes.
        assert_eq!(p.decide(&c, s(0), 26.0, 4), 3);
        // 3 replicas at 19: 2 would carry 9.5 each, over 9: all stay,
        // although ceil(19 / 10) = 2.
        assert_eq!(Policy::recommend(&c, 19.0), 2);
        assert_eq!(p.decide(&c, s(1), 19.0, 3), 3);
        // At 17, 2 carry 8.5 each: one goes.
        assert_eq!(p.decide(&c, s(2), 17.0, 3), 2);
        // To zero only with no load at all.
        let zero = PolicyConfig { min: 0, ..c };
        assert_eq!(p.decide(&zero, s(3), 0.0, 1), 0);
    }
}
