//! Logging and tracing setup, shared by every binary.

use clap::Args;

use tracing::field::{Field, Visit};
use tracing_subscriber::field::RecordFields;
use tracing_subscriber::filter::{filter_fn, EnvFilter, FilterExt, Targets};
use tracing_subscriber::fmt::format::Writer;
use tracing_subscriber::fmt::{FormatFields, FormattedFields};
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::Layer;

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
    let not_span_events = filter_fn(|m| !(m.is_event() && m.target() == otel::TARGET));
    // Trace spans are made whatever the log level; each layer filters alone.
    let spans = args.otlp_endpoint.as_deref().map(|endpoint| {
        let name = args.otlp_service_name.as_deref().unwrap_or(service);
        otel::layer(endpoint, name)
            .with_filter(Targets::new().with_target(otel::TARGET, tracing::Level::TRACE))
    });
    let _ = tracing_subscriber::registry()
        .with(fmt.with_filter(filter.and(not_span_events)))
        .with(spans)
        .try_init();
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
        if !more.is_empty() {
            if !current.fields.is_empty() {
                current.fields.push(' ');
            }
            current.fields.push_str(&more);
        }
        Ok(())
    }
}
