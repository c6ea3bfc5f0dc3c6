//! Command-line flags (each with an environment variable), and the validated
//! configuration they become.

use std::path::PathBuf;
use std::time::Duration;

use clap::{Parser, ValueEnum};
use pdserve_runtime::auth::{InternalAuthArgs, Secret};
use pdserve_runtime::net::HostAllow;
use pdserve_runtime::telemetry::TelemetryArgs;

use crate::policy::prefix::PrefixTuning;

/// Where prompts are prefilled.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Mode {
    /// Every prompt on a prefill worker, its KV streamed to the decode worker.
    Disaggregated,
    /// Every prompt prefilled on the decode worker itself.
    Aggregated,
    /// Short prompts (below `--local-prefill-max-tokens`) and every prompt
    /// while no prefill worker is up are prefilled on the decode worker.
    Auto,
}

/// When `auto` mode also prefills longer prompts on their decode worker:
/// `off`, or while the least-loaded prefill worker has more than this many
/// prompt tokens pending (and the decode worker fewer).
/// The HTTP version of the router's calls to workers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum WorkerProtocol {
    Http1,
    Http2,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Spill {
    Off,
    Above(u64),
}

impl std::str::FromStr for Spill {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.trim() {
            "off" => Ok(Self::Off),
            n => n
                .parse()
                .map(Self::Above)
                .map_err(|_| format!("`{s}` is neither `off` nor a token count")),
        }
    }
}

impl std::fmt::Display for Spill {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Off => f.write_str("off"),
            Self::Above(n) => write!(f, "{n}"),
        }
    }
}

/// How a pool's worker is chosen.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum PolicyKind {
    /// KV-aware: the prompt blocks the worker's prefix cache lacks plus its
    /// load, with a fall-back to least-load when the pool is uneven.
    Prefix,
    /// Prefill: fewest pending prompt tokens. Decode: most free KV.
    LeastLoad,
    RoundRobin,
    /// Two random workers, the less loaded of them.
    PowerOfTwo,
}

/// pdserve router: the OpenAI-compatible API in front of the prefill and decode pools.
#[derive(Parser, Debug, Clone)]
#[command(name = "pdserve-router", version, about)]
pub struct Args {
    /// Address to listen on.
    #[arg(long, env = "PDSERVE_HOST", default_value = "127.0.0.1")]
    pub host: String,
    /// Port to listen on (0 picks a free one).
    #[arg(long, env = "PDSERVE_PORT", default_value_t = 8000)]
    pub port: u16,
    /// GGUF model file: the router reads its tokenizer, chat template and
    /// context length (not its weights); local workers load it.
    #[arg(long = "model", env = "PDSERVE_MODEL")]
    pub model: PathBuf,
    /// The model name clients send and `/v1/models` lists (default: the file name without `.gguf`).
    #[arg(long, env = "PDSERVE_SERVED_MODEL_NAME")]
    pub served_model_name: Option<String>,
    /// Where prompts are prefilled.
    #[arg(long, env = "PDSERVE_MODE", value_enum, default_value_t = Mode::Auto)]
    pub mode: Mode,
    /// In `auto` mode, prompts shorter than this are prefilled on the decode worker.
    #[arg(long, env = "PDSERVE_LOCAL_PREFILL_MAX_TOKENS", default_value_t = 32)]
    pub local_prefill_max_tokens: usize,
    /// In `auto` mode, longer prompts also go to their decode worker's own
    /// prefill while the least-loaded prefill worker has more than this many
    /// prompt tokens pending and the decode worker fewer, so a burst uses
    /// the decode workers' cores too; `off` never.
    #[arg(long, env = "PDSERVE_LOCAL_PREFILL_SPILL_TOKENS", default_value_t = Spill::Above(512))]
    pub local_prefill_spill_tokens: Spill,
    /// Static prefill workers (base URLs, comma-separated).
    #[arg(
        long = "prefill-url",
        env = "PDSERVE_PREFILL_URLS",
        value_delimiter = ','
    )]
    pub prefill_urls: Vec<String>,
    /// Static decode workers (base URLs, comma-separated).
    #[arg(
        long = "decode-url",
        env = "PDSERVE_DECODE_URLS",
        value_delimiter = ','
    )]
    pub decode_urls: Vec<String>,
    /// Prefill workers behind a headless service, `name:port`, re-resolved periodically.
    #[arg(long, env = "PDSERVE_PREFILL_DNS")]
    pub prefill_dns: Option<String>,
    /// Decode workers behind a headless service, `name:port`.
    #[arg(long, env = "PDSERVE_DECODE_DNS")]
    pub decode_dns: Option<String>,
    /// Seconds between DNS resolutions.
    #[arg(long, env = "PDSERVE_DNS_REFRESH_SECONDS", default_value_t = 5)]
    pub dns_refresh_seconds: u64,
    /// Milliseconds between health polls of static and DNS workers.
    #[arg(long, env = "PDSERVE_HEALTH_INTERVAL_MS", default_value_t = 1000)]
    pub health_interval_ms: u64,
    /// Milliseconds a health poll may take before it counts as failed (a
    /// worker is down after 3 failed polls in a row). Longer than the
    /// interval: a busy worker's answer waits behind its own work.
    #[arg(long, env = "PDSERVE_HEALTH_TIMEOUT_MS", default_value_t = 5000)]
    pub health_timeout_ms: u64,
    /// A worker not heard from (heartbeat or poll) for this long is removed.
    #[arg(long, env = "PDSERVE_WORKER_TIMEOUT_MS", default_value_t = 5000)]
    pub worker_timeout_ms: u64,
    /// How a prefill worker is chosen.
    #[arg(long, env = "PDSERVE_PREFILL_POLICY", value_enum, default_value_t = PolicyKind::Prefix)]
    pub prefill_policy: PolicyKind,
    /// How a decode worker is chosen.
    #[arg(long, env = "PDSERVE_DECODE_POLICY", value_enum, default_value_t = PolicyKind::Prefix)]
    pub decode_policy: PolicyKind,
    /// `prefix` policy: weight of a prompt block a worker would compute
    /// against a block of work it already has.
    #[arg(long, env = "PDSERVE_PREFIX_WEIGHT", default_value_t = 1.0)]
    pub prefix_weight: f64,
    /// `prefix` policy: least-load decides instead when the pool's loads
    /// differ by more than this many tokens...
    #[arg(
        long,
        env = "PDSERVE_PREFIX_BALANCE_ABS_TOKENS",
        default_value_t = 8192
    )]
    pub prefix_balance_abs_tokens: u64,
    /// ...and the most loaded worker has more than this factor of the least.
    #[arg(long, env = "PDSERVE_PREFIX_BALANCE_REL", default_value_t = 2.0)]
    pub prefix_balance_rel: f64,
    /// Accepted API keys (comma-separated); none means no authentication.
    #[arg(
        long = "api-key",
        env = "PDSERVE_API_KEYS",
        value_delimiter = ',',
        hide_env_values = true
    )]
    pub api_keys: Vec<Secret>,
    #[command(flatten)]
    pub internal: InternalAuthArgs,
    /// Hosts that may register as workers: CIDRs, addresses or host names
    /// (comma-separated); none: any host (with the internal token).
    #[arg(long, env = "PDSERVE_WORKER_ALLOW", value_delimiter = ',')]
    pub worker_allow: Vec<String>,
    /// Largest request body in bytes (413 above).
    #[arg(long, env = "PDSERVE_MAX_BODY_BYTES", default_value_t = 4 << 20)]
    pub max_body_bytes: usize,
    /// Memory for the tokens of long prompt segments that recur (a shared
    /// system prompt, a chat's earlier turns), in MiB, so they are not
    /// tokenized again; 0: none.
    #[arg(long, env = "PDSERVE_TOKENIZER_CACHE_MB", default_value_t = 64)]
    pub tokenizer_cache_mb: usize,
    /// Requests in flight at most; more get 429 with `Retry-After`.
    #[arg(long, env = "PDSERVE_MAX_CONCURRENT_REQUESTS", default_value_t = 4096)]
    pub max_concurrent_requests: usize,
    /// `max_tokens` when a request gives none (capped by the context window).
    #[arg(long, env = "PDSERVE_DEFAULT_MAX_TOKENS", default_value_t = 1024)]
    pub default_max_tokens: u32,
    /// Choices per request at most (`n`).
    #[arg(long, env = "PDSERVE_MAX_N", default_value_t = 16)]
    pub max_n: u32,
    /// A request's whole lifetime at most, in seconds (504 after).
    #[arg(long, env = "PDSERVE_REQUEST_TIMEOUT_SECONDS", default_value_t = 600)]
    pub request_timeout_seconds: u64,
    /// One prefill attempt at most (queue, compute and KV delivery), in seconds.
    #[arg(long, env = "PDSERVE_PREFILL_TIMEOUT_SECONDS", default_value_t = 60)]
    pub prefill_timeout_seconds: u64,
    /// Extra prefill attempts, on other workers, after a retryable failure.
    #[arg(long, env = "PDSERVE_PREFILL_RETRIES", default_value_t = 2)]
    pub prefill_retries: u32,
    /// Milliseconds to wait for a decode worker's answer (its reservation).
    #[arg(
        long,
        env = "PDSERVE_WORKER_CONNECT_TIMEOUT_MS",
        default_value_t = 10_000
    )]
    pub worker_connect_timeout_ms: u64,
    /// How the router talks to workers: `http2` multiplexes every request
    /// to one worker over one connection (cleartext, prior knowledge; a
    /// router holding 10,000 streams then holds one socket per worker, not
    /// one per stream); `http1` opens a connection per concurrent request,
    /// for a proxy in between that only speaks HTTP/1.1.
    #[arg(long, env = "PDSERVE_WORKER_PROTOCOL", value_enum, default_value_t = WorkerProtocol::Http2)]
    pub worker_protocol: WorkerProtocol,
    /// Decode workers tried before a request fails with 503.
    #[arg(long, env = "PDSERVE_DECODE_ATTEMPTS", default_value_t = 3)]
    pub decode_attempts: u32,
    /// Seconds to let in-flight requests finish after SIGTERM.
    #[arg(long, env = "PDSERVE_DRAIN_SECONDS", default_value_t = 30)]
    pub drain_seconds: u64,
    /// Times one stream may move to another decode worker after a failure
    /// (0: streams never migrate).
    #[arg(long, env = "PDSERVE_MIGRATION_LIMIT", default_value_t = 3)]
    pub migration_limit: u32,
    /// A stream migrates only while its prompt plus generated tokens, which
    /// the new worker prefills again, are at most this many.
    #[arg(long, env = "PDSERVE_MIGRATION_MAX_TOKENS", default_value_t = 16_384)]
    pub migration_max_tokens: usize,
    /// A decode worker that sends nothing for this long while a stream
    /// expects its next token is given up on: the stream migrates and the
    /// worker is quarantined (0: never).
    #[arg(long, env = "PDSERVE_STREAM_IDLE_TIMEOUT_MS", default_value_t = 10_000)]
    pub stream_idle_timeout_ms: u64,
    #[command(flatten)]
    pub sampling_defaults: crate::defaults::DefaultArgs,
    #[command(flatten)]
    pub local: crate::supervisor::LocalArgs,
    #[command(flatten)]
    pub autoscaler: crate::autoscaler::AutoscalerArgs,
    #[command(flatten)]
    pub telemetry: TelemetryArgs,
}

/// Dispatch settings, validated.
#[derive(Debug, Clone)]
pub struct DispatchConfig {
    pub mode: Mode,
    pub local_prefill_max_tokens: usize,
    pub local_prefill_spill: Spill,
    pub request_timeout: Duration,
    pub prefill_timeout: Duration,
    pub prefill_retries: u32,
    pub decode_attempts: u32,
    pub connect_timeout: Duration,
    pub worker_protocol: WorkerProtocol,
    pub migration: MigrationConfig,
}

/// When a broken stream moves to another decode worker.
#[derive(Debug, Clone)]
pub struct MigrationConfig {
    /// Migrations per stream at most.
    pub limit: u32,
    /// Prompt plus generated tokens a migration may prefill again, at most.
    pub max_tokens: usize,
    /// Silence after which a stream's worker is given up on; `None`: never.
    pub idle_timeout: Option<Duration>,
}

/// Front-end limits, validated.
#[derive(Debug, Clone)]
pub struct Limits {
    pub max_body_bytes: usize,
    /// The tokenizer's segment cache, in bytes (0: none).
    pub tokenizer_cache_bytes: usize,
    pub max_concurrent_requests: usize,
    pub default_max_tokens: u32,
    pub max_n: u32,
    /// `--default-*` sampling flags (resolved against the model file by the front end).
    pub sampling: crate::defaults::DefaultArgs,
}

impl Args {
    /// Checks the flags that can be wrong in ways clap cannot see.
    pub fn validate(&self) -> Result<(), String> {
        for url in self.prefill_urls.iter().chain(&self.decode_urls) {
            if !(url.starts_with("http://") || url.starts_with("https://")) {
                return Err(format!(
                    "worker URL {url:?} must start with http:// or https://"
                ));
            }
        }
        for dns in self.prefill_dns.iter().chain(&self.decode_dns) {
            crate::discovery::parse_host_port(dns)?;
        }
        self.autoscaler.validate()?;
        let finite = |x: f64| x.is_finite() && x >= 0.0;
        if !finite(self.prefix_weight) || !finite(self.prefix_balance_rel) {
            return Err(
                "--prefix-weight and --prefix-balance-rel must be finite and not negative".into(),
            );
        }
        self.worker_allow()?;
        let positive = [
            ("--max-body-bytes", self.max_body_bytes as u64),
            (
                "--max-concurrent-requests",
                self.max_concurrent_requests as u64,
            ),
            ("--default-max-tokens", self.default_max_tokens as u64),
            ("--max-n", self.max_n as u64),
            ("--request-timeout-seconds", self.request_timeout_seconds),
            ("--prefill-timeout-seconds", self.prefill_timeout_seconds),
            ("--decode-attempts", self.decode_attempts as u64),
        ];
        match positive.iter().find(|(_, v)| *v == 0) {
            Some((flag, _)) => Err(format!("{flag} must be at least 1")),
            None => Ok(()),
        }
    }

    pub fn dispatch(&self) -> DispatchConfig {
        DispatchConfig {
            mode: self.mode,
            local_prefill_max_tokens: self.local_prefill_max_tokens,
            local_prefill_spill: self.local_prefill_spill_tokens,
            request_timeout: Duration::from_secs(self.request_timeout_seconds),
            prefill_timeout: Duration::from_secs(self.prefill_timeout_seconds),
            prefill_retries: self.prefill_retries,
            decode_attempts: self.decode_attempts,
            connect_timeout: Duration::from_millis(self.worker_connect_timeout_ms.max(1)),
            worker_protocol: self.worker_protocol,
            migration: MigrationConfig {
                limit: self.migration_limit,
                max_tokens: self.migration_max_tokens,
                idle_timeout: (self.stream_idle_timeout_ms > 0)
                    .then(|| Duration::from_millis(self.stream_idle_timeout_ms)),
            },
        }
    }

    pub fn prefix_tuning(&self) -> PrefixTuning {
        PrefixTuning {
            weight: self.prefix_weight,
            balance_abs_tokens: self.prefix_balance_abs_tokens,
            balance_rel: self.prefix_balance_rel,
        }
    }

    pub fn limits(&self) -> Limits {
        Limits {
            max_body_bytes: self.max_body_bytes,
            tokenizer_cache_bytes: self.tokenizer_cache_mb.saturating_mul(1 << 20),
            max_concurrent_requests: self.max_concurrent_requests,
            default_max_tokens: self.default_max_tokens,
            max_n: self.max_n,
            sampling: self.sampling_defaults.clone(),
        }
    }

    /// `--worker-allow`, parsed.
    pub fn worker_allow(&self) -> Result<HostAllow, String> {
        HostAllow::parse(&self.worker_allow).map_err(|e| format!("--worker-allow: {e}"))
    }

    /// The name clients use for the model.
    pub fn model_name(&self) -> String {
        self.served_model_name.clone().unwrap_or_else(|| {
            let stem = self
                .model
                .file_name()
                .map(|s| s.to_string_lossy().into_owned());
            let stem = stem.unwrap_or_else(|| "model".into());
            stem.strip_suffix(".gguf").unwrap_or(&stem).to_string()
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(extra: &[&str]) -> Args {
        let mut argv = vec!["pdserve-router", "--model", "/m/SmolLM2.Q4_1.gguf"];
        argv.extend_from_slice(extra);
        Args::try_parse_from(argv).unwrap()
    }

    #[test]
    fn defaults_are_valid_and_name_the_model_after_the_file() {
        let a = args(&[]);
        assert!(a.validate().is_ok());
        assert_eq!(a.model_name(), "SmolLM2.Q4_1");
        assert_eq!(a.mode, Mode::Auto);
    }

    #[test]
    fn bad_flags_are_refused() {
        assert!(args(&["--decode-url", "localhost:1"]).validate().is_err());
        assert!(args(&["--prefill-dns", "no-port"]).validate().is_err());
        assert!(args(&["--max-n", "0"]).validate().is_err());
        let a = args(&[
            "--decode-url",
            "http://a:1,http://b:2",
            "--api-key",
            "k1,k2",
        ]);
        assert_eq!(a.decode_urls.len(), 2);
        let keys: Vec<&str> = a.api_keys.iter().map(|k| k.expose()).collect();
        assert_eq!(keys, vec!["k1", "k2"]);
        assert!(!format!("{a:?}").contains("k1"), "keys are redacted");
        assert!(Args::try_parse_from(["r", "--model", "m", "--api-key", ""]).is_err());
        assert!(args(&["--worker-allow", "10.0.0.0/99"]).validate().is_err());
    }
}
