//! HTTP handlers. They only translate: admit (request), parse and validate
//! (front end), start sequences and answer (respond). Errors are `ApiError`s.

use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, Query, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use pdserve_protocol::internal::{
    Deregistration, Heartbeat, Pool, WorkerList, WorkerListing, WorkerRegistration,
};
use pdserve_protocol::openai::{
    ChatCompletionRequest, CompletionRequest, DetokenizeRequest, DetokenizeResponse, ModelCard,
    ModelList, TokenizeRequest, TokenizeResponse,
};
use pdserve_runtime::auth::{InternalToken, Secret};
use pdserve_runtime::metrics::labels;
use pdserve_runtime::net::{host_of, worker_base, HostAllow};
use serde::de::DeserializeOwned;
use tracing::Instrument;

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
    pub api_keys: Vec<Secret>,
    /// What the internal endpoints require.
    pub internal: InternalToken,
    /// Hosts that may register as workers.
    pub worker_allow: HostAllow,
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
    let internal = Router::new()
        .route("/v1/internal/workers", get(list_workers))
        .route("/v1/internal/workers/register", post(register))
        .route("/v1/internal/workers/heartbeat", post(heartbeat))
        .route("/v1/internal/workers/deregister", post(deregister));
    Router::new()
        .merge(public)
        .merge(state.internal.protect(internal))
        .route("/health", get(|| async { "ok" }))
        .route("/ready", get(ready))
        .route("/metrics", get(metrics))
        .fallback(|uri: axum::http::Uri| async move { ApiError::NotFound(uri.path().to_string()) })
        .layer(DefaultBodyLimit::max(state.frontend.limits.max_body_bytes))
        .with_state(state)
}

async fn authorize(
    State(s): State<Arc<AppState>>,
    req: axum::extract::Request,
    next: Next,
) -> Response {
    if s.api_keys.is_empty() {
        return next.run(req).await;
    }
    let given = pdserve_runtime::auth::bearer(req.headers());
    let ok = s
        .api_keys
        .iter()
        .fold(false, |ok, k| ok | k.matches(given.as_bytes()));
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
    prepare: impl Fn(&Frontend, &R) -> Result<Prepared, ApiError> + Send + 'static,
) -> Response {
    let (endpoint, prefix) = match format {
        Format::Chat => (labels::ENDPOINT_CHAT, "chatcmpl"),
        Format::Completion => (labels::ENDPOINT_COMPLETIONS, "cmpl"),
    };
    let mut request = s.admission.begin(endpoint, prefix);
    let operation = match format {
        Format::Chat => "chat",
        Format::Completion => "text_completion",
    };
    let model = &s.frontend.model_name;
    request.span = crate::trace::request_span(operation, model, &request.id, headers);
    let prepared = match request.admitted() {
        Ok(()) => {
            let st = s.clone();
            off_runtime(is_light(&body), move || {
                let req: R = parse(body, st.frontend.limits.max_body_bytes)?;
                prepare(&st.frontend, &req)
            })
            .await
        }
        Err(e) => Err(e),
    };
    let prepared = match prepared {
        Ok(p) => p,
        Err(e) => return request.refuse(e),
    };
    let client_id = headers
        .get(pdserve_protocol::internal::REQUEST_ID_HEADER)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    crate::trace::record_params(&request.span, &prepared.params);
    let span = request.span.clone();
    span.in_scope(|| tracing::info!(request_id = %request.id, client_request_id = %client_id, choices = prepared.prompts.len() as u32 * prepared.params.n, stream = prepared.params.stream, "request"));
    let ctx = Ctx {
        header: header(s, &request, format, &prepared),
        tokenizer: s.frontend.tokenizer.clone(),
        request,
    };
    respond::respond(&s.dispatcher, ctx, prepared)
        .instrument(span)
        .await
}

/// Bodies up to this size are prepared on the runtime's thread: parsing,
/// templating and tokenizing one takes tens of microseconds (about 50 for
/// a 200-character chat), less than the hop to the blocking pool and back,
/// which wakes two threads on every request.
const INLINE_BODY_BYTES: usize = 1024;

/// Whether a body is cheap enough to prepare without leaving the runtime:
/// small, and asking for nothing that compiles a grammar.
fn is_light(body: &Result<Bytes, BytesRejection>) -> bool {
    let Ok(body) = body else {
        return true;
    };
    let has = |needle: &[u8]| body.windows(needle.len()).any(|w| w == needle);
    body.len() <= INLINE_BODY_BYTES && !has(b"\"response_format\"") && !has(b"\"tools\"")
}

/// Runs CPU-heavy request work (parsing, templating, tokenizing up to the
/// body limit, compiling grammars) on the blocking pool, not on the async
/// runtime's threads, unless it is `light`.
async fn off_runtime<T: Send + 'static>(
    light: bool,
    work: impl FnOnce() -> Result<T, ApiError> + Send + 'static,
) -> Result<T, ApiError> {
    if light {
        return work();
    }
    tokio::task::spawn_blocking(work)
        .await
        .unwrap_or_else(|e| Err(ApiError::Internal(format!("preparing the request: {e}"))))
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
        parse_calls: prepared.parse_calls,
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
    off_runtime(is_light(&body), move || tokenize_now(&s, body))
        .await
        .map(Json)
}

fn tokenize_now(
    s: &AppState,
    body: Result<Bytes, BytesRejection>,
) -> Result<TokenizeResponse, ApiError> {
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
    Ok(TokenizeResponse {
        count: tokens.len() as u32,
        tokens,
        max_model_len: s.frontend.context_length as u32,
    })
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
    match s.admission.is_accepting() && s.dispatcher.can_serve() {
        true => StatusCode::OK,
        false => StatusCode::SERVICE_UNAVAILABLE,
    }
}

async fn metrics(State(s): State<Arc<AppState>>) -> impl IntoResponse {
    s.metrics
        .record_tokenizer(s.frontend.tokenizer.segment_stats());
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        s.metrics.render(&s.registry),
    )
}

async fn register(
    State(s): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Result<StatusCode, ApiError> {
    let mut reg: WorkerRegistration = parse(body, s.frontend.limits.max_body_bytes)?;
    reg.url = worker_base(&reg.url).map_err(|e| ApiError::invalid("url", e))?;
    if !s.worker_allow.allows(host_of(&reg.url)) {
        tracing::warn!(url = %reg.url, "refused a registration from a host --worker-allow does not list");
        return Err(ApiError::Forbidden(format!(
            "{} may not register: its host is not in --worker-allow",
            reg.url
        )));
    }
    if let Some(id) = &reg.worker_id {
        pdserve_protocol::internal::validate_request_id(id)
            .map_err(|_| ApiError::invalid("worker_id", "1..=128 printable ASCII characters"))?;
    }
    s.registry.register(&reg).map_err(|e| {
        tracing::warn!(url = %reg.url, "refused a registration: {e}");
        ApiError::Conflict(e)
    })?;
    Ok(StatusCode::NO_CONTENT)
}

#[derive(serde::Deserialize)]
struct ListQuery {
    pool: Option<Pool>,
}

/// `GET /v1/internal/workers[?pool=decode]`: the workers the router knows.
async fn list_workers(
    State(s): State<Arc<AppState>>,
    Query(q): Query<ListQuery>,
) -> Json<WorkerList> {
    let workers = s
        .registry
        .list()
        .into_iter()
        .filter(|(_, pool, _)| q.pool.is_none_or(|p| p == *pool))
        .map(|(url, pool, health)| WorkerListing {
            url,
            pool,
            health: health.label().to_string(),
        })
        .collect();
    Json(WorkerList { workers })
}

async fn heartbeat(
    State(s): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Result<StatusCode, ApiError> {
    let mut hb: Heartbeat = parse(body, s.frontend.limits.max_body_bytes)?;
    // As registered: the normalised form of the worker's URL.
    hb.url = worker_base(&hb.url).unwrap_or(hb.url);
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
    s.registry.deregister(&worker_base(&d.url).unwrap_or(d.url));
    Ok(StatusCode::NO_CONTENT)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_plain_bodies_are_prepared_inline_and_grammars_are_not() {
        let body = |s: &str| Ok(Bytes::from(s.to_string()));
        let chat = r#"{"messages":[{"role":"user","content":"hi"}]}"#;
        assert!(is_light(&body(chat)));
        let format = r#"{"messages":[],"response_format":{"type":"json_object"}}"#;
        assert!(!is_light(&body(format)));
        assert!(!is_light(&body(r#"{"messages":[],"tools":[]}"#)));
        assert!(!is_light(&body(&"x".repeat(INLINE_BODY_BYTES + 1))));
    }
}
