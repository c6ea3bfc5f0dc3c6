//! Whether a worker takes new work: true once built (the model is loaded
//! before the server starts), false once it drains.

use std::sync::atomic::{AtomicBool, Ordering};

use axum::http::StatusCode;
use pdserve_protocol::internal::{ErrorBody, ErrorKind};

use crate::http::ApiError;

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

    /// Stops taking new work (draining).
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

    /// Refuses new work while draining: 503, retryable `not_ready`.
    pub fn admit(&self) -> Result<(), ApiError> {
        match self.is_ready() {
            true => Ok(()),
            false => Err(ApiError(ErrorBody::retryable(
                ErrorKind::NotReady,
                "the worker is not ready or is draining",
            ))),
        }
    }
}
