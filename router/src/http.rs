//! HTTP handlers. They only translate: admit (request), parse and validate
//! (front end), start sequences and answer (respond). Errors are `ApiError`s.

use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use pdserve_protocol::internal::{Deregistration, Heartbeat, Pool, WorkerRegistration};
use pdserve_protocol::openai::{
    ChatCompletionRequest, CompletionRequest, DetokenizeRequest, DetokenizeResponse, ModelCard,
    ModelList, TokenizeRequest, TokenizeResponse,
};
use pdserve_runtime::metrics::labels;
use serde::de::DeserializeOwned;

use crate::dispatch::Dispatcher;
use crate::error::ApiError;
use crate::frontend::{Frontend, Prepared};
use crate::metrics::RouterMetrics;
use crate::registry::Registry;
use crate::request::{Admission, Request};
use crate::respond::render::{Format, Header};
use crate::respond::{self, Ctx};

pub struct AppState {
    pub frontend: Frontend,
    pub dispatcher: Arc<Dispatcher>,
    pub registry: Arc<Registry>,
    pub metrics: Arc<RouterMetrics>,
    pub api_keys: Vec<String>,
    /// The concurrency limit; draining stops it accepting (`/ready` is then 503).
    pub admission: Admission,
    /// When the router started (Unix seconds), for `/v1/models`.
    pub started: u64,
}

pub fn routes(state: Arc<AppState>) -> Router {
    let public = Router::new()
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .route("/v1/models", get(models))
        .route("/tokenize", post(tokenize))
        .route("/detokenize", post(detokenize))
        .route_layer(middleware::from_fn_with_state(state.clone(), authorize));
    Router::new()
        .merge(public)
        .route("/health", get(|| async { "ok" }))
        .route("/ready", get(ready))
        .route("/metrics", get(metrics))
        .route("/v1/internal/workers/register", post(register))
        .route("/v1/internal/workers/heartbeat", post(heartbeat))
        .route("/v1/internal/workers/deregister", post(deregister))
        .fallback(|uri: axum::http::Uri| async move { ApiError::NotFound(uri.path().to_string()) })
        .layer(DefaultBodyLimit::max(state.frontend.limits.max_body_bytes))
        .with_state(state)
}

/// Compares in time independent of where the strings differ.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

async fn authorize(
    State(s): State<Arc<AppState>>,
    req: axum::extract::Request,
    next: Next,
) -> Response {
    if s.api_keys.is_empty() {
        return next.run(req).await;
    }
    let given = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .unwrap_or("");
    let ok = s.api_keys.iter().fold(false, |ok, k| {
        ok | constant_time_eq(k.as_bytes(), given.as_bytes())
    });
    match ok {
        true => next.run(req).await,
        false => ApiError::Unauthorized.into_response(),
    }
}

fn parse<T: DeserializeOwned>(
    body: Result<Bytes, BytesRejection>,
    limit: usize,
) -> Result<T, ApiError> {
    let body = body.map_err(|e| match e.status() {
        StatusCode::PAYLOAD_TOO_LARGE => ApiError::PayloadTooLarge(limit),
        _ => ApiError::InvalidJson(e.body_text()),
    })?;
    serde_json::from_slice(&body)
        .map_err(|e| ApiError::InvalidJson(format!("invalid request body: {e}")))
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or_default()
}

async fn chat(
    State(s): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let prepare = |f: &Frontend, r: &ChatCompletionRequest| f.prepare_chat(r);
    generate(&s, &headers, body, Format::Chat, prepare).await
}

async fn completions(
    State(s): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let prepare = |f: &Frontend, r: &CompletionRequest| f.prepare_completion(r);
    generate(&s, &headers, body, Format::Completion, prepare).await
}

/// Both generation endpoints: admit, parse, prepare, answer. The
/// [`Request`] counts the outcome, whichever way it goes.
async fn generate<R: DeserializeOwned>(
    s: &Arc<AppState>,
    headers: &HeaderMap,
    body: Result<Bytes, BytesRejection>,
    format: Format,
    prepare: impl Fn(&Frontend, &R) -> Result<Prepared, ApiError>,
) -> Response {
    let (endpoint, prefix) = match format {
        Format::Chat => (labels::ENDPOINT_CHAT, "chatcmpl"),
        Format::Completion => (labels::ENDPOINT_COMPLETIONS, "cmpl"),
    };
    let mut request = s.admission.begin(endpoint, prefix);
    let prepared = request.admitted().and_then(|()| {
        let req: R = parse(body, s.frontend.limits.max_body_bytes)?;
        prepare(&s.frontend, &req)
    });
    let prepared = match prepared {
        Ok(p) => p,
        Err(e) => return request.refuse(e),
    };
    let client_id = headers
        .get(pdserve_protocol::internal::REQUEST_ID_HEADER)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    tracing::info!(request_id = %request.id, client_request_id = %client_id, choices = prepared.prompts.len() as u32 * prepared.params.n, stream = prepared.params.stream, "request");
    let ctx = Ctx {
        header: header(s, &request, format, &prepared),
        tokenizer: s.frontend.tokenizer.clone(),
        request,
    };
    respond::respond(&s.dispatcher, ctx, prepared).await
}

/// The identity every object of the response shares.
fn header(s: &AppState, request: &Request, format: Format, prepared: &Prepared) -> Header {
    Header {
        id: request.id.clone(),
        created: unix_now(),
        model: s.frontend.model_name.clone(),
        fingerprint: format!("pdserve-{}", env!("CARGO_PKG_VERSION")),
        format,
        logprobs: prepared.params.logprobs,
        include_usage: prepared.params.include_usage,
    }
}

async fn models(State(s): State<Arc<AppState>>) -> Json<ModelList> {
    Json(ModelList {
        object: "list".into(),
        data: vec![ModelCard {
            id: s.frontend.model_name.clone(),
            object: "model".into(),
            created: s.started,
            owned_by: "pdserve".into(),
            max_model_len: s.frontend.context_length as u32,
        }],
    })
}

async fn tokenize(
    State(s): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<TokenizeResponse>, ApiError> {
    let req: TokenizeRequest = parse(body, s.frontend.limits.max_body_bytes)?;
    let (model, tokens) = match &req {
        TokenizeRequest::Prompt {
            model,
            prompt,
            add_special_tokens,
        } => (
            model,
            s.frontend
                .tokenize(prompt, add_special_tokens.unwrap_or(true))?,
        ),
        TokenizeRequest::Chat {
            model,
            messages,
            add_special_tokens,
            add_generation_prompt,
        } => {
            let mut tokens = s
                .frontend
                .chat_tokens(messages, add_generation_prompt.unwrap_or(true))?;
            let bos = s.frontend.tokenizer.bos_token_id();
            if add_special_tokens.unwrap_or(false)
                && s.frontend.tokenizer.adds_bos()
                && tokens.first() != bos.as_ref()
            {
                tokens.splice(0..0, bos);
            }
            (model, tokens)
        }
    };
    if let Some(m) = model {
        s.frontend.check_model(m)?;
    }
    Ok(Json(TokenizeResponse {
        count: tokens.len() as u32,
        tokens,
        max_model_len: s.frontend.context_length as u32,
    }))
}

async fn detokenize(
    State(s): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<DetokenizeResponse>, ApiError> {
    let req: DetokenizeRequest = parse(body, s.frontend.limits.max_body_bytes)?;
    if let Some(m) = &req.model {
        s.frontend.check_model(m)?;
    }
    Ok(Json(DetokenizeResponse {
        prompt: s.frontend.detokenize(&req.tokens)?,
    }))
}

async fn ready(State(s): State<Arc<AppState>>) -> StatusCode {
    match s.admission.is_accepting() && s.registry.has_ready(Pool::Decode) {
        true => StatusCode::OK,
        false => StatusCode::SERVICE_UNAVAILABLE,
    }
}

async fn metrics(State(s): State<Arc<AppState>>) -> impl IntoResponse {
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        s.metrics.render(&s.registry),
    )
}

async fn register(
    State(s): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Result<StatusCode, ApiError> {
    let reg: WorkerRegistration = parse(body, s.frontend.limits.max_body_bytes)?;
    if !(reg.url.starts_with("http://") || reg.url.starts_with("https://")) {
        return Err(ApiError::invalid(
            "url",
            "a worker URL starts with http:// or https://",
        ));
    }
    s.registry.register(&reg);
    Ok(StatusCode::NO_CONTENT)
}

async fn heartbeat(
    State(s): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Result<StatusCode, ApiError> {
    let hb: Heartbeat = parse(body, s.frontend.limits.max_body_bytes)?;
    match s.registry.heartbeat(&hb) {
        true => Ok(StatusCode::NO_CONTENT),
        // Unknown (the router restarted): the worker registers again.
        false => Ok(StatusCode::NOT_FOUND),
    }
}

async fn deregister(
    State(s): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Result<StatusCode, ApiError> {
    let d: Deregistration = parse(body, s.frontend.limits.max_body_bytes)?;
    s.registry.deregister(&d.url);
    Ok(StatusCode::NO_CONTENT)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn constant_time_comparison() {
        assert!(constant_time_eq(b"secret", b"secret"));
        assert!(!constant_time_eq(b"secret", b"secreT"));
        assert!(!constant_time_eq(b"secret", b"secret2"));
        assert!(!constant_time_eq(b"", b"x"));
    }
}
