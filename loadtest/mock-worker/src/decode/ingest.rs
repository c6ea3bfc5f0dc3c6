//! `POST /v1/internal/kv/{request_id}`: a prefill worker streams a reserved
//! sequence's KV in the real wire format. Every frame is decoded and checked
//! (header against the reservation, ordering, sizes, CRCs); the bytes are
//! then dropped. The end frame hands the sequence, with its first token, to
//! the batcher.

use std::sync::Arc;
use std::time::Instant;

use axum::body::Body;
use axum::extract::{Path, State};
use axum::Json;
use futures_util::StreamExt;
use pdserve_protocol::internal::{ErrorBody, GenerateEvent};
use pdserve_protocol::kvwire::{self, KvEvent, KvLimits, KvStreamDecoder};
use pdserve_runtime::http::ApiError;

use super::batcher::Job;
use super::{DecodeState, Pending};
use crate::tokens::Sampled;

/// `{"tokens": n, "bytes": n}` once the KV is in and the sequence admitted.
#[derive(serde::Serialize)]
pub struct IngestResult {
    pub tokens: u32,
    pub bytes: u64,
}

pub async fn ingest(
    State(state): State<Arc<DecodeState>>,
    Path(request_id): Path<String>,
    body: Body,
) -> Result<Json<IngestResult>, ApiError> {
    let Some(pending) = state.pending().remove(&request_id) else {
        return Err(ApiError(ErrorBody::fatal(
            "unknown_reservation",
            format!(
                "no KV reservation for request {request_id} (expired, cancelled or never made)"
            ),
        )));
    };
    let started = Instant::now();
    match receive(&state, &request_id, &pending, body).await {
        Ok((first, bytes)) => {
            let m = &state.metrics.common;
            m.kv_transfer_bytes.inc_by(bytes);
            m.kv_transfer_seconds
                .observe(started.elapsed().as_secs_f64());
            let tokens = pending.prompt_len;
            admit(&state, request_id, pending, first)?;
            Ok(Json(IngestResult { tokens, bytes }))
        }
        Err(err) => {
            tracing::warn!(request_id = %request_id, "KV ingest failed: {err}");
            // Keep the reservation for a retry from another prefill worker,
            // unless its lease ran out while this stream held it.
            if pending.lease.task.is_finished() {
                let _ = pending
                    .events
                    .send(GenerateEvent::Error(ErrorBody::retryable(
                        "kv_lease_expired",
                        "the lease ended while a KV stream that then failed was arriving",
                    )));
            } else if !pending.events.is_closed() {
                state.pending().insert(request_id, pending);
            }
            Err(ApiError(err))
        }
    }
}

/// Reads and checks the whole stream; returns the first token and the bytes read.
async fn receive(
    state: &DecodeState,
    request_id: &str,
    pending: &Pending,
    body: Body,
) -> Result<(Sampled, u64), ErrorBody> {
    let expected = state.shape.expected(request_id, pending.prompt_len);
    let mut decoder = KvStreamDecoder::new(KvLimits::default());
    let mut stream = body.into_data_stream();
    let mut bytes = 0u64;
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.map_err(|e| ErrorBody::retryable("kv_stream_broken", e.to_string()))?;
        bytes += chunk.len() as u64;
        for event in decoder.push(&chunk).map_err(ErrorBody::from)? {
            match event {
                KvEvent::Header(h) => {
                    kvwire::validate_against(&h, &expected).map_err(ErrorBody::from)?;
                    if h.n_tokens != pending.prompt_len {
                        return Err(ErrorBody::fatal(
                            "kv_mismatch",
                            format!(
                                "KV for {} tokens, the prompt has {}",
                                h.n_tokens, pending.prompt_len
                            ),
                        ));
                    }
                }
                // The decoder has checked the frame's place and size; a mock keeps no KV.
                KvEvent::Layers(_) => {}
                KvEvent::End(t) => {
                    let first = Sampled {
                        token: t.first_token,
                        logprob: t.first_logprob,
                        top_logprobs: t.top_logprobs,
                    };
                    return Ok((first, bytes));
                }
            }
        }
    }
    decoder.finish().map_err(ErrorBody::from)?;
    Err(ErrorBody::retryable(
        "kv_stream_truncated",
        "the KV stream ended before its end frame",
    ))
}

fn admit(
    state: &DecodeState,
    request_id: String,
    pending: Pending,
    first: Sampled,
) -> Result<(), ApiError> {
    if first.token >= state.shape.vocab {
        return Err(ApiError(ErrorBody::fatal(
            "kv_bad_first_token",
            "the first token is outside the vocabulary",
        )));
    }
    let job = Job {
        request_id,
        prompt_len: pending.prompt_len,
        sampling: pending.sampling,
        first: Some(first),
        events: pending.events,
        kv: pending.kv,
    };
    state.batcher.submit(job).map_err(ApiError)
}
