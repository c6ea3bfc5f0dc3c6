//! Where a prefill worker may stream KV: only to the reservation URL of a
//! decode worker it knows, never to a URL a caller made up (an SSRF). The
//! decode workers come from `--decode-url`, from `--decode-dns` (resolved),
//! and from the router it registers with (`GET /v1/internal/workers`).
//! A destination not known is looked up again before it is refused, so a
//! decode worker that registered a moment ago is not refused; look-ups are
//! serialised, and jobs waiting behind one use its answer.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use pdserve_protocol::internal::{ErrorBody, ErrorKind, Pool, WorkerList};
use pdserve_runtime::auth::InternalToken;
use pdserve_runtime::net::worker_base;

use super::frames::DEFAULT_BUFFER_BYTES;

/// A prefill worker's network limits: where KV may go, how long a job may
/// take, how much KV may wait for a slow receiver.
#[derive(clap::Args, Debug, Clone)]
pub struct DestinationArgs {
    /// Decode workers this worker may stream KV to (base URLs,
    /// comma-separated), besides those its router lists.
    #[arg(
        long = "decode-url",
        env = "PDSERVE_DECODE_URLS",
        value_delimiter = ','
    )]
    pub decode_urls: Vec<String>,
    /// Decode workers behind a headless service, `name:port`: the addresses
    /// it resolves to may receive KV.
    #[arg(long, env = "PDSERVE_DECODE_DNS")]
    pub decode_dns: Option<String>,
    /// A job's deadline at most, in seconds, whatever the router asks.
    #[arg(long, env = "PDSERVE_MAX_JOB_SECONDS", default_value_t = 120)]
    pub max_job_seconds: u64,
    /// Bytes of one job's KV that may wait for a slow decode worker; beyond
    /// that the job fails (retryable) instead of stalling its batch.
    #[arg(long, env = "PDSERVE_KV_UPLOAD_BUFFER_BYTES", default_value_t = DEFAULT_BUFFER_BYTES)]
    pub kv_upload_buffer_bytes: u64,
    /// Carry a traced job's trace context in its KV stream's header frame
    /// too (it always goes in the HTTP header). Decode workers older than
    /// the frame's trace flag refuse such a stream (`bad_flags`): set it to
    /// false while they are upgraded.
    #[arg(long, env = "PDSERVE_KV_TRACE_CONTEXT", default_value_t = true, action = clap::ArgAction::Set)]
    pub kv_trace_context: bool,
}

/// Looked-up destinations are trusted this long, then looked up again.
const LEARNED_TTL: Duration = Duration::from_secs(30);

#[derive(Default)]
struct Learned {
    bases: HashSet<String>,
    at: Option<Instant>,
}

/// The decode workers a prefill worker may send KV to.
pub struct Destinations {
    fixed: HashSet<String>,
    dns: Option<String>,
    routers: Vec<String>,
    client: reqwest::Client,
    learned: tokio::sync::Mutex<Learned>,
}

impl Destinations {
    /// From the flags, the routers the worker registers with (if any) and
    /// the token its requests to them carry.
    pub fn new(
        args: &DestinationArgs,
        routers: &[String],
        token: &InternalToken,
    ) -> Result<Self, String> {
        let fixed = args
            .decode_urls
            .iter()
            .map(|u| worker_base(u).map_err(|e| format!("--decode-url: {e}")))
            .collect::<Result<_, _>>()?;
        let client = reqwest::Client::builder()
            .pool_idle_timeout(pdserve_runtime::net::POOL_IDLE_TIMEOUT)
            .default_headers(token.client_headers())
            .timeout(Duration::from_secs(2))
            .build()
            .map_err(|e| e.to_string())?;
        Ok(Self {
            fixed,
            dns: args.decode_dns.clone(),
            routers: routers
                .iter()
                .map(|r| r.trim_end_matches('/').to_string())
                .collect(),
            client,
            learned: Default::default(),
        })
    }

    /// Whether any source of decode workers is configured.
    pub fn has_sources(&self) -> bool {
        !self.fixed.is_empty() || self.dns.is_some() || !self.routers.is_empty()
    }

    /// Accepts `url` only as `<known decode worker>/v1/internal/kv/<request_id>`.
    pub async fn check(&self, url: &str, request_id: &str) -> Result<(), ErrorBody> {
        let base = reservation_base(url, request_id).map_err(|why| refused(url, &why))?;
        if self.fixed.contains(&base) {
            return Ok(());
        }
        if !self.has_sources() {
            return Err(refused(
                url,
                "this worker knows no decode workers (give it --router-url, --decode-url or --decode-dns)",
            ));
        }
        let mut learned = self.learned.lock().await;
        let fresh = learned.at.is_some_and(|t| t.elapsed() < LEARNED_TTL);
        if fresh && learned.bases.contains(&base) {
            return Ok(());
        }
        *learned = Learned {
            bases: self.look_up().await,
            at: Some(Instant::now()),
        };
        match learned.bases.contains(&base) {
            true => Ok(()),
            false => Err(refused(
                url,
                "not the reservation URL of a known decode worker",
            )),
        }
    }

    /// The decode workers the routers list and the DNS name resolves to: a
    /// router that is down lists nothing, the others still do.
    async fn look_up(&self) -> HashSet<String> {
        let mut bases = HashSet::new();
        for router in &self.routers {
            let url = format!("{router}/v1/internal/workers?pool=decode");
            let listed = async {
                let resp = self.client.get(&url).send().await.ok()?;
                resp.error_for_status()
                    .ok()?
                    .json::<WorkerList>()
                    .await
                    .ok()
            };
            match listed.await {
                Some(list) => bases.extend(
                    list.workers
                        .iter()
                        .filter(|w| w.pool == Pool::Decode)
                        .filter_map(|w| worker_base(&w.url).ok()),
                ),
                None => tracing::warn!(%url, "cannot list the router's decode workers"),
            }
        }
        if let Some(name) = &self.dns {
            match tokio::net::lookup_host(name.as_str()).await {
                Ok(addrs) => {
                    bases.extend(addrs.filter_map(|a| worker_base(&format!("http://{a}")).ok()))
                }
                Err(e) => tracing::warn!(%name, "cannot resolve the decode workers: {e}"),
            }
        }
        bases
    }
}

/// The normalised base of a reservation URL `<base>/v1/internal/kv/<id>`.
fn reservation_base(url: &str, request_id: &str) -> Result<String, String> {
    let (scheme, rest) = url.split_once("://").ok_or("not an absolute URL")?;
    let slash = rest.find('/').ok_or("no path")?;
    let (authority, path) = rest.split_at(slash);
    if path != format!("/v1/internal/kv/{request_id}") {
        return Err(format!("the path is not /v1/internal/kv/{request_id}"));
    }
    worker_base(&format!("{scheme}://{authority}"))
}

fn refused(url: &str, why: &str) -> ErrorBody {
    ErrorBody::fatal(
        ErrorKind::KvDestinationRefused,
        format!("kv_destination `{url}` refused: {why}"),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(urls: &[&str]) -> DestinationArgs {
        DestinationArgs {
            decode_urls: urls.iter().map(|s| s.to_string()).collect(),
            decode_dns: None,
            max_job_seconds: 120,
            kv_upload_buffer_bytes: DEFAULT_BUFFER_BYTES,
            kv_trace_context: true,
        }
    }

    #[tokio::test]
    async fn only_a_known_decode_workers_reservation_url_is_accepted() {
        let token = InternalToken::default();
        let d = Destinations::new(&args(&["http://10.0.0.2:8200"]), &[], &token).unwrap();
        assert!(d
            .check("http://10.0.0.2:8200/v1/internal/kv/r1", "r1")
            .await
            .is_ok());
        for bad in [
            "http://10.0.0.3:8200/v1/internal/kv/r1",
            "http://10.0.0.2:8200/v1/internal/kv/r2",
            "http://10.0.0.2:8200/v1/internal/kv/r1?x=1",
            "http://10.0.0.2:8201/v1/internal/kv/r1",
            "http://169.254.169.254/latest/meta-data",
            "http://u@10.0.0.2:8200/v1/internal/kv/r1",
            "file:///etc/passwd",
        ] {
            let e = d.check(bad, "r1").await.unwrap_err();
            assert_eq!(e.kind, ErrorKind::KvDestinationRefused, "{bad}");
        }
        let none = Destinations::new(&args(&[]), &[], &token).unwrap();
        assert!(!none.has_sources());
        assert!(none
            .check("http://10.0.0.2:8200/v1/internal/kv/r1", "r1")
            .await
            .is_err());
    }
}
