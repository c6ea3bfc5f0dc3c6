//! The local supervisor: runs worker processes on this machine, restarts any
//! that crash (with backoff), and stops them by SIGTERM so they drain. The
//! workers register themselves with the router (`--router-url`).

use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use clap::Args;
use pdserve_protocol::internal::Pool;
use tokio::process::{Child, Command};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// What local workers run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum LocalEngine {
    /// `pdserve-prefill` and `pdserve-decode` on the model.
    Real,
    /// `pdserve-mock-worker`: the real protocol with a latency model and no
    /// weights (its `PDSERVE_MOCK_*` settings come from this environment).
    Mock,
}

/// Flags of the local supervisor, flattened into the router's.
#[derive(Args, Debug, Clone)]
pub struct LocalArgs {
    /// Prefill worker processes to run and supervise on this machine.
    #[arg(long, env = "PDSERVE_LOCAL_PREFILL", default_value_t = 0)]
    pub local_prefill: usize,
    /// Decode worker processes to run and supervise on this machine.
    #[arg(long, env = "PDSERVE_LOCAL_DECODE", default_value_t = 0)]
    pub local_decode: usize,
    /// Folder with the `pdserve-prefill` and `pdserve-decode` binaries (default: this binary's).
    #[arg(long, env = "PDSERVE_WORKER_BIN_DIR")]
    pub worker_bin_dir: Option<PathBuf>,
    /// Model threads per local worker (0: this machine's cores shared out among
    /// the local workers, each pinned to its own cores).
    #[arg(long, env = "PDSERVE_WORKER_THREADS", default_value_t = 0)]
    pub worker_threads: usize,
    /// Weight format of local workers (both pools must match).
    #[arg(long, env = "PDSERVE_WORKER_WEIGHTS", default_value = "native")]
    pub worker_weights: String,
    /// What the local workers run.
    #[arg(long, env = "PDSERVE_LOCAL_ENGINE", value_enum, default_value_t = LocalEngine::Real)]
    pub local_engine: LocalEngine,
    /// KV cache budget of each local decode worker, in tokens.
    #[arg(long, env = "PDSERVE_WORKER_KV_CACHE_TOKENS", default_value_t = 65_536)]
    pub worker_kv_cache_tokens: usize,
}

/// What every local worker is started with.
#[derive(Debug, Clone)]
pub struct SupervisorConfig {
    pub bin_dir: PathBuf,
    pub model: PathBuf,
    pub router_url: String,
    pub weights: String,
    pub threads: usize,
    /// Pin each worker to cores of its own, `k*threads .. (k+1)*threads`
    /// for the lowest slot `k` no live worker holds, when they fit.
    pub pin: bool,
    pub kv_cache_tokens: usize,
    pub drain: Duration,
    pub engine: LocalEngine,
    /// The internal token every worker is given.
    pub token: Option<pdserve_runtime::auth::Secret>,
    /// Where the workers export their trace spans (the router's own
    /// `--otlp-endpoint`).
    pub otlp_endpoint: Option<String>,
}

impl SupervisorConfig {
    pub fn new(
        args: &LocalArgs,
        model: &Path,
        router_url: String,
        drain: Duration,
        token: Option<pdserve_runtime::auth::Secret>,
    ) -> Self {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let workers = (args.local_prefill + args.local_decode).max(1);
        let threads = match args.worker_threads {
            0 => (cores / workers).max(1),
            n => n,
        };
        let bin_dir = args.worker_bin_dir.clone().unwrap_or_else(|| {
            std::env::current_exe()
                .ok()
                .and_then(|p| p.parent().map(Path::to_path_buf))
                .unwrap_or_default()
        });
        Self {
            bin_dir,
            model: model.to_path_buf(),
            router_url,
            weights: args.worker_weights.clone(),
            threads,
            pin: threads <= cores,
            kv_cache_tokens: args.worker_kv_cache_tokens,
            drain,
            engine: args.local_engine,
            otlp_endpoint: None,
            token,
        }
    }
}

struct Slot {
    pool: Pool,
    /// Its cores' slot (see [`cores_of`]); a restart keeps it.
    core_slot: usize,
    stop: CancellationToken,
    task: JoinHandle<()>,
}

pub struct Supervisor {
    cfg: SupervisorConfig,
    slots: Mutex<Slots>,
}

#[derive(Default)]
struct Slots {
    running: Vec<Slot>,
    /// Workers told to drain, until they exit, with their core slots.
    draining: Vec<(usize, JoinHandle<()>)>,
}

impl Slots {
    /// The core slots live workers (running or draining) hold; forgets
    /// draining workers that have exited.
    fn held(&mut self) -> Vec<usize> {
        self.draining.retain(|(_, t)| !t.is_finished());
        let running = self.running.iter().map(|s| s.core_slot);
        running.chain(self.draining.iter().map(|d| d.0)).collect()
    }

    /// The lowest core slot that no live worker holds.
    fn free_core_slot(&mut self) -> usize {
        lowest_free(&self.held())
    }
}

impl Supervisor {
    pub fn new(cfg: SupervisorConfig) -> Arc<Self> {
        Arc::new(Self {
            cfg,
            slots: Mutex::new(Slots::default()),
        })
    }

    fn slots(&self) -> std::sync::MutexGuard<'_, Slots> {
        self.slots.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Starts one more supervised worker of `pool`.
    pub fn spawn(self: &Arc<Self>, pool: Pool) {
        let mut slots = self.slots();
        let core_slot = slots.free_core_slot();
        let stop = CancellationToken::new();
        let me = self.clone();
        let token = stop.clone();
        let task = tokio::spawn(async move { me.supervise(pool, core_slot, token).await });
        slots.running.push(Slot {
            pool,
            core_slot,
            stop,
            task,
        });
    }

    /// Drains the newest worker of `pool`: SIGTERM, so it stops taking work,
    /// finishes (or delivers) what it has, deregisters and exits.
    pub fn drain_one(&self, pool: Pool) {
        let mut slots = self.slots();
        if let Some(i) = slots.running.iter().rposition(|s| s.pool == pool) {
            let slot = slots.running.remove(i);
            slot.stop.cancel();
            slots.draining.push((slot.core_slot, slot.task));
        }
    }

    /// How many more workers can start on cores of their own: unbounded for
    /// mock workers and when pinning is off, else the core slots that no
    /// live worker (running or draining) holds. A worker started beyond
    /// that would share the others' cores and slow them all (docs/router.md).
    pub fn spare_slots(&self) -> usize {
        let c = &self.cfg;
        if c.engine != LocalEngine::Real || !c.pin {
            return usize::MAX;
        }
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        spare(&self.slots().held(), c.threads, cores)
    }

    /// Local workers per pool (draining ones excluded).
    pub fn count(&self, pool: Pool) -> usize {
        self.slots()
            .running
            .iter()
            .filter(|s| s.pool == pool)
            .count()
    }

    fn command(&self, pool: Pool, core_slot: usize) -> Command {
        let c = &self.cfg;
        let (bin, pool_arg) = match (c.engine, pool) {
            (LocalEngine::Real, Pool::Prefill) => ("pdserve-prefill", None),
            (LocalEngine::Real, Pool::Decode) => ("pdserve-decode", None),
            (LocalEngine::Mock, Pool::Prefill) => ("pdserve-mock-worker", Some("prefill")),
            (LocalEngine::Mock, Pool::Decode) => ("pdserve-mock-worker", Some("decode")),
        };
        let mut cmd = Command::new(c.bin_dir.join(bin));
        if let Some(p) = pool_arg {
            cmd.args(["--pool", p]);
        }
        cmd.arg("--model")
            .arg(&c.model)
            .args(["--host", "127.0.0.1", "--port", "0"])
            .args(["--router-url", &c.router_url])
            .args(["--drain-seconds", &c.drain.as_secs().to_string()])
            // The router's own settings must not leak into the worker.
            .env_remove("PDSERVE_PUBLIC_URL")
            .env_remove("PDSERVE_HOST")
            .env_remove("PDSERVE_PORT")
            .env_remove("PDSERVE_INTERNAL_TOKEN")
            .env_remove("PDSERVE_INTERNAL_TOKEN_FILE")
            .env_remove("PDSERVE_OTLP_SERVICE_NAME")
            .stdin(Stdio::null())
            .kill_on_drop(true);
        if let Some(token) = &c.token {
            // In the environment, not on the command line `ps` shows.
            cmd.env("PDSERVE_INTERNAL_TOKEN", token.expose());
        }
        if let Some(endpoint) = &c.otlp_endpoint {
            cmd.args(["--otlp-endpoint", endpoint]);
        }
        if pool == Pool::Decode {
            cmd.args(["--kv-cache-tokens", &c.kv_cache_tokens.to_string()]);
        }
        if c.engine == LocalEngine::Real {
            cmd.args(["--weights", &c.weights])
                .args(["--threads", &c.threads.to_string()]);
            let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
            if let Some(set) = cores_of(core_slot, c.threads, cores).filter(|_| c.pin) {
                pin_to_cores(&mut cmd, set);
            }
        }
        cmd
    }

    /// Runs one worker until stopped, restarting it when it exits on its own.
    async fn supervise(self: Arc<Self>, pool: Pool, core_slot: usize, stop: CancellationToken) {
        let mut backoff = Duration::from_millis(500);
        loop {
            let mut child = match self.command(pool, core_slot).spawn() {
                Ok(c) => c,
                Err(e) => {
                    tracing::error!(?pool, dir = %self.cfg.bin_dir.display(), "cannot start a worker: {e}");
                    if sleep_or_stop(&stop, backoff).await {
                        return;
                    }
                    backoff = (backoff * 2).min(Duration::from_secs(30));
                    continue;
                }
            };
            tracing::info!(?pool, pid = child.id(), "local worker started");
            let started = tokio::time::Instant::now();
            tokio::select! {
                status = child.wait() => {
                    log_exit(pool, status);
                    // A worker that ran a while gets a fresh backoff.
                    if started.elapsed() > Duration::from_secs(60) {
                        backoff = Duration::from_millis(500);
                    }
                    if sleep_or_stop(&stop, backoff).await {
                        return;
                    }
                    backoff = (backoff * 2).min(Duration::from_secs(30));
                }
                _ = stop.cancelled() => {
                    self.terminate(pool, &mut child).await;
                    return;
                }
            }
        }
    }

    /// SIGTERM (the worker drains), then SIGKILL after the drain deadline.
    async fn terminate(&self, pool: Pool, child: &mut Child) {
        if let Some(pid) = child.id() {
            // SAFETY: kill(2) on our own child's pid has no memory effects.
            unsafe {
                libc::kill(pid as libc::pid_t, libc::SIGTERM);
            }
        }
        let grace = self.cfg.drain + Duration::from_secs(5);
        match tokio::time::timeout(grace, child.wait()).await {
            Ok(status) => log_exit(pool, status),
            Err(_) => {
                tracing::warn!(?pool, "worker did not drain in time: killed");
                let _ = child.kill().await;
            }
        }
    }

    /// Stops every worker (they drain in parallel) and waits for them.
    pub async fn shutdown(&self) {
        let slots = std::mem::take(&mut *self.slots());
        for s in &slots.running {
            s.stop.cancel();
        }
        let tasks = slots
            .running
            .into_iter()
            .map(|s| s.task)
            .chain(slots.draining.into_iter().map(|d| d.1));
        for t in tasks {
            let _ = t.await;
        }
    }
}

/// True when stopped during the sleep.
async fn sleep_or_stop(stop: &CancellationToken, d: Duration) -> bool {
    tokio::select! {
        _ = stop.cancelled() => true,
        _ = tokio::time::sleep(d) => false,
    }
}

fn log_exit(pool: Pool, status: std::io::Result<ExitStatus>) {
    match status {
        Ok(s) if s.success() => tracing::info!(?pool, "local worker exited"),
        Ok(s) => tracing::warn!(?pool, %s, "local worker exited"),
        Err(e) => tracing::warn!(?pool, "waiting for a local worker failed: {e}"),
    }
}

/// The lowest slot not in `held`.
fn lowest_free(held: &[usize]) -> usize {
    (0..).find(|k| !held.contains(k)).unwrap_or(0)
}

/// Core slots of `threads` cores on a machine of `cores` that none of `held` takes.
fn spare(held: &[usize], threads: usize, cores: usize) -> usize {
    let total = (0..)
        .take_while(|&k| cores_of(k, threads, cores).is_some())
        .count();
    (0..total).filter(|k| !held.contains(k)).count()
}

/// The cores of core slot `slot` for workers of `threads` threads, when
/// they fit on a machine of `cores`; none (no pinning) when they do not.
fn cores_of(slot: usize, threads: usize, cores: usize) -> Option<std::ops::Range<usize>> {
    let first = slot.checked_mul(threads)?;
    let end = first.checked_add(threads)?;
    (threads > 0 && end <= cores).then_some(first..end)
}

/// Restricts the child to the cores of `set`.
fn pin_to_cores(cmd: &mut Command, set: std::ops::Range<usize>) {
    // SAFETY: the closure runs in the child between fork and exec and only
    // calls sched_setaffinity(2), which is async-signal-safe; the cpu_set_t
    // lives on the child's stack.
    unsafe {
        cmd.pre_exec(move || {
            let mut mask: libc::cpu_set_t = std::mem::zeroed();
            for c in set.clone() {
                libc::CPU_SET(c, &mut mask);
            }
            // Best effort: a failure (e.g. a restricted cpuset) leaves the default.
            libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mask);
            Ok(())
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_new_worker_takes_the_lowest_core_slot_no_live_worker_holds() {
        assert_eq!(lowest_free(&[]), 0);
        assert_eq!(lowest_free(&[0, 1]), 2);
        // Worker 0 drained and exited: the next one reuses its cores.
        assert_eq!(lowest_free(&[1, 2]), 0);
        assert_eq!(lowest_free(&[0, 2]), 1);
    }

    #[test]
    fn spare_slots_count_the_core_slots_no_live_worker_holds() {
        // 2 cores, 1 thread each: a prefill and a decode worker leave no room.
        assert_eq!(spare(&[0, 1], 1, 2), 0);
        assert_eq!(spare(&[0], 1, 2), 1);
        // 8 cores, 2 threads each: 4 slots; an unpinned slot (5) takes none.
        assert_eq!(spare(&[0, 1, 5], 2, 8), 2);
        assert_eq!(spare(&[], 3, 8), 2);
        assert_eq!(spare(&[], 0, 8), 0);
    }

    #[test]
    fn workers_are_pinned_only_to_cores_that_exist() {
        assert_eq!(cores_of(0, 1, 2), Some(0..1));
        assert_eq!(cores_of(1, 1, 2), Some(1..2));
        assert_eq!(
            cores_of(2, 1, 2),
            None,
            "a third worker on two cores is not pinned"
        );
        assert_eq!(cores_of(1, 2, 4), Some(2..4));
        assert_eq!(cores_of(1, 2, 3), None);
        assert_eq!(cores_of(0, 0, 2), None);
    }
}
