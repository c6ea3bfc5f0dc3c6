use super::*;
use crate::autoscaler::policy::{Policy, PolicyConfig};
use pdserve_protocol::internal::LoadReport;

/// 0.5 ms per prompt token + 5 ms; a step of 5 ms + 1 ms per sequence.
fn model() -> LatencyModel {
    LatencyModel {
        prefill_per_token: 0.0005,
        prefill_fixed: 0.005,
        step_fixed: 0.005,
        step_per_seq: 0.001,
        step_per_context_token: 0.0,
        scale: 1.0,
    }
}

fn planner() -> Planner {
    Planner {
        model: model(),
        slo_tpot: 0.010,
        utilization: 0.8,
        max_batch: 32,
        correction: [1.0, 1.0],
    }
}

fn offered(rate: f64) -> Offered {
    Offered {
        requests_per_second: rate,
        computed_prompt_tokens: 100.0,
        output_tokens: 20.0,
        context_tokens: 110.0,
        prefills: Vec::new(),
    }
}

fn decode_worker(active: u64, tokens_per_second: f64) -> WorkerView {
    WorkerView {
        url: "http://d".into(),
        load: LoadReport {
            active_sequences: active,
            tokens_per_second,
            ..LoadReport::default()
        },
        assigned_requests: 0,
        assigned_tokens: 0,
        assigned_prefill_tokens: 0,
        fingerprint: None,
        prefix: None,
    }
}

/// Routers behind one Service each see a share of the requests; the
/// Kubernetes overlay sums their demand, which is right only if the demand
/// is linear in the rate: two routers at 10 and 14 requests/s ask for what
/// one router at 24 does.
#[test]
fn the_demand_of_two_routers_adds_up_to_one_routers_at_the_whole_rate() {
    let workers = [decode_worker(5, 500.0), decode_worker(3, 400.0)];
    let whole = planner().demand(&offered(24.0), &workers);
    let (a, b) = (
        planner().demand(&offered(10.0), &workers),
        planner().demand(&offered(14.0), &workers),
    );
    assert!(
        (a.prefill + b.prefill - whole.prefill).abs() < 1e-9,
        "{a:?} {b:?} {whole:?}"
    );
    assert!(
        (a.decode + b.decode - whole.decode).abs() < 1e-9,
        "{a:?} {b:?} {whole:?}"
    );
    assert!(whole.prefill > 1.0 && whole.decode > 1.0, "{whole:?}");
}

#[test]
fn demand_follows_the_model() {
    let mut p = planner();
    // Within 10 ms a step holds 5 sequences: 5 / 10 ms = 500 tokens/s a replica.
    assert_eq!(p.decode_batch(110.0), (5, 0.010));
    let d = p.demand(&offered(24.0), &[]);
    // Prefill: 24/s × (50 + 5) ms / 0.8 = 1.65 replicas.
    assert!((d.prefill - 1.65).abs() < 1e-9, "{d:?}");
    // Decode: 24/s × 20 tokens = 480 tokens/s over 500 × 0.8 = 1.2 replicas.
    assert!((d.decode - 1.2).abs() < 1e-9, "{d:?}");
    let idle = p.demand(&offered(0.0), &[]);
    assert_eq!((idle.prefill, idle.decode), (0.0, 0.0));
}

#[test]
fn measured_times_correct_the_model() {
    let mut p = planner();
    let before = p.demand(&offered(24.0), &[]);
    // Prefill jobs take twice the model's 55 ms; decode steps of 4 take
    // 18 ms against the model's 9 (4 / 18 ms = 222 tokens/s).
    let mut o = offered(24.0);
    o.prefills = vec![(0.110, 100); 10];
    let slow = [decode_worker(4, 4.0 / 0.018)];
    for _ in 0..30 {
        p.demand(&o, &slow);
    }
    assert!((p.correction[0] - 2.0).abs() < 0.01, "{:?}", p.correction);
    assert!((p.correction[1] - 2.0).abs() < 0.01, "{:?}", p.correction);
    let after = p.demand(&o, &slow);
    assert!((after.prefill / before.prefill - 2.0).abs() < 0.02);
    // Twice as slow, the batch within 10 ms shrinks from 5 to 1 sequence.
    assert_eq!(p.decode_batch(110.0).0, 1);
    assert!(after.decode > 3.0 * before.decode, "{after:?} {before:?}");
    // Idle workers and no prefills hold the corrections.
    let held = p.correction;
    p.demand(&offered(0.0), &[decode_worker(0, 500.0)]);
    assert_eq!(p.correction, held);
}

/// Both pools through the policy as the autoscaler runs them: one tick a
/// second, the router's defaults (scale-down window 60 s, cooldown 10 s,
/// step 1, headroom 0.9), and a load that is noisy (±15%) around its rate.
fn run(rates: &[(f64, usize)]) -> Vec<[usize; 2]> {
    let cfg = PolicyConfig {
        target: 1.0,
        min: 1,
        max: 16,
        up_window: Duration::ZERO,
        down_window: Duration::from_secs(60),
        max_step: 1,
        cooldown: Duration::from_secs(10),
        down_headroom: 0.9,
    };
    let mut p = planner();
    let mut policies = [Policy::default(), Policy::default()];
    let mut replicas = [1usize, 1];
    let mut out = Vec::new();
    let mut t = 0u64;
    // A fixed pseudo-random sequence: the test is deterministic.
    let mut noise = 0x2545_f491_4f6c_dd1du64;
    for &(rate, seconds) in rates {
        for _ in 0..seconds {
            noise ^= noise << 13;
            noise ^= noise >> 7;
            noise ^= noise << 17;
            let jitter = 1.0 + 0.3 * ((noise % 1000) as f64 / 1000.0 - 0.5);
            let d = p.demand(&offered(rate * jitter), &[]);
            for (i, demand) in [d.prefill, d.decode].into_iter().enumerate() {
                let now = Duration::from_secs(t);
                replicas[i] = policies[i].decide(&cfg, now, demand, replicas[i]);
            }
            out.push(replicas);
            t += 1;
        }
    }
    out
}

/// The sizes a rate is planned for: the demand's ceiling.
fn planned(rate: f64) -> [usize; 2] {
    let d = planner().demand(&offered(rate), &[]);
    [d.prefill.ceil() as usize, d.decode.ceil() as usize]
}

#[test]
fn a_step_in_load_moves_both_pools_to_the_planned_sizes() {
    let (low, high) = (4.0, 60.0);
    assert_eq!(planned(low), [1, 1]);
    let target = planned(high);
    // 60/s: prefill 4.1 → 5, decode 3 → 3 (rounded up from the noisy peak).
    assert!(target[0] >= 4 && target[1] >= 3, "{target:?}");
    let trace = run(&[(low, 60), (high, 120)]);
    assert!(
        trace[..60].iter().all(|r| *r == [1, 1]),
        "{:?}",
        &trace[..60]
    );
    // Both pools start to grow in the step's first tick, together.
    assert_eq!(trace[60], [2, 2]);
    let end = trace[179];
    for pool in 0..2 {
        // At the top of the noise band's planned sizes.
        let lo = planned(high * 0.85)[pool];
        let hi = planned(high * 1.15)[pool];
        assert!(
            (lo..=hi).contains(&end[pool]),
            "pool {pool}: {end:?}, planned {lo}..={hi}"
        );
    }
    // The load falls back: both pools return to one replica each.
    let trace = run(&[(high, 120), (low, 240)]);
    assert_eq!(trace[359], [1, 1]);
}

#[test]
fn a_flat_load_never_oscillates() {
    // Rates near a boundary between sizes, where N ↔ N−1 flapping starts.
    for rate in [10.0, 23.0, 29.0, 41.0, 58.0] {
        let trace = run(&[(rate, 600)]);
        // After the climb (a minute at most), no change at all.
        let settled = &trace[60..];
        let changes = settled.windows(2).filter(|w| w[0] != w[1]).count();
        assert_eq!(
            changes,
            0,
            "rate {rate}: {:?}",
            settled.iter().step_by(10).collect::<Vec<_>>()
        );
    }
}

#[test]
fn the_window_measures_rate_and_means() {
    let load = OfferedLoad::default();
    let mut usage = Usage::new(120, 30);
    usage.prompt_tokens_details.cached_tokens = 20;
    // Off until the planned autoscaler turns it on.
    load.arrived();
    load.request(&usage);
    assert_eq!(load.over(Duration::from_secs(5)), Offered::default());
    load.enable();
    for _ in 0..10 {
        load.arrived();
        load.request(&usage);
    }
    load.arrived();
    load.prefill(0.05, 100);
    load.prefill(f64::NAN, 100);
    let o = load.over(Duration::from_secs(5));
    assert_eq!(o.requests_per_second, 2.2);
    assert_eq!(o.computed_prompt_tokens, 100.0);
    assert_eq!(o.output_tokens, 30.0);
    assert_eq!(o.context_tokens, 135.0);
    assert_eq!(o.prefills, vec![(0.05, 100)]);
}
