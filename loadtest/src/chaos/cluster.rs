//! A local cluster for one chaos case: a router and its workers as child
//! processes on 127.0.0.1, each known by its PID, so a case signals only
//! its own processes. Every process is killed when the cluster is dropped.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{bail, Context};
use serde_json::Value;

/// How long a process may take to listen.
const START_WITHIN: Duration = Duration::from_secs(60);

/// Which engine the workers run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
pub enum Engine {
    /// `pdserve-mock-worker`: the latency model, no weights.
    Mock,
    /// `pdserve-prefill` and `pdserve-decode` on the model's weights.
    Real,
}

/// One child process.
pub struct Proc {
    pub name: String,
    pub url: String,
    pub pid: u32,
    child: Child,
    log: Arc<Mutex<String>>,
}

impl Proc {
    /// Sends `signal` (`KILL`, `TERM`, `STOP`, `CONT`) to this process only.
    pub fn signal(&self, signal: &str) -> anyhow::Result<()> {
        let status = Command::new("kill")
            .args([&format!("-{signal}"), &self.pid.to_string()])
            .status()?;
        if !status.success() {
            bail!("kill -{signal} {} failed", self.pid);
        }
        Ok(())
    }

    /// Whether the process has exited.
    pub fn exited(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(Some(_)))
    }

    /// The last lines of its log, for a failure's detail.
    pub fn log_tail(&self, lines: usize) -> String {
        let log = self.log.lock().unwrap_or_else(|p| p.into_inner());
        let all: Vec<&str> = log.lines().collect();
        format!(
            "[{}] {}",
            self.name,
            all[all.len().saturating_sub(lines)..].join("\n")
        )
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// What a cluster is started with.
#[derive(Debug, Clone)]
pub struct Setup {
    pub bin_dir: PathBuf,
    pub model: PathBuf,
    pub engine: Engine,
    pub token: String,
    /// Extra router flags for this case.
    pub router_args: Vec<String>,
}

/// A router and its workers.
pub struct Cluster {
    pub setup: Setup,
    pub router: Proc,
    pub prefill: Vec<Proc>,
    pub decode: Vec<Proc>,
    pub client: reqwest::Client,
}

impl Cluster {
    /// Starts a router, then `prefill` and `decode` workers registering with
    /// it (`worker_args` go to every worker), and waits until all are ready.
    pub async fn start(
        setup: &Setup,
        (prefill, decode): (usize, usize),
        worker_args: &[&str],
    ) -> anyhow::Result<Self> {
        let router = start_router(setup, None).await?;
        let mut cluster = Cluster {
            setup: setup.clone(),
            router,
            prefill: Vec::new(),
            decode: Vec::new(),
            client: reqwest::Client::new(),
        };
        for _ in 0..prefill {
            let p = cluster.worker("prefill", worker_args).await?;
            cluster.prefill.push(p);
        }
        for _ in 0..decode {
            let d = cluster.worker("decode", worker_args).await?;
            cluster.decode.push(d);
        }
        cluster.wait_workers(prefill, decode, START_WITHIN).await?;
        Ok(cluster)
    }

    /// Starts one worker of `pool` registering with the router.
    pub async fn worker(&self, pool: &str, extra: &[&str]) -> anyhow::Result<Proc> {
        self.worker_at(pool, "0", extra).await
    }

    /// Starts one worker of `pool` on `port`.
    pub async fn worker_at(&self, pool: &str, port: &str, extra: &[&str]) -> anyhow::Result<Proc> {
        let s = &self.setup;
        let model = s.model.to_string_lossy().to_string();
        let mut args: Vec<String> = match s.engine {
            Engine::Mock => vec!["--pool".into(), pool.into()],
            Engine::Real => vec!["--threads".into(), "1".into()],
        };
        args.extend(["--model".into(), model, "--port".into(), port.into()]);
        args.extend(["--router-url".into(), self.router.url.clone()]);
        args.extend(["--heartbeat-ms".into(), "200".into()]);
        args.extend(extra.iter().map(|a| a.to_string()));
        let exe = match (s.engine, pool) {
            (Engine::Mock, _) => "pdserve-mock-worker",
            (Engine::Real, "prefill") => "pdserve-prefill",
            (Engine::Real, _) => "pdserve-decode",
        };
        spawn(&s.bin_dir.join(exe), &args, &s.token, pool).await
    }

    /// Replaces the router with a new one on the same port.
    pub async fn restart_router(&mut self) -> anyhow::Result<()> {
        let port = self
            .router
            .url
            .rsplit(':')
            .next()
            .unwrap_or("0")
            .to_string();
        self.router.signal("KILL")?;
        let _ = self.router.child.wait();
        self.router = start_router(&self.setup, Some(&port)).await?;
        Ok(())
    }

    /// Waits until the router lists `prefill` and `decode` ready workers.
    pub async fn wait_workers(
        &self,
        prefill: usize,
        decode: usize,
        within: Duration,
    ) -> anyhow::Result<Duration> {
        let started = tokio::time::Instant::now();
        loop {
            let (p, d) = self.ready_workers().await;
            if p >= prefill && d >= decode {
                return Ok(started.elapsed());
            }
            if started.elapsed() > within {
                bail!("{p} prefill and {d} decode workers ready, wanted {prefill} and {decode}");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Ready workers per pool, as the router lists them.
    pub async fn ready_workers(&self) -> (usize, usize) {
        let url = format!("{}/v1/internal/workers", self.router.url);
        let resp = self.client.get(url).bearer_auth(&self.setup.token).send();
        let Ok(Ok(resp)) = tokio::time::timeout(Duration::from_secs(2), resp).await else {
            return (0, 0);
        };
        let v: Value = resp.json().await.unwrap_or_default();
        let workers = v["workers"].as_array().cloned().unwrap_or_default();
        let count = |pool: &str| {
            let ready = |w: &&Value| w["pool"] == pool && w["health"] == "ready";
            workers.iter().filter(ready).count()
        };
        (count("prefill"), count("decode"))
    }

    /// A worker's `/load` report.
    pub async fn load(&self, url: &str) -> Option<Value> {
        let req = self
            .client
            .get(format!("{url}/load"))
            .bearer_auth(&self.setup.token);
        let resp = tokio::time::timeout(Duration::from_secs(2), req.send()).await;
        resp.ok()?.ok()?.json().await.ok()
    }

    /// The sum of one metric's samples on a process's `/metrics`.
    pub async fn metric(&self, url: &str, name: &str) -> Option<f64> {
        let req = self.client.get(format!("{url}/metrics")).send();
        let text = tokio::time::timeout(Duration::from_secs(2), req)
            .await
            .ok()?
            .ok()?;
        let text = text.text().await.ok()?;
        Some(crate::chaos::sum_metric(&text, name))
    }
}

/// Starts the router (on `port`, or a free one).
async fn start_router(setup: &Setup, port: Option<&str>) -> anyhow::Result<Proc> {
    let model = setup.model.to_string_lossy().to_string();
    let mut args: Vec<String> = vec!["--model".into(), model];
    args.extend(["--port".into(), port.unwrap_or("0").into()]);
    args.extend(["--mode".into(), "disaggregated".into()]);
    args.extend(["--health-interval-ms".into(), "200".into()]);
    args.extend(setup.router_args.iter().cloned());
    spawn(
        &setup.bin_dir.join("pdserve-router"),
        &args,
        &setup.token,
        "router",
    )
    .await
}

/// Starts `exe` with the internal token in its environment and waits until
/// it logs the address it listens on.
async fn spawn(exe: &Path, args: &[String], token: &str, name: &str) -> anyhow::Result<Proc> {
    let mut child = Command::new(exe)
        .args(args)
        .env("PDSERVE_INTERNAL_TOKEN", token)
        .env("PDSERVE_LOG", "info")
        .env("CANDLE_NUM_THREADS", "1")
        .env("RAYON_NUM_THREADS", "1")
        .env_remove("PDSERVE_LOG_JSON")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("starting {}", exe.display()))?;
    let log = Arc::new(Mutex::new(String::new()));
    let (tx, rx) = tokio::sync::oneshot::channel();
    let stderr = child.stderr.take().context("stderr is piped")?;
    let keep = log.clone();
    std::thread::spawn(move || read_log(stderr, keep, tx));
    let pid = child.id();
    let mut proc = Proc {
        name: name.to_string(),
        url: String::new(),
        pid,
        child,
        log,
    };
    match tokio::time::timeout(START_WITHIN, rx).await {
        Ok(Ok(addr)) => {
            proc.url = format!("http://{addr}");
            Ok(proc)
        }
        _ => bail!("{} did not start: {}", exe.display(), proc.log_tail(20)),
    }
}

/// Keeps the child's log and reports the `addr=` of its "listening" line.
fn read_log(
    stderr: std::process::ChildStderr,
    log: Arc<Mutex<String>>,
    addr: tokio::sync::oneshot::Sender<String>,
) {
    let mut addr = Some(addr);
    for line in BufReader::new(stderr).lines().map_while(Result::ok) {
        if line.contains("listening") {
            let found = line
                .split_whitespace()
                .find_map(|w| w.strip_prefix("addr="));
            if let (Some(a), Some(tx)) = (found, addr.take()) {
                let _ = tx.send(a.trim_matches('"').to_string());
            }
        }
        let mut log = log.lock().unwrap_or_else(|p| p.into_inner());
        log.push_str(&line);
        log.push('\n');
        // Bounded: keep the last 256 KiB.
        if log.len() > 512 << 10 {
            let cut = log.len() - (256 << 10);
            let cut = (cut..log.len())
                .find(|&i| log.is_char_boundary(i))
                .unwrap_or(0);
            log.drain(..cut);
        }
    }
}
