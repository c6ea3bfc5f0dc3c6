//! A worker's trace spans (docs/tracing.md). Each internal call gets a
//! `server` span, a child of the caller's `traceparent`: `prefill` (a
//! prefill job), `decode` (a generate stream) and `kv_receive` (a KV
//! stream from a prefill worker). The span stays open while the response
//! body streams. Handlers add the request's id and token counts, and the
//! stages they time on engine threads (`queue`, `compute`).

use axum::body::Body;
use axum::extract::Request;
use axum::http::Method;
use axum::middleware::Next;
use axum::response::Response;
use futures_util::StreamExt;
use pdserve_protocol::kvwire::KvTraceContext;
use pdserve_runtime::otel::{self, SpanContext};
use tracing::field::Empty;
use tracing::{Instrument, Span};

/// The stage an internal call serves, or `None` for calls not traced.
fn stage(method: &Method, path: &str) -> Option<&'static str> {
    match (method, path) {
        (&Method::POST, "/v1/internal/prefill") => Some("prefill"),
        (&Method::POST, "/v1/internal/generate") => Some("decode"),
        (&Method::POST, p) if p.starts_with("/v1/internal/kv/") => Some("kv_receive"),
        _ => None,
    }
}

/// Middleware: runs the call inside its span.
pub async fn middleware(req: Request, next: Next) -> Response {
    let Some(stage) = stage(req.method(), req.uri().path()) else {
        return next.run(req).await;
    };
    let span = tracing::info_span!(
        target: otel::TARGET,
        "worker",
        otel.name = stage,
        otel.kind = "server",
        otel.status_code = Empty,
        otel.status_message = Empty,
        traceparent = otel::extract(req.headers()),
        trace_id = Empty,
        request_id = Empty,
        gen_ai.usage.input_tokens = Empty,
        gen_ai.usage.output_tokens = Empty,
        pdserve.cached_tokens = Empty,
        pdserve.kv_bytes = Empty,
        http.response.status_code = Empty,
    );
    otel::tag_logs(&span);
    let resp = next.run(req).instrument(span.clone()).await;
    let status = resp.status();
    span.record("http.response.status_code", status.as_u16());
    if !status.is_success() {
        span.record("otel.status_code", "error");
    }
    if !otel::enabled() {
        return resp;
    }
    // The span ends when the body does (a stream's last line).
    let (parts, body) = resp.into_parts();
    let body = body.into_data_stream().map(move |chunk| {
        let _open = &span;
        chunk
    });
    Response::from_parts(parts, Body::from_stream(body))
}

/// Records a job's id and prompt on the current call's span.
pub fn record_job(request_id: &str, prompt_tokens: usize, cached_tokens: u32) {
    let span = Span::current();
    span.record("request_id", request_id);
    span.record("gen_ai.usage.input_tokens", prompt_tokens as u64);
    span.record("pdserve.cached_tokens", cached_tokens);
}

/// Marks the current call's span failed.
pub fn record_error(span: &Span, message: &str) {
    span.record("otel.status_code", "error");
    span.record("otel.status_message", message);
}

/// A prefill worker's upload of a job's KV: a `client` span whose
/// `traceparent` the KV stream's request carries.
pub fn kv_transfer(url: &str) -> Span {
    tracing::info_span!(
        target: otel::TARGET,
        "kv_transfer",
        otel.kind = "client",
        otel.status_code = Empty,
        otel.status_message = Empty,
        server.address = %url,
    )
}

/// `span`'s context as a KV stream's header frame carries it, when `span`
/// is exported.
pub fn kv_context(span: &Span) -> Option<KvTraceContext> {
    otel::context(span).map(|c| KvTraceContext {
        trace_id: c.trace_id,
        span_id: c.span_id,
        trace_flags: u8::from(c.sampled),
    })
}

/// Joins a `kv_receive` span to the sender's trace from the stream's header
/// frame, when the HTTP request carried no `traceparent`; a span that has
/// its caller already keeps it.
pub fn adopt_kv_context(span: &Span, trace: &KvTraceContext) {
    let sender = SpanContext {
        trace_id: trace.trace_id,
        span_id: trace.span_id,
        sampled: trace.trace_flags & 1 == 1,
    };
    let before = otel::context(span).map(|c| c.trace_id);
    span.record("traceparent", sender.to_string().as_str());
    if otel::context(span).map(|c| c.trace_id) != before {
        otel::tag_logs(span);
    }
}
