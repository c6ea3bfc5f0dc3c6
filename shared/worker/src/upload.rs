//! A prefill worker's side of the KV stream: frames, as they are produced,
//! go to the decode worker's ingest URL in one streamed POST.

use axum::http::header;
use bytes::Bytes;
use futures_util::StreamExt;
use pdserve_protocol::internal::{ErrorBody, ErrorKind};
use pdserve_protocol::kvwire;

use crate::prefill::frames::FrameReceiver;

/// The engine's header frame with the current span (the job's
/// `kv_transfer`) as its trace context, so the decode worker's spans join
/// the job's trace from the stream itself. Unchanged when nothing is
/// traced, so an untraced stream is what it was before the flag existed.
fn with_span_context(frame: Bytes) -> Bytes {
    let Some(trace) = crate::trace::kv_context(&tracing::Span::current()) else {
        return frame;
    };
    match kvwire::with_trace(&frame, trace) {
        Ok(stamped) => stamped.into(),
        // Not a header the decoder would take either: it says why.
        Err(_) => frame,
    }
}

/// What [`upload`] sent beyond the engine's frames: the trace context it
/// added to the header, in bytes.
pub type AddedBytes = u64;

/// Streams `frames` to `url` until the sender side closes; the decode
/// worker's error, when it refuses the stream, is returned as it sent it.
/// With `trace_context`, the header frame carries the current span's trace
/// context (docs/tracing.md); the bytes that adds are returned.
/// The POST starts with the first frame, once the engine has started the
/// job: a job waiting in the queue holds no connection that the decode
/// worker would see as a silent upload (`--kv-idle-timeout-ms`).
pub async fn upload(
    client: &reqwest::Client,
    url: &str,
    mut frames: FrameReceiver,
    trace_context: bool,
) -> Result<AddedBytes, ErrorBody> {
    let Some(first) = frames.recv().await else {
        return Err(ErrorBody::retryable(
            ErrorKind::KvUploadFailed,
            "the job ended before its first KV frame",
        ));
    };
    let engine_len = first.len();
    let first = match trace_context {
        true => with_span_context(first),
        false => first,
    };
    let added = first.len().saturating_sub(engine_len) as u64;
    let rest = futures_util::stream::poll_fn(move |cx| frames.poll_recv(cx));
    let stream = futures_util::stream::once(std::future::ready(first))
        .chain(rest)
        .map(Ok::<_, std::io::Error>);
    let request = client
        .post(url)
        .header(header::CONTENT_TYPE, "application/octet-stream");
    // The request's header joins the decode worker's spans to this job's
    // too, for whatever sees the HTTP request before the stream is decoded.
    let resp = pdserve_runtime::otel::inject(request)
        .body(reqwest::Body::wrap_stream(stream))
        .send()
        .await
        .map_err(|e| {
            ErrorBody::retryable(
                ErrorKind::KvUploadFailed,
                format!("sending KV to {url}: {e}"),
            )
        })?;
    if resp.status().is_success() {
        return Ok(added);
    }
    let status = resp.status();
    match resp.json::<ErrorBody>().await {
        Ok(body) => Err(body),
        Err(_) => Err(ErrorBody::retryable(
            ErrorKind::KvUploadFailed,
            format!("the decode worker answered {status}"),
        )),
    }
}
