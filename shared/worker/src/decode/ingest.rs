//! `POST /v1/internal/kv/{request_id}`: a prefill worker streams a reserved
//! sequence's KV in the format of `pdserve_protocol::kvwire`. Every frame is
//! decoded and checked (header against the reservation, order, sizes,
//! CRCs) and imported as it arrives; the end frame hands the sequence, with
//! its first token, to the backend.

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::extract::{Path, State};
use axum::Json;
use bytes::Bytes;
use futures_util::StreamExt;
use pdserve_protocol::internal::{ErrorBody, ErrorKind, GenerateEvent};
use pdserve_protocol::kvwire::{
    self, ExpectedKv, KvDtype, KvEvent, KvLimits, KvStreamDecoder, LayerFrame,
};
use pdserve_text::Sampled;
use tokio::sync::mpsc;

use super::lease::{expired_error, Pending};
use super::{DecodeBackend, DecodeJob, DecodeServer, KvImport, KvRows};
use crate::http::ApiError;

/// `{"tokens": n, "bytes": n}` once the KV is in and the sequence admitted.
#[derive(serde::Serialize)]
pub struct IngestResult {
    pub tokens: u32,
    pub bytes: u64,
}

pub(super) async fn ingest<B: DecodeBackend>(
    State(server): State<Arc<DecodeServer<B>>>,
    Path(request_id): Path<String>,
    body: Body,
) -> Result<Json<IngestResult>, ApiError> {
    let Some(pending) = server.pending().remove(&request_id) else {
        return Err(ApiError(ErrorBody::fatal(
            ErrorKind::UnknownReservation,
            format!(
                "no KV reservation for request {request_id} (expired, cancelled or never made)"
            ),
        )));
    };
    let span = tracing::Span::current();
    span.record("request_id", request_id.as_str());
    let started = Instant::now();
    let Some((mut pending, received)) = receive(&server, &request_id, pending, body).await else {
        // The importer panicked: the reservation is gone with it.
        let msg = "the KV import failed";
        return Err(ApiError(ErrorBody::retryable(ErrorKind::EngineFailed, msg)));
    };
    match received {
        Ok((first, bytes)) => {
            server
                .metrics
                .kv_received(bytes, started.elapsed().as_secs_f64());
            let tokens = pending.prompt.len() as u32;
            span.record("pdserve.kv_bytes", bytes);
            admit(&server, request_id, pending, first)?;
            Ok(Json(IngestResult { tokens, bytes }))
        }
        Err(err) => {
            tracing::warn!(request_id = %request_id, "KV ingest failed: {err}");
            crate::trace::record_error(&span, &err.message);
            // Keep the reservation for a retry from another prefill worker,
            // until its lease ends (it may have ended during this ingest).
            pending.kv.reset();
            if pending.lease.expired() {
                let detail =
                    "the lease ended while a KV upload that then failed held the reservation";
                let _ = pending.events.send(expired_error(detail));
            } else if !pending.events.is_closed() {
                server.pending().insert(request_id, pending);
            }
            Err(ApiError(err))
        }
    }
}

/// Chunks read but not yet imported.
const CHUNK_BUFFER: usize = 4;

/// Reads the stream here, failing it after `--kv-idle-timeout-ms` without
/// a byte, and decodes and imports it on the blocking pool (converting KV
/// bytes is CPU work, kept off the async runtime). Gives the reservation
/// back with the first token and the bytes read, or the error; `None` if
/// the importer panicked.
async fn receive<B: DecodeBackend>(
    server: &DecodeServer<B>,
    request_id: &str,
    mut pending: Pending<B::Kv>,
    body: Body,
) -> Option<(Pending<B::Kv>, Result<(Sampled, u64), ErrorBody>)> {
    // The stream carries only what the reservation does not hold already.
    let span = (pending.kv.cached() as u32, pending.prompt.len() as u32);
    let expected = server.backend.kv_shape().expected(request_id, span);
    let (tx, rx) = mpsc::channel::<Bytes>(CHUNK_BUFFER);
    let call = tracing::Span::current();
    let importer = tokio::task::spawn_blocking(move || {
        let imported = import_stream(&mut pending, &expected, rx, &call);
        (pending, imported)
    });
    let read = forward(body, tx, server.net.kv_idle_timeout).await;
    let (pending, imported) = importer.await.ok()?;
    Some((pending, read.and(imported)))
}

/// Sends the body's chunks to the importer until it ends or the importer
/// stops taking them (it has the end frame, or it failed).
async fn forward(body: Body, tx: mpsc::Sender<Bytes>, idle: Duration) -> Result<(), ErrorBody> {
    let mut stream = body.into_data_stream();
    loop {
        let Ok(next) = tokio::time::timeout(idle, stream.next()).await else {
            let ms = idle.as_millis();
            let msg = format!("the KV upload sent nothing for {ms} ms");
            return Err(ErrorBody::retryable(ErrorKind::KvStreamBroken, msg));
        };
        let Some(chunk) = next else { return Ok(()) };
        let chunk =
            chunk.map_err(|e| ErrorBody::retryable(ErrorKind::KvStreamBroken, e.to_string()))?;
        if tx.send(chunk).await.is_err() {
            return Ok(());
        }
    }
}

/// Decodes and imports the chunks into `pending.kv` until the end frame;
/// returns the first token and the bytes read. A header's trace context
/// joins `call` (the `kv_receive` span) to the sender's trace.
fn import_stream<Kv: KvImport>(
    pending: &mut Pending<Kv>,
    expected: &ExpectedKv,
    mut chunks: mpsc::Receiver<Bytes>,
    call: &tracing::Span,
) -> Result<(Sampled, u64), ErrorBody> {
    let n_tokens = pending.prompt.len();
    let mut decoder = KvStreamDecoder::new(KvLimits::default());
    let (mut bytes, mut dtype) = (0u64, KvDtype::F32);
    while let Some(chunk) = chunks.blocking_recv() {
        bytes += chunk.len() as u64;
        for event in decoder.push(&chunk).map_err(ErrorBody::from)? {
            match event {
                KvEvent::Header(h) => {
                    if let Some(trace) = &h.trace {
                        crate::trace::adopt_kv_context(call, trace);
                    }
                    kvwire::validate_against(&h, expected).map_err(ErrorBody::from)?;
                    if h.n_tokens as usize != n_tokens {
                        let msg =
                            format!("KV for {} tokens, the prompt has {n_tokens}", h.n_tokens);
                        return Err(ErrorBody::fatal(ErrorKind::KvMismatch, msg));
                    }
                    dtype = h.dtype;
                }
                KvEvent::Layers(frame) => import(&mut pending.kv, dtype, &frame)?,
                KvEvent::End(t) => {
                    pending.kv.finish(&pending.prompt)?;
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
        ErrorKind::KvStreamTruncated,
        "the KV stream ended before its end frame",
    ))
}

/// Imports every layer of one frame.
fn import(kv: &mut impl KvImport, dtype: KvDtype, frame: &LayerFrame) -> Result<(), ErrorBody> {
    let (start, n) = (frame.token_start as usize, frame.token_count as usize);
    for layer in frame.layer_start..frame.layer_start + frame.layer_count {
        let (k, v) = frame.layer_kv(layer).ok_or_else(|| {
            let msg = format!("layer {layer} missing from its frame");
            ErrorBody::fatal(ErrorKind::KvBadFrame, msg)
        })?;
        let layer = layer as usize;
        kv.import(KvRows {
            layer,
            dtype,
            start,
            n,
            k,
            v,
        })?;
    }
    Ok(())
}

/// Hands the sequence to the engine. A refusal (a bad first token, a full
/// queue) also ends the client's stream with the error, so the router
/// retries or answers instead of seeing a stream that just stops.
fn admit<B: DecodeBackend>(
    server: &DecodeServer<B>,
    request_id: String,
    pending: Pending<B::Kv>,
    first: Sampled,
) -> Result<(), ApiError> {
    let (events, id) = (pending.events.clone(), request_id.clone());
    let refuse = |e: ErrorBody| {
        tracing::warn!(request_id = %id, "the sequence could not start after its KV arrived: {e}");
        let _ = events.send(GenerateEvent::Error(e.clone()));
        ApiError(e)
    };
    if first.token as usize >= server.backend.config().vocab_size {
        return Err(refuse(ErrorBody::fatal(
            ErrorKind::KvBadFirstToken,
            "the first token is outside the vocabulary",
        )));
    }
    let job = DecodeJob {
        request_id,
        prompt: pending.prompt,
        sampling: pending.sampling,
        kv: pending.kv,
        first: Some(first),
        events: pending.events,
    };
    server.backend.submit(job).map_err(refuse)
}
