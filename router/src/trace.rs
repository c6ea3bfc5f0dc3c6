//! The router's trace spans (docs/tracing.md): one `server` span per
//! request, named `{gen_ai.operation.name} {gen_ai.request.model}` after
//! the OpenTelemetry GenAI conventions, with a `client` span for each call
//! to a worker (`decode`, `prefill`) and a `migration` span around a
//! stream's move to another decode worker. Exported only with
//! `--otlp-endpoint`; the request span's `request_id` and `trace_id` are in
//! every log line inside it either way.

use axum::http::HeaderMap;
use pdserve_runtime::otel;
use tracing::field::Empty;
use tracing::Span;

use crate::params::Params;

/// The span of one request at the router; a caller's `traceparent` makes
/// it a child of the caller's span.
pub fn request_span(operation: &str, model: &str, request_id: &str, headers: &HeaderMap) -> Span {
    let span = tracing::info_span!(
        target: otel::TARGET,
        "request",
        otel.name = %format_args!("{operation} {model}"),
        otel.kind = "server",
        otel.status_code = Empty,
        otel.status_message = Empty,
        traceparent = otel::extract(headers),
        trace_id = Empty,
        request_id = %request_id,
        gen_ai.operation.name = operation,
        gen_ai.provider.name = "pdserve",
        gen_ai.request.model = %model,
        gen_ai.request.max_tokens = Empty,
        gen_ai.request.temperature = Empty,
        gen_ai.request.top_p = Empty,
        gen_ai.request.seed = Empty,
        gen_ai.request.choice.count = Empty,
        gen_ai.response.id = %request_id,
        gen_ai.response.model = %model,
        gen_ai.response.finish_reasons = Empty,
        gen_ai.usage.input_tokens = Empty,
        gen_ai.usage.output_tokens = Empty,
        pdserve.stream = Empty,
        pdserve.cached_tokens = Empty,
        error.type = Empty,
    );
    otel::tag_logs(&span);
    span
}

/// Records what the request asked for.
pub fn record_params(span: &Span, params: &Params) {
    if let Some(m) = params.max_tokens {
        span.record("gen_ai.request.max_tokens", m);
    }
    span.record(
        "gen_ai.request.temperature",
        f64::from(params.sampling.temperature),
    );
    span.record("gen_ai.request.top_p", f64::from(params.sampling.top_p));
    if params.seeded {
        span.record("gen_ai.request.seed", params.sampling.seed);
    }
    span.record("gen_ai.request.choice.count", params.n);
    span.record("pdserve.stream", params.stream);
}

/// Marks `span` failed with an error of kind `kind`.
pub fn record_error(span: &Span, kind: &str, message: &str) {
    span.record("otel.status_code", "error");
    span.record("otel.status_message", message);
    span.record("error.type", kind);
}

/// A call to a worker, a child of the current span; requests sent inside
/// it carry its `traceparent`.
pub fn worker_call(stage: &'static str, worker: &str) -> Span {
    tracing::info_span!(
        target: otel::TARGET,
        "worker call",
        otel.name = stage,
        otel.kind = "client",
        otel.status_code = Empty,
        otel.status_message = Empty,
        server.address = %worker,
        pdserve.attempt = Empty,
    )
}

/// A stream moving off a decode worker; the new attempt's calls are its children.
pub fn migration(reason: &str, left: &str, replayed: u32) -> Span {
    tracing::info_span!(
        target: otel::TARGET,
        "migration",
        pdserve.migration.reason = reason,
        pdserve.migration.left = %left,
        pdserve.migration.replayed_tokens = replayed,
        pdserve.migration.joined = Empty,
    )
}
