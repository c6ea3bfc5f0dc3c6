//! The pool and sequences: budget, blocks, growth, import/export, the
//! prefix cache and copy-on-write.

use super::*;

fn layout() -> KvLayout {
    KvLayout {
        n_layers: 2,
        n_kv_heads: 2,
        head_dim: 4,
    }
}

fn pool(budget: usize, block_tokens: usize, prefix_cache: bool) -> KvPool {
    let cfg = KvConfig {
        budget_tokens: budget,
        block_tokens,
        prefix_cache,
        fingerprint: 7,
        dtype: KvDtype::F32,
    };
    KvPool::with_config(layout(), cfg)
}

/// Values of token position `p` in `layer` (distinct per layer, half, position).
fn row(layer: usize, p: usize, v: bool) -> Vec<f32> {
    let sign = if v { -1.0 } else { 1.0 };
    (0..layout().row())
        .map(|i| sign * ((p * 31 + i * 7 + layer * 101) as f32 * 0.37))
        .collect()
}

/// Appends tokens at `kv.len()..` as a forward pass would, and commits them.
fn push(kv: &mut SeqKv, tokens: &[u32]) {
    kv.reserve_to(kv.len() + tokens.len()).unwrap();
    let start = kv.len();
    for l in 0..2 {
        let (mut k, mut v) = (Vec::new(), Vec::new());
        for p in start..start + tokens.len() {
            k.extend(row(l, p, false));
            v.extend(row(l, p, true));
        }
        kv.append(l, &k, &v);
    }
    kv.commit(tokens);
}

fn filled(pool: &KvPool, tokens: usize) -> SeqKv {
    let mut s = pool.allocate(tokens).unwrap();
    push(&mut s, &(0..tokens as u32).collect::<Vec<_>>());
    s
}

fn layer(s: &SeqKv, l: usize) -> (Vec<f32>, Vec<f32>) {
    let mut bytes = Vec::new();
    s.export_layer(l, KvDtype::F32, &mut bytes);
    let vals: Vec<f32> = bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    let (k, v) = vals.split_at(vals.len() / 2);
    (k.to_vec(), v.to_vec())
}

#[test]
fn the_budget_is_counted_in_blocks_and_returned_on_drop() {
    let pool = pool(40, 8, false);
    let a = pool.allocate(17).unwrap();
    assert_eq!((a.blocks(), a.capacity()), (3, 17));
    let err = pool.allocate(17).unwrap_err();
    assert_eq!(
        err,
        KvError::Exhausted {
            requested: 24,
            free: 16,
            budget: 40
        }
    );
    let u = pool.usage();
    assert_eq!(
        (u.reserved_tokens, u.sequences, u.free_tokens()),
        (24, 1, 16)
    );
    drop(a);
    assert_eq!(pool.usage().reserved_tokens, 0);
    assert_eq!(pool.usage().sequences, 0);
    assert!(pool.allocate(40).is_ok());
}

#[test]
fn a_sequence_grows_a_block_at_a_time() {
    let pool = pool(64, 4, false);
    let mut s = pool.sequence();
    assert_eq!(s.blocks(), 0);
    push(&mut s, &[1, 2, 3]);
    assert_eq!(s.blocks(), 1);
    push(&mut s, &[4, 5]);
    assert_eq!(s.blocks(), 2);
    assert_eq!(s.tokens(), &[1, 2, 3, 4, 5]);
    assert!(matches!(
        s.ensure_room(1),
        Err(KvError::CapacityExceeded {
            needed: 6,
            capacity: 5
        })
    ));
}

#[test]
fn rows_across_blocks_read_back_in_order() {
    let pool = pool(64, 3, false);
    let s = filled(&pool, 8);
    let (k, v) = layer(&s, 1);
    let want_k: Vec<f32> = (0..8).flat_map(|p| row(1, p, false)).collect();
    let want_v: Vec<f32> = (0..8).flat_map(|p| row(1, p, true)).collect();
    assert_eq!((k, v), (want_k, want_v));
}

#[test]
fn f32_export_import_is_bit_exact_and_f16_close() {
    let pool = pool(100, 4, false);
    let src = filled(&pool, 5);
    let tokens: Vec<u32> = (0..5).collect();
    for dtype in [KvDtype::F32, KvDtype::F16] {
        let mut dst = pool.allocate(8).unwrap();
        for l in (0..2).rev() {
            let mut bytes = Vec::new();
            src.export_layer(l, dtype, &mut bytes);
            assert_eq!(bytes.len(), layout().layer_bytes(5, dtype));
            dst.import_layer(l, dtype, 5, &bytes).unwrap();
        }
        dst.finish_import(&tokens).unwrap();
        let (a, b) = (layer(&src, 1).0, layer(&dst, 1).0);
        match dtype {
            KvDtype::F32 => assert_eq!(a, b),
            KvDtype::F16 => assert!(a
                .iter()
                .zip(&b)
                .all(|(x, y)| (x - y).abs() <= 1e-3 * x.abs().max(1.0))),
        }
    }
}

/// An f16 store keeps each value rounded once, when written; both wire
/// types carry exactly those values, so a copy through either is the same.
#[test]
fn an_f16_store_holds_rounded_values_and_either_wire_carries_them() {
    let cfg = KvConfig {
        dtype: KvDtype::F16,
        ..pool(100, 4, false).config()
    };
    let pool = KvPool::with_config(layout(), cfg);
    let src = filled(&pool, 5);
    let exact: Vec<f32> = (0..5).flat_map(|p| row(1, p, false)).collect();
    let rounded: Vec<f32> = exact
        .iter()
        .map(|&x| half::f16::from_f32(x).to_f32())
        .collect();
    assert_ne!(exact, rounded, "the test values are not all f16 values");
    assert_eq!(layer(&src, 1).0, rounded);
    let tokens: Vec<u32> = (0..5).collect();
    for dtype in [KvDtype::F32, KvDtype::F16] {
        let mut dst = pool.allocate(8).unwrap();
        for l in 0..2 {
            let mut bytes = Vec::new();
            src.export_layer(l, dtype, &mut bytes);
            assert_eq!(bytes.len(), layout().layer_bytes(5, dtype));
            dst.import_layer(l, dtype, 5, &bytes).unwrap();
        }
        dst.finish_import(&tokens).unwrap();
        for l in 0..2 {
            assert_eq!(layer(&dst, l), layer(&src, l), "{dtype:?} layer {l}");
        }
    }
    assert_eq!(
        layout().bytes_per_token(KvDtype::F16) * 2,
        layout().bytes_per_token(KvDtype::F32)
    );
}

#[test]
fn bad_imports_are_rejected() {
    let pool = pool(100, 4, false);
    let src = filled(&pool, 2);
    let mut bytes = Vec::new();
    src.export_layer(0, KvDtype::F32, &mut bytes);
    let mut dst = pool.allocate(2).unwrap();
    assert!(dst.import_layer(0, KvDtype::F32, 2, &bytes[1..]).is_err());
    assert!(dst.import_layer(7, KvDtype::F32, 2, &bytes).is_err());
    assert!(dst.import_layer(0, KvDtype::F32, 3, &bytes).is_err());
    dst.import_layer(0, KvDtype::F32, 2, &bytes).unwrap();
    assert!(dst.import_layer(0, KvDtype::F32, 2, &bytes).is_err());
    // Layer 1 never arrived.
    assert!(dst.finish_import(&[0, 1]).is_err());
    assert_eq!(dst.len(), 0);
}

#[test]
fn chunked_import_in_order_equals_whole_import() {
    let pool = pool(100, 4, false);
    let src = filled(&pool, 5);
    let row_bytes = layout().row() * 4;
    let mut dst = pool.allocate(5).unwrap();
    for (start, n) in [(0usize, 2usize), (2, 3)] {
        for l in 0..2 {
            let mut bytes = Vec::new();
            src.export_layer(l, KvDtype::F32, &mut bytes);
            let (k, v) = bytes.split_at(bytes.len() / 2);
            let range = start * row_bytes..(start + n) * row_bytes;
            dst.import_rows(l, KvDtype::F32, start, n, &k[range.clone()], &v[range])
                .unwrap();
        }
    }
    // A chunk out of order is refused.
    assert!(dst
        .import_rows(0, KvDtype::F32, 1, 1, &[0; 32], &[0; 32])
        .is_err());
    dst.finish_import(&[0, 1, 2, 3, 4]).unwrap();
    assert_eq!(layer(&src, 1), layer(&dst, 1));
}

#[test]
fn truncate_forgets_the_tail_and_keeps_the_capacity() {
    let pool = pool(100, 4, false);
    let mut s = filled(&pool, 7);
    s.truncate(2);
    assert_eq!((s.len(), s.layer_len(1), s.capacity()), (2, 2, 7));
    assert_eq!(pool.usage().stored_tokens, 2);
    push(&mut s, &[9]);
    assert_eq!(s.tokens(), &[0, 1, 9]);
}

#[test]
fn a_cached_prefix_is_shared_and_never_written() {
    let pool = pool(64, 4, true);
    let prompt: Vec<u32> = (10..21).collect(); // 11 tokens: two full blocks and 3
    let mut a = pool.sequence();
    push(&mut a, &prompt);
    let before = layer(&a, 0);
    assert_eq!(pool.cached_prefix(&prompt), 8);
    let mut b = pool.sequence();
    assert_eq!(b.attach_prefix(&prompt), 8);
    assert_eq!(b.tokens(), &prompt[..8]);
    assert_eq!(pool.usage().blocks.used, 3, "b shares a's two full blocks");
    // b computes its own tail; its rows 0..8 are a's.
    push(&mut b, &prompt[8..]);
    let n = 8 * layout().row();
    assert_eq!(layer(&b, 0).0[..n], before.0[..n]);
    // Truncating into the shared prefix copies instead of writing a's block.
    b.truncate(5);
    push(&mut b, &[99, 98, 97]);
    assert_eq!(layer(&a, 0), before, "a's blocks are untouched");
    let stats = pool.prefix_stats();
    assert_eq!((stats.queried_tokens, stats.hit_tokens), (11, 8));
}

#[test]
fn the_whole_prompt_is_never_taken_and_cached_blocks_outlive_their_sequence() {
    let pool = pool(64, 4, true);
    let prompt: Vec<u32> = (0..8).collect();
    drop(filled(&pool, 8));
    assert_eq!(pool.usage().blocks.cached, 2);
    // The last token must be computed for its logits: one block only.
    let mut s = pool.sequence();
    assert_eq!(s.attach_prefix(&prompt), 4);
    assert_eq!(pool.usage().blocks.cached, 1);
    drop(s);
    // Memory pressure reclaims cached blocks, oldest first.
    let all = pool.allocate(64).unwrap();
    assert_eq!(pool.usage().blocks.cached, 0);
    assert_eq!(pool.prefix_stats().evictions, 2);
    drop(all);
    assert_eq!(pool.cached_prefix(&prompt), 0);
}

#[test]
fn an_import_may_continue_an_attached_prefix() {
    let pool = pool(64, 4, true);
    let prompt: Vec<u32> = (0..10).collect();
    let src = filled(&pool, 10);
    let mut dst = pool.sequence();
    assert_eq!(dst.attach_prefix(&prompt), 8);
    dst.reserve_to(10).unwrap();
    let row_bytes = layout().row() * 4;
    for l in 0..2 {
        let mut bytes = Vec::new();
        src.export_layer(l, KvDtype::F32, &mut bytes);
        let (k, v) = bytes.split_at(bytes.len() / 2);
        let tail = 8 * row_bytes..10 * row_bytes;
        dst.import_rows(l, KvDtype::F32, 8, 2, &k[tail.clone()], &v[tail])
            .unwrap();
    }
    assert!(
        dst.finish_import(&[5; 10]).is_err(),
        "the prefix must match"
    );
    for l in 0..2 {
        assert_eq!(dst.layer_len(l), 8, "a failed finish rolls back");
    }
}

#[test]
fn the_digest_lists_what_a_new_sequence_would_find() {
    use pdserve_protocol::prefix::block_hashes;
    let pool = pool(64, 4, true);
    let prompt: Vec<u32> = (0..11).collect();
    let empty = pool.prefix_digest().unwrap();
    assert!(empty.is_empty());
    let s = filled(&pool, 11);
    let set = pool.prefix_digest().unwrap().parse().unwrap();
    assert_eq!((set.block_tokens, set.seed), (4, 7));
    let hashes = block_hashes(&prompt[..10], 4, 7);
    assert_eq!(set.leading_blocks(&hashes) * 4, pool.cached_prefix(&prompt));
    drop(s);
    drop(pool.allocate(64).unwrap());
    assert!(
        pool.prefix_digest().unwrap().is_empty(),
        "evicted blocks leave the digest"
    );
    let off = super::KvPool::new(layout(), 64);
    assert!(off.prefix_digest().is_none());
}
