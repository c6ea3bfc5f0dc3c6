use clap::{CommandFactory, Parser};

use super::cluster::{ClusterCfg, Finished, Output, Request, Sim};
use super::*;

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    sim: SimArgs,
}

fn args(flags: &[&str]) -> SimArgs {
    let argv = std::iter::once("pdserve-loadtest").chain(flags.iter().copied());
    Cli::try_parse_from(argv).unwrap().sim
}

#[test]
fn the_flags_of_run_and_of_the_cluster_do_not_collide() {
    Cli::command().debug_assert();
}

/// A cluster with round numbers: prefill 1 ms/token + 5 ms, a step 10 ms
/// + 2 ms per sequence + 0.01 ms per context token, no router overhead.
fn cfg(prefill: usize, decode: usize, extra: &[&str]) -> ClusterCfg {
    let mut flags = vec![
        "--concurrency=1",
        "--prefill-ms-per-token=1",
        "--prefill-fixed-ms=5",
        "--step-fixed-ms=10",
        "--step-ms-per-seq=2",
        "--step-ms-per-context-token=0.01",
        "--router-overhead-ms=0",
    ];
    let (p, d) = (
        format!("--prefill-workers={prefill}"),
        format!("--decode-workers={decode}"),
    );
    flags.extend([p.as_str(), d.as_str()]);
    flags.extend_from_slice(extra);
    args(&flags).cluster.config().unwrap()
}

fn request(id: usize, prompt: Vec<u32>, max_tokens: u32) -> Request {
    Request {
        id,
        prompt,
        max_tokens,
    }
}

/// Every request's outcome, in the order they finish.
fn drain(sim: &mut Sim) -> Vec<Finished> {
    let mut out = Vec::new();
    while let Some(o) = sim.next() {
        if let Output::Done(f) = o {
            out.push(f);
        }
    }
    out
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() < 1e-9
}

#[test]
fn one_request_takes_what_the_latency_model_says_on_both_paths() {
    let prompt: Vec<u32> = (0..100).collect();
    for (prefill, mode, link_ms) in [(0, "aggregated", 0.0), (1, "disaggregated", 1.5)] {
        let latency = format!("--link-latency-ms={link_ms}");
        let mode = format!("--mode={mode}");
        let c = cfg(prefill, 1, &[&mode, &latency]);
        let model = c.latency;
        let mut sim = Sim::new(c);
        sim.submit_at(0.5, request(7, prompt.clone(), 10));
        let f = drain(&mut sim).pop().unwrap();
        assert_eq!((f.id, f.error, f.completion_tokens), (7, None, 10));
        let ttft = model.prefill(100).as_secs_f64() + link_ms / 1e3;
        assert!(close(f.first.unwrap() - f.start, ttft), "{mode}: {f:?}");
        // Each later token is one step over the one sequence, its context
        // growing by a token a step.
        let steps: Vec<f64> = (1..10)
            .map(|g| model.step(1, 100 + g).as_secs_f64())
            .collect();
        assert_eq!(f.itl.len(), 9);
        for (got, want) in f.itl.iter().zip(&steps) {
            assert!(close(*got, *want), "{mode}: gap {got} against {want}");
        }
        assert!(close(f.end - f.start, ttft + steps.iter().sum::<f64>()));
        assert_eq!(sim.kv_used(), vec![0], "the reservation is given back");
    }
}

#[test]
fn a_slow_link_shows_in_the_first_token_and_a_fast_one_hides_behind_prefill() {
    let prompt: Vec<u32> = (0..512).collect();
    let ttft = |gbps: &str| {
        let c = cfg(
            1,
            1,
            &["--mode=disaggregated", gbps, "--kv-bytes-per-token=23040"],
        );
        let mut sim = Sim::new(c);
        sim.submit_at(0.0, request(0, prompt.clone(), 2));
        let f = drain(&mut sim).pop().unwrap();
        f.first.unwrap() - f.start
    };
    let compute = 0.512 + 0.005;
    // 512 tokens × 23,040 bytes = 11.8 MB: 9.4 ms at 10 Gb/s, streamed
    // while 517 ms of prefill run; only the last layer's share shows.
    let fast = ttft("--link-gbps=10");
    assert!(fast > compute && fast < compute + 0.001, "{fast}");
    // At 0.1 Gb/s the transfer (944 ms) outlasts the compute.
    let slow = ttft("--link-gbps=0.1");
    assert!(close(slow, 512.0 * 23_040.0 / 0.1e9 * 8.0), "{slow}");
}

/// 480 tokens every such prompt shares, then 20 of its own from `t`.
fn with_tail(t: u32) -> Vec<u32> {
    (0..480).chain(t..t + 20).collect()
}

#[test]
fn a_cached_prefix_is_not_prefilled_again() {
    let c = cfg(1, 1, &["--mode=disaggregated"]);
    let mut sim = Sim::new(c);
    sim.submit_at(0.0, request(0, with_tail(1000), 4));
    let first = drain(&mut sim).pop().unwrap();
    sim.submit_at(sim.now(), request(1, with_tail(2000), 4));
    let second = drain(&mut sim).pop().unwrap();
    assert_eq!((first.cached_tokens, second.cached_tokens), (0, 480));
    let ttft = |f: &Finished| f.first.unwrap() - f.start;
    // The second computes 20 tokens on the prefill worker (its own cache
    // holds the rest) instead of 500, and only those 20 cross the link.
    assert!(close(ttft(&first), 0.505), "{first:?}");
    assert!(close(ttft(&second), 0.025), "{second:?}");
    let t = sim.totals();
    assert_eq!(t.prefill_tokens_computed, 520);
    assert_eq!(t.decode_cache_hit_tokens, 480);
}

#[test]
fn auto_mode_prefills_locally_what_the_cache_leaves_short() {
    let mut sim = Sim::new(cfg(1, 1, &[]));
    sim.submit_at(0.0, request(0, with_tail(1000), 4));
    drain(&mut sim);
    sim.submit_at(sim.now(), request(1, with_tail(2000), 4));
    drain(&mut sim);
    let t = sim.totals();
    assert_eq!((t.remote_prefills, t.local_prefills), (1, 1));
    assert_eq!(t.local_tokens_computed, 20, "only the uncached 20 tokens");
}

#[test]
fn a_burst_splits_evenly_over_equal_decode_workers_with_every_policy() {
    for policy in ["prefix", "least-load", "round-robin", "power-of-two"] {
        let flag = format!("--decode-policy={policy}");
        let mut sim = Sim::new(cfg(0, 2, &["--mode=aggregated", &flag]));
        for i in 0..12u32 {
            sim.submit_at(
                0.0,
                request(i as usize, (i * 1000..i * 1000 + 64).collect(), 36),
            );
        }
        sim.wake_at(1e-6, 0);
        while let Some(o) = sim.next() {
            if matches!(o, Output::Wake(0)) {
                break;
            }
        }
        let used = sim.kv_used();
        let per_request = 100;
        let split: Vec<u64> = used.iter().map(|u| u / per_request).collect();
        assert!(
            split.iter().all(|&n| (5..=7).contains(&n)) && split.iter().sum::<u64>() == 12,
            "{policy}: {split:?}"
        );
        assert_eq!(drain(&mut sim).len(), 12);
    }
}

#[test]
fn no_room_is_a_503_and_a_request_that_never_fits_a_400() {
    let c = cfg(0, 1, &["--mode=aggregated", "--kv-cache-tokens=1000"]);
    let mut sim = Sim::new(c);
    sim.submit_at(0.0, request(0, (0..500).collect(), 100));
    sim.submit_at(0.0, request(1, (1000..1500).collect(), 100));
    sim.submit_at(0.0, request(2, (0..990).collect(), 20));
    let mut got: Vec<(usize, Option<&str>)> =
        drain(&mut sim).iter().map(|f| (f.id, f.error)).collect();
    got.sort();
    assert_eq!(
        got,
        vec![(0, None), (1, Some("http_503")), (2, Some("http_400"))]
    );
}

#[test]
fn a_chat_turn_finds_the_previous_turn_and_its_answer_cached() {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("sim.json");
    let json_flag = format!("--json={}", json.display());
    let a = args(&[
        "--concurrency=1",
        "--requests=1",
        "--workload=chat",
        "--turns=3",
        "--input-len=40",
        "--output-len=24",
        "--prefix-len=0",
        "--no-progress",
        &json_flag,
    ]);
    let report = run(a).unwrap();
    let records = &report.points[0].targets[0].records;
    assert_eq!(records.len(), 3, "one record per turn");
    assert!(records
        .iter()
        .all(|r| r.error.is_none() && r.completion_tokens == 24));
    // Turn 2 resends turn 1 (5 + 40 + 5 ids) and its 24-token answer.
    assert_eq!(records[1].prompt_tokens, 50 + 24 + 45 + 5);
    let written: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    let hits = written["simulation"][0]["totals"]["decode_cache_hit_tokens"]
        .as_u64()
        .unwrap();
    // Turn 2 finds turn 1's prompt and answer (74 ids) as 4 whole blocks,
    // turn 3 turn 2's (148 ids) as 9.
    assert_eq!(hits, 64 + 144);
    assert_eq!(written["points"][0]["targets"][0]["label"], "simulated");
}

#[test]
fn the_open_loop_counts_arrivals_beyond_the_in_flight_cap_as_client_overload() {
    let a = args(&[
        "--rate=1000",
        "--requests=200",
        "--max-in-flight=10",
        "--input-len=64",
        "--output-len=32",
        "--no-progress",
    ]);
    let report = run(a).unwrap();
    let s = &report.points[0].targets[0].summary;
    assert_eq!(s.requests, 200);
    let overload = s.errors.get("client_overload").copied().unwrap_or(0);
    assert!(overload > 100 && s.ok + overload == 200, "{s:?}");
}

#[test]
fn a_thousand_workers_serve_an_open_loop_without_errors() {
    let a = args(&[
        "--rate=500",
        "--requests=10000",
        "--prefill-workers=500",
        "--decode-workers=500",
        "--input-len=256",
        "--output-len=16",
        "--no-progress",
    ]);
    let report = run(a).unwrap();
    let s = &report.points[0].targets[0].summary;
    assert_eq!((s.requests, s.ok), (10_000, 10_000), "{:?}", s.errors);
    // At half the prefill pool's capacity a first token takes about one
    // prefill of 266 ids (256 words and two chat headers).
    let prefill = 0.0018 * 266.0 + 0.005;
    assert!(
        s.ttft.p50 > prefill && s.ttft.p50 < prefill * 1.5,
        "{:?}",
        s.ttft
    );
}

#[test]
fn more_decode_workers_serve_more_at_saturation() {
    let throughput = |decode: &str| {
        let a = args(&[
            "--concurrency=64",
            "--requests=640",
            "--prefill-workers=2",
            decode,
            "--input-len=16",
            "--output-len=64",
            "--no-progress",
        ]);
        run(a).unwrap().points[0].targets[0]
            .summary
            .output_tokens_per_second
    };
    let (one, two) = (
        throughput("--decode-workers=1"),
        throughput("--decode-workers=2"),
    );
    assert!(two > one * 1.5, "{one} against {two}");
}

/// Two prefills at once: on cores of their own each takes its model time;
/// sharing one core (`--cores 1`) each takes twice that, and 1.5 cores
/// 4/3 of it. Two cores are as good as their own.
#[test]
fn workers_sharing_cores_slow_each_other_down() {
    let ttfts = |cores: Option<&str>| {
        let mut flags = vec!["--mode=disaggregated"];
        flags.extend(cores);
        let c = cfg(2, 2, &flags);
        let mut sim = Sim::new(c);
        sim.submit_at(0.0, request(0, (0..100).collect(), 1));
        sim.submit_at(0.0, request(1, (1000..1100).collect(), 1));
        let done = drain(&mut sim);
        assert_eq!(done.len(), 2);
        assert!(done.iter().all(|f| f.error.is_none()), "{done:?}");
        done.iter()
            .map(|f| f.first.unwrap() - f.start)
            .collect::<Vec<_>>()
    };
    let alone = cfg(2, 2, &[]).latency.prefill(100).as_secs_f64();
    for (cores, factor) in [
        (None, 1.0),
        (Some("--cores=2"), 1.0),
        (Some("--cores=1"), 2.0),
        (Some("--cores=1.5"), 4.0 / 3.0),
    ] {
        let got = ttfts(cores);
        assert!(
            got.iter().all(|t| close(*t, alone * factor)),
            "{cores:?}: {got:?}, alone {alone}"
        );
    }
    let bad = ["pdserve-loadtest", "--cores=0", "--concurrency=1"];
    let parsed = Cli::try_parse_from(bad).unwrap().sim;
    assert!(parsed.cluster.config().is_err());
}
