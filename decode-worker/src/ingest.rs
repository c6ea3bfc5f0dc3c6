//! KV ingest: a prefill worker streams a reserved sequence's KV here
//! (`POST /v1/internal/kv/{request_id}`, the binary format of
//! `pdserve_protocol::kvwire`). Each layer frame is imported as it arrives;
//! the end frame hands the sequence, with its first token, to the engine.

use std::sync::Arc;
use std::time::Instant;

use axum::body::Body;
use axum::extract::{Path, State};
use axum::Json;
use futures_util::StreamExt;
use pdserve_engine::KvDtype;
use pdserve_protocol::internal::{ErrorBody, GenerateEvent};
use pdserve_protocol::kvwire::{self, ExpectedKv, KvEvent, KvLimits, KvStreamDecoder};
use pdserve_runtime::http::ApiError;

use crate::engine::{FirstToken, Job, Start};
use crate::state::{AppState, Pending};

/// `{"tokens": n, "bytes": n}` once the KV is in and the sequence admitted.
#[derive(serde::Serialize)]
pub struct IngestResult {
    pub tokens: u32,
    pub bytes: u64,
}

pub async fn ingest(
    State(state): State<Arc<AppState>>,
    Path(request_id): Path<String>,
    body: Body,
) -> Result<Json<IngestResult>, ApiError> {
    let Some(mut pending) = state.pending().remove(&request_id) else {
        return Err(ApiError(ErrorBody::fatal(
            "unknown_reservation",
            format!(
                "no KV reservation for request {request_id} (expired, cancelled or never made)"
            ),
        )));
    };
    let started = Instant::now();
    match receive(&state, &request_id, &mut pending, body).await {
        Ok((first, bytes)) => {
            let tokens = pending.prompt.len() as u32;
            record_transfer(&state, bytes, started.elapsed().as_secs_f64());
            admit(&state, request_id, pending, first)?;
            Ok(Json(IngestResult { tokens, bytes }))
        }
        Err(err) => {
            tracing::warn!(request_id = %request_id, "KV ingest failed: {err}");
            // Keep the reservation for a retry from another prefill worker,
            // until its lease ends (it may have ended during this ingest).
            pending.kv.truncate(0);
            let expired = tokio::time::Instant::now() >= pending.lease_until;
            if expired {
                let _ = pending
                    .events
                    .send(GenerateEvent::Error(ErrorBody::retryable(
                        "kv_lease_expired",
                        "the lease ended while a failed KV upload held the reservation",
                    )));
            } else if !pending.events.is_closed() {
                state.pending().insert(request_id, pending);
            }
            Err(ApiError(err))
        }
    }
}

fn record_transfer(state: &AppState, bytes: u64, secs: f64) {
    state.metrics.kv_transfer_bytes.inc_by(bytes);
    state.metrics.kv_transfer_seconds.observe(secs);
}

/// Reads the whole stream into `pending.kv`; returns the first token and the bytes read.
async fn receive(
    state: &AppState,
    request_id: &str,
    pending: &mut Pending,
    body: Body,
) -> Result<(FirstToken, u64), ErrorBody> {
    let model = &state.model;
    let layout = model.kv_layout();
    let expected = ExpectedKv {
        request_id: request_id.to_string(),
        model_fingerprint: model.fingerprint(),
        n_layers: layout.n_layers as u32,
        n_kv_heads: layout.n_kv_heads as u32,
        head_dim: layout.head_dim as u32,
        max_tokens: pending.prompt.len() as u32,
    };
    let mut decoder = KvStreamDecoder::new(KvLimits::default());
    let mut stream = body.into_data_stream();
    let (mut bytes, mut dtype) = (0u64, KvDtype::F32);
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.map_err(|e| ErrorBody::retryable("kv_stream_broken", e.to_string()))?;
        bytes += chunk.len() as u64;
        let events = decoder.push(&chunk).map_err(ErrorBody::from)?;
        for event in events {
            match event {
                KvEvent::Header(h) => {
                    kvwire::validate_against(&h, &expected).map_err(ErrorBody::from)?;
                    if h.n_tokens as usize != pending.prompt.len() {
                        return Err(ErrorBody::fatal(
                            "kv_mismatch",
                            format!(
                                "KV for {} tokens, the prompt has {}",
                                h.n_tokens,
                                pending.prompt.len()
                            ),
                        ));
                    }
                    dtype = h.dtype.into();
                }
                KvEvent::Layers(frame) => {
                    for layer in frame.layer_start..frame.layer_start + frame.layer_count {
                        let (k, v) = frame.layer_kv(layer).ok_or_else(|| {
                            ErrorBody::fatal(
                                "kv_bad_frame",
                                format!("layer {layer} missing from its frame"),
                            )
                        })?;
                        let layer = layer as usize;
                        let (start, n) = (frame.token_start as usize, frame.token_count as usize);
                        pending
                            .kv
                            .import_rows(layer, dtype, start, n, k, v)
                            .map_err(|e| ErrorBody::fatal(e.kind(), e.to_string()))?;
                    }
                }
                KvEvent::End(t) => {
                    pending
                        .kv
                        .finish_import(pending.prompt.len())
                        .map_err(|e| ErrorBody::fatal(e.kind(), e.to_string()))?;
                    let first = FirstToken {
                        id: t.first_token,
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
    state: &AppState,
    request_id: String,
    pending: Pending,
    first: FirstToken,
) -> Result<(), ApiError> {
    if first.id as usize >= state.model.config().vocab_size {
        return Err(ApiError(ErrorBody::fatal(
            "kv_bad_first_token",
            "the first token is outside the vocabulary",
        )));
    }
    let job = Job {
        request_id,
        prompt: pending.prompt,
        sampling: pending.sampling,
        kv: pending.kv,
        start: Start::Imported(first),
        events: pending.events,
    };
    state.engine.submit(job).map_err(ApiError)
}
