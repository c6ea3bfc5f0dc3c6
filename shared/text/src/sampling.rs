//! Sampling parameters, their validation, and what sampling one token
//! produces. The sampler itself runs in the engine; the router validates
//! requests with these types without linking it.

use std::collections::{HashMap, HashSet};

use pdserve_protocol::internal::SamplingSpec;

/// Maximum number of `top_logprobs` entries returned per token.
pub const MAX_TOP_LOGPROBS: usize = 20;
/// Largest `repetition_penalty` accepted.
pub const MAX_REPETITION_PENALTY: f32 = 10.0;
/// Largest magnitude of a `logit_bias` entry (OpenAI's range).
pub const MAX_LOGIT_BIAS: f32 = 100.0;

/// Per-request sampling configuration.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// Softmax temperature in `[0, 100]`; `0.0` means greedy decoding.
    pub temperature: f32,
    /// Keep only the `k` most likely tokens; `None` disables top-k.
    pub top_k: Option<usize>,
    /// Nucleus mass in `(0, 1]`; `1.0` disables top-p.
    pub top_p: f32,
    /// Drop tokens whose probability is below `min_p * max_prob`; `0.0` disables it.
    pub min_p: f32,
    /// Subtracted once from the logit of every token already generated, in `[-2, 2]`.
    pub presence_penalty: f32,
    /// Subtracted per occurrence from the logit of generated tokens, in `[-2, 2]`.
    pub frequency_penalty: f32,
    /// Seed of the counter-based random draw.
    pub seed: u64,
    /// Number of most likely alternatives to report (capped at [`MAX_TOP_LOGPROBS`]).
    pub top_logprobs: usize,
    /// Divides positive logits (multiplies negative ones) of every token in
    /// the prompt or the output so far; `1.0` disables it.
    pub repetition_penalty: f32,
    /// Added to the logits of these tokens, each in `[-100, 100]`.
    pub logit_bias: Vec<(u32, f32)>,
}

impl Default for SamplingParams {
    /// The wire defaults ([`SamplingSpec::default`]): temperature 1, no truncation.
    fn default() -> Self {
        Self::from(&SamplingSpec::default())
    }
}

impl SamplingParams {
    /// Checks every parameter against its allowed range.
    pub fn validate(&self) -> Result<(), SamplingError> {
        let t = self.temperature;
        if !(t.is_finite() && (0.0..=100.0).contains(&t)) {
            return Err(SamplingError::InvalidTemperature(t));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(SamplingError::InvalidTopP(self.top_p));
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return Err(SamplingError::InvalidMinP(self.min_p));
        }
        if !(-2.0..=2.0).contains(&self.presence_penalty) {
            return Err(SamplingError::InvalidPresencePenalty(self.presence_penalty));
        }
        if !(-2.0..=2.0).contains(&self.frequency_penalty) {
            return Err(SamplingError::InvalidFrequencyPenalty(
                self.frequency_penalty,
            ));
        }
        if self.top_k == Some(0) {
            return Err(SamplingError::InvalidTopK(0));
        }
        let r = self.repetition_penalty;
        if !(r.is_finite() && r > 0.0 && r <= MAX_REPETITION_PENALTY) {
            return Err(SamplingError::InvalidRepetitionPenalty(r));
        }
        if let Some(&(token, bias)) = self
            .logit_bias
            .iter()
            .find(|(_, b)| !(-MAX_LOGIT_BIAS..=MAX_LOGIT_BIAS).contains(b))
        {
            return Err(SamplingError::InvalidLogitBias { token, bias });
        }
        Ok(())
    }

    /// True when the temperature selects greedy (argmax) decoding: it is
    /// `0.0`, or so small (subnormal) that `1 / temperature` overflows.
    pub fn is_greedy(&self) -> bool {
        !(1.0 / self.temperature).is_finite()
    }
}

/// Errors reported by [`SamplingParams::validate`] and [`sample`].
#[derive(thiserror::Error, Debug, Clone, PartialEq)]
pub enum SamplingError {
    /// Temperature outside `[0, 100]` or not finite.
    #[error("temperature must be a finite number in [0, 100], got {0}")]
    InvalidTemperature(f32),
    /// `top_p` outside `(0, 1]`.
    #[error("top_p must be in (0, 1], got {0}")]
    InvalidTopP(f32),
    /// `min_p` outside `[0, 1]`.
    #[error("min_p must be in [0, 1], got {0}")]
    InvalidMinP(f32),
    /// `presence_penalty` outside `[-2, 2]`.
    #[error("presence_penalty must be in [-2, 2], got {0}")]
    InvalidPresencePenalty(f32),
    /// `frequency_penalty` outside `[-2, 2]`.
    #[error("frequency_penalty must be in [-2, 2], got {0}")]
    InvalidFrequencyPenalty(f32),
    /// `top_k` set to a value below 1.
    #[error("top_k must be at least 1 when set, got {0}")]
    InvalidTopK(usize),
    /// `repetition_penalty` not in `(0, 10]`.
    #[error("repetition_penalty must be in (0, 10], got {0}")]
    InvalidRepetitionPenalty(f32),
    /// A `logit_bias` entry outside `[-100, 100]`.
    #[error("logit_bias for token {token} must be in [-100, 100], got {bias}")]
    InvalidLogitBias {
        /// The token the bias is for.
        token: u32,
        /// The rejected bias.
        bias: f32,
    },
    /// The grammar could not be compiled or refused a token.
    #[error(transparent)]
    Grammar(#[from] crate::grammar::GrammarError),
    /// The request has a grammar but this process cannot compile grammars.
    #[error("this worker cannot run constrained decoding: {0}")]
    NoGrammars(String),
    /// The logits vector is empty or holds no finite value.
    #[error("logits vector of length {len} has no finite value to sample from")]
    NoFiniteLogits {
        /// Length of the rejected logits vector.
        len: usize,
    },
    /// The logits vector is longer than the `u32` token id space.
    #[error("logits vector of length {len} exceeds the u32 token id range")]
    VocabTooLarge {
        /// Length of the rejected logits vector.
        len: usize,
    },
}

/// Counts of tokens generated so far, used for presence/frequency penalties,
/// and the prompt's distinct tokens when a repetition penalty needs them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TokenCounts {
    counts: HashMap<u32, u32>,
    prompt: HashSet<u32>,
}

impl TokenCounts {
    /// Creates an empty set of counts.
    pub fn new() -> Self {
        Self::default()
    }

    /// The counts a sequence resumes with: the last `replayed` tokens of
    /// `prompt` are its own earlier output (a migrated stream).
    pub fn replayed(prompt: &[u32], replayed: u32) -> Self {
        let from = prompt.len().saturating_sub(replayed as usize);
        prompt[from..].iter().copied().collect()
    }

    /// Also remembers the distinct tokens of `prompt` (for the repetition
    /// penalty, which counts the prompt too).
    pub fn with_prompt(mut self, prompt: &[u32]) -> Self {
        self.prompt.extend(prompt.iter().copied());
        self
    }

    /// Every token seen in the prompt or generated, each once.
    pub fn seen(&self) -> impl Iterator<Item = u32> + '_ {
        let generated = self.counts.keys().copied();
        let prompt_only = self.prompt.iter().copied();
        generated.chain(prompt_only.filter(|t| !self.counts.contains_key(t)))
    }

    /// Records one more occurrence of `token`.
    pub fn add(&mut self, token: u32) {
        let count = self.counts.entry(token).or_insert(0);
        *count = count.saturating_add(1);
    }

    /// Number of recorded occurrences of `token`.
    pub fn get(&self, token: u32) -> u32 {
        self.counts.get(&token).copied().unwrap_or(0)
    }

    /// Iterates over `(token, count)` pairs in unspecified order.
    pub fn iter(&self) -> impl Iterator<Item = (u32, u32)> + '_ {
        self.counts.iter().map(|(&token, &count)| (token, count))
    }

    /// Number of distinct tokens recorded.
    pub fn len(&self) -> usize {
        self.counts.len()
    }

    /// True when no token has been recorded.
    pub fn is_empty(&self) -> bool {
        self.counts.is_empty()
    }

    /// Forgets every recorded token.
    pub fn clear(&mut self) {
        self.counts.clear();
        self.prompt.clear();
    }
}

impl FromIterator<u32> for TokenCounts {
    fn from_iter<I: IntoIterator<Item = u32>>(iter: I) -> Self {
        let mut counts = Self::new();
        for token in iter {
            counts.add(token);
        }
        counts
    }
}

/// The outcome of sampling one token.
#[derive(Debug, Clone, PartialEq)]
pub struct Sampled {
    /// The chosen token id.
    pub token: u32,
    /// Log-probability of `token` under the penalised logits (before
    /// temperature and truncation).
    pub logprob: f32,
    /// The most likely tokens with their log-probabilities (same
    /// distribution as `logprob`), sorted descending, ties to the lower id.
    pub top_logprobs: Vec<(u32, f32)>,
}

impl From<&SamplingSpec> for SamplingParams {
    fn from(spec: &SamplingSpec) -> Self {
        Self {
            temperature: spec.temperature,
            top_k: spec.top_k.map(|k| k as usize),
            top_p: spec.top_p,
            min_p: spec.min_p,
            presence_penalty: spec.presence_penalty,
            frequency_penalty: spec.frequency_penalty,
            seed: spec.seed,
            top_logprobs: spec.top_logprobs as usize,
            repetition_penalty: spec.repetition_penalty,
            logit_bias: spec.logit_bias.clone(),
        }
    }
}
