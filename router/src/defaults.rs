//! Server-side sampling defaults: what a request that leaves a parameter
//! out gets. Each value comes from, in order: its `--default-*` flag, the
//! model file's `general.sampling.*` key, the built-in value. A request's
//! own value always wins. The resolved table is logged at start.

use pdserve_text::generation::ModelSamplingDefaults;
use serde::Serialize;

/// `--default-*` flags: a value here overrides the model file's.
#[derive(clap::Args, Debug, Clone, Default, PartialEq)]
pub struct DefaultArgs {
    /// `temperature` of requests that give none.
    #[arg(long, env = "PDSERVE_DEFAULT_TEMPERATURE")]
    pub default_temperature: Option<f64>,
    /// `top_p` of requests that give none.
    #[arg(long, env = "PDSERVE_DEFAULT_TOP_P")]
    pub default_top_p: Option<f64>,
    /// `top_k` of requests that give none (0 or -1: off).
    #[arg(long, env = "PDSERVE_DEFAULT_TOP_K", allow_negative_numbers = true)]
    pub default_top_k: Option<i64>,
    /// `min_p` of requests that give none.
    #[arg(long, env = "PDSERVE_DEFAULT_MIN_P")]
    pub default_min_p: Option<f64>,
    /// `repetition_penalty` of requests that give none (1: off).
    #[arg(long, env = "PDSERVE_DEFAULT_REPETITION_PENALTY")]
    pub default_repetition_penalty: Option<f64>,
    /// `presence_penalty` of requests that give none.
    #[arg(
        long,
        env = "PDSERVE_DEFAULT_PRESENCE_PENALTY",
        allow_negative_numbers = true
    )]
    pub default_presence_penalty: Option<f64>,
    /// `frequency_penalty` of requests that give none.
    #[arg(
        long,
        env = "PDSERVE_DEFAULT_FREQUENCY_PENALTY",
        allow_negative_numbers = true
    )]
    pub default_frequency_penalty: Option<f64>,
}

/// The defaults in force, and where each came from.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SamplingDefaults {
    pub temperature: Sourced<f64>,
    pub top_p: Sourced<f64>,
    /// −1: off.
    pub top_k: Sourced<i64>,
    pub min_p: Sourced<f64>,
    pub repetition_penalty: Sourced<f64>,
    pub presence_penalty: Sourced<f64>,
    pub frequency_penalty: Sourced<f64>,
}

/// A default value with its origin: `flag`, `model` or `built-in`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Sourced<T> {
    pub value: T,
    pub source: &'static str,
}

/// Built-in temperature: low enough that SmolLM2-135M-Instruct answers
/// factual questions right on nearly every draw (docs/sampling.md, where
/// the three built-in values were chosen by measurement).
pub const BUILT_IN_TEMPERATURE: f64 = 0.2;
/// Built-in nucleus: cuts the long tail a 135M model puts 10% of its mass on.
pub const BUILT_IN_TOP_P: f64 = 0.9;
/// Built-in repetition penalty: without it the default model's most
/// likely first answer to "What is the capital of France?" is a French
/// list of landmarks; 1.1 makes it name Paris on every seed tried. It is
/// part of the built-in sampling profile only: see
/// [`SamplingDefaults::repetition_penalty_for`].
pub const BUILT_IN_REPETITION_PENALTY: f64 = 1.1;

fn pick<T: Copy>(flag: Option<T>, model: Option<T>, built_in: T) -> Sourced<T> {
    match (flag, model) {
        (Some(value), _) => Sourced {
            value,
            source: "flag",
        },
        (None, Some(value)) => Sourced {
            value,
            source: "model",
        },
        (None, None) => Sourced {
            value: built_in,
            source: "built-in",
        },
    }
}

impl SamplingDefaults {
    /// The repetition penalty of a request that gives none. The built-in
    /// one belongs with the built-in temperature: a request that sets its
    /// own `temperature` (0 for greedy, say) gets no penalty it did not ask
    /// for, since a penalty on the prompt's tokens keeps a model from
    /// restating the question ("The capital of France is Paris."). A value
    /// from a flag or the model file applies to every request.
    pub fn repetition_penalty_for(&self, temperature_given: bool) -> f64 {
        match (self.repetition_penalty.source, temperature_given) {
            ("built-in", true) => 1.0,
            _ => self.repetition_penalty.value,
        }
    }

    /// Flags over the model file over the built-in values.
    pub fn resolve(flags: &DefaultArgs, model: &ModelSamplingDefaults) -> Self {
        let f = |x: Option<f32>| x.map(f64::from);
        Self {
            temperature: pick(
                flags.default_temperature,
                f(model.temperature),
                BUILT_IN_TEMPERATURE,
            ),
            top_p: pick(flags.default_top_p, f(model.top_p), BUILT_IN_TOP_P),
            top_k: pick(flags.default_top_k, model.top_k.map(|k| k as i64), -1),
            min_p: pick(flags.default_min_p, f(model.min_p), 0.0),
            repetition_penalty: pick(
                flags.default_repetition_penalty,
                f(model.repetition_penalty),
                BUILT_IN_REPETITION_PENALTY,
            ),
            presence_penalty: pick(flags.default_presence_penalty, None, 0.0),
            frequency_penalty: pick(flags.default_frequency_penalty, None, 0.0),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_win_over_the_model_file_which_wins_over_built_ins() {
        let flags = DefaultArgs {
            default_temperature: Some(0.7),
            ..DefaultArgs::default()
        };
        let model = ModelSamplingDefaults {
            temperature: Some(0.5),
            top_p: Some(0.8),
            ..ModelSamplingDefaults::default()
        };
        let d = SamplingDefaults::resolve(&flags, &model);
        assert_eq!((d.temperature.value, d.temperature.source), (0.7, "flag"));
        assert_eq!(d.top_p.source, "model");
        assert!((d.top_p.value - 0.8).abs() < 1e-6);
        assert_eq!((d.min_p.value, d.min_p.source), (0.0, "built-in"));
        let none = SamplingDefaults::resolve(&DefaultArgs::default(), &Default::default());
        assert_eq!(none.temperature.value, BUILT_IN_TEMPERATURE);
        assert_eq!(none.top_k.value, -1);
        // The built-in penalty only with the built-in temperature; a flag's always.
        assert_eq!(
            none.repetition_penalty_for(false),
            BUILT_IN_REPETITION_PENALTY
        );
        assert_eq!(none.repetition_penalty_for(true), 1.0);
        let flagged = DefaultArgs {
            default_repetition_penalty: Some(1.3),
            ..DefaultArgs::default()
        };
        let d = SamplingDefaults::resolve(&flagged, &Default::default());
        assert_eq!(d.repetition_penalty_for(true), 1.3);
    }
}
