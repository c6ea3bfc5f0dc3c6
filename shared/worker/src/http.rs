//! The internal API's responses: errors, streams of JSON lines, the metrics
//! page, and the listener.

use std::convert::Infallible;

use axum::body::Body;
use axum::extract::rejection::JsonRejection;
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures_util::{Stream, StreamExt};
use pdserve_protocol::internal::{ErrorBody, ErrorClass, ErrorKind};

/// An [`ErrorBody`] as an HTTP response: fatal → 400, retryable → 503 with `Retry-After`.
#[derive(Debug)]
pub struct ApiError(pub ErrorBody);

impl From<ErrorBody> for ApiError {
    fn from(e: ErrorBody) -> Self {
        Self(e)
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = match self.0.class {
            ErrorClass::Fatal => StatusCode::BAD_REQUEST,
            ErrorClass::Retryable => StatusCode::SERVICE_UNAVAILABLE,
        };
        let mut resp = (status, Json(self.0)).into_response();
        if status == StatusCode::SERVICE_UNAVAILABLE {
            resp.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        }
        resp
    }
}

/// The body of a JSON request, or the `invalid_json` error.
pub fn json_body<T>(body: Result<Json<T>, JsonRejection>) -> Result<T, ApiError> {
    body.map(|Json(b)| b)
        .map_err(|e| ApiError(ErrorBody::fatal(ErrorKind::InvalidJson, e.body_text())))
}

/// A streamed `application/x-ndjson` response: each item as one JSON line,
/// until the stream ends.
pub fn ndjson<T: serde::Serialize>(items: impl Stream<Item = T> + Send + 'static) -> Response {
    let lines = items.map(|item| {
        let mut line = serde_json::to_vec(&item).unwrap_or_default();
        line.push(b'\n');
        Ok::<_, Infallible>(bytes::Bytes::from(line))
    });
    Response::builder()
        .header(header::CONTENT_TYPE, "application/x-ndjson")
        .body(Body::from_stream(lines))
        .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response())
}

/// `GET /metrics`: the registry in Prometheus text format.
pub fn metrics_page(registry: &prometheus::Registry) -> Response {
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        pdserve_runtime::metrics::render(registry),
    )
        .into_response()
}

/// Binds the worker's listener (port 0 picks a free one). The serve loop
/// logs its address once the signal handlers are in place.
pub async fn listen(host: &str, port: u16) -> std::io::Result<tokio::net::TcpListener> {
    tokio::net::TcpListener::bind((host, port))
        .await
        .map_err(|e| std::io::Error::new(e.kind(), format!("binding {host}:{port}: {e}")))
}
