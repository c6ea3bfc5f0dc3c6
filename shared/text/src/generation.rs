//! Sampling defaults a model file recommends: the `general.sampling.*`
//! keys llama.cpp's converter writes from a model's generation config.

use crate::error::Result;
use crate::gguf::Header;
use crate::metadata::Metadata;

/// The recommended values the model file carries; `None` where it is silent.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct ModelSamplingDefaults {
    /// `general.sampling.temp`
    pub temperature: Option<f32>,
    /// `general.sampling.top_p`
    pub top_p: Option<f32>,
    /// `general.sampling.top_k`
    pub top_k: Option<usize>,
    /// `general.sampling.min_p`
    pub min_p: Option<f32>,
    /// `general.sampling.penalty_repeat`
    pub repetition_penalty: Option<f32>,
}

impl ModelSamplingDefaults {
    /// The metadata key of each field, for logs and docs.
    pub const KEYS: [&'static str; 5] = [
        "general.sampling.temp",
        "general.sampling.top_p",
        "general.sampling.top_k",
        "general.sampling.min_p",
        "general.sampling.penalty_repeat",
    ];

    /// Reads the keys that are present; a key of the wrong type is an error.
    pub fn from_gguf(header: &Header) -> Result<Self> {
        let md = Metadata(&header.metadata);
        let [temp, top_p, top_k, min_p, repeat] = Self::KEYS;
        Ok(Self {
            temperature: md.opt_f32(temp)?,
            top_p: md.opt_f32(top_p)?,
            top_k: md.opt_usize(top_k)?,
            min_p: md.opt_f32(min_p)?,
            repetition_penalty: md.opt_f32(repeat)?,
        })
    }
}
