//! Hermetic tests of every engine path on a tiny random-weight model.

mod common;

use std::ops::ControlFlow;

use common::*;
use pdserve_engine::{
    every_layer, ChatMessage, EngineError, KvDtype, KvError, KvPool, Model, Segment, Tokenizer,
    WeightFormat,
};
use pdserve_testkit::tiny::TinyModelSpec;

const FORMATS: [WeightFormat; 3] = [WeightFormat::Native, WeightFormat::Q8_0, WeightFormat::F32];

fn prompt(n: usize) -> Vec<u32> {
    (0..n as u32).map(|i| 3 + (i * 37 + 11) % 250).collect()
}

#[test]
fn loads_in_every_format_with_config_from_metadata() {
    let (_d, path) = tiny_model(&TinyModelSpec::default());
    for format in FORMATS {
        let m = load(&path, format);
        let c = m.config();
        assert_eq!(
            (c.n_layers, c.n_heads, c.n_kv_heads, c.head_dim),
            (2, 4, 2, 16)
        );
        assert_eq!(
            (c.hidden_size, c.ffn_size, c.vocab_size, c.context_length),
            (64, 96, 266, 512)
        );
        assert_eq!(m.weight_format(), format);
    }
    // Q8_0 weights are about a quarter of f32's.
    let (q8, f32) = (
        load(&path, WeightFormat::Q8_0),
        load(&path, WeightFormat::F32),
    );
    assert!(
        q8.weight_bytes() * 3 < f32.weight_bytes(),
        "{} vs {}",
        q8.weight_bytes(),
        f32.weight_bytes()
    );
    // Formats compute different KV, so they must not share a fingerprint.
    let fps: Vec<u64> = FORMATS
        .iter()
        .map(|f| load(&path, *f).fingerprint())
        .collect();
    assert!(fps[0] != fps[1] && fps[1] != fps[2] && fps[0] != fps[2]);
    assert_eq!(fps[2], load(&path, WeightFormat::F32).fingerprint());
    // Caches of different types hold different values: neither may pair.
    let m = load(&path, WeightFormat::Native);
    let (f16, f32) = (
        m.kv_fingerprint(KvDtype::F16),
        m.kv_fingerprint(KvDtype::F32),
    );
    assert!(f16 != f32 && f16 != m.fingerprint() && f32 != m.fingerprint());
    assert_eq!(
        f16,
        load(&path, WeightFormat::Native).kv_fingerprint(KvDtype::F16)
    );
    let pool = m.kv_pool(64, 16, true, KvDtype::F32);
    assert_eq!(pool.config().fingerprint, f32, "block hashes chain from it");
}

#[test]
fn formats_agree_approximately_and_untied_head_loads() {
    let (_d, path) = tiny_model(&TinyModelSpec::default());
    let logits: Vec<Vec<f32>> = FORMATS
        .iter()
        .map(|f| {
            let m = load(&path, *f);
            let mut kv = pool(&m).allocate(8).unwrap();
            m.prefill(&prompt(8), &mut kv).unwrap()
        })
        .collect();
    // Q4_1 → Q8_0 requantization and f32 differ only by rounding.
    assert!(max_abs_diff(&logits[1], &logits[2]) < 0.5);
    let (_d2, untied) = tiny_model(&TinyModelSpec {
        tied_embeddings: false,
        ..Default::default()
    });
    let m = load(&untied, WeightFormat::F32);
    let mut kv = pool(&m).allocate(8).unwrap();
    let l = m.prefill(&prompt(8), &mut kv).unwrap();
    assert_eq!(l.len(), 266);
    assert!(
        max_abs_diff(&l, &logits[2]) > 1e-3,
        "output.weight must be used when present"
    );
}

#[test]
fn chunked_prefill_equals_one_shot() {
    let (_d, path) = tiny_model(&TinyModelSpec::default());
    for format in FORMATS {
        let m = load(&path, format);
        let pool = pool(&m);
        let p = prompt(45);
        let mut one = pool.allocate(45).unwrap();
        let want = m.prefill(&p, &mut one).unwrap();
        let mut chunked = pool.allocate(45).unwrap();
        let mut got = Vec::new();
        for c in p.chunks(8) {
            got = m.prefill(c, &mut chunked).unwrap();
        }
        assert_eq!(chunked.len(), 45);
        let tol = if format == WeightFormat::F32 {
            1e-4
        } else {
            1e-2
        };
        assert!(
            max_abs_diff(&got, &want) < tol,
            "{format}: {}",
            max_abs_diff(&got, &want)
        );
        for l in 0..2 {
            assert!(max_abs_diff(&kv_layer(&one, l).0, &kv_layer(&chunked, l).0) < tol);
        }
    }
}

#[test]
fn every_position_logits_match_a_prefill_that_ends_there() {
    let (_d, path) = tiny_model(&TinyModelSpec::default());
    for format in FORMATS {
        let m = load(&path, format);
        let pool = pool(&m);
        let p = prompt(20);
        let mut kv = pool.allocate(20).unwrap();
        let all = m.prefill_all_logits(&p, &mut kv).unwrap();
        assert_eq!((all.len(), kv.len()), (20, 20));
        let tol = if format == WeightFormat::F32 {
            1e-4
        } else {
            1e-2
        };
        for end in [1, 7, 20] {
            let mut alone = pool.allocate(end).unwrap();
            let want = m.prefill(&p[..end], &mut alone).unwrap();
            let diff = max_abs_diff(all.row(end - 1), &want);
            assert!(diff < tol, "{format}, position {end}: {diff}");
        }
    }
}

#[test]
fn batched_decode_of_different_lengths_equals_single_sequence_decode() {
    let (_d, path) = tiny_model(&TinyModelSpec::default());
    let m = load(&path, WeightFormat::Q8_0);
    let pool = pool(&m);
    let lens = [1usize, 5, 13, 30];
    let steps = 12;
    let alone: Vec<Vec<u32>> = lens
        .iter()
        .map(|&n| {
            let mut kv = pool.allocate(n + steps).unwrap();
            let l = m.prefill(&prompt(n), &mut kv).unwrap();
            greedy(&m, &mut kv, &l, steps)
        })
        .collect();
    let mut kvs: Vec<_> = lens
        .iter()
        .map(|&n| pool.allocate(n + steps).unwrap())
        .collect();
    let mut outs: Vec<Vec<u32>> = kvs
        .iter_mut()
        .zip(lens)
        .map(|(kv, n)| vec![argmax(&m.prefill(&prompt(n), kv).unwrap())])
        .collect();
    for _ in 1..steps {
        let mut batch: Vec<_> = kvs
            .iter_mut()
            .zip(&outs)
            .map(|(kv, o)| (kv, *o.last().unwrap()))
            .collect();
        let logits = m.decode_step(&mut batch).unwrap();
        assert_eq!(logits.len(), lens.len());
        outs.iter_mut()
            .enumerate()
            .for_each(|(i, o)| o.push(argmax(logits.row(i))));
    }
    assert_eq!(outs, alone);
}

#[test]
fn mixed_batch_of_prefill_chunks_and_decode_rows() {
    let (_d, path) = tiny_model(&TinyModelSpec::default());
    let m = load(&path, WeightFormat::F32);
    let pool = pool(&m);
    let (a, b) = (prompt(20), prompt(7));
    let mut ka = pool.allocate(21).unwrap();
    let mut kb = pool.allocate(7).unwrap();
    let la = m.prefill(&a[..19], &mut ka).unwrap();
    let _ = la;
    let mixed = m
        .forward(
            &mut [
                Segment {
                    kv: &mut ka,
                    tokens: &a[19..],
                },
                Segment {
                    kv: &mut kb,
                    tokens: &b,
                },
            ],
            &mut every_layer,
        )
        .unwrap();
    let mut ka2 = pool.allocate(20).unwrap();
    let mut kb2 = pool.allocate(7).unwrap();
    assert!(max_abs_diff(mixed.row(0), &m.prefill(&a, &mut ka2).unwrap()) < 1e-4);
    assert!(max_abs_diff(mixed.row(1), &m.prefill(&b, &mut kb2).unwrap()) < 1e-4);
}

#[test]
fn layer_callback_sees_each_layer_written() {
    let (_d, path) = tiny_model(&TinyModelSpec {
        n_layers: 3,
        ..Default::default()
    });
    let m = load(&path, WeightFormat::F32);
    let pool = pool(&m);
    let mut kv = pool.allocate(9).unwrap();
    let mut seen = Vec::new();
    let p = prompt(9);
    m.forward(
        &mut [Segment {
            kv: &mut kv,
            tokens: &p,
        }],
        &mut |l, segs| {
            assert_eq!(segs[0].kv.layer_len(l), 9);
            seen.push(l);
            ControlFlow::Continue(())
        },
    )
    .unwrap();
    assert_eq!(seen, [0, 1, 2]);
}

#[test]
fn a_layer_callback_can_stop_the_forward_and_the_kv_stays_as_it_was() {
    let (_d, path) = tiny_model(&TinyModelSpec {
        n_layers: 4,
        ..Default::default()
    });
    let m = load(&path, WeightFormat::F32);
    let pool = pool(&m);
    let (p, more) = (prompt(9), prompt(5));
    let mut kv = pool.allocate(14).unwrap();
    m.prefill(&p, &mut kv).unwrap();
    let mut seen = Vec::new();
    let err = m
        .forward(
            &mut [Segment {
                kv: &mut kv,
                tokens: &more,
            }],
            &mut |l, _| {
                seen.push(l);
                match l {
                    1 => ControlFlow::Break(()),
                    _ => ControlFlow::Continue(()),
                }
            },
        )
        .unwrap_err();
    assert_eq!(seen, [0, 1], "layers after the break were not computed");
    assert!(
        matches!(err, EngineError::Interrupted { after_layer: 1 }),
        "{err:?}"
    );
    assert_eq!(err.kind(), "interrupted");
    assert_eq!(kv.len(), 9, "the stopped chunk left no rows behind");
    // The sequence goes on exactly as if the stopped pass had never run.
    let mut fresh = pool.allocate(14).unwrap();
    m.prefill(&p, &mut fresh).unwrap();
    assert_eq!(
        m.prefill(&more, &mut kv).unwrap(),
        m.prefill(&more, &mut fresh).unwrap()
    );
}

#[test]
fn kv_export_import_continues_exactly_in_f32_and_closely_in_f16() {
    let (_d, path) = tiny_model(&TinyModelSpec::default());
    let m = load(&path, WeightFormat::F32);
    let pool = pool(&m);
    let p = prompt(25);
    let mut kv = pool.allocate(40).unwrap();
    let logits = m.prefill(&p, &mut kv).unwrap();
    let copy = |dtype: KvDtype| {
        let mut dst = pool.allocate(40).unwrap();
        for l in 0..2 {
            let mut bytes = Vec::new();
            kv.export_layer(l, dtype, &mut bytes);
            dst.import_layer(l, dtype, kv.len(), &bytes).unwrap();
        }
        dst.finish_import(kv.tokens()).unwrap();
        dst
    };
    let mut f32_copy = copy(KvDtype::F32);
    let mut f16_copy = copy(KvDtype::F16);
    let next = argmax(&logits);
    let via_f16 = m.decode_step(&mut [(&mut f16_copy, next)]).unwrap();
    let via_f32 = m.decode_step(&mut [(&mut f32_copy, next)]).unwrap();
    let direct = greedy(&m, &mut kv, &logits, 10);
    assert!(max_abs_diff(via_f16.row(0), via_f32.row(0)) < 0.05);
    let mut continued = vec![next, argmax(via_f32.row(0))];
    continued.extend(
        greedy(&m, &mut f32_copy, via_f32.row(0), 9)
            .into_iter()
            .skip(1),
    );
    assert_eq!(continued, direct);
}

#[test]
fn kv_budget_is_exhausted_cleanly_and_observable() {
    let (_d, path) = tiny_model(&TinyModelSpec::default());
    let m = load(&path, WeightFormat::Q8_0);
    // 100 tokens in blocks of 16: 7 blocks, 112 tokens.
    let pool = KvPool::new(m.kv_layout(), 100);
    let mut a = pool.allocate(60).unwrap();
    m.prefill(&prompt(10), &mut a).unwrap();
    let u = pool.usage();
    assert_eq!(
        (u.reserved_tokens, u.stored_tokens, u.free_tokens()),
        (64, 10, 48)
    );
    assert!(matches!(
        pool.allocate(49),
        Err(KvError::Exhausted {
            requested: 64,
            free: 48,
            ..
        })
    ));
    drop(a);
    assert_eq!(pool.usage().reserved_tokens, 0);
    assert_eq!(pool.usage().stored_tokens, 0);
}

#[test]
fn bad_inputs_are_errors_and_leave_the_kv_untouched() {
    let (_d, path) = tiny_model(&TinyModelSpec {
        context_length: 32,
        ..Default::default()
    });
    let m = load(&path, WeightFormat::F32);
    let pool = pool(&m);
    let mut kv = pool.allocate(64).unwrap();
    m.prefill(&prompt(4), &mut kv).unwrap();
    let err = m.prefill(&[3, 9999], &mut kv).unwrap_err();
    assert!(matches!(err, EngineError::InvalidInput(_)), "{err}");
    assert!(matches!(
        m.prefill(&[], &mut kv),
        Err(EngineError::InvalidInput(_))
    ));
    let err = m.prefill(&prompt(40), &mut kv).unwrap_err();
    assert!(err.to_string().contains("context window"), "{err}");
    let mut small = pool.allocate(2).unwrap();
    assert!(matches!(
        m.prefill(&prompt(3), &mut small),
        Err(EngineError::Kv(KvError::CapacityExceeded { .. }))
    ));
    assert_eq!(kv.len(), 4);
    assert_eq!(kv.layer_len(1), 4);
    let other = KvPool::new(
        pdserve_engine::KvLayout {
            n_layers: 2,
            n_kv_heads: 1,
            head_dim: 16,
        },
        10,
    );
    let mut wrong = other.allocate(5).unwrap();
    assert!(m.prefill(&prompt(2), &mut wrong).is_err());
    // One batch reads one cache type: a mix is refused, not a panic.
    let wide = m.kv_pool(64, 16, false, KvDtype::F32);
    let (mut a, mut b) = (pool.allocate(8).unwrap(), wide.allocate(8).unwrap());
    let (pa, pb) = (prompt(3), prompt(2));
    let mut segs = [
        Segment {
            kv: &mut a,
            tokens: &pa,
        },
        Segment {
            kv: &mut b,
            tokens: &pb,
        },
    ];
    let err = m.forward(&mut segs, &mut every_layer).unwrap_err();
    assert!(matches!(err, EngineError::InvalidInput(_)), "{err}");
    assert!((a.len(), b.len()) == (0, 0), "nothing was written");
    assert!(matches!(
        Model::load(path.with_extension("missing"), &Default::default()),
        Err(EngineError::Text(pdserve_text::TextError::Io { .. }))
    ));
}

#[test]
fn tokenizer_and_chat_template_from_tiny_metadata() {
    let (_d, path) = tiny_model(&TinyModelSpec::default());
    let tok = Tokenizer::from_gguf_file(&path).unwrap();
    assert_eq!(tok.vocab_size(), 266);
    assert_eq!((tok.bos_token_id(), tok.eos_token_id()), (Some(1), 2));
    let text = tok
        .apply_chat_template(&[ChatMessage::new("user", "say the cat 12 €")], true)
        .unwrap();
    assert_eq!(
        text,
        "<|im_start|>user\nsay the cat 12 €<|im_end|>\n<|im_start|>assistant\n"
    );
    let ids = tok.encode(&text, true).unwrap();
    assert_eq!(ids[0], 1, "<|im_start|> is one special token");
    assert!(ids.contains(&(259 + 2)), "merge `Ġt he` → `Ġthe` applies");
    assert_eq!(tok.decode(&ids, false).unwrap(), text);
    assert_eq!(
        tok.decode(&ids, true).unwrap(),
        "user\nsay the cat 12 €\nassistant\n"
    );
    assert!(tok.decode(&[5000], false).is_err());
}
