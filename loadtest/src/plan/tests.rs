use clap::{CommandFactory, Parser};

use super::*;

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    plan: PlanArgs,
}

fn args(flags: &[&str]) -> PlanArgs {
    let argv = std::iter::once("pdserve-loadtest").chain(flags.iter().copied());
    Cli::try_parse_from(argv).unwrap().plan
}

/// A load that one decode worker cannot carry within the SLOs: Poisson at
/// 20 req/s of 64-token prompts and 32-token answers, with the mock's
/// default latency model (a step 6.7 ms + 2.5 ms per sequence).
const LOAD: &[&str] = &[
    "--rate=20",
    "--requests=300",
    "--endpoint=completions",
    "--input-len=64",
    "--output-len=32",
    "--slo-ttft=500",
    "--slo-tpot=40",
    "--attainment=0.95",
    "--router-overhead-ms=0",
    "--max-prefill-workers=3",
    "--max-decode-workers=6",
];

/// [`LOAD`] with `extra`'s flags in place of its own.
fn with(extra: &[&str]) -> PlanArgs {
    let name = |f: &str| f.split('=').next().unwrap_or_default().to_string();
    let given: Vec<String> = extra.iter().map(|f| name(f)).collect();
    let mut flags: Vec<&str> = LOAD
        .iter()
        .copied()
        .filter(|f| !given.contains(&name(f)))
        .collect();
    flags.extend_from_slice(extra);
    args(&flags)
}

#[test]
fn the_flags_of_simulate_and_of_the_space_do_not_collide() {
    Cli::command().debug_assert();
}

/// Simulates every (P, D) of the space: what bisection must agree with.
fn exhaustive(a: &PlanArgs) -> Vec<(usize, usize, bool)> {
    let mut out = Vec::new();
    for p in a.space.min_prefill_workers..=a.space.max_prefill_workers {
        for d in a.space.min_decode_workers..=a.space.max_decode_workers {
            let mut one = a.clone();
            one.space.min_prefill_workers = p;
            one.space.max_prefill_workers = p;
            one.space.min_decode_workers = d;
            one.space.max_decode_workers = d;
            let plan = search(&one).unwrap();
            out.push((p, d, plan.chosen.is_some()));
        }
    }
    out
}

#[test]
fn the_plan_is_the_cheapest_configuration_that_meets_the_slos() {
    let a = with(&["--decode-cost=2"]);
    let plan = search(&a).unwrap();
    let chosen = plan
        .chosen()
        .expect("the space holds a configuration that meets");
    assert!(chosen.meets && chosen.slo_attainment >= 0.95);
    assert!(
        chosen.decode_workers > 1,
        "one decode worker should not carry 20 req/s: {chosen:?}"
    );
    let cheapest = exhaustive(&a)
        .into_iter()
        .filter(|(_, _, meets)| *meets)
        .map(|(p, d, _)| a.space.cost(p, d))
        .fold(f64::INFINITY, f64::min);
    assert_eq!(chosen.cost, cheapest, "{}", show::table(&plan));
    // Nothing cheaper that was simulated met the SLOs.
    assert!(plan
        .candidates
        .iter()
        .filter(|c| c.cost < chosen.cost)
        .all(|c| !c.meets));
}

#[test]
fn bisection_simulates_fewer_candidates_than_the_grid() {
    let a = with(&[]);
    let plan = search(&a).unwrap();
    let grid = 4 * 6;
    assert!(
        plan.candidates.len() < grid,
        "{} candidates for a grid of {grid}",
        plan.candidates.len()
    );
    // Each candidate is one configuration, simulated once.
    let mut seen: Vec<_> = plan
        .candidates
        .iter()
        .map(|c| (c.prefill_workers, c.decode_workers, c.knobs.max_batch))
        .collect();
    seen.sort_unstable();
    seen.dedup();
    assert_eq!(seen.len(), plan.candidates.len());
}

#[test]
fn a_slower_measured_decode_needs_more_decode_workers() {
    let fast = search(&with(&[])).unwrap();
    let slow = search(&with(&["--decode-correction=1.6"])).unwrap();
    let (f, s) = (fast.chosen().unwrap(), slow.chosen().unwrap());
    assert!(
        s.decode_workers > f.decode_workers,
        "corrected plan {s:?} against {f:?}"
    );
}

#[test]
fn knobs_are_searched_when_given() {
    let plan = search(&with(&["--search-max-batch=1,16"])).unwrap();
    let batches: std::collections::BTreeSet<usize> =
        plan.candidates.iter().map(|c| c.knobs.max_batch).collect();
    assert_eq!(batches.into_iter().collect::<Vec<_>>(), vec![1, 16]);
    // A batch of one cannot keep up with 20 req/s on six workers.
    assert_eq!(plan.chosen().unwrap().knobs.max_batch, 16);
}

#[test]
fn an_unreachable_slo_is_an_error_with_the_best_found() {
    let a = with(&[
        "--slo-ttft=1",
        "--max-prefill-workers=1",
        "--max-decode-workers=2",
    ]);
    let plan = search(&a).unwrap();
    assert!(plan.chosen.is_none());
    assert!(show::verdict(&plan, &a).contains("none meets"));
    let err = run(a).unwrap_err().to_string();
    assert!(err.contains("no configuration"), "{err}");
}

#[test]
fn the_pareto_front_only_gains_attainment_with_cost() {
    let plan = search(&with(&[])).unwrap();
    let front = show::front(&plan);
    assert!(!front.is_empty());
    for w in front.windows(2) {
        assert!(w[0].cost <= w[1].cost && w[0].slo_attainment < w[1].slo_attainment);
    }
    // Nothing off the front beats a front point at no more cost.
    for c in plan.candidates.iter().filter(|c| !c.pareto) {
        assert!(front
            .iter()
            .any(|f| f.cost <= c.cost && f.slo_attainment >= c.slo_attainment));
    }
    let text = show::text_plot(&plan);
    assert!(text.contains('#') && text.contains("0.95"), "{text}");
}

#[test]
fn bad_spaces_are_refused() {
    for extra in [
        &["--attainment=0"][..],
        &["--min-decode-workers=0"],
        &["--min-prefill-workers=4"],
        &["--decode-correction=0"],
        &["--search-max-batch=0"],
        &["--sweep=1,2"],
    ] {
        let err = search(&with(extra));
        assert!(err.is_err(), "{extra:?} was accepted");
    }
    let no_slo = args(&["--rate=1", "--requests=10"]);
    let err = search(&no_slo).unwrap_err().to_string();
    assert!(err.contains("SLO"), "{err}");
}

#[test]
fn the_report_has_the_plot_the_table_and_the_command() {
    let a = with(&[]);
    let plan = search(&a).unwrap();
    let dir = tempfile::tempdir().unwrap();
    show::write_report(dir.path(), &plan, &a).unwrap();
    let md = std::fs::read_to_string(dir.path().join("plan.md")).unwrap();
    assert!(
        md.contains("pdserve-router") && md.contains("| > |"),
        "{md}"
    );
    let svg = std::fs::read_to_string(plot_path(dir.path())).unwrap();
    assert!(svg.contains("<svg"));
}

#[test]
fn max_workers_caps_both_pools_together() {
    let plan = search(&with(&["--max-workers=3", "--max-prefill-workers=2"])).unwrap();
    assert!(!plan.candidates.is_empty());
    for c in &plan.candidates {
        assert!(c.prefill_workers + c.decode_workers <= 3, "{c:?}");
    }
    let unlimited = search(&with(&["--max-prefill-workers=2"])).unwrap();
    let biggest = unlimited
        .candidates
        .iter()
        .map(|c| c.prefill_workers + c.decode_workers)
        .max();
    assert!(
        biggest > Some(3),
        "the cap must remove something: {biggest:?}"
    );
    assert!(search(&with(&["--max-workers=0"])).is_err());
}
