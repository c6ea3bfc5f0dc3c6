//! `pdserve-loadtest kv`: the cost of moving one sequence's KV: export from
//! the cache to bytes, framing and CRC (encode), parsing and CRC (decode),
//! and import back into a cache, for every cache type and wire type (f32,
//! f16). Medians of several runs.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result};
use clap::Args;
use pdserve_engine::{KvConfig, KvDtype, KvLayout, KvPool, ModelConfig, SeqKv};
use pdserve_protocol::kvwire::{self, KvEvent, KvHeader, KvLimits, KvStreamDecoder, KvTrailer};
use serde::Serialize;

/// The element types measured, for the cache and for the wire.
const DTYPES: [(KvDtype, &str); 2] = [(KvDtype::F32, "f32"), (KvDtype::F16, "f16")];

#[derive(Args, Debug)]
pub struct KvArgs {
    /// GGUF model whose KV shape to use (only its header is read). Without it,
    /// the shape of the default model: 30 layers, 3 KV heads of 64.
    #[arg(long, env = "PDSERVE_MODEL")]
    model: Option<PathBuf>,
    /// Prompt lengths in tokens.
    #[arg(
        long,
        env = "PDSERVE_KV_BENCH_TOKENS",
        value_delimiter = ',',
        default_value = "128,512"
    )]
    tokens: Vec<usize>,
    /// Timed repetitions (the median is reported).
    #[arg(long, env = "PDSERVE_KV_BENCH_REPS", default_value_t = 7)]
    reps: usize,
    /// Write the results as JSON to this file.
    #[arg(long, env = "PDSERVE_KV_BENCH_JSON")]
    json: Option<PathBuf>,
}

#[derive(Serialize, Debug)]
struct KvResult {
    cache: &'static str,
    dtype: &'static str,
    tokens: usize,
    bytes: usize,
    export_ms: f64,
    encode_ms: f64,
    decode_ms: f64,
    import_ms: f64,
}

pub fn run(args: KvArgs) -> Result<()> {
    anyhow::ensure!(args.reps > 0, "--reps must be > 0");
    let layout = layout(args.model.as_ref())?;
    let mut results = Vec::new();
    for &tokens in &args.tokens {
        for cache in DTYPES {
            for dtype in DTYPES {
                results.push(measure(layout, tokens, cache, dtype, args.reps)?);
            }
        }
    }
    println!(
        "\n{:<6} {:<6} {:>7} {:>11} {:>10} {:>10} {:>10} {:>10}",
        "cache", "wire", "tokens", "bytes", "export ms", "encode ms", "decode ms", "import ms"
    );
    for r in &results {
        println!(
            "{:<6} {:<6} {:>7} {:>11} {:>10.2} {:>10.2} {:>10.2} {:>10.2}",
            r.cache, r.dtype, r.tokens, r.bytes, r.export_ms, r.encode_ms, r.decode_ms, r.import_ms
        );
    }
    if let Some(path) = &args.json {
        std::fs::write(path, serde_json::to_string_pretty(&results)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}

fn layout(model: Option<&PathBuf>) -> Result<KvLayout> {
    let Some(path) = model else {
        return Ok(KvLayout {
            n_layers: 30,
            n_kv_heads: 3,
            head_dim: 64,
        });
    };
    let cfg = ModelConfig::from_gguf_file(path)?;
    Ok(KvLayout {
        n_layers: cfg.n_layers,
        n_kv_heads: cfg.n_kv_heads,
        head_dim: cfg.head_dim,
    })
}

/// A sequence of `tokens` tokens with deterministic KV values.
fn filled(pool: &KvPool, tokens: usize) -> Result<SeqKv> {
    let layout = pool.layout();
    let mut kv = pool.allocate(tokens)?;
    let values: Vec<u8> = (0..tokens * layout.row())
        .flat_map(|i| ((i % 1000) as f32 * 0.001).to_le_bytes())
        .collect();
    let half = values.len();
    for l in 0..layout.n_layers {
        kv.import_rows(l, KvDtype::F32, 0, tokens, &values[..half], &values[..half])?;
    }
    kv.finish_import(&vec![0; tokens])?;
    Ok(kv)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn measure(
    layout: KvLayout,
    tokens: usize,
    (cache, cache_name): (KvDtype, &'static str),
    (dtype, name): (KvDtype, &'static str),
    reps: usize,
) -> Result<KvResult> {
    let cfg = KvConfig {
        dtype: cache,
        ..KvPool::new(layout, tokens * 4).config()
    };
    let pool = KvPool::with_config(layout, cfg);
    let src = filled(&pool, tokens)?;
    let header = header(layout, tokens, dtype);
    let mut times = Times::default();
    let mut bytes = 0;
    for _ in 0..=reps {
        bytes = round_trip(&pool, &src, &header, dtype, tokens, &mut times)?;
    }
    // The first run is a warm-up.
    let ms = |v: Vec<f64>| median(v[1..].to_vec()) * 1e3;
    Ok(KvResult {
        cache: cache_name,
        dtype: name,
        tokens,
        bytes,
        export_ms: ms(times.export),
        encode_ms: ms(times.encode),
        decode_ms: ms(times.decode),
        import_ms: ms(times.import),
    })
}

/// Seconds each step of every round trip took.
#[derive(Default)]
struct Times {
    export: Vec<f64>,
    encode: Vec<f64>,
    decode: Vec<f64>,
    import: Vec<f64>,
}

fn header(layout: KvLayout, tokens: usize, dtype: KvDtype) -> KvHeader {
    KvHeader {
        request_id: "bench".into(),
        model_fingerprint: 1,
        dtype: dtype.into(),
        n_layers: layout.n_layers as u32,
        n_kv_heads: layout.n_kv_heads as u32,
        head_dim: layout.head_dim as u32,
        n_tokens: tokens as u32,
        start_token: 0,
        seed: 0,
        trace: None,
    }
}

/// Runs `f`, adding the seconds it took to `samples`.
fn timed<T>(samples: &mut Vec<f64>, f: impl FnOnce() -> T) -> T {
    let t = Instant::now();
    let out = f();
    samples.push(t.elapsed().as_secs_f64());
    out
}

/// One timed export, encode, decode and import of `src`; returns the size
/// of the encoded stream. Buffers are freed after the timed steps.
fn round_trip(
    pool: &KvPool,
    src: &SeqKv,
    header: &KvHeader,
    dtype: KvDtype,
    tokens: usize,
    times: &mut Times,
) -> Result<usize> {
    let layers = timed(&mut times.export, || export(src, dtype, tokens))?;
    let stream = timed(&mut times.encode, || encode(header, &layers, tokens))?;
    let events = timed(&mut times.decode, || {
        KvStreamDecoder::new(KvLimits::default()).push(&stream)
    })?;
    let _dst = timed(&mut times.import, || import(pool, &events, dtype, tokens))?;
    Ok(stream.len())
}

/// Every layer's K and V rows of `src`, as bytes of `dtype`.
fn export(src: &SeqKv, dtype: KvDtype, tokens: usize) -> Result<Vec<(Vec<u8>, Vec<u8>)>> {
    let layers = (0..src.layout().n_layers)
        .map(|l| {
            let (mut k, mut v) = (Vec::new(), Vec::new());
            src.export_rows(l, dtype, 0, tokens, &mut k, &mut v)
                .map(|_| (k, v))
        })
        .collect::<Result<_, _>>()?;
    Ok(layers)
}

/// A whole KV stream: header, one frame per layer, trailer.
fn encode(header: &KvHeader, layers: &[(Vec<u8>, Vec<u8>)], tokens: usize) -> Result<Vec<u8>> {
    let mut stream = kvwire::encode_header(header)?;
    for (l, (k, v)) in layers.iter().enumerate() {
        kvwire::encode_layer_parts(l as u32, 0, tokens as u32, &[(k, v)], &mut stream)?;
    }
    stream.extend(kvwire::encode_end(&KvTrailer {
        first_token: 0,
        first_logprob: 0.0,
        top_logprobs: vec![],
    })?);
    Ok(stream)
}

/// A new sequence of `pool` holding the layers of the decoded `events`.
fn import(pool: &KvPool, events: &[KvEvent], dtype: KvDtype, tokens: usize) -> Result<SeqKv> {
    let mut dst = pool.allocate(tokens)?;
    for e in events {
        if let KvEvent::Layers(f) = e {
            let (k, v) = f
                .layer_kv(f.layer_start)
                .context("frame without its layer")?;
            dst.import_rows(f.layer_start as usize, dtype, 0, tokens, k, v)?;
        }
    }
    dst.finish_import(&vec![0; tokens])?;
    Ok(dst)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn measures_a_round_trip_of_the_right_size() {
        let layout = KvLayout {
            n_layers: 2,
            n_kv_heads: 1,
            head_dim: 8,
        };
        for cache in DTYPES {
            for wire in DTYPES {
                let r = measure(layout, 5, cache, wire, 2).unwrap();
                let payload = layout.n_layers * layout.layer_bytes(5, wire.0);
                assert!(
                    r.bytes > payload && r.bytes < payload + 200,
                    "{} vs {payload}",
                    r.bytes
                );
                assert!(r.export_ms >= 0.0 && r.import_ms >= 0.0);
            }
        }
    }
}
