//! The chaos cases. Each starts its own cluster, runs a load, injects one
//! fault into its own child processes, and checks what clients saw and
//! what the processes hold afterwards.

use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure};
use futures_util::future::BoxFuture;

use super::client::{Answer, Ask, Client};
use super::cluster::{Cluster, Setup};
use super::proxy::{self, Fault, Plan};
use super::ChaosArgs;

/// What a case measured, as `name=value` pairs.
pub type Measured = Vec<(String, String)>;

/// One case: its name, its time limit, and how to run it.
pub struct Case {
    pub name: &'static str,
    pub limit_seconds: u64,
    pub run: fn(Ctx) -> BoxFuture<'static, anyhow::Result<Measured>>,
}

pub const CASES: &[Case] = &[
    Case {
        name: "SIGKILL a decode worker mid-stream",
        limit_seconds: 180,
        run: |c| Box::pin(kill_decode(c)),
    },
    Case {
        name: "SIGKILL a prefill worker mid-prefill",
        limit_seconds: 180,
        run: |c| Box::pin(kill_prefill(c)),
    },
    Case {
        name: "SIGSTOP a decode worker",
        limit_seconds: 240,
        run: |c| Box::pin(stop_decode(c)),
    },
    Case {
        name: "KV stream cut and stalled by a proxy",
        limit_seconds: 180,
        run: |c| Box::pin(kv_proxy(c)),
    },
    Case {
        name: "scale-down of a decode worker (SIGTERM)",
        limit_seconds: 180,
        run: |c| Box::pin(drain_decode(c)),
    },
    Case {
        name: "disconnect storm",
        limit_seconds: 120,
        run: |c| Box::pin(disconnect_storm(c)),
    },
    Case {
        name: "overload burst of 10x the concurrency limit",
        limit_seconds: 180,
        run: |c| Box::pin(overload(c)),
    },
    Case {
        name: "router restart with workers up",
        limit_seconds: 120,
        run: |c| Box::pin(router_restart(c)),
    },
];

/// What every case gets.
pub struct Ctx {
    setup: Setup,
    streams: usize,
    max_tokens: u32,
    stop_seconds: u64,
}

impl Ctx {
    pub fn new(args: &ChaosArgs, bin_dir: &Path) -> Self {
        let token = format!("chaos-{:x}", rand::random::<u64>());
        let idle = args.idle_timeout_ms.to_string();
        Self {
            setup: Setup {
                bin_dir: bin_dir.to_path_buf(),
                model: args.model.clone(),
                engine: args.engine,
                token,
                router_args: vec!["--stream-idle-timeout-ms".into(), idle],
            },
            streams: args.streams.max(2),
            max_tokens: args.max_tokens.max(8),
            stop_seconds: args.stop_seconds,
        }
    }

    fn with_router_args(mut self, extra: &[&str]) -> Self {
        self.setup
            .router_args
            .extend(extra.iter().map(|s| s.to_string()));
        self
    }

    async fn cluster(
        &self,
        pools: (usize, usize),
        worker_args: &[&str],
    ) -> anyhow::Result<Cluster> {
        Cluster::start(&self.setup, pools, worker_args).await
    }
}

fn client(c: &Cluster) -> Client {
    let model = c
        .setup
        .model
        .file_stem()
        .unwrap_or_default()
        .to_string_lossy()
        .into_owned();
    Client {
        http: reqwest::Client::new(),
        url: c.router.url.clone(),
        model,
    }
}

/// A load running in the background, and the text chunks it has received.
struct Load {
    progress: Arc<AtomicUsize>,
    task: tokio::task::JoinHandle<Vec<Answer>>,
}

impl Load {
    fn spawn(client: &Client, asks: &[Ask], drop_after_first: bool) -> Self {
        let progress = Arc::new(AtomicUsize::new(0));
        let runs: Vec<_> = asks
            .iter()
            .map(|a| {
                let (c, a, p) = (client.clone(), a.clone(), progress.clone());
                tokio::spawn(async move { c.stream(&a, Some(p), drop_after_first).await })
            })
            .collect();
        let task = tokio::spawn(async move {
            let mut out = Vec::new();
            for r in runs {
                out.push(r.await.unwrap_or_default());
            }
            out
        });
        Self { progress, task }
    }

    /// Waits (bounded) until `chunks` text chunks have arrived in all.
    async fn reached(&self, chunks: usize, within: Duration) -> anyhow::Result<()> {
        let start = Instant::now();
        while self.progress.load(Ordering::Relaxed) < chunks {
            ensure!(
                start.elapsed() < within,
                "the load made too little progress"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        Ok(())
    }

    async fn answers(self) -> anyhow::Result<Vec<Answer>> {
        Ok(self.task.await?)
    }
}

/// Runs `asks` with no fault: the reference texts.
async fn reference(c: &Cluster, asks: &[Ask]) -> anyhow::Result<Vec<Answer>> {
    let answers = Load::spawn(&client(c), asks, false).answers().await?;
    let failed = answers.iter().filter(|a| !a.ok()).count();
    ensure!(
        failed == 0,
        "{failed} requests failed without a fault: {:?}",
        first_error(&answers)
    );
    Ok(answers)
}

fn first_error(answers: &[Answer]) -> Option<String> {
    answers
        .iter()
        .find(|a| !a.ok())
        .map(|a| format!("{} {:?}", a.status, a.error))
}

/// Checks that every answer succeeded with the reference's text, token
/// count and log-probabilities.
fn same_as(reference: &[Answer], answers: &[Answer], m: &mut Measured) -> anyhow::Result<()> {
    let failed = answers.iter().filter(|a| !a.ok()).count();
    let close = |x: &Vec<f64>, y: &Vec<f64>| {
        x.len() == y.len() && x.iter().zip(y).all(|(a, b)| (a - b).abs() < 1e-3)
    };
    let same = |r: &Answer, a: &Answer| {
        let lp = r.logprobs.len() == a.logprobs.len()
            && r.logprobs.iter().zip(&a.logprobs).all(|(x, y)| close(x, y));
        let usage =
            (r.prompt_tokens, r.completion_tokens) == (a.prompt_tokens, a.completion_tokens);
        r.texts == a.texts && usage && lp
    };
    let differ = reference
        .iter()
        .zip(answers)
        .filter(|(r, a)| a.ok() && !same(r, a))
        .count();
    m.push(("failed".into(), failed.to_string()));
    m.push(("differ".into(), differ.to_string()));
    ensure!(
        failed == 0,
        "{failed} requests failed: {:?}",
        first_error(answers)
    );
    ensure!(differ == 0, "{differ} texts differ from the fault-free run");
    Ok(())
}

/// The decode worker running the most sequences now.
async fn busiest_decode(c: &Cluster) -> usize {
    let mut best = (0, 0);
    for (i, d) in c.decode.iter().enumerate() {
        let load = c.load(&d.url).await.unwrap_or_default();
        let active = load["active_sequences"].as_u64().unwrap_or(0);
        if active > best.1 {
            best = (i, active);
        }
    }
    best.0
}

/// Migrations the router counted (all reasons, `migrated` outcome).
async fn migrations(c: &Cluster) -> f64 {
    let text = c
        .client
        .get(format!("{}/metrics", c.router.url))
        .send()
        .await;
    let text = match text {
        Ok(r) => r.text().await.unwrap_or_default(),
        Err(_) => return 0.0,
    };
    text.lines()
        .filter(|l| {
            l.starts_with("pdserve_migrations_total{") && l.contains("outcome=\"migrated\"")
        })
        .filter_map(|l| l.rsplit_once(' ')?.1.parse::<f64>().ok())
        .sum()
}

/// Waits (bounded) until the decode workers still up hold no KV and the
/// router has nothing in flight; returns how long that took.
async fn settles(c: &Cluster, within: Duration) -> anyhow::Result<Duration> {
    let start = Instant::now();
    loop {
        let mut held = 0.0;
        for d in &c.decode {
            held += c
                .metric(&d.url, "pdserve_kv_cache_used_tokens")
                .await
                .unwrap_or(0.0);
        }
        let in_flight = c
            .metric(&c.router.url, "pdserve_requests_in_flight")
            .await
            .unwrap_or(0.0);
        if held == 0.0 && in_flight == 0.0 {
            return Ok(start.elapsed());
        }
        ensure!(
            start.elapsed() < within,
            "after {within:?}: {held} KV tokens held, {in_flight} requests in flight"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Case 1: SIGKILL the busiest decode worker once every stream has tokens.
async fn kill_decode(ctx: Ctx) -> anyhow::Result<Measured> {
    let mut c = ctx.cluster((2, 2), &[]).await?;
    let asks = Ask::batch(ctx.streams, 24, ctx.max_tokens);
    let reference = reference(&c, &asks).await?;
    let load = Load::spawn(&client(&c), &asks, false);
    load.reached(ctx.streams * 3, Duration::from_secs(60))
        .await?;
    let victim = busiest_decode(&c).await;
    c.decode[victim].signal("KILL")?;
    let answers = load.answers().await?;
    let mut m = vec![("migrated".into(), migrations(&c).await.to_string())];
    same_as(&reference, &answers, &mut m)?;
    ensure!(
        migrations(&c).await > 0.0,
        "no stream migrated: the fault hit nothing"
    );
    c.decode.remove(victim);
    m.push((
        "settled_s".into(),
        format!(
            "{:.2}",
            settles(&c, Duration::from_secs(10)).await?.as_secs_f64()
        ),
    ));
    Ok(m)
}

/// Case 2: SIGKILL a prefill worker while it computes long prompts.
async fn kill_prefill(ctx: Ctx) -> anyhow::Result<Measured> {
    let mut c = ctx.cluster((2, 2), &[]).await?;
    let asks = Ask::batch(ctx.streams, 50, ctx.max_tokens.min(16));
    let load = Load::spawn(&client(&c), &asks, false);
    let start = Instant::now();
    let victim = loop {
        if let Some(i) = busy_prefill(&c).await {
            break i;
        }
        if load.task.is_finished() {
            let answers = load.answers().await?;
            bail!(
                "the load ended before a prefill worker had work: {:?}",
                first_error(&answers)
            );
        }
        ensure!(
            start.elapsed() < Duration::from_secs(30),
            "no prefill worker got work"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    };
    c.prefill[victim].signal("KILL")?;
    let answers = load.answers().await?;
    c.prefill.remove(victim);
    let failed = answers.iter().filter(|a| !a.ok()).count();
    let retries = c
        .metric(&c.router.url, "pdserve_prefill_retries_total")
        .await
        .unwrap_or(0.0);
    let m = vec![
        ("failed".into(), failed.to_string()),
        ("prefill_retries".into(), retries.to_string()),
    ];
    ensure!(
        failed == 0,
        "{failed} requests failed: {:?}",
        first_error(&answers)
    );
    ensure!(
        retries > 0.0,
        "no prefill was retried: the fault hit nothing"
    );
    Ok(m)
}

/// A prefill worker with work queued or running.
async fn busy_prefill(c: &Cluster) -> Option<usize> {
    for (i, p) in c.prefill.iter().enumerate() {
        let load = c.load(&p.url).await.unwrap_or_default();
        let n = |k: &str| load[k].as_u64().unwrap_or(0);
        if n("active_sequences") + n("queued_requests") > 0 {
            return Some(i);
        }
    }
    None
}

/// Case 3: SIGSTOP the busiest decode worker; its streams migrate after the
/// idle timeout; after SIGCONT it frees their KV.
async fn stop_decode(ctx: Ctx) -> anyhow::Result<Measured> {
    let c = ctx.cluster((2, 2), &[]).await?;
    let asks = Ask::batch(ctx.streams, 24, ctx.max_tokens);
    let reference = reference(&c, &asks).await?;
    let load = Load::spawn(&client(&c), &asks, false);
    load.reached(ctx.streams * 3, Duration::from_secs(60))
        .await?;
    let victim = busiest_decode(&c).await;
    c.decode[victim].signal("STOP")?;
    let stopped = Instant::now();
    let answers = load.answers().await?;
    let served_in = stopped.elapsed();
    let wait = Duration::from_secs(ctx.stop_seconds).saturating_sub(stopped.elapsed());
    tokio::time::sleep(wait).await;
    c.decode[victim].signal("CONT")?;
    let mut m = vec![(
        "all_done_after_stop_s".into(),
        format!("{:.1}", served_in.as_secs_f64()),
    )];
    m.push(("migrated".into(), migrations(&c).await.to_string()));
    same_as(&reference, &answers, &mut m)?;
    let freed = settles(&c, Duration::from_secs(15)).await?;
    m.push((
        "kv_freed_after_cont_s".into(),
        format!("{:.2}", freed.as_secs_f64()),
    ));
    Ok(m)
}

/// Case 4: KV uploads to one decode worker are cut, to another stalled.
async fn kv_proxy(ctx: Ctx) -> anyhow::Result<Measured> {
    let ctx = ctx.with_router_args(&["--prefill-timeout-seconds", "4"]);
    let mut c = ctx.cluster((2, 0), &[]).await?;
    let mut proxies = Vec::new();
    for fault in [Fault::Cut, Fault::Stall] {
        let port = free_port()?;
        let plan = Plan {
            fault,
            faults: 2,
            after_bytes: 600,
        };
        let p = proxy::start(format!("127.0.0.1:{port}"), plan).await?;
        let public = format!("http://{}", p.addr);
        let port = port.to_string();
        let extra = ["--kv-idle-timeout-ms", "1000", "--public-url", &public];
        c.decode.push(c.worker_at("decode", &port, &extra).await?);
        proxies.push(p);
    }
    c.wait_workers(2, 2, Duration::from_secs(60)).await?;
    let asks = Ask::batch(ctx.streams, 24, ctx.max_tokens.min(16));
    let answers = Load::spawn(&client(&c), &asks, false).answers().await?;
    let failed = answers.iter().filter(|a| !a.ok()).count();
    let faulted: Vec<usize> = proxies
        .iter()
        .map(|p| p.faulted.load(Ordering::Relaxed))
        .collect();
    let mut m = vec![
        ("failed".into(), failed.to_string()),
        ("cut".into(), faulted[0].to_string()),
        ("stalled".into(), faulted[1].to_string()),
    ];
    ensure!(
        failed == 0,
        "{failed} requests failed: {:?}",
        first_error(&answers)
    );
    ensure!(
        faulted.iter().all(|&f| f > 0),
        "a proxy faulted no KV stream"
    );
    let settled = settles(&c, Duration::from_secs(10)).await?;
    m.push((
        "kv_back_to_0_s".into(),
        format!("{:.2}", settled.as_secs_f64()),
    ));
    Ok(m)
}

/// Case 5: SIGTERM the busiest decode worker (a scale-down) under load: it
/// hands back what cannot finish within its 2 s drain and exits in time.
async fn drain_decode(ctx: Ctx) -> anyhow::Result<Measured> {
    let c = ctx.cluster((2, 2), &["--drain-seconds", "2"]).await?;
    let asks = Ask::batch(ctx.streams, 24, ctx.max_tokens * 3);
    let reference = reference(&c, &asks).await?;
    let load = Load::spawn(&client(&c), &asks, false);
    load.reached(ctx.streams * 3, Duration::from_secs(60))
        .await?;
    let victim = busiest_decode(&c).await;
    let mut c = c;
    c.decode[victim].signal("TERM")?;
    let termed = Instant::now();
    while !c.decode[victim].exited() {
        ensure!(
            termed.elapsed() < Duration::from_secs(30),
            "the worker did not exit"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let drained = termed.elapsed();
    let answers = load.answers().await?;
    let mut m = vec![("drain_s".into(), format!("{:.2}", drained.as_secs_f64()))];
    m.push(("migrated".into(), migrations(&c).await.to_string()));
    same_as(&reference, &answers, &mut m)?;
    ensure!(
        drained < Duration::from_millis(3000),
        "the drain took {drained:?} (limit 2 s + 1 s)"
    );
    Ok(m)
}

/// Case 6: 40 clients go away after their first token; every decode
/// worker's KV is free again within 2 s.
async fn disconnect_storm(ctx: Ctx) -> anyhow::Result<Measured> {
    let c = ctx.cluster((1, 2), &[]).await?;
    let asks = Ask::batch(40, 24, ctx.max_tokens * 4);
    let answers = Load::spawn(&client(&c), &asks, true).answers().await?;
    let got = answers.iter().filter(|a| a.chunks > 0).count();
    let settled = settles(&c, Duration::from_secs(2)).await?;
    ensure!(got == 40, "only {got} of 40 streams got a first token");
    Ok(vec![
        ("streams".into(), "40".into()),
        (
            "kv_free_after_s".into(),
            format!("{:.2}", settled.as_secs_f64()),
        ),
    ])
}

/// Case 7: a burst of 10x `--max-concurrent-requests`: the excess gets 429
/// with `Retry-After`, the rest completes, the router's memory stays bounded.
async fn overload(ctx: Ctx) -> anyhow::Result<Measured> {
    let limit = 8;
    let ctx = ctx.with_router_args(&["--max-concurrent-requests", "8"]);
    let c = ctx.cluster((1, 1), &[]).await?;
    let before = rss_kib(c.router.pid)?;
    let asks = Ask::batch(limit * 10, 24, ctx.max_tokens.min(32));
    let answers = Load::spawn(&client(&c), &asks, false).answers().await?;
    let after = rss_kib(c.router.pid)?;
    let refused: Vec<&Answer> = answers.iter().filter(|a| a.status == 429).collect();
    let admitted = answers.len() - refused.len();
    let failed = answers
        .iter()
        .filter(|a| a.status != 429 && !a.ok())
        .count();
    let m = vec![
        ("refused_429".into(), refused.len().to_string()),
        ("admitted".into(), admitted.to_string()),
        ("failed".into(), failed.to_string()),
        (
            "router_rss_mib".into(),
            format!(
                "{:.0}->{:.0}",
                before as f64 / 1024.0,
                after as f64 / 1024.0
            ),
        ),
    ];
    ensure!(!refused.is_empty(), "no request was refused");
    ensure!(
        refused.iter().all(|a| a.retry_after.is_some()),
        "a 429 without Retry-After"
    );
    ensure!(
        failed == 0,
        "{failed} admitted requests failed: {:?}",
        first_error(&answers)
    );
    ensure!(
        after < before + 64 * 1024,
        "router RSS grew from {before} to {after} KiB"
    );
    Ok(m)
}

/// Case 8: the router is killed and restarted on its port; the workers
/// register again within a heartbeat or two and requests succeed.
async fn router_restart(ctx: Ctx) -> anyhow::Result<Measured> {
    let mut c = ctx.cluster((1, 1), &[]).await?;
    let asks = Ask::batch(2, 24, 8);
    reference(&c, &asks).await?;
    c.restart_router().await?;
    let back = c.wait_workers(1, 1, Duration::from_secs(10)).await?;
    let answers = Load::spawn(&client(&c), &asks, false).answers().await?;
    let failed = answers.iter().filter(|a| !a.ok()).count();
    let m = vec![
        (
            "reregistered_s".into(),
            format!("{:.2}", back.as_secs_f64()),
        ),
        ("failed".into(), failed.to_string()),
    ];
    ensure!(
        failed == 0,
        "{failed} requests failed after the restart: {:?}",
        first_error(&answers)
    );
    ensure!(
        back < Duration::from_secs(2),
        "workers took {back:?} to register again"
    );
    Ok(m)
}

fn free_port() -> anyhow::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

/// Resident memory of `pid`, in KiB.
fn rss_kib(pid: u32) -> anyhow::Result<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    for line in status.lines() {
        if let Some(v) = line.strip_prefix("VmRSS:") {
            return Ok(v.trim().trim_end_matches("kB").trim().parse()?);
        }
    }
    bail!("no VmRSS for {pid}")
}
