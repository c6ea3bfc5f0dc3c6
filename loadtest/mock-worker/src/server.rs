//! What both pools' HTTP sides share: readiness, the metrics page, request
//! admission, and the drain on shutdown.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use axum::extract::rejection::JsonRejection;
use axum::http::{header, StatusCode};
use axum::response::IntoResponse;
use axum::Json;
use pdserve_protocol::internal::ErrorBody;
use pdserve_runtime::http::ApiError;
use tokio_util::sync::CancellationToken;

/// Ready to take work: true from the start (nothing to load), false once draining.
#[derive(Debug)]
pub struct Readiness(AtomicBool);

impl Default for Readiness {
    fn default() -> Self {
        Self(AtomicBool::new(true))
    }
}

impl Readiness {
    pub fn is_ready(&self) -> bool {
        self.0.load(Ordering::Relaxed)
    }

    pub fn stop(&self) {
        self.0.store(false, Ordering::Relaxed);
    }

    /// `GET /ready`: 200, or 503 while draining.
    pub fn status(&self) -> StatusCode {
        match self.is_ready() {
            true => StatusCode::OK,
            false => StatusCode::SERVICE_UNAVAILABLE,
        }
    }

    /// Unwraps a JSON body, refusing new work while draining.
    pub fn admit<T>(&self, body: Result<Json<T>, JsonRejection>) -> Result<T, ApiError> {
        let Json(body) =
            body.map_err(|e| ApiError(ErrorBody::fatal("invalid_json", e.body_text())))?;
        match self.is_ready() {
            true => Ok(body),
            false => Err(ApiError(ErrorBody::retryable(
                "not_ready",
                "the worker is not ready or is draining",
            ))),
        }
    }
}

/// `GET /metrics`.
pub fn metrics_page(registry: &prometheus::Registry) -> impl IntoResponse {
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        pdserve_runtime::metrics::render(registry),
    )
}

/// On shutdown: stop taking work, let in-flight work finish (at most
/// `deadline`), then return so the server closes.
pub async fn drain(
    readiness: &Readiness,
    in_flight: impl Fn() -> u64,
    token: CancellationToken,
    deadline: Duration,
) {
    token.cancelled().await;
    readiness.stop();
    let until = tokio::time::Instant::now() + deadline;
    let mut tick = tokio::time::interval(Duration::from_millis(50));
    while in_flight() > 0 {
        tokio::select! {
            biased;
            _ = tokio::time::sleep_until(until) => {
                tracing::warn!(in_flight = in_flight(), "drain deadline reached");
                return;
            }
            _ = tick.tick() => {}
        }
    }
    tracing::info!("drained");
}
