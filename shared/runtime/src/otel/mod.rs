//! OpenTelemetry traces over OTLP/HTTP (JSON), off unless
//! `--otlp-endpoint` is set.
//!
//! Every process makes its spans with target [`TARGET`]; the layer turns
//! them into OTLP spans and a thread sends them in batches. Processes join
//! one trace through the W3C `traceparent` header: the router's calls to
//! workers carry it, and so does a prefill worker's KV stream to a decode
//! worker. Span names and attributes follow the OpenTelemetry GenAI
//! conventions (`gen_ai.*`) plus pdserve's stages (docs/tracing.md).

mod context;
mod export;
mod layer;

use std::sync::OnceLock;
use std::time::{Duration, SystemTime};

use tracing::Span;
use tracing_subscriber::registry::LookupSpan;

pub use context::{SpanContext, TRACEPARENT};
pub use layer::{AttrValue, OtelLayer, SpanData, SpanKind};

/// The target of every span and span event that is exported.
pub const TARGET: &str = "pdserve::otel";

static EXPORTER: OnceLock<export::Exporter> = OnceLock::new();

/// The layer exporting to `endpoint` as `service` (`service.name`), and
/// the exporter behind it; once per process.
pub fn layer(endpoint: &str, service: &str) -> OtelLayer {
    let resource = vec![
        ("service.name".to_string(), AttrValue::from(service)),
        (
            "service.version".to_string(),
            AttrValue::from(env!("CARGO_PKG_VERSION")),
        ),
        (
            "process.pid".to_string(),
            AttrValue::from(u64::from(std::process::id())),
        ),
    ];
    let exporter = EXPORTER
        .get_or_init(|| export::Exporter::start(endpoint, resource))
        .clone();
    OtelLayer { exporter }
}

/// Whether spans are exported at all.
pub fn enabled() -> bool {
    EXPORTER.get().is_some()
}

/// Sends every finished span still queued, waiting at most `within`;
/// called as a process exits.
pub fn flush(within: Duration) {
    if let Some(e) = EXPORTER.get() {
        e.flush(within);
    }
}

/// The span's context, when it is exported (read in place: the span's
/// attributes and events are not copied).
pub fn context(span: &Span) -> Option<SpanContext> {
    span.with_subscriber(|(id, dispatch)| {
        let registry = dispatch.downcast_ref::<tracing_subscriber::Registry>()?;
        let span = registry.span(id)?;
        let ext = span.extensions();
        ext.get::<SpanData>().map(|d| d.ctx)
    })
    .flatten()
}

/// The `traceparent` value that makes a callee's spans children of `span`.
pub fn traceparent(span: &Span) -> Option<String> {
    context(span).map(|c| c.to_string())
}

/// Adds the current span's `traceparent` to an outgoing request.
pub fn inject(request: reqwest::RequestBuilder) -> reqwest::RequestBuilder {
    match traceparent(&Span::current()) {
        Some(tp) => request.header(TRACEPARENT, tp),
        None => request,
    }
}

/// The caller's `traceparent` header, if it sent one.
pub fn extract(headers: &axum::http::HeaderMap) -> Option<&str> {
    headers.get(TRACEPARENT).and_then(|v| v.to_str().ok())
}

/// Records the trace id in `span`'s `trace_id` field, so every log line
/// inside the span carries it.
pub fn tag_logs(span: &Span) {
    if let Some(c) = context(span) {
        span.record("trace_id", c.trace_hex());
    }
}

/// Adds a span event (`first_token`) to `span`.
pub fn event(span: &Span, name: &str) {
    tracing::info!(target: TARGET, parent: span, "{name}");
}

/// Exports a finished child of `parent` after the fact: a stage whose
/// times were measured elsewhere (an engine thread's queue wait and
/// compute).
pub fn emit(
    parent: &Span,
    name: &str,
    (start, end): (SystemTime, SystemTime),
    attrs: Vec<(&str, AttrValue)>,
) {
    let (Some(exporter), Some(p)) = (EXPORTER.get(), context(parent)) else {
        return;
    };
    if !p.sampled {
        return;
    }
    let span = SpanData {
        ctx: p.child(),
        parent: Some(p.span_id),
        name: name.to_string(),
        kind: SpanKind::Internal,
        start,
        attrs: attrs.into_iter().map(|(k, v)| (k.to_string(), v)).collect(),
        events: Vec::new(),
        error: None,
    };
    exporter.send(span.to_json(end));
}

/// The wall-clock time of `at`: converts an `Instant` measured
/// on this machine into a span timestamp.
pub fn wall_clock(at: std::time::Instant) -> SystemTime {
    SystemTime::now() - at.elapsed()
}
