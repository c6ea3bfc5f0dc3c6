//! `pdserve-loadtest engine`: prefill and decode throughput of the engine,
//! measured in-process after warm-up, median of several repetitions.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result};
use clap::Args;
use pdserve_engine::profile::StageClock;
use pdserve_engine::quant::{set_kernel, KernelChoice};
use pdserve_engine::{KvPool, LoadOptions, Model, SeqKv, WeightFormat, DEFAULT_BLOCK_TOKENS};
use pdserve_protocol::kvwire::KvDtype;
use serde::Serialize;

#[derive(Args, Debug)]
pub struct EngineArgs {
    /// GGUF model file.
    #[arg(long, env = "PDSERVE_MODEL")]
    model: PathBuf,
    /// Weight formats to measure, comma-separated (native, q8_0, f32).
    #[arg(
        long,
        env = "PDSERVE_BENCH_WEIGHTS",
        value_delimiter = ',',
        default_value = "native,q8_0"
    )]
    weights: Vec<WeightFormat>,
    /// Threads for the model's pools (0 = one per core).
    #[arg(long, env = "PDSERVE_THREADS", default_value_t = 2)]
    threads: usize,
    /// Prompt lengths for the prefill measurement.
    #[arg(
        long,
        env = "PDSERVE_BENCH_PREFILL_LENS",
        value_delimiter = ',',
        default_value = "128,512"
    )]
    prefill_lens: Vec<usize>,
    /// Concurrent sequences for the decode measurement.
    #[arg(
        long,
        env = "PDSERVE_BENCH_DECODE_BATCHES",
        value_delimiter = ',',
        default_value = "1,4,16"
    )]
    decode_batches: Vec<usize>,
    /// Context length of each sequence when decoding starts.
    #[arg(long, env = "PDSERVE_BENCH_DECODE_CONTEXT", default_value_t = 128)]
    decode_context: usize,
    /// Decode steps timed per repetition.
    #[arg(long, env = "PDSERVE_BENCH_DECODE_STEPS", default_value_t = 32)]
    decode_steps: usize,
    /// Timed repetitions per measurement (the median is reported).
    #[arg(long, env = "PDSERVE_BENCH_REPS", default_value_t = 5)]
    reps: usize,
    /// Also print where the time goes, per stage of the forward pass.
    #[arg(long, env = "PDSERVE_BENCH_PROFILE")]
    profile: bool,
    /// Write the results as JSON to this file.
    #[arg(long, env = "PDSERVE_BENCH_JSON")]
    json: Option<PathBuf>,
    /// Element type of the KV cache (f16 or f32), as the workers' --kv-cache-dtype.
    #[arg(long, env = "PDSERVE_KV_CACHE_DTYPE", default_value = "f16")]
    kv_cache_dtype: KvDtype,
    /// Kernel path for `native` weights (auto, avx512vnni, avx2, scalar).
    #[arg(long, env = "PDSERVE_KERNEL", default_value = "auto")]
    kernel: KernelChoice,
    /// The machine's peak arithmetic rate, GFLOP/s, for MFU (default: the
    /// f32 GEMM rate measured on the 2-core reference machine).
    #[arg(long, env = "PDSERVE_BENCH_PEAK_GFLOPS", default_value_t = 410.0)]
    peak_gflops: f64,
}

#[derive(Serialize, Debug)]
struct EngineResult {
    weights: String,
    threads: usize,
    prefill_tok_s: BTreeMap<String, f64>,
    decode_tok_s: BTreeMap<String, f64>,
    /// The kernel path of `native` weights.
    kernel: String,
    /// Bytes of weights one decode step reads.
    weight_bytes: usize,
    /// The machine's measured read bandwidth (GB/s) and its MBU at decode ×1.
    bandwidth_gb_s: f64,
    mbu_decode1: Option<f64>,
    /// MFU of the longest prefill against `--peak-gflops`.
    mfu_prefill: Option<f64>,
    /// Seconds per stage, summed over the timed decode runs of the largest batch.
    profile_decode: BTreeMap<String, f64>,
    /// Seconds per stage, summed over the timed prefill runs of the longest prompt.
    profile_prefill: BTreeMap<String, f64>,
}

pub fn run(args: EngineArgs) -> Result<()> {
    anyhow::ensure!(
        args.reps > 0 && args.decode_steps > 0,
        "--reps and --decode-steps must be > 0"
    );
    let threads = pdserve_engine::threads::configure(args.threads);
    let kernel = set_kernel(args.kernel).map_err(anyhow::Error::msg)?;
    let bandwidth = pdserve_engine::profile::read_bandwidth_gb_s();
    eprintln!("kernel path {kernel}; measured read bandwidth {bandwidth:.1} GB/s");
    let mut results = Vec::new();
    for &weights in &args.weights {
        let started = Instant::now();
        let model = Model::load(
            &args.model,
            &LoadOptions {
                weights,
                ..Default::default()
            },
        )
        .with_context(|| format!("loading {}", args.model.display()))?;
        eprintln!(
            "loaded {} as {weights} in {:.2} s",
            args.model.display(),
            started.elapsed().as_secs_f64()
        );
        let mut r = bench_model(&model, &args, threads)?;
        r.kernel = kernel.to_string();
        r.bandwidth_gb_s = bandwidth;
        r.mbu_decode1 = r
            .decode_tok_s
            .get("1")
            .map(|t| t * r.weight_bytes as f64 / (bandwidth * 1e9));
        let longest = args.prefill_lens.iter().max().map(usize::to_string);
        r.mfu_prefill = longest
            .and_then(|l| r.prefill_tok_s.get(&l).copied())
            .map(|t| 2.0 * t * model.layer_macs_per_token() as f64 / (args.peak_gflops * 1e9));
        results.push(r);
    }
    print_table(&results, &args);
    if let Some(path) = &args.json {
        let json = match results.as_slice() {
            [one] => serde_json::to_string_pretty(one)?,
            many => serde_json::to_string_pretty(many)?,
        };
        std::fs::write(path, json).with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}

fn bench_model(model: &Model, args: &EngineArgs, threads: usize) -> Result<EngineResult> {
    let longest = args.prefill_lens.iter().max().copied().unwrap_or(0);
    let biggest = args.decode_batches.iter().max().copied().unwrap_or(0);
    let need = longest.max(biggest * (args.decode_context + args.decode_steps + 1));
    let pool: KvPool = model.kv_pool(
        need * 2,
        DEFAULT_BLOCK_TOKENS,
        false,
        args.kv_cache_dtype.into(),
    );
    let mut out = EngineResult {
        weights: model.weight_format().to_string(),
        threads,
        kernel: String::new(),
        weight_bytes: model.weight_bytes(),
        bandwidth_gb_s: 0.0,
        mbu_decode1: None,
        mfu_prefill: None,
        prefill_tok_s: BTreeMap::new(),
        decode_tok_s: BTreeMap::new(),
        profile_decode: BTreeMap::new(),
        profile_prefill: BTreeMap::new(),
    };
    for &len in &args.prefill_lens {
        let prompt = synthetic_prompt(model, len, 0);
        let run = || -> Result<f64> {
            let mut kv = pool.allocate(len)?;
            let t = Instant::now();
            model.prefill(&prompt, &mut kv)?;
            Ok(t.elapsed().as_secs_f64())
        };
        let secs = timed(model.stage_clock(), args.reps, run)?;
        out.prefill_tok_s.insert(len.to_string(), len as f64 / secs);
        if len == longest {
            out.profile_prefill = stage_map(model.stage_clock());
        }
    }
    for &batch in &args.decode_batches {
        let secs = timed(model.stage_clock(), args.reps, || {
            decode_run(model, &pool, batch, args)
        })?;
        out.decode_tok_s
            .insert(batch.to_string(), (batch * args.decode_steps) as f64 / secs);
        if batch == biggest {
            out.profile_decode = stage_map(model.stage_clock());
        }
    }
    Ok(out)
}

/// One warm-up, then `reps` timed runs; returns the median seconds. The stage
/// clock covers only the timed runs.
fn timed(clock: &StageClock, reps: usize, mut run: impl FnMut() -> Result<f64>) -> Result<f64> {
    run()?;
    clock.reset();
    let mut secs = (0..reps).map(|_| run()).collect::<Result<Vec<f64>>>()?;
    secs.sort_by(f64::total_cmp);
    Ok(secs[secs.len() / 2])
}

/// Prefills `batch` sequences (untimed), then times `decode_steps` batched steps.
fn decode_run(model: &Model, pool: &KvPool, batch: usize, args: &EngineArgs) -> Result<f64> {
    let mut kvs: Vec<SeqKv> = Vec::with_capacity(batch);
    let mut next = Vec::with_capacity(batch);
    let clock = model.stage_clock();
    // The clock should end up holding decode steps only, summed over repetitions.
    let before = clock.snapshot();
    for i in 0..batch {
        // Slightly different lengths, as in a real batch.
        let ctx = args.decode_context + i % 7;
        let mut kv = pool.allocate(ctx + args.decode_steps + 1)?;
        let logits = model.prefill(&synthetic_prompt(model, ctx, i as u32), &mut kv)?;
        next.push(argmax(&logits));
        kvs.push(kv);
    }
    clock.reset();
    let t = Instant::now();
    for _ in 0..args.decode_steps {
        let mut items: Vec<(&mut SeqKv, u32)> = kvs.iter_mut().zip(next.iter().copied()).collect();
        let logits = model.decode_step(&mut items)?;
        next = (0..batch).map(|i| argmax(logits.row(i))).collect();
    }
    let secs = t.elapsed().as_secs_f64();
    // Put back the decode time of earlier repetitions.
    clock.add(&before);
    Ok(secs)
}

fn argmax(logits: &[f32]) -> u32 {
    logits
        .iter()
        .enumerate()
        .fold((0, f32::NEG_INFINITY), |(bi, bv), (i, &v)| {
            if v > bv {
                (i, v)
            } else {
                (bi, bv)
            }
        })
        .0 as u32
}

/// Deterministic token ids that avoid the special tokens at the start of the vocabulary.
pub(crate) fn synthetic_prompt(model: &Model, len: usize, salt: u32) -> Vec<u32> {
    let vocab = model.config().vocab_size as u32;
    let base = 100.min(vocab / 2);
    (0..len as u32)
        .map(|i| {
            base + (i.wrapping_mul(2_654_435_761).wrapping_add(salt * 97) >> 7) % (vocab - base)
        })
        .collect()
}

fn stage_map(clock: &StageClock) -> BTreeMap<String, f64> {
    clock
        .snapshot()
        .into_iter()
        .map(|(s, secs)| (s.name().to_string(), secs))
        .collect()
}

fn print_table(results: &[EngineResult], args: &EngineArgs) {
    println!(
        "\n{:<8} {:>8} {:<26} {:>12}",
        "weights", "threads", "measure", "tok/s"
    );
    for r in results {
        for (len, v) in sorted(&r.prefill_tok_s) {
            println!(
                "{:<8} {:>8} {:<26} {:>12.1}",
                r.weights,
                r.threads,
                format!("prefill {len} tokens"),
                v
            );
        }
        for (b, v) in sorted(&r.decode_tok_s) {
            let what = format!("decode x{b} @ctx {}", args.decode_context);
            println!("{:<8} {:>8} {:<26} {:>12.1}", r.weights, r.threads, what, v);
        }
    }
    for r in results {
        if let Some(mbu) = r.mbu_decode1 {
            println!(
                "{:<8} decode x1 MBU {mbu:.2} ({:.1} MB a step at {:.1} GB/s)",
                r.weights,
                r.weight_bytes as f64 / 1e6,
                r.bandwidth_gb_s
            );
        }
        if let Some(mfu) = r.mfu_prefill {
            println!(
                "{:<8} prefill MFU {mfu:.2} (against {:.0} GFLOP/s)",
                r.weights, args.peak_gflops
            );
        }
    }
    if args.profile {
        for r in results {
            print_profile(
                &format!("{} prefill (longest prompt)", r.weights),
                &r.profile_prefill,
            );
            print_profile(
                &format!("{} decode (largest batch)", r.weights),
                &r.profile_decode,
            );
        }
    }
}

fn sorted(m: &BTreeMap<String, f64>) -> Vec<(usize, f64)> {
    let mut v: Vec<(usize, f64)> = m
        .iter()
        .filter_map(|(k, v)| Some((k.parse().ok()?, *v)))
        .collect();
    v.sort_by_key(|(k, _)| *k);
    v
}

fn print_profile(title: &str, stages: &BTreeMap<String, f64>) {
    let total: f64 = stages.values().sum();
    println!("\nwhere the time goes: {title}");
    let mut rows: Vec<_> = stages.iter().collect();
    rows.sort_by(|a, b| b.1.total_cmp(a.1));
    for (name, secs) in rows {
        println!("  {:<28} {:>6.1}%", name, 100.0 * secs / total.max(1e-12));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timed_reports_the_median_of_the_timed_runs() {
        let clock = StageClock::default();
        let mut calls = 0;
        let samples = [100.0, 3.0, 1.0, 2.0, 50.0, 4.0];
        let median = timed(&clock, 5, || {
            calls += 1;
            Ok(samples[calls - 1])
        })
        .unwrap();
        // The first call (100.0) is the warm-up and is excluded.
        assert_eq!(calls, 6);
        assert_eq!(median, 3.0);
    }

    #[test]
    fn argmax_takes_the_first_maximum() {
        assert_eq!(argmax(&[0.5, 2.0, -1.0, 2.0]), 1);
        assert_eq!(argmax(&[f32::NEG_INFINITY, -3.0]), 1);
    }

    #[test]
    fn sorted_orders_numeric_keys() {
        let m: BTreeMap<String, f64> = [("16", 3.0), ("4", 2.0), ("1", 1.0)]
            .into_iter()
            .map(|(k, v)| (k.to_string(), v))
            .collect();
        assert_eq!(sorted(&m), vec![(1, 1.0), (4, 2.0), (16, 3.0)]);
    }
}
