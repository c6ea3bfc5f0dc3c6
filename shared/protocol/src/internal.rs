//! The internal HTTP/JSON API between the router and the workers.
//!
//! - `POST /v1/internal/generate` (decode worker): a [`GenerateRequest`]; the
//!   response is a stream of [`GenerateEvent`]s, one JSON object per line.
//! - `POST /v1/internal/prefill` (prefill worker): a [`PrefillJob`]; the
//!   response is a stream of [`PrefillEvent`]s, one JSON object per line:
//!   `queued` at once, then `done` (a [`PrefillResult`], once the KV is
//!   delivered) or `error`. A job refused before it is queued is an
//!   [`ErrorBody`] with its HTTP status.
//! - `GET /load` (both): a [`LoadReport`].

use serde::{Deserialize, Serialize};

use crate::prefix::PrefixDigest;

pub use crate::error::{ErrorBody, ErrorClass, ErrorKind};

/// Version of this API; sent in the `x-pdserve-api` header.
pub const API_VERSION: u32 = 2;
/// Header that carries the request id through every process.
pub const REQUEST_ID_HEADER: &str = "x-request-id";
/// Longest accepted request id, in bytes.
pub const MAX_REQUEST_ID_LEN: usize = 128;

/// How to sample, as sent to workers (validated by the router).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct SamplingSpec {
    /// 0 means greedy.
    pub temperature: f32,
    pub top_k: Option<u32>,
    pub top_p: f32,
    pub min_p: f32,
    pub presence_penalty: f32,
    pub frequency_penalty: f32,
    pub seed: u64,
    /// How many alternatives to report with each token (0 = none).
    pub top_logprobs: u32,
    /// Completion tokens to generate at most.
    pub max_tokens: u32,
    /// Keep generating past the model's end-of-sequence token.
    pub ignore_eos: bool,
    /// Extra token ids that end the sequence.
    pub stop_token_ids: Vec<u32>,
    /// How many of the prompt's last tokens this sequence generated itself
    /// before (a stream the router migrated): they count for the presence
    /// and frequency penalties as generated tokens. Sampling positions are
    /// absolute, so the continuation is the one an unbroken run samples.
    pub replayed_tokens: u32,
    /// Divides positive logits and multiplies negative ones of every token
    /// in the prompt or generated so far (1 = off; vLLM's
    /// `repetition_penalty`).
    pub repetition_penalty: f32,
    /// Added to the logits of these tokens before sampling (OpenAI's
    /// `logit_bias`, already range-checked).
    pub logit_bias: Vec<(u32, f32)>,
    /// The output must match this grammar (llguidance's Lark dialect; JSON
    /// schemas are embedded with `%json`). The worker that samples compiles
    /// it and masks the logits at every step.
    pub grammar: Option<String>,
    /// Also report the logprob of every prompt token after the first
    /// (completions' `echo` with `logprobs`), with `top_logprobs`
    /// alternatives each, in a `prompt_logprobs` event before the first
    /// token.
    pub prompt_logprobs: bool,
}

impl Default for SamplingSpec {
    fn default() -> Self {
        Self {
            temperature: 1.0,
            top_k: None,
            top_p: 1.0,
            min_p: 0.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            seed: 0,
            top_logprobs: 0,
            max_tokens: 16,
            ignore_eos: false,
            stop_token_ids: Vec::new(),
            replayed_tokens: 0,
            repetition_penalty: 1.0,
            logit_bias: Vec::new(),
            grammar: None,
            prompt_logprobs: false,
        }
    }
}

/// Where a decode worker gets a sequence's prompt KV from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "kind")]
pub enum KvSource {
    /// Prefill the prompt on the decode worker itself (aggregated serving).
    Local,
    /// A prefill worker streams the KV to this worker's ingest endpoint; the
    /// reservation is released if it has not fully arrived within `lease_ms`.
    Remote { lease_ms: u64 },
}

/// `POST /v1/internal/generate`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GenerateRequest {
    pub request_id: String,
    pub prompt_tokens: Vec<u32>,
    pub sampling: SamplingSpec,
    pub kv_source: KvSource,
}

/// Why a sequence ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// End-of-sequence or a stop token.
    Stop,
    /// `max_tokens` reached.
    Length,
}

/// One prompt token's logprob and its alternatives.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PromptLogprob {
    pub logprob: f32,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub top_logprobs: Vec<(u32, f32)>,
}

/// One line of the generate stream.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "event")]
pub enum GenerateEvent {
    /// KV capacity is reserved; for a remote source, the KV can be sent to
    /// `kv_url`. Every load report the worker numbers above `report_seq`
    /// counts this sequence.
    Reserved {
        kv_url: Option<String>,
        #[serde(default)]
        report_seq: u64,
        /// Leading prompt tokens the worker already holds (its prefix
        /// cache): they are not computed again.
        #[serde(default)]
        cached_tokens: u32,
    },
    /// The prompt's logprobs (when the spec asks for them): one entry per
    /// prompt token after the first, in order, each its logprob given the
    /// tokens before it and the most likely alternatives.
    PromptLogprobs { entries: Vec<PromptLogprob> },
    /// A generated token.
    Token {
        id: u32,
        logprob: f32,
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        top_logprobs: Vec<(u32, f32)>,
    },
    /// The sequence ended normally.
    Finished {
        reason: FinishReason,
        prompt_tokens: u32,
        completion_tokens: u32,
    },
    /// The sequence ended with an error.
    Error(ErrorBody),
}

/// `POST /v1/internal/prefill`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PrefillJob {
    pub request_id: String,
    pub prompt_tokens: Vec<u32>,
    pub sampling: SamplingSpec,
    /// The decode worker's KV ingest URL (from its `Reserved` event).
    pub kv_destination: String,
    /// The job fails (retryably) if the KV is not delivered within this time.
    pub deadline_ms: u64,
    /// Leading prompt tokens the decode worker already holds (its
    /// `Reserved` event's `cached_tokens`): the KV stream starts after them.
    #[serde(default)]
    pub cached_tokens: u32,
}

/// One line of a prefill job's answer (`application/x-ndjson`): `queued`
/// as soon as the job is accepted, then `done` or `error`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "event")]
pub enum PrefillEvent {
    /// The job is queued; every load report numbered above `report_seq`
    /// counts it.
    Queued { report_seq: u64 },
    /// The KV is delivered.
    Done(PrefillResult),
    /// The job failed after it was queued.
    Error(ErrorBody),
}

/// A prefill job's result, once the KV is delivered.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PrefillResult {
    pub request_id: String,
    pub prompt_tokens: u32,
    pub first_token: u32,
    pub queue_seconds: f64,
    pub compute_seconds: f64,
    pub transfer_bytes: u64,
}

/// `GET /load`: what the router balances and scales on.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct LoadReport {
    /// Requests waiting (not yet running).
    pub queued_requests: u64,
    /// Prompt tokens waiting to be prefilled.
    pub queued_tokens: u64,
    /// Sequences being decoded (or prefilled) now.
    pub active_sequences: u64,
    pub kv_used_tokens: u64,
    pub kv_free_tokens: u64,
    /// Tokens processed per second, recent average.
    pub tokens_per_second: f64,
    /// Ready to take work (model loaded, not draining).
    pub ready: bool,
    /// Increases with every report the worker builds: work the worker
    /// acknowledged at `report_seq = n` is counted by every report above n.
    #[serde(default)]
    pub report_seq: u64,
    /// The blocks the worker's prefix cache holds, when it has one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefix_cache: Option<PrefixDigest>,
}

/// The largest count a load report may carry: sums over many workers of
/// numbers this size cannot overflow.
pub const MAX_REPORTED: u64 = 1 << 48;

impl LoadReport {
    /// The report with every number clamped to what a worker can honestly
    /// report: counts to [`MAX_REPORTED`], throughput finite and at most
    /// 1e12 tokens a second. A buggy or hostile worker cannot overflow the
    /// router's sums or poison its scores.
    pub fn sanitized(mut self) -> Self {
        for n in [
            &mut self.queued_requests,
            &mut self.queued_tokens,
            &mut self.active_sequences,
            &mut self.kv_used_tokens,
            &mut self.kv_free_tokens,
        ] {
            *n = (*n).min(MAX_REPORTED);
        }
        let tps = self.tokens_per_second;
        self.tokens_per_second = if tps.is_finite() {
            tps.clamp(0.0, 1e12)
        } else {
            0.0
        };
        self
    }
}

/// A worker's KV cache, as its load report and metrics show it (built by
/// the engine, read by the worker layer; not itself sent).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct KvReport {
    /// Tokens of the blocks live sequences hold.
    pub used_tokens: u64,
    pub capacity_tokens: u64,
    pub blocks_used: u64,
    /// Cached blocks nobody holds (reclaimable).
    pub blocks_cached: u64,
    pub blocks_free: u64,
    /// Prompt tokens looked up in the prefix cache, and found.
    pub prefix_queried_tokens: u64,
    pub prefix_hit_tokens: u64,
    /// Cached blocks reclaimed for new work.
    pub evictions: u64,
}

impl KvReport {
    /// Tokens a new request can take: free and reclaimable blocks.
    pub fn free_tokens(&self) -> u64 {
        self.capacity_tokens.saturating_sub(self.used_tokens)
    }
}

/// The two worker pools.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Pool {
    Prefill,
    Decode,
}

/// `POST /v1/internal/workers/register` on the router, from a starting worker.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WorkerRegistration {
    pub pool: Pool,
    /// The worker's base URL as the router and peers reach it.
    pub url: String,
    /// Workers exchange KV only when their fingerprints match.
    pub model_fingerprint: u64,
    /// `q8_0`, `f32` or `native`.
    pub weights: String,
    /// The worker's identity across re-registrations: the router refuses an
    /// id it knows at another URL. Absent from older workers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub worker_id: Option<String>,
}

/// `GET /v1/internal/workers[?pool=decode]` on the router: the workers it
/// knows. A prefill worker checks KV destinations against the decode ones.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkerList {
    pub workers: Vec<WorkerListing>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkerListing {
    pub url: String,
    pub pool: Pool,
    /// `starting`, `ready`, `draining` or `down`.
    pub health: String,
}

/// `POST /v1/internal/workers/heartbeat` on the router, every few hundred ms.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Heartbeat {
    pub url: String,
    pub load: LoadReport,
}

/// `POST /v1/internal/workers/deregister` on the router, when a worker drains.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Deregistration {
    pub url: String,
}

/// Checks a request id: 1..=128 printable ASCII characters.
pub fn validate_request_id(id: &str) -> Result<(), ErrorBody> {
    let ok = !id.is_empty()
        && id.len() <= MAX_REQUEST_ID_LEN
        && id.bytes().all(|b| b.is_ascii_graphic());
    match ok {
        true => Ok(()),
        false => Err(ErrorBody::fatal(
            ErrorKind::InvalidRequestId,
            format!("request id must be 1..={MAX_REQUEST_ID_LEN} printable ASCII characters"),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_serialize_as_tagged_lines() {
        let e = GenerateEvent::Token {
            id: 5,
            logprob: -0.5,
            top_logprobs: vec![],
        };
        assert_eq!(
            serde_json::to_string(&e).unwrap(),
            r#"{"event":"token","id":5,"logprob":-0.5}"#
        );
        let e = GenerateEvent::Error(ErrorBody::retryable(ErrorKind::KvExhausted, "full"));
        let json = serde_json::to_string(&e).unwrap();
        assert_eq!(
            json,
            r#"{"event":"error","class":"retryable","kind":"kv_exhausted","message":"full"}"#
        );
        assert_eq!(serde_json::from_str::<GenerateEvent>(&json).unwrap(), e);
    }

    #[test]
    fn prefill_answers_are_tagged_lines() {
        let q = PrefillEvent::Queued { report_seq: 7 };
        let json = serde_json::to_string(&q).unwrap();
        assert_eq!(json, r#"{"event":"queued","report_seq":7}"#);
        let done = PrefillEvent::Done(PrefillResult {
            request_id: "r".into(),
            prompt_tokens: 3,
            first_token: 9,
            queue_seconds: 0.0,
            compute_seconds: 0.5,
            transfer_bytes: 10,
        });
        let json = serde_json::to_string(&done).unwrap();
        assert!(
            json.starts_with(r#"{"event":"done","request_id":"r""#),
            "{json}"
        );
        assert_eq!(serde_json::from_str::<PrefillEvent>(&json).unwrap(), done);
        // A reservation from an older worker, without report_seq, still reads.
        let old: GenerateEvent =
            serde_json::from_str(r#"{"event":"reserved","kv_url":null}"#).unwrap();
        assert_eq!(
            old,
            GenerateEvent::Reserved {
                kv_url: None,
                report_seq: 0,
                cached_tokens: 0
            }
        );
    }

    #[test]
    fn sampling_defaults_fill_missing_fields() {
        let s: SamplingSpec = serde_json::from_str(r#"{"temperature":0,"max_tokens":3}"#).unwrap();
        assert_eq!(s.temperature, 0.0);
        assert_eq!(s.max_tokens, 3);
        assert_eq!(s.top_p, 1.0);
        let src: KvSource = serde_json::from_str(r#"{"kind":"remote","lease_ms":500}"#).unwrap();
        assert_eq!(src, KvSource::Remote { lease_ms: 500 });
    }

    #[test]
    fn request_ids_are_validated() {
        assert!(validate_request_id("req-1").is_ok());
        assert!(validate_request_id("").is_err());
        assert!(validate_request_id("has space").is_err());
        assert!(validate_request_id(&"x".repeat(129)).is_err());
    }
}
