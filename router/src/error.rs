//! The router's one error type, mapped in one place to an HTTP status and the
//! OpenAI error body `{"error": {"message", "type", "param", "code"}}`.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use pdserve_protocol::internal::{ErrorBody, ErrorClass, ErrorKind, Pool};
use pdserve_protocol::openai::{ErrorDetail, ErrorResponse};

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ApiError {
    /// The body is not JSON, or a field has the wrong type.
    #[error("{0}")]
    InvalidJson(String),
    /// A value out of range, a missing field, an empty prompt.
    #[error("{message}")]
    Invalid {
        param: Option<&'static str>,
        message: String,
    },
    /// Prompt plus `max_tokens` does not fit the context window.
    #[error("{0}")]
    ContextLength(String),
    #[error("the model `{0}` does not exist")]
    ModelNotFound(String),
    /// No such endpoint.
    #[error("no such endpoint: {0}")]
    NotFound(String),
    #[error("invalid or missing API key")]
    Unauthorized,
    /// A worker registration from a host `--worker-allow` does not list.
    #[error("{0}")]
    Forbidden(String),
    /// A worker registration that would take over another worker's URL or id.
    #[error("{0}")]
    Conflict(String),
    #[error("the request body is larger than {0} bytes")]
    PayloadTooLarge(usize),
    /// The router's own concurrency limit.
    #[error("too many requests in flight; retry later")]
    Overloaded,
    /// Every worker of a pool refused for lack of capacity.
    #[error("the {pool:?} pool is at capacity: {message}")]
    Busy { pool: Pool, message: String },
    #[error("no {0:?} worker is available")]
    NoWorker(Pool),
    /// A worker failed in a way retries could not hide.
    #[error("a {pool:?} worker failed: {message}")]
    Upstream { pool: Pool, message: String },
    #[error("the request did not finish within {0} s")]
    Deadline(u64),
    #[error("internal error: {0}")]
    Internal(String),
}

impl ApiError {
    pub fn invalid(param: &'static str, message: impl Into<String>) -> Self {
        ApiError::Invalid {
            param: Some(param),
            message: message.into(),
        }
    }

    /// A stable name: the `code` in the body and the metric label.
    pub fn kind(&self) -> &'static str {
        match self {
            ApiError::InvalidJson(_) => "invalid_json",
            ApiError::Invalid { .. } => "invalid_value",
            ApiError::ContextLength(_) => "context_length_exceeded",
            ApiError::ModelNotFound(_) => "model_not_found",
            // The code clients have always seen for an unknown path.
            ApiError::NotFound(_) => "invalid_value",
            ApiError::Unauthorized => "invalid_api_key",
            ApiError::Forbidden(_) => "forbidden",
            ApiError::Conflict(_) => "conflict",
            ApiError::PayloadTooLarge(_) => "payload_too_large",
            ApiError::Overloaded => "rate_limit_exceeded",
            ApiError::Busy { .. } => "overloaded",
            ApiError::NoWorker(_) => "no_worker",
            ApiError::Upstream { .. } => "upstream_error",
            ApiError::Deadline(_) => "deadline_exceeded",
            ApiError::Internal(_) => "internal_error",
        }
    }

    pub fn status(&self) -> StatusCode {
        match self {
            ApiError::InvalidJson(_) | ApiError::Invalid { .. } | ApiError::ContextLength(_) => {
                StatusCode::BAD_REQUEST
            }
            ApiError::ModelNotFound(_) | ApiError::NotFound(_) => StatusCode::NOT_FOUND,
            ApiError::Unauthorized => StatusCode::UNAUTHORIZED,
            ApiError::Forbidden(_) => StatusCode::FORBIDDEN,
            ApiError::Conflict(_) => StatusCode::CONFLICT,
            ApiError::PayloadTooLarge(_) => StatusCode::PAYLOAD_TOO_LARGE,
            ApiError::Overloaded => StatusCode::TOO_MANY_REQUESTS,
            ApiError::Busy { .. } | ApiError::NoWorker(_) => StatusCode::SERVICE_UNAVAILABLE,
            ApiError::Upstream { .. } => StatusCode::BAD_GATEWAY,
            ApiError::Deadline(_) => StatusCode::GATEWAY_TIMEOUT,
            ApiError::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    /// The OpenAI error `type`.
    fn error_type(&self) -> &'static str {
        match self.status() {
            StatusCode::UNAUTHORIZED => "authentication_error",
            StatusCode::NOT_FOUND => "invalid_request_error",
            StatusCode::TOO_MANY_REQUESTS => "rate_limit_error",
            s if s.is_client_error() => "invalid_request_error",
            _ => "server_error",
        }
    }

    fn param(&self) -> Option<String> {
        match self {
            ApiError::Invalid { param, .. } => param.map(str::to_string),
            ApiError::ContextLength(_) => Some("messages".into()),
            ApiError::ModelNotFound(_) => Some("model".into()),
            ApiError::NotFound(_) => Some("path".into()),
            _ => None,
        }
    }

    /// The body, also sent as an SSE `data:` event when a stream fails midway.
    pub fn body(&self) -> ErrorResponse {
        ErrorResponse {
            error: ErrorDetail {
                message: self.to_string(),
                kind: self.error_type().into(),
                param: self.param(),
                code: Some(self.kind().into()),
            },
        }
    }

    /// Translates a worker's error. Fatal ones are the request's fault (the
    /// router validated it, so this is rare); retryable ones mean the pool
    /// could not take it.
    pub fn from_worker(pool: Pool, e: ErrorBody) -> Self {
        use ErrorKind::{ContextLengthExceeded, KvExhausted, NotReady, Overloaded};
        match (e.class, &e.kind) {
            (ErrorClass::Fatal, ContextLengthExceeded) => ApiError::ContextLength(e.message),
            // Not the request's fault (the engine failed, a KV stream or the
            // deployment is broken), even if a worker calls it fatal: a
            // 5xx, retried elsewhere.
            (ErrorClass::Fatal, kind) if !is_request_fault(kind) => ApiError::Upstream {
                pool,
                message: format!("{}: {}", e.kind, e.message),
            },
            (ErrorClass::Fatal, _) => ApiError::Invalid {
                param: None,
                message: e.message,
            },
            (ErrorClass::Retryable, KvExhausted | Overloaded | NotReady) => ApiError::Busy {
                pool,
                message: e.message,
            },
            (ErrorClass::Retryable, _) => ApiError::Upstream {
                pool,
                message: format!("{}: {}", e.kind, e.message),
            },
        }
    }
}

/// Kinds that are the client request's own fault: a 400, never retried.
/// Every other fatal kind from a worker is the engine, the KV transfer or
/// the deployment failing.
fn is_request_fault(kind: &ErrorKind) -> bool {
    use ErrorKind::*;
    matches!(
        kind,
        InvalidJson
            | InvalidRequest
            | InvalidRequestId
            | InvalidSampling
            | InvalidInput
            | ContextLengthExceeded
            | KvCapacityExceeded
            | DuplicateRequestId
            | Cancelled
            | Sampling
    )
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = self.status();
        let mut resp = (status, Json(self.body())).into_response();
        if matches!(
            status,
            StatusCode::TOO_MANY_REQUESTS | StatusCode::SERVICE_UNAVAILABLE
        ) {
            resp.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        }
        if status == StatusCode::UNAUTHORIZED {
            resp.headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        resp
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_error_has_its_status_and_an_openai_body() {
        let cases = [
            (
                ApiError::InvalidJson("x".into()),
                400,
                "invalid_request_error",
            ),
            (ApiError::invalid("n", "bad"), 400, "invalid_request_error"),
            (
                ApiError::ContextLength("x".into()),
                400,
                "invalid_request_error",
            ),
            (
                ApiError::ModelNotFound("m".into()),
                404,
                "invalid_request_error",
            ),
            (
                ApiError::NotFound("/x".into()),
                404,
                "invalid_request_error",
            ),
            (ApiError::Unauthorized, 401, "authentication_error"),
            (ApiError::PayloadTooLarge(1), 413, "invalid_request_error"),
            (ApiError::Overloaded, 429, "rate_limit_error"),
            (ApiError::NoWorker(Pool::Decode), 503, "server_error"),
            (
                ApiError::Upstream {
                    pool: Pool::Prefill,
                    message: "x".into(),
                },
                502,
                "server_error",
            ),
            (ApiError::Deadline(5), 504, "server_error"),
        ];
        for (err, status, kind) in cases {
            assert_eq!(err.status().as_u16(), status, "{err:?}");
            let body = err.body();
            assert_eq!(body.error.kind, kind, "{err:?}");
            assert_eq!(body.error.code.as_deref(), Some(err.kind()));
        }
        assert_eq!(
            ApiError::invalid("n", "bad").body().error.param.as_deref(),
            Some("n")
        );
    }

    #[test]
    fn worker_errors_keep_their_meaning() {
        let worker = |pool, e| ApiError::from_worker(pool, e);
        let busy = worker(
            Pool::Decode,
            ErrorBody::retryable(ErrorKind::KvExhausted, "full"),
        );
        assert_eq!(busy.status(), StatusCode::SERVICE_UNAVAILABLE);
        let upload = ErrorBody::retryable(ErrorKind::KvUploadFailed, "x");
        assert_eq!(
            worker(Pool::Prefill, upload).status(),
            StatusCode::BAD_GATEWAY
        );
        let bad = worker(
            Pool::Decode,
            ErrorBody::fatal(ErrorKind::InvalidSampling, "x"),
        );
        assert_eq!(bad.status(), StatusCode::BAD_REQUEST);
        let long = ErrorBody::fatal(ErrorKind::ContextLengthExceeded, "x");
        assert_eq!(worker(Pool::Decode, long).kind(), "context_length_exceeded");
    }

    #[test]
    fn engine_failures_are_server_errors_whatever_class_a_worker_sent() {
        for class in [ErrorClass::Fatal, ErrorClass::Retryable] {
            for kind in [
                ErrorKind::EngineFailed,
                ErrorKind::Tensor,
                ErrorKind::EnginePanic,
                ErrorKind::KvMismatch,
                ErrorKind::KvDestinationRefused,
                ErrorKind::Unauthorized,
            ] {
                let e = ErrorBody {
                    class,
                    kind: kind.clone(),
                    message: "x".into(),
                };
                let err = ApiError::from_worker(Pool::Prefill, e);
                assert!(
                    err.status().is_server_error(),
                    "{kind:?} {class:?}: {err:?}"
                );
            }
        }
        // The request's own fault stays a 400, not retried.
        let bad = ErrorBody::fatal(ErrorKind::KvCapacityExceeded, "too big");
        assert_eq!(ApiError::from_worker(Pool::Decode, bad).status(), 400);
    }
}
