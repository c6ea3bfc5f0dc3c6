//! Conversions between the engine's types and their wire forms in `pdserve-protocol`.

use pdserve_protocol::internal::SamplingSpec;
use pdserve_protocol::kvwire;

use crate::kv::KvDtype;
use crate::sampler::SamplingParams;

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
        }
    }
}

impl From<kvwire::KvDtype> for KvDtype {
    fn from(d: kvwire::KvDtype) -> Self {
        match d {
            kvwire::KvDtype::F32 => Self::F32,
            kvwire::KvDtype::F16 => Self::F16,
        }
    }
}

impl From<KvDtype> for kvwire::KvDtype {
    fn from(d: KvDtype) -> Self {
        match d {
            KvDtype::F32 => Self::F32,
            KvDtype::F16 => Self::F16,
        }
    }
}
