//! Logging and tracing setup, shared by every binary.

use clap::Args;

use tracing::field::{Field, Visit};
use tracing_subscriber::field::RecordFields;
use tracing_subscriber::filter::{filter_fn, EnvFilter, FilterExt, LevelFilter, Targets};
use tracing_subscriber::fmt::format::Writer;
use tracing_subscriber::fmt::{FormatFields, FormattedFields};
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{Layer, Registry};

use crate::otel;

/// Logging and tracing flags, flattened into each binary's arguments.
#[derive(Args, Debug, Clone)]
pub struct TelemetryArgs {
    /// Log filter, in `RUST_LOG` syntax.
    #[arg(long, env = "PDSERVE_LOG", default_value = "info")]
    pub log: String,
    /// Log one JSON object per line instead of text.
    #[arg(long, env = "PDSERVE_LOG_JSON")]
    pub log_json: bool,
    /// Export OpenTelemetry traces to this OTLP/HTTP collector (JSON
    /// encoding), e.g. `http://otel-collector:4318`; `/v1/traces` is
    /// appended unless given. Off when unset.
    #[arg(long, env = "PDSERVE_OTLP_ENDPOINT")]
    pub otlp_endpoint: Option<String>,
    /// The `service.name` of this process's spans (default: the binary's
    /// role, e.g. `pdserve-router`).
    #[arg(long, env = "PDSERVE_OTLP_SERVICE_NAME")]
    pub otlp_service_name: Option<String>,
}

/// Installs the global subscriber (a second call is a no-op): logs to
/// stderr, and spans to the collector when `--otlp-endpoint` is set.
/// `service` names the process in its spans unless `--otlp-service-name`
/// does.
pub fn init(args: &TelemetryArgs, service: &str) {
    let _ = tracing_subscriber::registry()
        .with(layers(args, service))
        .try_init();
}

type Layers = Vec<Box<dyn Layer<Registry> + Send + Sync>>;

/// The log layer, and the trace layer when tracing is on. Each filters
/// alone, and a callsite no layer wants (h2's and hyper's per-frame
/// `trace` spans, say) is disabled outright: every layer's filter carries a
/// level hint, and an absent trace layer is left out, not a `None` (which
/// tracing-subscriber treats as enabling everything).
fn layers(args: &TelemetryArgs, service: &str) -> Layers {
    let filter = EnvFilter::try_new(&args.log).unwrap_or_else(|_| EnvFilter::new("info"));
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let fmt = tracing_subscriber::fmt::layer()
        .with_target(false)
        .with_ansi(ansi)
        .with_writer(std::io::stderr);
    let fmt = match args.log_json {
        true => fmt.json().boxed(),
        false => fmt.fmt_fields(LogFields).boxed(),
    };
    // Span events (`first_token`) are for traces only.
    let not_span_events = filter_fn(|m| !(m.is_event() && m.target() == otel::TARGET))
        .with_max_level_hint(LevelFilter::TRACE);
    let mut layers: Layers = vec![fmt.with_filter(filter.and(not_span_events)).boxed()];
    // Trace spans are made whatever the log level.
    if let Some(endpoint) = args.otlp_endpoint.as_deref() {
        let name = args.otlp_service_name.as_deref().unwrap_or(service);
        let spans = Targets::new().with_target(otel::TARGET, tracing::Level::TRACE);
        layers.push(otel::layer(endpoint, name).with_filter(spans).boxed());
    }
    layers
}

/// Text logs: a trace span's fields are its exported attributes; a log line
/// inside it shows only its `request_id` and `trace_id`.
struct LogFields;

/// Fields only the trace wants (`otel.kind`, `gen_ai.usage.input_tokens`, ...).
fn trace_only(name: &str) -> bool {
    name == "traceparent" || name.contains('.')
}

struct LogVisitor<'a> {
    out: Writer<'a>,
    first: bool,
    result: std::fmt::Result,
}

impl Visit for LogVisitor<'_> {
    fn record_str(&mut self, f: &Field, v: &str) {
        self.record_debug(f, &format_args!("{v}"))
    }

    fn record_debug(&mut self, f: &Field, v: &dyn std::fmt::Debug) {
        if self.result.is_err() || trace_only(f.name()) {
            return;
        }
        let sep = if std::mem::replace(&mut self.first, false) {
            ""
        } else {
            " "
        };
        self.result = match f.name() {
            "message" => write!(self.out, "{sep}{v:?}"),
            name => write!(self.out, "{sep}{name}={v:?}"),
        };
    }
}

impl<'w> FormatFields<'w> for LogFields {
    fn format_fields<R: RecordFields>(&self, out: Writer<'w>, fields: R) -> std::fmt::Result {
        let mut v = LogVisitor {
            out,
            first: true,
            result: Ok(()),
        };
        fields.record(&mut v);
        v.result
    }

    fn add_fields(
        &self,
        current: &'w mut FormattedFields<Self>,
        fields: &tracing::span::Record<'_>,
    ) -> std::fmt::Result {
        let mut more = String::new();
        self.format_fields(Writer::new(&mut more), fields)?;
        // A span that joined its caller's trace late (a KV stream's header
        // frame) records `trace_id` again: the new one replaces the old.
        if let Some(id) = more.strip_prefix("trace_id=") {
            if let Some(old) = field_value(&current.fields, "trace_id=") {
                current.fields.replace_range(old, id);
                return Ok(());
            }
        }
        if !more.is_empty() {
            if !current.fields.is_empty() {
                current.fields.push(' ');
            }
            current.fields.push_str(&more);
        }
        Ok(())
    }
}

/// Where `key` (`name=`) starts a field of a formatted line, the range of
/// its value (up to the next space).
fn field_value(line: &str, key: &str) -> Option<std::ops::Range<usize>> {
    let at = line
        .match_indices(key)
        .map(|(i, _)| i)
        .find(|&i| i == 0 || line.as_bytes()[i - 1] == b' ')?;
    let start = at + key.len();
    let end = line[start..].find(' ').map_or(line.len(), |e| start + e);
    Some(start..end)
}

#[cfg(test)]
mod tests {
    use super::*;
    use tracing_subscriber::layer::SubscriberExt;

    fn args(log: &str, otlp: Option<&str>) -> TelemetryArgs {
        TelemetryArgs {
            log: log.into(),
            log_json: false,
            otlp_endpoint: otlp.map(str::to_string),
            otlp_service_name: None,
        }
    }

    /// Spans below the log level (h2 makes one per frame) cost nothing:
    /// they are disabled, not made and then ignored by every layer.
    /// A shared buffer the text log layer writes into.
    #[derive(Clone, Default)]
    struct Buf(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);

    impl std::io::Write for Buf {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn a_trace_id_recorded_again_replaces_the_old_one_in_text_logs() {
        let buf = Buf::default();
        let out = buf.clone();
        // Only its own target: callsite interest is shared by the tests'
        // subscribers, and the others check what is disabled.
        const T: &str = "pdserve_log_fields_test";
        let fmt = tracing_subscriber::fmt::layer()
            .fmt_fields(LogFields)
            .with_ansi(false)
            .with_writer(move || out.clone())
            .with_filter(Targets::new().with_target(T, tracing::Level::INFO));
        let subscriber = tracing_subscriber::registry().with(fmt);
        tracing::subscriber::with_default(subscriber, || {
            let span = tracing::info_span!(
                target: T,
                "call",
                trace_id = "aaaa",
                request_id = tracing::field::Empty,
                x_trace_id = "keep"
            );
            span.record("request_id", "r1");
            span.record("trace_id", "bbbb");
            span.in_scope(|| tracing::info!(target: T, "inside"));
        });
        let text = String::from_utf8(buf.0.lock().unwrap().clone()).unwrap();
        assert!(text.contains("trace_id=bbbb"), "{text}");
        assert!(!text.contains("aaaa"), "{text}");
        assert_eq!(text.matches("trace_id=bbbb").count(), 1, "{text}");
        assert!(
            text.contains("request_id=r1") && text.contains("x_trace_id=keep"),
            "{text}"
        );
    }

    #[test]
    fn spans_no_layer_wants_are_disabled() {
        let subscriber = tracing_subscriber::registry().with(layers(&args("info", None), "t"));
        tracing::subscriber::with_default(subscriber, || {
            assert!(tracing::trace_span!(target: "h2::codec", "decode_frame").is_disabled());
            assert!(tracing::debug_span!("below the level").is_disabled());
            assert!(!tracing::info_span!("at the level").is_disabled());
        });
    }

    #[test]
    fn trace_spans_are_made_whatever_the_log_level_when_tracing_is_on() {
        let on = args("warn", Some("http://127.0.0.1:9/v1/traces"));
        let subscriber = tracing_subscriber::registry().with(layers(&on, "t"));
        tracing::subscriber::with_default(subscriber, || {
            assert!(!tracing::trace_span!(target: otel::TARGET, "request").is_disabled());
            assert!(tracing::trace_span!(target: "h2::codec", "decode_frame").is_disabled());
        });
        let subscriber = tracing_subscriber::registry().with(layers(&args("warn", None), "t"));
        tracing::subscriber::with_default(subscriber, || {
            assert!(tracing::info_span!(target: otel::TARGET, "request").is_disabled());
        });
    }
}
