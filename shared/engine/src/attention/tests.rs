use super::*;

/// Naive reference: per head, full softmax over 0..=pos.
fn naive(q: &[f32], k: &[f32], v: &[f32], pos: usize, h: Heads) -> Vec<f32> {
    let hd = h.head_dim;
    let mut out = vec![0f32; h.n_heads * hd];
    for head in 0..h.n_heads {
        let kvh = head / h.group();
        let qh = &q[head * hd..(head + 1) * hd];
        let mut s: Vec<f32> = (0..=pos)
            .map(|t| {
                let kt = &k[t * h.n_kv_heads * hd + kvh * hd..][..hd];
                qh.iter().zip(kt).map(|(a, b)| a * b).sum::<f32>() / (hd as f32).sqrt()
            })
            .collect();
        let m = s.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let total: f32 = s
            .iter_mut()
            .map(|x| {
                *x = (*x - m).exp();
                *x
            })
            .sum();
        s.iter_mut().for_each(|x| *x /= total);
        for (t, p) in s.iter().enumerate() {
            let vt = &v[t * h.n_kv_heads * hd + kvh * hd..][..hd];
            for i in 0..hd {
                out[head * hd + i] += p * vt[i];
            }
        }
    }
    out
}

/// Contiguous rows cut into blocks of `block_tokens`.
fn paged<'a, T>(k: &'a [T], v: &'a [T], kv_row: usize, block_tokens: usize) -> SeqView<'a, T> {
    let cut = |x: &'a [T]| x.chunks(block_tokens * kv_row).collect();
    SeqView {
        k: cut(k),
        v: cut(v),
        block_tokens,
    }
}

fn values(n: usize, seed: u32) -> Vec<f32> {
    (0..n)
        .map(|i| {
            ((i as u32).wrapping_mul(2654435761).wrapping_add(seed) % 1000) as f32 / 500.0 - 1.0
        })
        .collect()
}

/// Three sequences of `lens` tokens, their KV cut into blocks of
/// `block_tokens`, and query rows at the given (sequence, position)s:
/// returns the attention output and the naive reference.
fn run_case(
    h: Heads,
    lens: &[usize],
    row_seq: &[(usize, usize)],
    block_tokens: usize,
) -> (Vec<f32>, Vec<f32>) {
    let kv_row = h.n_kv_heads * h.head_dim;
    let ks: Vec<Vec<f32>> = lens.iter().map(|&n| values(n * kv_row, n as u32)).collect();
    let vs: Vec<Vec<f32>> = lens
        .iter()
        .map(|&n| values(n * kv_row, 99 + n as u32))
        .collect();
    let w = h.n_heads * h.head_dim;
    // Each row's query depends only on its (sequence, position).
    let q: Vec<f32> = row_seq
        .iter()
        .flat_map(|&(s, pos)| values(w, 7 + 100 * s as u32 + pos as u32))
        .collect();
    let seqs: Vec<SeqView<f32>> = ks
        .iter()
        .zip(&vs)
        .map(|(k, v)| paged(k, v, kv_row, block_tokens))
        .collect();
    let mut out = vec![0f32; q.len()];
    attention(&q, &seqs, row_seq, h, &mut out);
    let want = row_seq
        .iter()
        .enumerate()
        .flat_map(|(r, &(s, pos))| naive(&q[r * w..(r + 1) * w], &ks[s], &vs[s], pos, h))
        .collect();
    (out, want)
}

fn assert_close(got: &[f32], want: &[f32]) {
    for (i, (a, b)) in got.iter().zip(want).enumerate() {
        assert!((a - b).abs() < 1e-5, "element {i}: {a} vs {b}");
    }
}

/// Head widths that take the portable path (20), and the SIMD path with
/// wide chunks only (64) and with a narrow one (40); groups of 3 (a pair
/// of heads and one alone) and 2.
#[test]
fn batched_attention_matches_naive_per_sequence() {
    for (n_heads, n_kv_heads, head_dim) in [(6, 2, 20), (9, 3, 64), (4, 2, 40), (3, 1, 8)] {
        let h = Heads {
            n_heads,
            n_kv_heads,
            head_dim,
        };
        // The last token of seq 0, the last three of seq 1, one of seq 2
        // at pos 1, and seq 3's last (more than 8 keys in a block).
        let rows = [(0, 0), (1, 4), (1, 5), (1, 6), (2, 1), (3, 40)];
        for block_tokens in [2, 16] {
            let (got, want) = run_case(h, &[1, 7, 3, 41], &rows, block_tokens);
            assert_close(&got, &want);
        }
    }
}

/// A row's output is the same bits however the KV is cut into blocks and
/// whatever else is in the batch (what makes chunked prefill equal
/// one-shot, and disaggregated equal aggregated).
#[test]
fn attention_bits_do_not_depend_on_blocks_or_batch() {
    let h = Heads {
        n_heads: 9,
        n_kv_heads: 3,
        head_dim: 64,
    };
    let lens = [1, 7, 3, 41];
    // A prefill's rows (sequence 3 from position 3: tiles of 16, 16 and 5
    // rows) among decode rows.
    let mut all = vec![(0, 0), (1, 4), (1, 5), (1, 6), (2, 1), (3, 40), (3, 17)];
    all.extend((3..40).map(|pos| (3, pos)));
    let w = h.n_heads * h.head_dim;
    let (base, _) = run_case(h, &lens, &all, 16);
    for block_tokens in [1, 3, 8, 9, 32, 64] {
        assert_eq!(run_case(h, &lens, &all, block_tokens).0, base);
    }
    for (r, &row) in all.iter().enumerate() {
        let (alone, _) = run_case(h, &lens, &[row], 5);
        assert_eq!(alone, base[r * w..(r + 1) * w], "row {r}");
    }
}

/// Attention over f16 KV gives the bits of attention over the same
/// values held as f32, on the SIMD path (head width 64) and the
/// portable one (20).
#[test]
fn f16_kv_reads_as_its_values_in_f32() {
    use half::f16;
    for (n_heads, n_kv_heads, head_dim) in [(9, 3, 64), (6, 2, 20)] {
        let h = Heads {
            n_heads,
            n_kv_heads,
            head_dim,
        };
        let kv_row = n_kv_heads * head_dim;
        let round = |x: Vec<f32>| -> (Vec<f32>, Vec<f16>) {
            let half: Vec<f16> = x.iter().map(|&v| f16::from_f32(v)).collect();
            (half.iter().map(|v| v.to_f32()).collect(), half)
        };
        let (k32, k16) = round(values(41 * kv_row, 3));
        let (v32, v16) = round(values(41 * kv_row, 4));
        // Decode rows, and a prefill's 20 rows as tiles.
        let mut rows = vec![(0, 40), (0, 7)];
        rows.extend((10..30).map(|pos| (0, pos)));
        let q = values(rows.len() * n_heads * head_dim, 11);
        let (mut wide, mut narrow) = (vec![0f32; q.len()], vec![0f32; q.len()]);
        attention(&q, &[paged(&k32, &v32, kv_row, 16)], &rows, h, &mut wide);
        attention(&q, &[paged(&k16, &v16, kv_row, 16)], &rows, h, &mut narrow);
        assert_eq!(wide, narrow, "head width {head_dim}");
    }
}

#[test]
fn rope_at_zero_is_identity_and_preserves_norm() {
    let rope = Rope::new(8, 10_000.0, 16);
    let orig = values(16, 3);
    let mut x = orig.clone();
    rope.apply(&mut x, 0);
    assert_eq!(x, orig);
    rope.apply(&mut x, 9);
    assert_ne!(x, orig);
    let n0: f32 = orig.iter().map(|v| v * v).sum();
    let n1: f32 = x.iter().map(|v| v * v).sum();
    assert!((n0 - n1).abs() < 1e-4);
}

/// Kernel speed in isolation, f32 and f16 KV (`cargo test --release -p
/// pdserve-engine --lib attention_decode_speed -- --ignored --nocapture`).
#[test]
#[ignore]
fn attention_decode_speed() {
    let h = Heads {
        n_heads: 9,
        n_kv_heads: 3,
        head_dim: 64,
    };
    let (ctx, seqs) = (1024, 16);
    let kv_row = h.n_kv_heads * h.head_dim;
    let ks: Vec<Vec<f32>> = (0..seqs).map(|i| values(ctx * kv_row, i as u32)).collect();
    let halves: Vec<Vec<half::f16>> = ks
        .iter()
        .map(|k| k.iter().map(|&x| half::f16::from_f32(x)).collect())
        .collect();
    let row_seq: Vec<(usize, usize)> = (0..seqs).map(|i| (i, ctx - 1)).collect();
    let q = values(seqs * h.n_heads * h.head_dim, 5);
    fn time<T: KvElem>(
        name: &str,
        q: &[f32],
        views: &[SeqView<T>],
        rows: &[(usize, usize)],
        h: Heads,
    ) {
        let mut out = vec![0f32; q.len()];
        let start = std::time::Instant::now();
        for _ in 0..100 {
            attention(q, views, rows, h, &mut out);
        }
        eprintln!(
            "{name}: one layer, {} sequences of {}: {:?}",
            views.len(),
            rows[0].1 + 1,
            start.elapsed() / 100
        );
    }
    for _ in 0..2 {
        let views: Vec<SeqView<f32>> = ks.iter().map(|k| paged(k, k, kv_row, 16)).collect();
        time("f32", &q, &views, &row_seq, h);
        let views: Vec<SeqView<half::f16>> =
            halves.iter().map(|k| paged(k, k, kv_row, 16)).collect();
        time("f16", &q, &views, &row_seq, h);
    }
}
