//! The latency model of an engine: how long a prefill and a decode step
//! take. The mock worker waits this long instead of computing, the
//! simulator and the planner run on it, and the router's `planned`
//! autoscaler sizes both pools with it. Its input is the JSON that
//! `pdserve-loadtest engine --json` writes.
//!
//! - prefill of a prompt of `n` tokens: `a·n + b`;
//! - one decode step over `batch` sequences holding `ctx` tokens of context
//!   in all: `c + d·batch + e·ctx`;
//!
//! all multiplied by `scale` (0: as fast as possible). `a, b, c, d` can be
//! fitted from the JSON of `pdserve-loadtest engine --json`.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use serde::Deserialize;

/// Seconds per unit of each term, and the overall scale.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LatencyModel {
    /// `a`: prefill seconds per prompt token.
    pub prefill_per_token: f64,
    /// `b`: prefill seconds per prompt.
    pub prefill_fixed: f64,
    /// `c`: seconds per decode step.
    pub step_fixed: f64,
    /// `d`: decode-step seconds per sequence in the batch.
    pub step_per_seq: f64,
    /// `e`: decode-step seconds per context token in the batch.
    pub step_per_context_token: f64,
    /// Multiplies every term.
    pub scale: f64,
}

impl LatencyModel {
    /// Time to prefill `tokens` prompt tokens.
    pub fn prefill(&self, tokens: usize) -> Duration {
        self.secs(self.prefill_per_token * tokens as f64 + self.prefill_fixed)
    }

    /// Time of one decode step over `batch` sequences with `context_tokens` in all.
    pub fn step(&self, batch: usize, context_tokens: u64) -> Duration {
        self.secs(
            self.step_fixed
                + self.step_per_seq * batch as f64
                + self.step_per_context_token * context_tokens as f64,
        )
    }

    fn secs(&self, s: f64) -> Duration {
        Duration::try_from_secs_f64(s * self.scale).unwrap_or(Duration::ZERO)
    }

    /// Every term must be finite and non-negative.
    pub fn validate(&self) -> Result<(), FitError> {
        let terms = [
            ("prefill per token", self.prefill_per_token),
            ("prefill fixed", self.prefill_fixed),
            ("step fixed", self.step_fixed),
            ("step per sequence", self.step_per_seq),
            ("step per context token", self.step_per_context_token),
            ("latency scale", self.scale),
        ];
        match terms.iter().find(|(_, v)| !(v.is_finite() && *v >= 0.0)) {
            Some((name, v)) => Err(FitError::Invalid(format!(
                "{name} must be finite and >= 0, got {v}"
            ))),
            None => Ok(()),
        }
    }

    /// Replaces `a, b, c, d` with a fit to an engine benchmark's results.
    pub fn fitted(self, profile: &EngineProfile) -> Result<Self, FitError> {
        let prefill = points(&profile.prefill_tok_s, |len, tok_s| len / tok_s)?;
        let decode = points(&profile.decode_tok_s, |batch, tok_s| batch / tok_s)?;
        let (a, b) = fit_line(&prefill).ok_or(FitError::Empty("prefill_tok_s"))?;
        let (d, c) = fit_line(&decode).ok_or(FitError::Empty("decode_tok_s"))?;
        Ok(Self {
            prefill_per_token: a,
            prefill_fixed: b,
            step_fixed: c,
            step_per_seq: d,
            ..self
        })
    }
}

/// Why a latency model could not be built.
#[derive(Debug, thiserror::Error)]
pub enum FitError {
    #[error("reading {path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error("{path} is not the JSON of `pdserve-loadtest engine --json`: {source}")]
    Json {
        path: String,
        source: serde_json::Error,
    },
    #[error("no result for weights `{0}` in the benchmark file")]
    NoWeights(String),
    #[error("the benchmark has no usable `{0}` figures")]
    Empty(&'static str),
    #[error("bad figure in the benchmark: {0}")]
    BadFigure(String),
    #[error("{0}")]
    Invalid(String),
}

impl FitError {
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Io { .. } => "io",
            Self::Json { .. } => "invalid_json",
            Self::NoWeights(_) => "no_weights",
            Self::Empty(_) => "empty_profile",
            Self::BadFigure(_) => "bad_figure",
            Self::Invalid(_) => "invalid_latency",
        }
    }
}

/// The part of one `pdserve-loadtest engine` result the fit reads.
#[derive(Debug, Clone, Deserialize)]
pub struct EngineProfile {
    pub weights: String,
    /// Prompt length → prefill tokens/s.
    pub prefill_tok_s: BTreeMap<String, f64>,
    /// Batch size → aggregate decode tokens/s.
    pub decode_tok_s: BTreeMap<String, f64>,
}

/// Reads the benchmark file: one result, or a list from which the one with
/// `weights` is taken.
pub fn read_profile(path: &Path, weights: &str) -> Result<EngineProfile, FitError> {
    let p = path.display().to_string();
    let text = std::fs::read_to_string(path).map_err(|source| FitError::Io {
        path: p.clone(),
        source,
    })?;
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum OneOrMany {
        One(EngineProfile),
        Many(Vec<EngineProfile>),
    }
    let parsed =
        serde_json::from_str(&text).map_err(|source| FitError::Json { path: p, source })?;
    match parsed {
        OneOrMany::One(one) => Ok(one),
        OneOrMany::Many(many) => many
            .into_iter()
            .find(|r| r.weights == weights)
            .ok_or_else(|| FitError::NoWeights(weights.to_string())),
    }
}

/// `(x, seconds)` points from `x → tokens/s` figures.
fn points(
    figures: &BTreeMap<String, f64>,
    seconds: impl Fn(f64, f64) -> f64,
) -> Result<Vec<(f64, f64)>, FitError> {
    figures
        .iter()
        .map(|(x, tok_s)| {
            let n: f64 = x
                .parse()
                .map_err(|_| FitError::BadFigure(format!("`{x}` is not a number")))?;
            match n > 0.0 && tok_s.is_finite() && *tok_s > 0.0 {
                true => Ok((n, seconds(n, *tok_s))),
                false => Err(FitError::BadFigure(format!("{x}: {tok_s} tok/s"))),
            }
        })
        .collect()
}

/// Least-squares `y = slope·x + intercept`, both kept non-negative: a
/// negative intercept (superlinear cost) refits through the origin, a
/// negative slope becomes a constant. `None` without points.
pub fn fit_line(points: &[(f64, f64)]) -> Option<(f64, f64)> {
    let n = points.len() as f64;
    if points.is_empty() {
        return None;
    }
    let mean_x = points.iter().map(|p| p.0).sum::<f64>() / n;
    let mean_y = points.iter().map(|p| p.1).sum::<f64>() / n;
    let sxx: f64 = points.iter().map(|p| (p.0 - mean_x).powi(2)).sum();
    let sxy: f64 = points.iter().map(|p| (p.0 - mean_x) * (p.1 - mean_y)).sum();
    let through_origin = || {
        let xx: f64 = points.iter().map(|p| p.0 * p.0).sum();
        let xy: f64 = points.iter().map(|p| p.0 * p.1).sum();
        (xy / xx, 0.0)
    };
    if sxx <= f64::EPSILON {
        return Some(through_origin());
    }
    let slope = sxy / sxx;
    let intercept = mean_y - slope * mean_x;
    Some(match (slope >= 0.0, intercept >= 0.0) {
        (true, true) => (slope, intercept),
        (true, false) => through_origin(),
        (false, _) => (0.0, mean_y),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn model() -> LatencyModel {
        LatencyModel {
            prefill_per_token: 0.002,
            prefill_fixed: 0.005,
            step_fixed: 0.01,
            step_per_seq: 0.001,
            step_per_context_token: 0.000_01,
            scale: 1.0,
        }
    }

    #[test]
    fn terms_add_up_and_scale() {
        let m = model();
        assert_eq!(m.prefill(100), Duration::from_secs_f64(0.205));
        assert_eq!(m.step(4, 1000), Duration::from_secs_f64(0.024));
        let half = LatencyModel { scale: 0.5, ..m };
        assert_eq!(half.prefill(100), Duration::from_secs_f64(0.1025));
        let zero = LatencyModel { scale: 0.0, ..m };
        assert_eq!(zero.step(64, 100_000), Duration::ZERO);
    }

    #[test]
    fn negative_or_nan_terms_are_refused() {
        assert!(model().validate().is_ok());
        let bad = LatencyModel {
            step_per_seq: -1.0,
            ..model()
        };
        assert_eq!(bad.validate().unwrap_err().kind(), "invalid_latency");
        let nan = LatencyModel {
            scale: f64::NAN,
            ..model()
        };
        assert!(nan.validate().is_err());
    }

    #[test]
    fn a_line_is_recovered_exactly() {
        let pts: Vec<(f64, f64)> = [1.0, 4.0, 16.0]
            .iter()
            .map(|&x| (x, 0.0025 * x + 0.007))
            .collect();
        let (slope, intercept) = fit_line(&pts).unwrap();
        assert!((slope - 0.0025).abs() < 1e-12 && (intercept - 0.007).abs() < 1e-12);
    }

    #[test]
    fn the_fit_keeps_terms_non_negative() {
        // Superlinear (attention): the free fit's intercept would be negative.
        let (a, b) = fit_line(&[(128.0, 0.16), (512.0, 0.94)]).unwrap();
        assert_eq!(b, 0.0);
        assert!(
            (a - (128.0 * 0.16 + 512.0 * 0.94) / (128.0f64.powi(2) + 512.0f64.powi(2))).abs()
                < 1e-12
        );
        assert_eq!(fit_line(&[(1.0, 0.5), (2.0, 0.3)]).unwrap(), (0.0, 0.4));
        assert_eq!(fit_line(&[(10.0, 0.5)]).unwrap(), (0.05, 0.0));
        assert_eq!(fit_line(&[]), None);
    }

    #[test]
    fn fits_the_engine_benchmark_json() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("engine.json");
        let json = r#"[{"weights":"f32","threads":2,"prefill_tok_s":{"512":100.0},"decode_tok_s":{"1":10.0},
            "profile_decode":{},"profile_prefill":{}},
          {"weights":"q8_0","threads":2,"prefill_tok_s":{"128":640.0,"512":512.0},
            "decode_tok_s":{"1":100.0,"4":250.0,"16":400.0},"profile_decode":{},"profile_prefill":{}}]"#;
        std::fs::write(&path, json).unwrap();
        let profile = read_profile(&path, "q8_0").unwrap();
        let m = model().fitted(&profile).unwrap();
        // Prefill: 0.2 s for 128, 1.0 s for 512 → a = 1/480 s, b = 0.2 - 128/480 < 0 → through the origin.
        assert_eq!(m.prefill_fixed, 0.0);
        assert!(
            m.prefill_per_token > 0.0019 && m.prefill_per_token < 0.0020,
            "{m:?}"
        );
        // Decode: 10 ms, 16 ms, 40 ms at batch 1, 4, 16 → d = 2 ms, c = 8 ms.
        assert!((m.step_per_seq - 0.002).abs() < 1e-9, "{m:?}");
        assert!((m.step_fixed - 0.008).abs() < 1e-9, "{m:?}");
        assert_eq!(m.step_per_context_token, model().step_per_context_token);
        assert_eq!(
            read_profile(&path, "native").unwrap_err().kind(),
            "no_weights"
        );
    }
}
