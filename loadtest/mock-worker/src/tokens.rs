//! Deterministic pseudo-random "sampling": the token at a position depends
//! only on `(seed, position)`, as in the real sampler, so a mock prefill
//! followed by a mock decode gives exactly the tokens of a mock local
//! prefill. Ids fall in `[FIRST_ID, vocab)`, which skips the special tokens
//! (end of text, chat markers) at the start of Llama-family vocabularies, so
//! a sequence never stops early by accident. A greedy request's tokens do
//! not depend on its seed.

use pdserve_protocol::internal::SamplingSpec;
use pdserve_text::Sampled;

/// Smallest id generated.
pub const FIRST_ID: u32 = 3;

/// SplitMix64: a good 64-bit mix of one integer.
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The token a sequence sampled with `spec` gets at `position`. Greedy
/// sampling (temperature 0) ignores the seed, as the real sampler does, so
/// every greedy request for a prompt gets the same tokens.
pub fn sample_for(spec: &SamplingSpec, vocab: u32, position: u64) -> Sampled {
    let seed = match spec.temperature == 0.0 {
        true => 0,
        false => spec.seed,
    };
    sample(vocab, seed, position, spec.top_logprobs)
}

/// The token at `position` of a sequence seeded `seed`, for a vocabulary of
/// `vocab` ids (more than [`FIRST_ID`]), with `top_n` alternatives: the
/// token itself first, logprobs descending, the logprob in `[-3, -0.05]`.
pub fn sample(vocab: u32, seed: u64, position: u64, top_n: u32) -> Sampled {
    let span = u64::from(vocab.saturating_sub(FIRST_ID).max(1));
    let r = mix(seed ^ mix(position));
    let token = FIRST_ID + (r % span) as u32;
    let logprob = -0.05 - ((r >> 40) % 2950) as f32 / 1000.0;
    let top_n = u64::from(top_n).min(span);
    let top_logprobs = (0..top_n)
        .map(|i| {
            let id = FIRST_ID + ((u64::from(token - FIRST_ID) + i) % span) as u32;
            (id, logprob - 0.5 * i as f32)
        })
        .collect();
    Sampled {
        token,
        logprob,
        top_logprobs,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_depend_only_on_seed_and_position() {
        assert_eq!(sample(266, 7, 40, 2), sample(266, 7, 40, 2));
        let a: Vec<u32> = (0..64).map(|p| sample(266, 7, p, 0).token).collect();
        let b: Vec<u32> = (0..64).map(|p| sample(266, 8, p, 0).token).collect();
        assert_ne!(a, b, "another seed gives another sequence");
        let distinct: std::collections::HashSet<_> = a.iter().collect();
        assert!(distinct.len() > 32, "tokens vary along a sequence: {a:?}");
    }

    #[test]
    fn ids_stay_in_range_and_logprobs_are_plausible() {
        for p in 0..2000 {
            let s = sample(266, 1, p, 5);
            assert!((FIRST_ID..266).contains(&s.token), "{s:?}");
            assert!((-3.0..=-0.05).contains(&s.logprob), "{s:?}");
            assert_eq!(s.top_logprobs.len(), 5);
            assert_eq!(s.top_logprobs[0], (s.token, s.logprob));
            assert!(s.top_logprobs.windows(2).all(|w| w[0].1 > w[1].1));
            let ids: std::collections::HashSet<_> = s.top_logprobs.iter().map(|t| t.0).collect();
            assert_eq!(ids.len(), 5, "alternatives are distinct: {s:?}");
        }
        assert_eq!(
            sample(5, 1, 0, 20).top_logprobs.len(),
            2,
            "capped by the vocabulary"
        );
    }
}
