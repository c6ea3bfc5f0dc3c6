//! Checks of internal requests that every backend shares: the request id,
//! the prompt against the model, the sampling parameters.

use pdserve_protocol::internal::{
    validate_request_id, ErrorBody, ErrorKind, GenerateRequest, PrefillJob, SamplingSpec,
};
use pdserve_text::{ModelConfig, SamplingParams};

fn sampling(spec: &SamplingSpec, prompt_len: usize) -> Result<(), ErrorBody> {
    if spec.replayed_tokens as usize >= prompt_len {
        return Err(ErrorBody::fatal(
            ErrorKind::InvalidSampling,
            "replayed_tokens must be below the prompt's length",
        ));
    }
    SamplingParams::from(spec)
        .validate()
        .map_err(|e| ErrorBody::fatal(ErrorKind::InvalidSampling, e.to_string()))
}

/// A generate request: a prompt that leaves room for `max_tokens` (at least 1).
pub fn generate(config: &ModelConfig, req: &GenerateRequest) -> Result<(), ErrorBody> {
    validate_request_id(&req.request_id)?;
    if req.sampling.max_tokens == 0 {
        return Err(ErrorBody::fatal(
            ErrorKind::InvalidRequest,
            "max_tokens must be at least 1",
        ));
    }
    let max_new = req.sampling.max_tokens as usize;
    config.check_prompt(&req.prompt_tokens, max_new)?;
    sampling(&req.sampling, req.prompt_tokens.len())
}

/// A prefill job: a prompt that fits, fewer cached tokens than it has, and
/// an http(s) KV destination.
pub fn prefill(config: &ModelConfig, job: &PrefillJob) -> Result<(), ErrorBody> {
    validate_request_id(&job.request_id)?;
    config.check_prompt(&job.prompt_tokens, 0)?;
    if job.cached_tokens as usize >= job.prompt_tokens.len() {
        return Err(ErrorBody::fatal(
            ErrorKind::InvalidRequest,
            "cached_tokens must be below the prompt's length (its last token is always computed)",
        ));
    }
    let url = &job.kv_destination;
    if !(url.starts_with("http://") || url.starts_with("https://")) {
        return Err(ErrorBody::fatal(
            ErrorKind::InvalidRequest,
            format!("kv_destination `{url}` is not an http(s) URL"),
        ));
    }
    sampling(&job.sampling, job.prompt_tokens.len())
}
