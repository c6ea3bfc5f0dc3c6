//! What both pools' HTTP sides share: readiness, the metrics page and
//! request admission.

use std::sync::atomic::{AtomicBool, Ordering};

use axum::extract::rejection::JsonRejection;
use axum::http::{header, StatusCode};
use axum::response::IntoResponse;
use axum::Json;
use pdserve_protocol::internal::ErrorBody;
use pdserve_runtime::http::ApiError;

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
