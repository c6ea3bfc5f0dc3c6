//! One request's life at the router: admitted under the concurrency limit,
//! named, and its outcome counted exactly once — `ok`, the error's code, or
//! `cancelled` when the client went away first.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

use axum::response::{IntoResponse, Response};
use pdserve_protocol::internal::Pool;
use pdserve_protocol::openai::Usage;
use pdserve_runtime::metrics::labels;

use crate::error::ApiError;
use crate::metrics::RouterMetrics;

/// The gate in front of the generation endpoints.
pub struct Admission {
    in_flight: Arc<AtomicUsize>,
    /// False once draining: new requests are refused.
    accepting: AtomicBool,
    max_in_flight: usize,
    metrics: Arc<RouterMetrics>,
}

impl Admission {
    pub fn new(max_in_flight: usize, metrics: Arc<RouterMetrics>) -> Self {
        Self {
            in_flight: Arc::default(),
            accepting: AtomicBool::new(true),
            max_in_flight,
            metrics,
        }
    }

    /// Requests in flight now.
    pub fn in_flight(&self) -> usize {
        self.in_flight.load(Ordering::Relaxed)
    }

    pub fn is_accepting(&self) -> bool {
        self.accepting.load(Ordering::Relaxed)
    }

    /// Refuses new requests from now on (draining).
    pub fn stop_accepting(&self) {
        self.accepting.store(false, Ordering::Relaxed);
    }

    /// Starts a request on `endpoint` (a `labels::ENDPOINT_*`) with an id
    /// of `prefix`; it counts as in flight until dropped, and is refused
    /// (see [`Request::admitted`]) while draining or over the limit.
    pub fn begin(&self, endpoint: &'static str, prefix: &str) -> Request {
        let before = self.in_flight.fetch_add(1, Ordering::Relaxed);
        self.metrics.in_flight.inc();
        let refusal = match (self.is_accepting(), before < self.max_in_flight) {
            (false, _) => Some(ApiError::NoWorker(Pool::Decode)),
            (true, false) => Some(ApiError::Overloaded),
            (true, true) => None,
        };
        if refusal.is_none() {
            self.metrics.offered.arrived();
        }
        Request {
            id: new_id(prefix),
            endpoint,
            started: Instant::now(),
            refusal,
            span: tracing::Span::none(),
            counted: false,
            in_flight: self.in_flight.clone(),
            metrics: self.metrics.clone(),
        }
    }
}

/// A request in flight. Dropping it before [`Request::succeed`] or
/// [`Request::fail`] counts it `cancelled`: the client went away.
pub struct Request {
    pub id: String,
    pub endpoint: &'static str,
    pub started: Instant,
    /// The request's trace span (`crate::trace::request_span`); it ends
    /// when the request does.
    pub span: tracing::Span,
    refusal: Option<ApiError>,
    counted: bool,
    in_flight: Arc<AtomicUsize>,
    metrics: Arc<RouterMetrics>,
}

impl Request {
    /// Whether the request got past admission.
    pub fn admitted(&mut self) -> Result<(), ApiError> {
        match self.refusal.take() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    fn count(&mut self, status: &str) {
        if !std::mem::replace(&mut self.counted, true) {
            let m = &self.metrics;
            m.requests.with_label_values(&[self.endpoint, status]).inc();
        }
    }

    /// Counts the request as served and observes its duration.
    pub fn succeed(&mut self) {
        self.count(labels::STATUS_OK);
        let elapsed = self.started.elapsed();
        self.metrics
            .duration
            .with_label_values(&[self.endpoint])
            .observe(elapsed.as_secs_f64());
        // Per request, for loadtest/scripts/router_overhead.sh; off unless
        // `pdserve_router::request=debug` is in the log filter.
        let elapsed_us = elapsed.as_micros() as u64;
        tracing::debug!(request_id = %self.id, elapsed_us, "request served");
    }

    /// Counts the request as failed with `e`'s code.
    pub fn fail(&mut self, e: &ApiError) {
        self.count(e.kind());
        crate::trace::record_error(&self.span, e.kind(), &e.to_string());
    }

    /// Counts the request as failed with `e`, answered with `e`'s status.
    pub fn refuse(mut self, e: ApiError) -> Response {
        self.fail(&e);
        e.into_response()
    }

    /// The first token (of any choice) reached the client.
    pub fn observe_ttft(&self) {
        pdserve_runtime::otel::event(&self.span, "first_token");
        self.metrics
            .ttft
            .with_label_values(&[self.endpoint])
            .observe(self.started.elapsed().as_secs_f64());
    }

    /// Adds the request's tokens to the token counters.
    pub fn count_tokens(&self, usage: Usage) {
        let m = &self.metrics;
        m.prompt_tokens.inc_by(usage.prompt_tokens as u64);
        m.generation_tokens.inc_by(usage.completion_tokens as u64);
        m.offered.request(&usage);
        let span = &self.span;
        span.record("gen_ai.usage.input_tokens", usage.prompt_tokens);
        span.record("gen_ai.usage.output_tokens", usage.completion_tokens);
        let cached = usage.prompt_tokens_details.cached_tokens;
        span.record("pdserve.cached_tokens", cached);
    }

    /// Records each choice's finish reason on the request's span
    /// (`gen_ai.response.finish_reasons`, a string array).
    pub fn record_finish_reasons<S: AsRef<str>>(&self, reasons: &[S]) {
        let reasons: Vec<&str> = reasons.iter().map(AsRef::as_ref).collect();
        if reasons.is_empty() {
            return;
        }
        let field = "gen_ai.response.finish_reasons";
        self.span.record(field, reasons.join(",").as_str());
    }

    pub fn metrics(&self) -> &Arc<RouterMetrics> {
        &self.metrics
    }
}

impl Drop for Request {
    fn drop(&mut self) {
        self.count(labels::STATUS_CANCELLED);
        self.in_flight.fetch_sub(1, Ordering::Relaxed);
        self.metrics.in_flight.dec();
    }
}

/// A fresh id: `prefix-` and 16 hex digits.
fn new_id(prefix: &str) -> String {
    use std::hash::{BuildHasher, Hasher};
    static COUNTER: AtomicUsize = AtomicUsize::new(0);
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_usize(COUNTER.fetch_add(1, Ordering::Relaxed));
    format!("{prefix}-{:016x}", h.finish())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn text(m: &RouterMetrics) -> String {
        m.render(&crate::registry::Registry::default())
    }

    fn count(m: &RouterMetrics, status: &str) -> bool {
        let series = format!("pdserve_requests_total{{endpoint=\"chat\",status=\"{status}\"}} 1");
        text(m).contains(&series)
    }

    #[test]
    fn every_outcome_is_counted_once() {
        let metrics = Arc::new(RouterMetrics::new());
        let gate = Admission::new(2, metrics.clone());
        let mut ok = gate.begin(labels::ENDPOINT_CHAT, "chatcmpl");
        assert!(ok.id.starts_with("chatcmpl-"));
        ok.admitted().unwrap();
        ok.succeed();
        ok.fail(&ApiError::Overloaded);
        drop(ok);
        assert!(count(&metrics, "ok"));
        assert!(!text(&metrics).contains("rate_limit_exceeded"));
        drop(gate.begin(labels::ENDPOINT_CHAT, "chatcmpl"));
        assert!(count(&metrics, "cancelled"));
        assert_eq!(gate.in_flight(), 0);
    }

    #[test]
    fn over_the_limit_or_draining_is_refused() {
        let metrics = Arc::new(RouterMetrics::new());
        let gate = Admission::new(1, metrics.clone());
        let mut first = gate.begin(labels::ENDPOINT_CHAT, "a");
        first.admitted().unwrap();
        let mut second = gate.begin(labels::ENDPOINT_CHAT, "b");
        assert_eq!(second.admitted(), Err(ApiError::Overloaded));
        let _ = second.refuse(ApiError::Overloaded);
        assert!(count(&metrics, "rate_limit_exceeded"));
        drop(first);
        gate.stop_accepting();
        let mut third = gate.begin(labels::ENDPOINT_CHAT, "c");
        assert_eq!(third.admitted(), Err(ApiError::NoWorker(Pool::Decode)));
        assert_ne!(gate.begin("chat", "d").id, gate.begin("chat", "d").id);
    }
}
