//! `POST /v1/internal/prefill` and its `DELETE`.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::extract::rejection::JsonRejection;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::Response;
use axum::Json;
use futures_util::stream::{self, StreamExt};
use pdserve_protocol::internal::{ErrorBody, ErrorKind, PrefillEvent, PrefillJob, PrefillResult};
use tokio::sync::oneshot;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use super::frames::{self, FrameReceiver};
use super::{cancelled, Computed, PrefillBackend, PrefillServer, PrefillTask};
use crate::http::{json_body, ndjson, ApiError};
use crate::upload::upload;

/// A job as the server tracks it, for `DELETE` and the drain.
pub(super) struct Tracked {
    cancel: CancellationToken,
    /// Set once the engine sends the job's first KV frame.
    started: Arc<AtomicBool>,
    handed_back: Arc<AtomicBool>,
}

impl Tracked {
    /// Returns a job the engine has not started to the router (cancelling
    /// it here); true if it was still queued.
    pub(super) fn hand_back(&self) -> bool {
        if self.started.load(Ordering::Acquire) {
            return false;
        }
        self.handed_back.store(true, Ordering::Release);
        self.cancel.cancel();
        true
    }
}

/// Cancels the job when the handler ends for any reason, including the
/// router dropping the request; the engine stops after the current layer.
struct JobGuard<B: PrefillBackend> {
    server: Arc<PrefillServer<B>>,
    id: String,
    cancel: CancellationToken,
    handed_back: Arc<AtomicBool>,
}

impl<B: PrefillBackend> JobGuard<B> {
    /// Registers a job (for `DELETE` and the drain), refusing an id already
    /// in progress.
    fn track(
        server: &Arc<PrefillServer<B>>,
        id: &str,
        started: Arc<AtomicBool>,
    ) -> Result<Self, ApiError> {
        let cancel = CancellationToken::new();
        let handed_back = Arc::new(AtomicBool::new(false));
        let mut jobs = server.jobs();
        if jobs.contains_key(id) {
            let msg = "a job with this id is in progress";
            return Err(ApiError(ErrorBody::fatal(
                ErrorKind::DuplicateRequestId,
                msg,
            )));
        }
        let tracked = Tracked {
            cancel: cancel.clone(),
            started,
            handed_back: handed_back.clone(),
        };
        jobs.insert(id.to_string(), tracked);
        Ok(Self {
            server: server.clone(),
            id: id.to_string(),
            cancel,
            handed_back,
        })
    }

    /// Why the job ended early: a drain handed it back (retryable), or its
    /// caller cancelled it.
    fn cancelled(&self) -> ErrorBody {
        match self.handed_back.load(Ordering::Acquire) {
            true => ErrorBody::retryable(
                ErrorKind::NotReady,
                "the prefill worker is draining: the job was returned before it started",
            ),
            false => cancelled(),
        }
    }
}

impl<B: PrefillBackend> Drop for JobGuard<B> {
    fn drop(&mut self) {
        self.cancel.cancel();
        self.server.jobs().remove(&self.id);
    }
}

/// `POST /v1/internal/prefill`: validate and queue the job, answer
/// `queued` at once, then `done` once the KV is delivered (or `error`). The
/// job is cancelled when the caller goes away.
pub(super) async fn prefill<B: PrefillBackend>(
    State(server): State<Arc<PrefillServer<B>>>,
    body: Result<Json<PrefillJob>, JsonRejection>,
) -> Result<Response, ApiError> {
    let mut job = json_body(body)?;
    server.readiness.admit()?;
    crate::validate::prefill(server.backend.config(), &job)?;
    let net = &server.net;
    net.destinations
        .check(&job.kv_destination, &job.request_id)
        .await?;
    crate::trace::record_job(&job.request_id, job.prompt_tokens.len(), job.cached_tokens);
    let span = tracing::Span::current();
    let (frames_tx, frames_rx) = frames::channel(net.upload_buffer_bytes);
    let guard = JobGuard::track(&server, &job.request_id, frames_rx.started())?;
    let (reply_tx, reply_rx) = oneshot::channel();
    // The router's deadline, capped by this worker's own.
    let deadline = Duration::from_millis(job.deadline_ms.max(1)).min(net.max_job);
    job.deadline_ms = deadline.as_millis() as u64;
    let (id, tokens, url) = (
        job.request_id.clone(),
        job.prompt_tokens.len() as u32,
        job.kv_destination.clone(),
    );
    let enqueued = Instant::now();
    let task = PrefillTask {
        job,
        enqueued,
        cancel: guard.cancel.clone(),
        frames: frames_tx,
        reply: reply_tx,
    };
    server.backend.submit(task)?;
    let queued = PrefillEvent::Queued {
        report_seq: server.backend.stats().acknowledge(),
    };
    let outcome = async move {
        let work = deliver(&server, &url, frames_rx, reply_rx);
        let result = until_deadline_or_cancel(work, deadline, &guard.cancel).await;
        let result = result.map_err(|e| match e.kind == ErrorKind::Cancelled {
            true => guard.cancelled(),
            false => e,
        });
        drop(guard);
        server.metrics.finished(result.is_ok());
        match result {
            Ok(c) => {
                emit_stages(&tracing::Span::current(), enqueued, &c);
                PrefillEvent::Done(PrefillResult {
                    request_id: id,
                    prompt_tokens: tokens,
                    first_token: c.first_token,
                    queue_seconds: c.queue_seconds,
                    compute_seconds: c.compute_seconds,
                    transfer_bytes: c.bytes,
                })
            }
            Err(e) => {
                tracing::warn!(request_id = %id, "prefill failed: {e}");
                crate::trace::record_error(&tracing::Span::current(), &e.message);
                PrefillEvent::Error(e)
            }
        }
    }
    .instrument(span);
    let events = stream::once(std::future::ready(queued)).chain(stream::once(outcome));
    Ok(ndjson(events))
}

/// The job's `queue` and `compute` spans, timed on the engine's thread.
fn emit_stages(span: &tracing::Span, enqueued: Instant, c: &Computed) {
    use pdserve_runtime::otel;
    let secs = std::time::Duration::from_secs_f64;
    let end = otel::wall_clock(c.finished_at.into_std());
    let compute_start = end - secs(c.compute_seconds.max(0.0));
    let queued = otel::wall_clock(enqueued.into_std());
    let queue_end = queued + secs(c.queue_seconds.max(0.0));
    otel::emit(span, "queue", (queued, queue_end), Vec::new());
    let bytes = vec![("pdserve.kv_bytes", c.bytes.into())];
    otel::emit(span, "compute", (compute_start, end), bytes);
}

/// `work`, unless the deadline passes or the job is cancelled first. A
/// cancel stops the upload too (dropping it aborts the stream, so the
/// decode worker never commits the KV), unless the KV was delivered first.
async fn until_deadline_or_cancel(
    work: impl std::future::Future<Output = Result<Computed, ErrorBody>>,
    deadline: Duration,
    cancel: &CancellationToken,
) -> Result<Computed, ErrorBody> {
    tokio::select! {
        biased;
        r = tokio::time::timeout(deadline, work) => r.unwrap_or_else(|_| Err(ErrorBody::retryable(
            ErrorKind::DeadlineExceeded,
            format!("KV not delivered within {} ms", deadline.as_millis()),
        ))),
        _ = cancel.cancelled() => Err(cancelled()),
    }
}

/// Uploads the frames while the engine produces them; done when both are.
async fn deliver<B: PrefillBackend>(
    server: &PrefillServer<B>,
    url: &str,
    frames: FrameReceiver,
    reply: oneshot::Receiver<Result<Computed, ErrorBody>>,
) -> Result<Computed, ErrorBody> {
    let upload_started = Instant::now();
    let span = crate::trace::kv_transfer(url);
    let uploading = async {
        let sent = upload(&server.client, url, frames, server.net.kv_trace_context).await;
        if let Err(e) = &sent {
            crate::trace::record_error(&tracing::Span::current(), &e.message);
        }
        Ok::<_, ErrorBody>((Instant::now(), sent?))
    }
    .instrument(span);
    let (computed, uploaded) = tokio::join!(reply, uploading);
    let computed = computed.map_err(|_| {
        ErrorBody::retryable(ErrorKind::EngineStopped, "the prefill engine stopped")
    })?;
    let (mut computed, (acked, added)) = match (computed, uploaded) {
        (Ok(c), Ok(done)) => (c, done),
        // The engine stopped because the upload did: the upload's error
        // says why (the decode worker's own answer, when it refused).
        (Err(e), Err(upload)) if e.kind == ErrorKind::KvUploadFailed => return Err(upload),
        (Err(e), _) | (Ok(_), Err(e)) => return Err(e),
    };
    // The header's trace context is sent too: count it as the decode
    // worker does.
    computed.bytes += added;
    let m = &server.metrics;
    m.kv_transfer_bytes.inc_by(added);
    m.kv_transfer_seconds
        .observe((acked - upload_started).as_secs_f64());
    let tail = acked.saturating_duration_since(computed.finished_at);
    m.transfer_tail_seconds.observe(tail.as_secs_f64());
    Ok(computed)
}

/// `DELETE /v1/internal/prefill/{request_id}`: 200, or 404 for an unknown job.
pub(super) async fn cancel<B: PrefillBackend>(
    State(server): State<Arc<PrefillServer<B>>>,
    Path(id): Path<String>,
) -> StatusCode {
    match server.jobs().get(&id) {
        Some(job) => {
            job.cancel.cancel();
            StatusCode::OK
        }
        None => StatusCode::NOT_FOUND,
    }
}
