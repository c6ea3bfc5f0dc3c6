//! Token sampling from a logits vector.
//!
//! The pipeline is: presence/frequency penalties, temperature scaling,
//! top-k, top-p (nucleus), min-p, renormalisation and an inverse-CDF draw.
//! `temperature == 0.0` selects greedy decoding (argmax, ties to the lowest
//! token id) and skips the draw entirely.
//!
//! Randomness is counter based: the draw for a token depends only on the
//! request seed and the absolute token position (see [`uniform`]), so the
//! same request samples the same token at the same position in any process.

mod ops;

use std::borrow::Cow;

use pdserve_protocol::internal::SamplingSpec;
use pdserve_text::grammar::Constraint;
pub use pdserve_text::grammar::Grammars;

pub use ops::uniform;
use ops::{clean, draw_full, draw_truncated, needs_truncation, top_logprobs, LogitStats};
pub use pdserve_text::sampling::{
    Sampled, SamplingError, SamplingParams, TokenCounts, MAX_TOP_LOGPROBS,
};

/// Samples one token from `logits` at absolute token `position`.
///
/// `history` holds the counts of tokens generated so far for the penalties.
/// Non-finite logits are never sampled; an empty or all-non-finite vector
/// is an error.
pub fn sample(
    logits: &[f32],
    params: &SamplingParams,
    position: u64,
    history: &TokenCounts,
) -> Result<Sampled, SamplingError> {
    params.validate()?;
    if u32::try_from(logits.len()).is_err() {
        return Err(SamplingError::VocabTooLarge { len: logits.len() });
    }
    let penalised = apply_penalties(logits, params, history);
    let inv_temp = (!params.is_greedy()).then(|| 1.0 / params.temperature);
    let stats = LogitStats::compute(&penalised, inv_temp)?;
    let index = match inv_temp {
        None => stats.argmax,
        Some(inv_t) => {
            let u = uniform(params.seed, position);
            if needs_truncation(params, penalised.len()) {
                draw_truncated(&penalised, params, &stats, inv_t, u)
            } else {
                draw_full(&penalised, &stats, inv_t, u)
            }
        }
    };
    let log_norm = stats.log_norm();
    let logprob = penalised
        .get(index)
        .map_or(f32::NEG_INFINITY, |&x| clean(x))
        - log_norm;
    let wanted = params.top_logprobs.min(MAX_TOP_LOGPROBS);
    Ok(Sampled {
        token: index as u32,
        logprob,
        top_logprobs: top_logprobs(&penalised, wanted, log_norm),
    })
}

/// The logprob of `next` under `logits` (the model's own distribution, as
/// OpenAI reports prompt logprobs) and the `top` most likely tokens.
pub fn logprob_of(
    logits: &[f32],
    next: u32,
    top: usize,
) -> Result<(f32, Vec<(u32, f32)>), SamplingError> {
    let stats = LogitStats::compute(logits, None)?;
    let log_norm = stats.log_norm();
    let logprob = logits
        .get(next as usize)
        .map_or(f32::NEG_INFINITY, |&x| clean(x))
        - log_norm;
    let top = top_logprobs(logits, top.min(MAX_TOP_LOGPROBS), log_norm);
    Ok((logprob, top))
}

/// Applies `logit_bias`, the repetition penalty, then OpenAI-style presence
/// and frequency penalties; borrows the input unchanged when none of them
/// can have any effect.
fn apply_penalties<'a>(
    logits: &'a [f32],
    params: &SamplingParams,
    history: &TokenCounts,
) -> Cow<'a, [f32]> {
    let (presence, frequency) = (params.presence_penalty, params.frequency_penalty);
    let counted = !history.is_empty() && (presence != 0.0 || frequency != 0.0);
    let repetition = params.repetition_penalty != 1.0;
    if !counted && !repetition && params.logit_bias.is_empty() {
        return Cow::Borrowed(logits);
    }
    let mut out = logits.to_vec();
    for &(token, bias) in &params.logit_bias {
        if let Some(logit) = out.get_mut(token as usize) {
            *logit += bias;
        }
    }
    if repetition {
        let r = params.repetition_penalty;
        for token in history.seen() {
            if let Some(logit) = out.get_mut(token as usize) {
                *logit = if *logit > 0.0 { *logit / r } else { *logit * r };
            }
        }
    }
    if counted {
        for (token, count) in history.iter() {
            if count == 0 {
                continue;
            }
            if let Some(logit) = out.get_mut(token as usize) {
                *logit -= frequency * count as f32 + presence;
            }
        }
    }
    Cow::Owned(out)
}

/// The grammar compiler for the model file at `path` (its tokenizer, with
/// `vocab_size` logits per step). A model whose vocabulary cannot be read
/// still serves; only requests with a grammar are refused.
pub fn grammars_for(path: &std::path::Path, vocab_size: usize) -> Option<Grammars> {
    let built = pdserve_text::Tokenizer::from_gguf_file(path)
        .map_err(|e| e.to_string())
        .and_then(|t| Grammars::new(std::sync::Arc::new(t), vocab_size).map_err(|e| e.to_string()));
    match built {
        Ok(g) => Some(g),
        Err(e) => {
            tracing::warn!("constrained decoding is off: {e}");
            None
        }
    }
}

/// One sequence's sampling state: its parameters, the tokens counted for
/// the penalties, and its grammar's matcher when the output is constrained.
pub struct SeqSampler {
    pub params: SamplingParams,
    pub history: TokenCounts,
    constraint: Option<Constraint>,
}

impl SeqSampler {
    /// The state at the end of `prompt`. Its last `spec.replayed_tokens`
    /// tokens are the sequence's own earlier output (a migrated stream):
    /// they count as generated, and the grammar is advanced past them.
    pub fn new(
        spec: &SamplingSpec,
        prompt: &[u32],
        grammars: Option<&Grammars>,
    ) -> Result<Self, SamplingError> {
        let params = SamplingParams::from(spec);
        params.validate()?;
        let replayed = (spec.replayed_tokens as usize).min(prompt.len());
        let (own, generated) = prompt.split_at(prompt.len() - replayed);
        let mut history: TokenCounts = generated.iter().copied().collect();
        if params.repetition_penalty != 1.0 {
            history = history.with_prompt(own);
        }
        let constraint = match (&spec.grammar, grammars) {
            (None, _) => None,
            (Some(_), None) => {
                return Err(SamplingError::NoGrammars(
                    "the model's vocabulary could not be loaded".into(),
                ))
            }
            (Some(g), Some(grammars)) => {
                let mut c = grammars.compile(g)?;
                for &t in generated {
                    c.accept(t)?;
                }
                Some(c)
            }
        };
        Ok(Self {
            params,
            history,
            constraint,
        })
    }

    /// Samples the token at absolute `position` from `logits`, masked by
    /// the grammar when there is one.
    pub fn sample(&mut self, logits: &[f32], position: u64) -> Result<Sampled, SamplingError> {
        match &mut self.constraint {
            None => sample(logits, &self.params, position, &self.history),
            Some(c) => {
                let mut masked = logits.to_vec();
                c.mask(&mut masked)?;
                sample(&masked, &self.params, position, &self.history)
            }
        }
    }

    /// Records `token` as generated and advances the grammar past it.
    pub fn accept(&mut self, token: u32) -> Result<(), SamplingError> {
        self.history.add(token);
        match &mut self.constraint {
            Some(c) => Ok(c.accept(token)?),
            None => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Default params with the given temperature, edited by `edit`.
    fn cfg(temperature: f32, edit: impl FnOnce(&mut SamplingParams)) -> SamplingParams {
        let mut p = SamplingParams {
            temperature,
            ..SamplingParams::default()
        };
        edit(&mut p);
        p
    }

    fn run(logits: &[f32], p: &SamplingParams, pos: u64, h: &TokenCounts) -> Sampled {
        sample(logits, p, pos, h).unwrap_or_else(|e| panic!("sample failed: {e}"))
    }

    fn draw(logits: &[f32], p: &SamplingParams, pos: u64) -> u32 {
        run(logits, p, pos, &TokenCounts::new()).token
    }

    fn softmax(logits: &[f32], t: f32) -> Vec<f64> {
        let m = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let w: Vec<f64> = logits
            .iter()
            .map(|&l| (f64::from(l - m) / f64::from(t)).exp())
            .collect();
        let s: f64 = w.iter().sum();
        w.iter().map(|x| x / s).collect()
    }

    fn ln_probs(p: &[f64]) -> Vec<f32> {
        p.iter().map(|x| x.ln() as f32).collect()
    }

    fn frequencies(logits: &[f32], p: &SamplingParams, draws: u64) -> Vec<f64> {
        let mut counts = vec![0u64; logits.len()];
        for pos in 0..draws {
            counts[draw(logits, p, pos) as usize] += 1;
        }
        counts.iter().map(|&c| c as f64 / draws as f64).collect()
    }

    #[test]
    fn logprob_of_is_the_model_distribution() {
        let logits = [1.0f32, 2.0, 3.0];
        let norm = (1f32.exp() + 2f32.exp() + 3f32.exp()).ln();
        let (lp, top) = logprob_of(&logits, 0, 2).unwrap();
        assert!((lp - (1.0 - norm)).abs() < 1e-6, "{lp}");
        assert_eq!(top.iter().map(|e| e.0).collect::<Vec<_>>(), vec![2, 1]);
        assert!((top[0].1 - (3.0 - norm)).abs() < 1e-6);
        assert_eq!(logprob_of(&logits, 9, 0).unwrap().0, f32::NEG_INFINITY);
        assert!(logprob_of(&[f32::NAN], 0, 0).is_err());
    }

    #[test]
    fn seeded_sampling_is_deterministic_and_varies_with_position() {
        let logits = [0.0f32; 10];
        let p = cfg(1.0, |p| p.seed = 1234);
        let mut seen = [false; 10];
        for pos in 0..200 {
            let a = draw(&logits, &p, pos);
            assert_eq!(a, draw(&logits, &p, pos));
            seen[a as usize] = true;
        }
        assert!(
            seen.iter().all(|&s| s),
            "all tokens drawn over 200 positions"
        );
        let other = cfg(1.0, |p| p.seed = 99);
        let differs = (0..50).any(|pos| draw(&logits, &p, pos) != draw(&logits, &other, pos));
        assert!(differs, "a different seed gives a different stream");
    }

    #[test]
    fn greedy_takes_argmax_with_lowest_id_on_ties() {
        let p = cfg(0.0, |_| {});
        assert_eq!(draw(&[0.1, 2.0, -1.0, 1.9], &p, 0), 1);
        assert_eq!(draw(&[1.0, 3.0, 3.0, 2.0], &p, 0), 1);
        assert_eq!(draw(&[f32::NAN, 5.0, 5.0], &p, 3), 1);
        let tiny = cfg(1e-45, |_| {});
        assert!((0..100).all(|pos| draw(&[1.0, 3.0, 3.0, 2.9], &tiny, pos) == 1));
    }

    #[test]
    fn top_k_one_equals_greedy() {
        let logits = [0.3f32, 1.2, 1.1, -0.5, 1.2];
        let p = cfg(1.5, |p| p.top_k = Some(1));
        let greedy = cfg(0.0, |_| {});
        for pos in 0..500 {
            assert_eq!(draw(&logits, &p, pos), draw(&logits, &greedy, pos));
        }
    }

    #[test]
    fn top_k_never_picks_outside_the_top_k() {
        // 37 is coprime with 50, so all logits are distinct.
        let logits: Vec<f32> = (0..50).map(|i| ((i * 37) % 50) as f32 * 0.05).collect();
        let p = cfg(2.0, |p| p.top_k = Some(3));
        let mut order: Vec<usize> = (0..50).collect();
        order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]));
        let allowed = &order[..3];
        let mut seen = [false; 50];
        for pos in 0..2000 {
            let t = draw(&logits, &p, pos) as usize;
            assert!(allowed.contains(&t), "token {t} outside top-3");
            seen[t] = true;
        }
        assert!(allowed.iter().all(|&t| seen[t]));
    }

    #[test]
    fn top_p_keeps_the_nucleus_only() {
        let logits = ln_probs(&[0.5, 0.3, 0.15, 0.05]);
        let f = frequencies(&logits, &cfg(1.0, |p| p.top_p = 0.7), 4000);
        assert_eq!(f[2] + f[3], 0.0);
        assert!(
            (f[0] - 0.625).abs() < 0.03,
            "renormalised 0.5/0.8, got {}",
            f[0]
        );
        // A tiny nucleus still keeps the most likely token.
        let tiny = cfg(1.0, |p| p.top_p = 1e-6);
        assert!((0..200).all(|pos| draw(&logits, &tiny, pos) == 0));
    }

    #[test]
    fn min_p_drops_unlikely_tokens() {
        let logits = ln_probs(&[0.5, 0.3, 0.15, 0.05]);
        let f = frequencies(&logits, &cfg(1.0, |p| p.min_p = 0.4), 4000);
        assert_eq!(f[2] + f[3], 0.0);
        assert!(f[0] > 0.5 && f[1] > 0.3);
        let strict = cfg(1.0, |p| p.min_p = 1.0);
        assert!((0..200).all(|pos| draw(&logits, &strict, pos) == 0));
    }

    #[test]
    fn penalties_change_the_argmax() {
        let logits = [2.0f32, 1.5, 0.0];
        let history: TokenCounts = [0, 0].into_iter().collect();
        let argmax = |presence: f32, frequency: f32| {
            let p = cfg(0.0, |p| {
                (p.presence_penalty, p.frequency_penalty) = (presence, frequency)
            });
            run(&logits, &p, 0, &history).token
        };
        assert_eq!(argmax(0.0, 0.0), 0);
        assert_eq!(argmax(1.0, 0.0), 1); // 2.0 - 1.0 = 1.0 < 1.5
        assert_eq!(argmax(0.0, 0.3), 1); // 2.0 - 2 * 0.3 = 1.4 < 1.5
        assert_eq!(argmax(0.0, 0.2), 0); // 2.0 - 2 * 0.2 = 1.6 > 1.5
        assert_eq!(argmax(0.4, 0.0), 0); // presence ignores the count
        assert_eq!(argmax(-1.0, 0.0), 0);
    }

    #[test]
    fn temperature_matches_softmax_frequencies() {
        let logits = [1.0f32, 0.5, 0.0, -1.0, 0.2];
        for t in [0.7f32, 1.0, 1.8] {
            let expected = softmax(&logits, t);
            let plain = cfg(t, |p| p.seed = 3);
            // A tiny min_p forces the truncating path without removing tokens.
            let truncating = cfg(t, |p| (p.seed, p.min_p, p.top_k) = (3, 1e-9, Some(5)));
            for p in [plain, truncating] {
                let f = frequencies(&logits, &p, 20_000);
                for (got, want) in f.iter().zip(&expected) {
                    assert!((got - want).abs() < 0.02, "t={t}: {got} vs {want}");
                }
            }
        }
    }

    #[test]
    fn logprobs_are_log_softmax_of_penalised_logits() {
        let logits = [1.0f32, 2.0, 3.0];
        let lse = (1f64.exp() + 2f64.exp() + 3f64.exp()).ln() as f32;
        let s = run(
            &logits,
            &cfg(0.0, |p| p.top_logprobs = 2),
            0,
            &TokenCounts::new(),
        );
        assert_eq!(s.token, 2);
        assert!((s.logprob - (3.0 - lse)).abs() < 1e-5);
        assert_eq!(s.top_logprobs.len(), 2);
        assert_eq!((s.top_logprobs[0].0, s.top_logprobs[1].0), (2, 1));
        assert!((s.top_logprobs[1].1 - (2.0 - lse)).abs() < 1e-5);

        // Penalised: token 2 drops to 1.0; temperature does not affect logprobs.
        let history: TokenCounts = [2].into_iter().collect();
        let p = cfg(5.0, |p| (p.presence_penalty, p.top_logprobs) = (2.0, 3));
        let s = run(&logits, &p, 9, &history);
        let lse = (2.0 * 1f64.exp() + 2f64.exp()).ln() as f32;
        let ids: Vec<u32> = s.top_logprobs.iter().map(|e| e.0).collect();
        assert_eq!(ids, vec![1, 0, 2]);
        assert!((s.top_logprobs[0].1 - (2.0 - lse)).abs() < 1e-5);
        let chosen = [1.0, 2.0, 1.0][s.token as usize] - lse;
        assert!((s.logprob - chosen).abs() < 1e-5);
    }

    #[test]
    fn top_logprobs_ties_cap_and_non_finite() {
        let mut logits = vec![0.0f32; 30];
        (logits[3], logits[7]) = (f32::NAN, f32::INFINITY);
        let s = run(
            &logits,
            &cfg(0.0, |p| p.top_logprobs = 50),
            0,
            &TokenCounts::new(),
        );
        let ids: Vec<u32> = s.top_logprobs.iter().map(|e| e.0).collect();
        let want: Vec<u32> = (0..30).filter(|&i| i != 3 && i != 7).take(20).collect();
        assert_eq!(ids, want);
        assert!((s.top_logprobs[0].1 + 28f32.ln()).abs() < 1e-5);
    }

    #[test]
    fn non_finite_logits_are_never_sampled() {
        let logits = [f32::NAN, 0.0, f32::NEG_INFINITY, 0.0, f32::NAN];
        let nucleus = cfg(1.0, |p| p.top_p = 0.99);
        for pos in 0..300 {
            assert!(matches!(draw(&logits, &cfg(1.0, |_| {}), pos), 1 | 3));
            assert!(matches!(draw(&logits, &nucleus, pos), 1 | 3));
        }
    }

    #[test]
    fn empty_or_all_nan_logits_error() {
        let h = TokenCounts::new();
        let want = |len| Err(SamplingError::NoFiniteLogits { len });
        assert_eq!(sample(&[], &cfg(1.0, |_| {}), 0, &h), want(0));
        assert_eq!(sample(&[f32::NAN; 4], &cfg(1.0, |_| {}), 0, &h), want(4));
        assert_eq!(sample(&[f32::NAN; 4], &cfg(0.0, |_| {}), 0, &h), want(4));
    }

    #[test]
    fn validate_rejects_each_bad_value() {
        assert_eq!(SamplingParams::default().validate(), Ok(()));
        let bad: [fn(&mut SamplingParams); 14] = [
            |p| p.temperature = -0.1,
            |p| p.temperature = 100.5,
            |p| p.temperature = f32::NAN,
            |p| p.temperature = f32::INFINITY,
            |p| p.top_p = 0.0,
            |p| p.top_p = 1.01,
            |p| p.top_p = f32::NAN,
            |p| p.min_p = -0.01,
            |p| p.min_p = 1.5,
            |p| p.presence_penalty = 2.5,
            |p| p.presence_penalty = -2.5,
            |p| p.frequency_penalty = 2.01,
            |p| p.frequency_penalty = f32::NAN,
            |p| p.top_k = Some(0),
        ];
        for edit in bad {
            let p = cfg(1.0, edit);
            assert!(p.validate().is_err(), "{p:?} should be rejected");
            assert!(sample(&[0.0], &p, 0, &TokenCounts::new()).is_err());
        }
        let msg = SamplingError::InvalidTopP(2.0).to_string();
        assert!(msg.contains("top_p") && msg.contains("(0, 1]"));
        let edge = cfg(100.0, |p| {
            (p.top_k, p.min_p) = (Some(1), 1.0);
            (p.presence_penalty, p.frequency_penalty) = (-2.0, 2.0);
        });
        assert_eq!(edge.validate(), Ok(()));
    }

    #[test]
    fn large_vocab_with_small_top_k() {
        let logits: Vec<f32> = (0..49_152u32)
            .map(|i| ((i * 7919) % 1000) as f32 / 100.0)
            .collect();
        let p = cfg(1.0, |p| {
            (p.top_k, p.top_p, p.top_logprobs) = (Some(5), 0.9, 5)
        });
        for pos in 0..20 {
            let s = run(&logits, &p, pos, &TokenCounts::new());
            assert!(s.top_logprobs.iter().any(|&(id, _)| id == s.token));
        }
    }
}
