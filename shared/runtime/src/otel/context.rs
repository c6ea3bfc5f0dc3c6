//! W3C Trace Context: the ids that join one request's spans across
//! processes, and the `traceparent` header that carries them.
//! <https://www.w3.org/TR/trace-context/>

use std::fmt;

/// The name of the header (HTTP requests to workers, and the KV stream's).
pub const TRACEPARENT: &str = "traceparent";

/// One span's place in a trace.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SpanContext {
    pub trace_id: [u8; 16],
    pub span_id: [u8; 8],
    /// The caller records this trace (flag `01`); an unsampled trace is
    /// propagated but not exported.
    pub sampled: bool,
}

impl SpanContext {
    /// A new trace's first span, sampled.
    pub fn new_root() -> Self {
        Self {
            trace_id: nonzero(),
            span_id: nonzero(),
            sampled: true,
        }
    }

    /// A new span in this one's trace.
    pub fn child(&self) -> Self {
        Self {
            span_id: nonzero(),
            ..*self
        }
    }

    /// Parses a `traceparent` value: `00-<32 hex>-<16 hex>-<2 hex>`. Ids of
    /// all zeros, version `ff` and malformed values are refused (a new trace
    /// starts instead); a later version's extra fields are ignored.
    pub fn parse(value: &str) -> Option<Self> {
        let mut parts = value.trim().split('-');
        let version = parts.next()?;
        let (trace, span, flags) = (parts.next()?, parts.next()?, parts.next()?);
        if version.len() != 2 || version == "ff" || (version == "00" && parts.next().is_some()) {
            return None;
        }
        u8::from_str_radix(version, 16).ok()?;
        let trace_id: [u8; 16] = hex_decode(trace)?;
        let span_id: [u8; 8] = hex_decode(span)?;
        let [flags] = hex_decode::<1>(flags)?;
        if trace_id == [0; 16] || span_id == [0; 8] {
            return None;
        }
        Some(Self {
            trace_id,
            span_id,
            sampled: flags & 1 == 1,
        })
    }

    /// The trace id as 32 lowercase hex digits.
    pub fn trace_hex(&self) -> String {
        hex(&self.trace_id)
    }

    /// The span id as 16 lowercase hex digits.
    pub fn span_hex(&self) -> String {
        hex(&self.span_id)
    }
}

/// The `traceparent` header value.
impl fmt::Display for SpanContext {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let flags = u8::from(self.sampled);
        write!(f, "00-{}-{}-{flags:02x}", self.trace_hex(), self.span_hex())
    }
}

pub(crate) fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn hex_decode<const N: usize>(s: &str) -> Option<[u8; N]> {
    if s.len() != 2 * N || !s.bytes().all(|c| matches!(c, b'0'..=b'9' | b'a'..=b'f')) {
        return None;
    }
    let mut out = [0u8; N];
    for (i, b) in out.iter_mut().enumerate() {
        *b = u8::from_str_radix(&s[2 * i..2 * i + 2], 16).ok()?;
    }
    Some(out)
}

/// Random bytes, never all zero (the spec's invalid id).
fn nonzero<const N: usize>() -> [u8; N] {
    loop {
        let id: [u8; N] = rand::random();
        if id != [0; N] {
            return id;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_traceparent_round_trips() {
        let v = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        let ctx = SpanContext::parse(v).unwrap();
        assert!(ctx.sampled);
        assert_eq!(ctx.trace_hex(), "4bf92f3577b34da6a3ce929d0e0e4736");
        assert_eq!(ctx.to_string(), v);
        let child = ctx.child();
        assert_eq!(child.trace_id, ctx.trace_id);
        assert_ne!(child.span_id, ctx.span_id);
        let unsampled = SpanContext::parse(&v.replace("-01", "-00")).unwrap();
        assert!(!unsampled.sampled);
    }

    #[test]
    fn malformed_values_are_refused() {
        for bad in [
            "",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-x",
        ] {
            assert_eq!(SpanContext::parse(bad), None, "{bad}");
        }
        // A later version may append fields.
        let later = "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra";
        assert!(SpanContext::parse(later).is_some());
    }
}
