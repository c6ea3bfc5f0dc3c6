//! OpenAI request parameters → validated sampling settings. Every range
//! check of the public API is here; a value out of range is a 400 naming
//! the parameter.

use std::hash::{BuildHasher, Hasher};

use pdserve_protocol::internal::SamplingSpec;
use pdserve_protocol::openai::CommonParams;
use pdserve_text::sampling::MAX_TOP_LOGPROBS;
use pdserve_text::stop::StopMatcher;

use crate::config::Limits;
use crate::defaults::SamplingDefaults;
use crate::error::ApiError;

/// How logprobs are reported, by endpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogprobMode {
    None,
    /// Chat: `logprobs: true` with `top_logprobs` alternatives.
    Chat(u32),
    /// Completions: `logprobs: k`.
    Completion(u32),
}

/// What a request asks for besides the prompt.
#[derive(Debug, Clone)]
pub struct Params {
    /// Sampling for choice 0; `max_tokens` is 0 until the prompt length is known.
    pub sampling: SamplingSpec,
    /// `max_tokens` as asked, if asked.
    pub max_tokens: Option<u32>,
    /// Whether the seed was given (choices then derive theirs from it).
    pub seeded: bool,
    pub n: u32,
    /// The stop sequences, as a matcher each choice clones.
    pub stop: StopMatcher,
    pub stream: bool,
    pub include_usage: bool,
    pub logprobs: LogprobMode,
}

fn range(
    param: &'static str,
    v: Option<f64>,
    lo: f64,
    hi: f64,
    default: f64,
) -> Result<f32, ApiError> {
    let v = v.unwrap_or(default);
    match v.is_finite() && (lo..=hi).contains(&v) {
        true => Ok(v as f32),
        false => Err(ApiError::invalid(
            param,
            format!("{param} must be between {lo} and {hi}, got {v}"),
        )),
    }
}

fn int_range(param: &'static str, v: i64, lo: i64, hi: i64) -> Result<u32, ApiError> {
    match (lo..=hi).contains(&v) {
        true => Ok(v as u32),
        false => Err(ApiError::invalid(
            param,
            format!("{param} must be between {lo} and {hi}, got {v}"),
        )),
    }
}

/// A seed for requests that give none: different for every call.
fn fresh_seed() -> u64 {
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or_default(),
    );
    h.finish()
}

/// What a request is checked against: the front end's limits, the
/// server's sampling defaults and the vocabulary size.
pub struct Rules<'a> {
    pub limits: &'a Limits,
    pub defaults: &'a SamplingDefaults,
    pub vocab_size: usize,
}

/// Most `logit_bias` entries one request may give.
pub const MAX_LOGIT_BIAS_ENTRIES: usize = 1024;

/// `logit_bias`: token ids (as strings) to biases in [-100, 100].
fn logit_bias(
    map: Option<&serde_json::Map<String, serde_json::Value>>,
    vocab_size: usize,
) -> Result<Vec<(u32, f32)>, ApiError> {
    let Some(map) = map else {
        return Ok(Vec::new());
    };
    let bad = |m: String| ApiError::invalid("logit_bias", m);
    if map.len() > MAX_LOGIT_BIAS_ENTRIES {
        return Err(bad(format!(
            "logit_bias may hold at most {MAX_LOGIT_BIAS_ENTRIES} entries"
        )));
    }
    let mut out = Vec::with_capacity(map.len());
    for (key, value) in map {
        let token = key
            .parse::<u32>()
            .ok()
            .filter(|&t| (t as usize) < vocab_size)
            .ok_or_else(|| {
                bad(format!(
                    "logit_bias key {key:?} is not a token id below {vocab_size}"
                ))
            })?;
        let bias = value
            .as_f64()
            .filter(|b| (-100.0..=100.0).contains(b))
            .ok_or_else(|| {
                bad(format!(
                    "logit_bias for token {token} must be a number in [-100, 100], got {value}"
                ))
            })?;
        out.push((token, bias as f32));
    }
    out.sort_by_key(|&(t, _)| t);
    Ok(out)
}

/// The sampling fields, each checked, or the server's default when absent.
fn sampling_spec(
    p: &CommonParams,
    top_logprobs: u32,
    rules: &Rules,
) -> Result<SamplingSpec, ApiError> {
    let d = rules.defaults;
    let top_k = match p.top_k.unwrap_or(d.top_k.value) {
        -1 | 0 => None,
        k => Some(int_range("top_k", k, 1, u32::MAX as i64)?),
    };
    Ok(SamplingSpec {
        temperature: range("temperature", p.temperature, 0.0, 2.0, d.temperature.value)?,
        top_k,
        top_p: match range("top_p", p.top_p, 0.0, 1.0, d.top_p.value)? {
            v if v > 0.0 => v,
            _ => return Err(ApiError::invalid("top_p", "top_p must be greater than 0")),
        },
        min_p: range("min_p", p.min_p, 0.0, 1.0, d.min_p.value)?,
        presence_penalty: range(
            "presence_penalty",
            p.presence_penalty,
            -2.0,
            2.0,
            d.presence_penalty.value,
        )?,
        frequency_penalty: range(
            "frequency_penalty",
            p.frequency_penalty,
            -2.0,
            2.0,
            d.frequency_penalty.value,
        )?,
        seed: p.seed.map(|s| s as u64).unwrap_or_else(fresh_seed),
        top_logprobs,
        max_tokens: 0,
        ignore_eos: p.ignore_eos.unwrap_or(false),
        stop_token_ids: Vec::new(),
        replayed_tokens: 0,
        repetition_penalty: match range(
            "repetition_penalty",
            p.repetition_penalty,
            0.0,
            10.0,
            d.repetition_penalty_for(p.temperature.is_some()),
        )? {
            r if r > 0.0 => r,
            _ => {
                return Err(ApiError::invalid(
                    "repetition_penalty",
                    "repetition_penalty must be greater than 0",
                ))
            }
        },
        logit_bias: logit_bias(p.logit_bias.as_ref(), rules.vocab_size)?,
        grammar: None,
        prompt_logprobs: false,
    })
}

/// Validates the parameters both endpoints share; a parameter left out
/// takes the server's default.
pub fn parse(
    p: &CommonParams,
    max_tokens: Option<i64>,
    logprobs: LogprobMode,
    rules: &Rules,
) -> Result<Params, ApiError> {
    let limits = rules.limits;
    let max_tokens = max_tokens
        .map(|m| int_range("max_tokens", m, 1, u32::MAX as i64))
        .transpose()?;
    let stop = p.stop.clone().map(|s| s.into_vec()).unwrap_or_default();
    let stop = StopMatcher::new(stop).map_err(|e| ApiError::invalid("stop", e.to_string()))?;
    let top_logprobs = match logprobs {
        LogprobMode::None => 0,
        LogprobMode::Chat(k) | LogprobMode::Completion(k) => k,
    };
    let sampling = sampling_spec(p, top_logprobs, rules)?;
    let n = int_range("n", p.n.unwrap_or(1), 1, limits.max_n as i64)?;
    let stream = p.stream.unwrap_or(false);
    let include_usage = p.stream_options.as_ref().is_some_and(|o| o.include_usage);
    if include_usage && !stream {
        return Err(ApiError::invalid(
            "stream_options",
            "stream_options is only allowed when stream is true",
        ));
    }
    Ok(Params {
        sampling,
        max_tokens,
        seeded: p.seed.is_some(),
        n,
        stop,
        stream,
        include_usage,
        logprobs,
    })
}

/// Chat `logprobs` / `top_logprobs`.
pub fn chat_logprobs(logprobs: Option<bool>, top: Option<i64>) -> Result<LogprobMode, ApiError> {
    let k = top
        .map(|k| int_range("top_logprobs", k, 0, MAX_TOP_LOGPROBS as i64))
        .transpose()?;
    match (logprobs.unwrap_or(false), k) {
        (true, k) => Ok(LogprobMode::Chat(k.unwrap_or(0))),
        (false, Some(k)) if k > 0 => Err(ApiError::invalid(
            "top_logprobs",
            "top_logprobs requires logprobs to be true",
        )),
        (false, _) => Ok(LogprobMode::None),
    }
}

/// Completions `logprobs: k`.
pub fn completion_logprobs(logprobs: Option<i64>) -> Result<LogprobMode, ApiError> {
    logprobs
        .map(|k| int_range("logprobs", k, 0, MAX_TOP_LOGPROBS as i64).map(LogprobMode::Completion))
        .transpose()
        .map(|m| m.unwrap_or(LogprobMode::None))
}

impl Params {
    /// The sampling of choice `index`: seeded requests derive one seed per
    /// choice from theirs, so every choice is reproducible.
    pub fn for_choice(&self, index: u32, max_tokens: u32) -> SamplingSpec {
        let mut s = self.sampling.clone();
        s.max_tokens = max_tokens;
        s.seed = match (self.seeded, index) {
            (_, 0) => s.seed,
            (true, i) => s.seed.wrapping_add(i as u64),
            (false, _) => fresh_seed(),
        };
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits() -> Limits {
        Limits {
            max_body_bytes: 1 << 20,
            tokenizer_cache_bytes: 0,
            max_concurrent_requests: 10,
            default_max_tokens: 16,
            max_n: 4,
            sampling: Default::default(),
        }
    }

    fn parse_json(json: &str) -> Result<Params, ApiError> {
        let p: CommonParams = serde_json::from_str(json).unwrap();
        let (limits, defaults) = (
            limits(),
            SamplingDefaults::resolve(&Default::default(), &Default::default()),
        );
        let rules = Rules {
            limits: &limits,
            defaults: &defaults,
            vocab_size: 100,
        };
        parse(&p, p.max_tokens, LogprobMode::None, &rules)
    }

    #[test]
    fn out_of_range_values_name_their_parameter() {
        for (json, param) in [
            (r#"{"temperature":2.5}"#, "temperature"),
            (r#"{"top_p":0}"#, "top_p"),
            (r#"{"top_p":1.5}"#, "top_p"),
            (r#"{"min_p":-0.1}"#, "min_p"),
            (r#"{"presence_penalty":3}"#, "presence_penalty"),
            (r#"{"frequency_penalty":-3}"#, "frequency_penalty"),
            (r#"{"n":5}"#, "n"),
            (r#"{"n":0}"#, "n"),
            (r#"{"max_tokens":0}"#, "max_tokens"),
            (r#"{"top_k":-2}"#, "top_k"),
            (r#"{"repetition_penalty":0}"#, "repetition_penalty"),
            (r#"{"repetition_penalty":11}"#, "repetition_penalty"),
            (r#"{"logit_bias":{"100":1}}"#, "logit_bias"),
            (r#"{"logit_bias":{"x":1}}"#, "logit_bias"),
            (r#"{"logit_bias":{"5":101}}"#, "logit_bias"),
            (r#"{"logit_bias":{"5":"1"}}"#, "logit_bias"),
            (
                r#"{"stop":["a","b","c","d","e","f","g","h","i","j","k","l","m","n","o","p","q"]}"#,
                "stop",
            ),
            (
                r#"{"stream_options":{"include_usage":true}}"#,
                "stream_options",
            ),
        ] {
            match parse_json(json) {
                Err(ApiError::Invalid { param: Some(p), .. }) => assert_eq!(p, param, "{json}"),
                other => panic!("{json}: {other:?}"),
            }
        }
    }

    #[test]
    fn defaults_and_conversions() {
        let p = parse_json(r#"{"temperature":0,"top_k":-1,"stop":"END","seed":-1}"#).unwrap();
        assert_eq!(p.sampling.temperature, 0.0);
        assert_eq!(p.sampling.top_k, None);
        assert_eq!(p.stop, StopMatcher::new(vec!["END".into()]).unwrap());
        assert_eq!(p.sampling.seed, u64::MAX);
        assert_eq!(p.n, 1);
        assert!(!p.stream);
        // Left out: the server's defaults.
        let d = parse_json(r#"{"logit_bias":{"7":-100,"3":2.5}}"#).unwrap();
        assert_eq!(
            d.sampling.temperature as f64,
            crate::defaults::BUILT_IN_TEMPERATURE as f32 as f64
        );
        assert_eq!(d.sampling.top_p, crate::defaults::BUILT_IN_TOP_P as f32);
        assert_eq!(
            d.sampling.repetition_penalty,
            crate::defaults::BUILT_IN_REPETITION_PENALTY as f32
        );
        let greedy = parse_json(r#"{"temperature":0}"#).unwrap();
        assert_eq!(greedy.sampling.repetition_penalty, 1.0);
        assert_eq!(d.sampling.logit_bias, vec![(3, 2.5), (7, -100.0)]);
    }

    #[test]
    fn seeded_choices_are_reproducible_and_distinct() {
        let p = parse_json(r#"{"seed":7,"n":3}"#).unwrap();
        let seeds: Vec<u64> = (0..3).map(|i| p.for_choice(i, 4).seed).collect();
        assert_eq!(seeds, vec![7, 8, 9]);
        assert_eq!(p.for_choice(1, 4).max_tokens, 4);
    }

    #[test]
    fn logprob_modes() {
        assert_eq!(
            chat_logprobs(Some(true), Some(3)).unwrap(),
            LogprobMode::Chat(3)
        );
        assert!(chat_logprobs(None, Some(2)).is_err());
        assert!(chat_logprobs(Some(true), Some(21)).is_err());
        assert_eq!(
            completion_logprobs(Some(2)).unwrap(),
            LogprobMode::Completion(2)
        );
        assert_eq!(completion_logprobs(None).unwrap(), LogprobMode::None);
    }
}
