//! `pdserve-loadtest prefill-batch`: does running several short prompts as
//! segments of one forward pass beat running them one after another?
//! Batched (A) and one-by-one (B) runs alternate, A, B, A, B, so that drift
//! in the machine's speed hits both alike.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result};
use clap::Args;
use pdserve_engine::{every_layer, KvPool, LoadOptions, Model, Segment, SeqKv, WeightFormat};
use serde::Serialize;

use crate::engine_bench::synthetic_prompt;

#[derive(Args, Debug)]
pub struct BatchArgs {
    /// GGUF model file.
    #[arg(long, env = "PDSERVE_MODEL")]
    model: PathBuf,
    /// Weight format (native, q8_0, f32).
    #[arg(long, env = "PDSERVE_WEIGHTS", default_value = "native")]
    weights: WeightFormat,
    /// Threads for the model's pools (0 = one per core).
    #[arg(long, env = "PDSERVE_THREADS", default_value_t = 2)]
    threads: usize,
    /// Prompts per batch.
    #[arg(long, env = "PDSERVE_BATCH_BENCH_PROMPTS", default_value_t = 8)]
    prompts: usize,
    /// Tokens per prompt.
    #[arg(long, env = "PDSERVE_BATCH_BENCH_PROMPT_LEN", default_value_t = 32)]
    prompt_len: usize,
    /// Timed (A, B) pairs; medians are reported.
    #[arg(long, env = "PDSERVE_BATCH_BENCH_REPS", default_value_t = 9)]
    reps: usize,
    /// Write the result as JSON to this file.
    #[arg(long, env = "PDSERVE_BATCH_BENCH_JSON")]
    json: Option<PathBuf>,
}

#[derive(Serialize, Debug)]
struct BatchResult {
    weights: String,
    threads: usize,
    prompts: usize,
    prompt_len: usize,
    batched_s: f64,
    one_by_one_s: f64,
    speedup: f64,
    /// Largest difference between a prompt's logits batched and alone.
    max_logit_diff: f32,
}

pub fn run(args: BatchArgs) -> Result<()> {
    anyhow::ensure!(
        args.reps > 0 && args.prompts > 0 && args.prompt_len > 0,
        "--reps, --prompts and --prompt-len must be > 0"
    );
    let threads = pdserve_engine::threads::configure(args.threads);
    let opts = LoadOptions {
        weights: args.weights,
        ..Default::default()
    };
    let model = Model::load(&args.model, &opts)
        .with_context(|| format!("loading {}", args.model.display()))?;
    let prompts: Vec<Vec<u32>> = (0..args.prompts)
        .map(|i| synthetic_prompt(&model, args.prompt_len, i as u32))
        .collect();
    let pool = KvPool::new(model.kv_layout(), args.prompts * args.prompt_len * 2);
    let (batched_logits, _) = batched(&model, &pool, &prompts)?;
    let (alone_logits, _) = one_by_one(&model, &pool, &prompts)?;
    let max_logit_diff = max_diff(&batched_logits, &alone_logits);
    let (mut a, mut b) = (Vec::new(), Vec::new());
    for _ in 0..args.reps {
        a.push(batched(&model, &pool, &prompts)?.1);
        b.push(one_by_one(&model, &pool, &prompts)?.1);
    }
    let (batched_s, one_by_one_s) = (median(a), median(b));
    let r = BatchResult {
        weights: model.weight_format().to_string(),
        threads,
        prompts: args.prompts,
        prompt_len: args.prompt_len,
        batched_s,
        one_by_one_s,
        speedup: one_by_one_s / batched_s,
        max_logit_diff,
    };
    let tokens = (r.prompts * r.prompt_len) as f64;
    println!(
        "{} prompts x {} tokens, {}, {} threads: batched {:.1} ms ({:.0} tok/s), one by one {:.1} ms ({:.0} tok/s), speedup {:.2}x, max logit diff {}",
        r.prompts, r.prompt_len, r.weights, r.threads,
        batched_s * 1e3, tokens / batched_s, one_by_one_s * 1e3, tokens / one_by_one_s,
        r.speedup, r.max_logit_diff
    );
    if let Some(path) = &args.json {
        std::fs::write(path, serde_json::to_string_pretty(&r)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}

/// All prompts as segments of one forward pass; their logits and the seconds taken.
fn batched(model: &Model, pool: &KvPool, prompts: &[Vec<u32>]) -> Result<(Vec<Vec<f32>>, f64)> {
    let mut kvs = allocate(pool, prompts)?;
    let t = Instant::now();
    let mut segs: Vec<Segment> = kvs
        .iter_mut()
        .zip(prompts)
        .map(|(kv, p)| Segment { kv, tokens: p })
        .collect();
    let logits = model.forward(&mut segs, &mut every_layer)?;
    Ok((logits.into_rows(), t.elapsed().as_secs_f64()))
}

/// One prefill per prompt, one after another.
fn one_by_one(model: &Model, pool: &KvPool, prompts: &[Vec<u32>]) -> Result<(Vec<Vec<f32>>, f64)> {
    let mut kvs = allocate(pool, prompts)?;
    let t = Instant::now();
    let logits = kvs
        .iter_mut()
        .zip(prompts)
        .map(|(kv, p)| model.prefill(p, kv))
        .collect::<Result<Vec<_>, _>>()?;
    Ok((logits, t.elapsed().as_secs_f64()))
}

fn allocate(pool: &KvPool, prompts: &[Vec<u32>]) -> Result<Vec<SeqKv>> {
    Ok(prompts
        .iter()
        .map(|p| pool.allocate(p.len()))
        .collect::<Result<Vec<_>, _>>()?)
}

fn max_diff(a: &[Vec<f32>], b: &[Vec<f32>]) -> f32 {
    a.iter()
        .flatten()
        .zip(b.iter().flatten())
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_and_max_diff() {
        assert_eq!(median(vec![5.0, 1.0, 3.0]), 3.0);
        assert_eq!(max_diff(&[vec![1.0, 2.0]], &[vec![1.5, -1.0]]), 3.0);
    }
}
