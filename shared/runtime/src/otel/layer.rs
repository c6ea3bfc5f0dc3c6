//! The `tracing` layer that turns pdserve's trace spans (target
//! [`TARGET`](super::TARGET)) into OpenTelemetry spans.
//!
//! A span's fields become its attributes, except these, which follow the
//! `tracing-opentelemetry` conventions: `otel.name` (the span's name),
//! `otel.kind` (`server`, `client`, `internal`), `otel.status_code`
//! (`error` or `ok`), `otel.status_message`; `traceparent` (a remote parent,
//! when the span is a process's first of the request, or recorded later
//! into a span that has no parent) and `trace_id` (for the logs) are not
//! exported. Events of the same target inside a span
//! become its span events.

use std::time::SystemTime;

use serde_json::{json, Value};
use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing::{Event, Subscriber};
use tracing_subscriber::layer::Context;
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::Layer;

use super::context::{hex, SpanContext};
use super::export::Exporter;

/// An attribute's value, as OTLP types it.
#[derive(Clone, Debug, PartialEq)]
pub enum AttrValue {
    Str(String),
    Int(i64),
    Double(f64),
    Bool(bool),
    /// A string array: a field named in [`ARRAY_FIELDS`], recorded as one
    /// comma-separated string.
    StrArray(Vec<String>),
}

/// Fields that OpenTelemetry defines as string arrays; `tracing` records
/// them as one string, split at commas on export.
const ARRAY_FIELDS: &[&str] = &["gen_ai.response.finish_reasons"];

impl AttrValue {
    pub(crate) fn to_json(&self) -> Value {
        match self {
            Self::Str(s) => json!({ "stringValue": s }),
            // OTLP/JSON writes 64-bit integers as strings.
            Self::Int(i) => json!({ "intValue": i.to_string() }),
            Self::Double(d) => json!({ "doubleValue": d }),
            Self::Bool(b) => json!({ "boolValue": b }),
            Self::StrArray(v) => {
                let values: Vec<Value> = v.iter().map(|s| json!({ "stringValue": s })).collect();
                json!({ "arrayValue": { "values": values } })
            }
        }
    }
}

impl From<&str> for AttrValue {
    fn from(s: &str) -> Self {
        Self::Str(s.to_string())
    }
}
impl From<String> for AttrValue {
    fn from(s: String) -> Self {
        Self::Str(s)
    }
}
impl From<u64> for AttrValue {
    fn from(v: u64) -> Self {
        Self::Int(v.min(i64::MAX as u64) as i64)
    }
}
impl From<f64> for AttrValue {
    fn from(v: f64) -> Self {
        Self::Double(v)
    }
}

/// OTLP's span kinds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SpanKind {
    Internal = 1,
    Server = 2,
    Client = 3,
}

/// Attributes, in the order they were set.
pub type Attrs = Vec<(String, AttrValue)>;

/// A span event: when, its name, its attributes.
pub type SpanEvent = (SystemTime, String, Attrs);

/// A span's data while it is open, kept in its extensions.
#[derive(Clone, Debug)]
pub struct SpanData {
    pub ctx: SpanContext,
    pub parent: Option<[u8; 8]>,
    pub name: String,
    pub kind: SpanKind,
    pub start: SystemTime,
    pub attrs: Vec<(String, AttrValue)>,
    pub events: Vec<SpanEvent>,
    /// `Some(message)` when the span failed.
    pub error: Option<String>,
}

impl SpanData {
    fn set(&mut self, key: &str, value: AttrValue) {
        match key {
            "otel.name" => self.name = plain(value),
            "otel.kind" => {
                self.kind = match plain(value).as_str() {
                    "server" => SpanKind::Server,
                    "client" => SpanKind::Client,
                    _ => SpanKind::Internal,
                }
            }
            "otel.status_code" => {
                if plain(value).eq_ignore_ascii_case("error") {
                    self.error.get_or_insert_with(String::new);
                }
            }
            "otel.status_message" => self.error = Some(plain(value)),
            "traceparent" => self.adopt(&plain(value)),
            "trace_id" => {}
            _ => match self.attrs.iter_mut().find(|(k, _)| k == key) {
                Some(slot) => slot.1 = value,
                None => self.attrs.push((key.to_string(), value)),
            },
        }
    }

    /// A root span given a `traceparent` after it started (the KV stream's
    /// header frame) joins that trace, keeping its own span id; a span that
    /// has a parent keeps it. Spans started under it before are not moved.
    fn adopt(&mut self, traceparent: &str) {
        if self.parent.is_some() {
            return;
        }
        if let Some(remote) = SpanContext::parse(traceparent) {
            self.ctx = SpanContext {
                span_id: self.ctx.span_id,
                ..remote
            };
            self.parent = Some(remote.span_id);
        }
    }

    /// The span as OTLP/JSON, ended at `end`.
    pub(crate) fn to_json(&self, end: SystemTime) -> Value {
        let mut span = json!({
            "traceId": self.ctx.trace_hex(),
            "spanId": self.ctx.span_hex(),
            "name": self.name,
            "kind": self.kind as u8,
            "startTimeUnixNano": unix_nanos(self.start),
            "endTimeUnixNano": unix_nanos(end.max(self.start)),
            "attributes": attrs_json(&self.attrs),
            "events": self.events.iter().map(|(at, name, attrs)| json!({
                "timeUnixNano": unix_nanos(*at),
                "name": name,
                "attributes": attrs_json(attrs),
            })).collect::<Vec<_>>(),
            "status": match &self.error {
                Some(m) => json!({ "code": 2, "message": m }),
                None => json!({ "code": 0 }),
            },
        });
        if let Some(p) = self.parent {
            span["parentSpanId"] = Value::String(hex(&p));
        }
        span
    }
}

fn plain(v: AttrValue) -> String {
    match v {
        AttrValue::Str(s) => s,
        AttrValue::Int(i) => i.to_string(),
        AttrValue::Double(d) => d.to_string(),
        AttrValue::Bool(b) => b.to_string(),
        AttrValue::StrArray(v) => v.join(","),
    }
}

pub(crate) fn attrs_json(attrs: &[(String, AttrValue)]) -> Vec<Value> {
    attrs
        .iter()
        .map(|(k, v)| json!({ "key": k, "value": v.to_json() }))
        .collect()
}

/// Nanoseconds since the Unix epoch, as the decimal string OTLP/JSON uses.
pub(crate) fn unix_nanos(t: SystemTime) -> String {
    let nanos = t
        .duration_since(SystemTime::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    nanos.to_string()
}

/// Collects fields as attributes.
#[derive(Default)]
struct Fields(Vec<(String, AttrValue)>);

impl Visit for Fields {
    fn record_str(&mut self, f: &Field, v: &str) {
        let value = match ARRAY_FIELDS.contains(&f.name()) {
            true => AttrValue::StrArray(v.split(',').map(str::to_string).collect()),
            false => v.into(),
        };
        self.0.push((f.name().to_string(), value));
    }
    fn record_i64(&mut self, f: &Field, v: i64) {
        self.0.push((f.name().to_string(), AttrValue::Int(v)));
    }
    fn record_u64(&mut self, f: &Field, v: u64) {
        self.0.push((f.name().to_string(), v.into()));
    }
    fn record_f64(&mut self, f: &Field, v: f64) {
        self.0.push((f.name().to_string(), AttrValue::Double(v)));
    }
    fn record_bool(&mut self, f: &Field, v: bool) {
        self.0.push((f.name().to_string(), AttrValue::Bool(v)));
    }
    fn record_debug(&mut self, f: &Field, v: &dyn std::fmt::Debug) {
        self.0.push((f.name().to_string(), format!("{v:?}").into()));
    }
}

/// The layer; every closed, sampled span goes to the exporter.
pub struct OtelLayer {
    pub(crate) exporter: Exporter,
}

impl<S> Layer<S> for OtelLayer
where
    S: Subscriber + for<'a> LookupSpan<'a>,
{
    fn on_new_span(&self, attrs: &Attributes<'_>, id: &Id, ctx: Context<'_, S>) {
        let Some(span) = ctx.span(id) else { return };
        let mut fields = Fields::default();
        attrs.record(&mut fields);
        let remote = fields.0.iter().find_map(|(k, v)| match (k.as_str(), v) {
            ("traceparent", AttrValue::Str(s)) => SpanContext::parse(s),
            _ => None,
        });
        let local = span
            .parent()
            .and_then(|p| p.extensions().get::<SpanData>().map(|d| d.ctx));
        let parent = remote.or(local);
        let mut data = SpanData {
            ctx: parent.map_or_else(SpanContext::new_root, |p| p.child()),
            parent: parent.map(|p| p.span_id),
            name: attrs.metadata().name().to_string(),
            kind: SpanKind::Internal,
            start: SystemTime::now(),
            attrs: Vec::new(),
            events: Vec::new(),
            error: None,
        };
        for (k, v) in fields.0 {
            data.set(&k, v);
        }
        span.extensions_mut().insert(data);
    }

    fn on_record(&self, id: &Id, values: &Record<'_>, ctx: Context<'_, S>) {
        let Some(span) = ctx.span(id) else { return };
        let mut fields = Fields::default();
        values.record(&mut fields);
        let mut ext = span.extensions_mut();
        if let Some(data) = ext.get_mut::<SpanData>() {
            for (k, v) in fields.0 {
                data.set(&k, v);
            }
        }
    }

    fn on_event(&self, event: &Event<'_>, ctx: Context<'_, S>) {
        let Some(span) = ctx.event_span(event) else {
            return;
        };
        let mut fields = Fields::default();
        event.record(&mut fields);
        let mut name = event.metadata().name().to_string();
        fields.0.retain(|(k, v)| match k.as_str() {
            "message" => {
                name = plain(v.clone());
                false
            }
            _ => true,
        });
        let mut ext = span.extensions_mut();
        if let Some(data) = ext.get_mut::<SpanData>() {
            data.events.push((SystemTime::now(), name, fields.0));
        }
    }

    fn on_close(&self, id: Id, ctx: Context<'_, S>) {
        let Some(span) = ctx.span(&id) else { return };
        let data = span.extensions_mut().remove::<SpanData>();
        if let Some(data) = data.filter(|d| d.ctx.sampled) {
            self.exporter.send(data.to_json(SystemTime::now()));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn span(parent: Option<SpanContext>) -> SpanData {
        SpanData {
            ctx: parent.map_or_else(SpanContext::new_root, |p| p.child()),
            parent: parent.map(|p| p.span_id),
            name: "kv_receive".into(),
            kind: SpanKind::Server,
            start: SystemTime::now(),
            attrs: Vec::new(),
            events: Vec::new(),
            error: None,
        }
    }

    #[test]
    fn a_root_adopts_a_later_traceparent_and_a_child_keeps_its_parent() {
        let sender = SpanContext::parse("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01");
        let tp = AttrValue::Str(sender.unwrap().to_string());
        let mut root = span(None);
        let own = root.ctx.span_id;
        root.set("traceparent", tp.clone());
        assert_eq!(root.ctx.trace_hex(), "4bf92f3577b34da6a3ce929d0e0e4736");
        assert_eq!(
            (root.ctx.span_id, root.parent),
            (own, Some(sender.unwrap().span_id))
        );
        assert!(root.attrs.is_empty(), "not exported as an attribute");

        let caller = SpanContext::new_root();
        let mut child = span(Some(caller));
        child.set("traceparent", tp);
        assert_eq!(child.ctx.trace_id, caller.trace_id);
        assert_eq!(child.parent, Some(caller.span_id));

        let mut unsampled = span(None);
        let off = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00";
        unsampled.set("traceparent", AttrValue::Str(off.into()));
        assert!(!unsampled.ctx.sampled);
        let mut garbage = span(None);
        garbage.set("traceparent", AttrValue::Str("00-zz".into()));
        assert_eq!(garbage.parent, None);
    }
}
