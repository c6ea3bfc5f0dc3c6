//! The internal plane's shared secret, and secrets that never reach a log.
//!
//! Every internal endpoint (the router's worker registration, the workers'
//! `/v1/internal/...` and `/load`) answers 401 unless the request carries
//! `Authorization: Bearer <token>`, compared in constant time; every
//! internal client sends it. `/health`, `/ready` and `/metrics` stay open.

use std::fmt;
use std::str::FromStr;
use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

/// A secret string (an API key, the internal token): `Debug` and `Display`
/// print `[redacted]`, so no log line or error message can hold it.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(Arc<str>);

impl Secret {
    pub fn new(value: impl Into<Arc<str>>) -> Self {
        Self(value.into())
    }

    /// The secret itself, for the one place that must send or compare it.
    pub fn expose(&self) -> &str {
        &self.0
    }

    /// Whether `given` is this secret, in time independent of where they differ.
    pub fn matches(&self, given: &[u8]) -> bool {
        constant_time_eq(self.0.as_bytes(), given)
    }

    /// 32 random bytes, hex: a fresh token for a cluster nobody gave one.
    pub fn generate() -> Self {
        let bytes: [u8; 32] = rand::random();
        Self::new(bytes.iter().map(|b| format!("{b:02x}")).collect::<String>())
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("[redacted]")
    }
}

impl fmt::Display for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("[redacted]")
    }
}

impl FromStr for Secret {
    type Err = String;

    /// A secret from a flag: not empty, no surrounding whitespace.
    fn from_str(s: &str) -> Result<Self, String> {
        match s.trim() {
            "" => Err("a secret must not be empty".into()),
            t => Ok(Self::new(t)),
        }
    }
}

/// Compares in time independent of where the inputs differ (the length is
/// not secret).
pub fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// The secret in an `Authorization: Bearer` header, or `""`.
pub fn bearer(headers: &HeaderMap) -> &str {
    headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .unwrap_or("")
}

/// Reads a token file (`--internal-token-file`), trimming whitespace.
fn read_token_file(path: &str) -> Result<Secret, String> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("reading the internal token file {path}: {e}"))?;
    text.parse()
        .map_err(|e| format!("the internal token file {path}: {e}"))
}

/// The internal token's flags, flattened into every binary's arguments.
#[derive(clap::Args, Debug, Clone, Default)]
pub struct InternalAuthArgs {
    /// Shared secret of the internal plane: every internal endpoint requires
    /// `Authorization: Bearer <token>` and every internal client sends it.
    /// Unset: the internal API is open (a warning is logged at start).
    #[arg(long, env = "PDSERVE_INTERNAL_TOKEN", hide_env_values = true)]
    pub internal_token: Option<Secret>,
    /// A file holding the internal token (used when --internal-token is not given).
    #[arg(long, env = "PDSERVE_INTERNAL_TOKEN_FILE", value_parser = read_token_file)]
    pub internal_token_file: Option<Secret>,
}

impl InternalAuthArgs {
    /// The token the flags give: `--internal-token`, else the file's.
    pub fn token(&self) -> InternalToken {
        InternalToken(
            self.internal_token
                .clone()
                .or_else(|| self.internal_token_file.clone()),
        )
    }
}

/// The internal plane's token, or none (open).
#[derive(Clone, Debug, Default)]
pub struct InternalToken(Option<Secret>);

impl InternalToken {
    pub fn new(secret: Option<Secret>) -> Self {
        Self(secret)
    }

    pub fn secret(&self) -> Option<&Secret> {
        self.0.as_ref()
    }

    pub fn is_set(&self) -> bool {
        self.0.is_some()
    }

    /// Whether a request with `headers` may use an internal endpoint.
    pub fn authorizes(&self, headers: &HeaderMap) -> bool {
        match &self.0 {
            Some(secret) => secret.matches(bearer(headers).as_bytes()),
            None => true,
        }
    }

    /// The headers every internal client sends (none when unset); the value
    /// is marked sensitive, so HTTP logging leaves it out.
    pub fn client_headers(&self) -> HeaderMap {
        let mut headers = HeaderMap::new();
        let value = self
            .0
            .as_ref()
            .and_then(|s| HeaderValue::from_str(&format!("Bearer {}", s.expose())).ok());
        if let Some(mut v) = value {
            v.set_sensitive(true);
            headers.insert(header::AUTHORIZATION, v);
        }
        headers
    }

    /// Logs, loudly, that the internal plane is open when no token is set.
    pub fn warn_if_unset(&self, binary: &str) {
        if !self.is_set() {
            tracing::warn!(
                "{binary}: NO INTERNAL TOKEN: anyone who can reach this process can use its \
                 internal API. Set PDSERVE_INTERNAL_TOKEN (or --internal-token-file) on the \
                 router and every worker."
            );
        }
    }

    /// `router`'s routes, each answering 401 without the token.
    pub fn protect<S: Clone + Send + Sync + 'static>(
        &self,
        router: axum::Router<S>,
    ) -> axum::Router<S> {
        router.route_layer(axum::middleware::from_fn_with_state(self.clone(), require))
    }
}

/// The 401 of a request without the right token, in the internal API's
/// error shape (`{class, kind, message}`).
pub fn unauthorized() -> Response {
    let body = r#"{"class":"fatal","kind":"unauthorized","message":"the internal API needs Authorization: Bearer <internal token>"}"#;
    (
        StatusCode::UNAUTHORIZED,
        [
            (header::CONTENT_TYPE, "application/json"),
            (header::WWW_AUTHENTICATE, "Bearer"),
        ],
        body,
    )
        .into_response()
}

async fn require(State(token): State<InternalToken>, req: Request, next: Next) -> Response {
    match token.authorizes(req.headers()) {
        true => next.run(req).await,
        false => unauthorized(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secrets_never_print() {
        let s: Secret = "hunter2".parse().unwrap();
        assert_eq!(format!("{s:?} {s}"), "[redacted] [redacted]");
        assert_eq!(s.expose(), "hunter2");
        assert!("  ".parse::<Secret>().is_err());
        assert_eq!(Secret::generate().expose().len(), 64);
    }

    #[test]
    fn constant_time_comparison() {
        assert!(constant_time_eq(b"secret", b"secret"));
        assert!(!constant_time_eq(b"secret", b"secreT"));
        assert!(!constant_time_eq(b"secret", b"secret2"));
        assert!(!constant_time_eq(b"", b"x"));
    }

    #[test]
    fn the_token_authorizes_only_its_bearer() {
        let token = InternalToken::new(Some("t0k".parse().unwrap()));
        let mut h = token.client_headers();
        assert!(token.authorizes(&h));
        h.insert(
            header::AUTHORIZATION,
            HeaderValue::from_static("Bearer t0K"),
        );
        assert!(!token.authorizes(&h));
        assert!(!token.authorizes(&HeaderMap::new()));
        assert!(InternalToken::default().authorizes(&HeaderMap::new()));
        assert!(InternalToken::default().client_headers().is_empty());
    }
}
