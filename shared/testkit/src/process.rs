//! Binaries run as child processes, as in production: a worker with its
//! address read from its log, signals, bounded waits for exit, and where
//! the workspace's binaries are.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use pdserve_protocol::internal::{ErrorBody, ErrorClass, ErrorKind};
use tokio::sync::oneshot;

/// How long any one wait of these helpers may take.
pub const WAIT: Duration = Duration::from_secs(30);

/// A running worker process. Dropping it kills the process if it still runs.
pub struct WorkerProcess {
    pub url: String,
    pid: u32,
    exited: Option<oneshot::Receiver<ExitStatus>>,
    terminated: Option<Instant>,
    log: Arc<Mutex<String>>,
}

impl WorkerProcess {
    /// Starts `exe` with `args` (which should include `--port 0`) and waits,
    /// at most `within`, until it logs the address it listens on.
    pub async fn start(exe: &str, args: &[&str], within: Duration) -> Self {
        let mut child = Command::new(exe)
            .args(args)
            .env("PDSERVE_LOG", "info")
            .env_remove("PDSERVE_LOG_JSON")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("starting {exe}: {e}"));
        let pid = child.id();
        let log = Arc::new(Mutex::new(String::new()));
        let (addr_tx, addr_rx) = oneshot::channel();
        read_log(&mut child, log.clone(), addr_tx);
        let (exit_tx, exited) = oneshot::channel();
        std::thread::spawn(move || {
            if let Ok(status) = child.wait() {
                let _ = exit_tx.send(status);
            }
        });
        let addr = tokio::time::timeout(within, addr_rx).await;
        let Ok(Ok(addr)) = addr else {
            let _ = Command::new("kill")
                .args(["-KILL", &pid.to_string()])
                .status();
            panic!("{exe} did not start listening: {}", log.lock().unwrap());
        };
        Self {
            url: format!("http://{addr}"),
            pid,
            exited: Some(exited),
            terminated: None,
            log,
        }
    }

    /// Starts a worker binary on `model`, on a free port of 127.0.0.1, with
    /// one model thread and a drain deadline of `drain_seconds`.
    pub async fn worker(exe: &str, model: &Path, drain_seconds: u64) -> Self {
        Self::worker_with(exe, model, drain_seconds, &[]).await
    }

    /// [`worker`](Self::worker) with `extra` flags.
    pub async fn worker_with(exe: &str, model: &Path, drain_seconds: u64, extra: &[&str]) -> Self {
        let (model, drain) = (
            model.to_str().expect("UTF-8 path"),
            drain_seconds.to_string(),
        );
        let args = [
            "--model",
            model,
            "--port",
            "0",
            "--threads",
            "1",
            "--drain-seconds",
            &drain,
        ];
        let args: Vec<&str> = args.iter().chain(extra).copied().collect();
        Self::start(exe, &args, WAIT).await
    }

    /// Waits (bounded) until `/ready` answers 503; says whether it did.
    pub async fn turns_unready(&self) -> bool {
        crate::http::eventually(WAIT, || async {
            let r = reqwest::get(format!("{}/ready", self.url)).await;
            r.map(|r| r.status() == 503).unwrap_or(false)
        })
        .await
    }

    /// Sends SIGTERM.
    pub fn terminate(&mut self) {
        self.terminated = Some(Instant::now());
        let status = Command::new("kill")
            .args(["-TERM", &self.pid.to_string()])
            .status()
            .expect("run kill");
        assert!(status.success(), "kill -TERM {} failed", self.pid);
    }

    /// Sends SIGKILL: the process dies without a drain.
    pub fn kill(&mut self) {
        let status = Command::new("kill")
            .args(["-KILL", &self.pid.to_string()])
            .status()
            .expect("run kill");
        assert!(status.success(), "kill -KILL {} failed", self.pid);
    }

    /// Waits for the process to exit, failing the test after `within`.
    pub async fn exit_status(&mut self, within: Duration) -> ExitStatus {
        let rx = self.exited.take().expect("exit status awaited once");
        match tokio::time::timeout(within, rx).await {
            Ok(Ok(status)) => status,
            _ => panic!(
                "the worker did not exit within {within:?}; its log:\n{}",
                self.log()
            ),
        }
    }

    /// Waits (bounded) for the process to exit with status 0 after
    /// [`terminate`](Self::terminate); returns the time since the signal.
    pub async fn exits_cleanly(&mut self) -> Duration {
        let status = self.exit_status(WAIT).await;
        assert!(status.success(), "{status:?}\n{}", self.log());
        self.terminated.expect("terminate() was called").elapsed()
    }

    /// Everything the process has logged so far.
    pub fn log(&self) -> String {
        self.log.lock().unwrap().clone()
    }
}

impl Drop for WorkerProcess {
    fn drop(&mut self) {
        if self.exited.is_some() {
            let _ = Command::new("kill")
                .args(["-KILL", &self.pid.to_string()])
                .status();
        }
    }
}

/// Collects the child's log and reports the `addr=` of its "listening" line.
fn read_log(child: &mut Child, log: Arc<Mutex<String>>, addr: oneshot::Sender<String>) {
    let stderr = child.stderr.take().expect("stderr is piped");
    std::thread::spawn(move || {
        let mut addr = Some(addr);
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            if line.contains("listening") {
                let found = line
                    .split_whitespace()
                    .find_map(|w| w.strip_prefix("addr="));
                if let (Some(a), Some(tx)) = (found, addr.take()) {
                    let _ = tx.send(a.to_string());
                }
            }
            let mut log = log.lock().unwrap();
            log.push_str(&line);
            log.push('\n');
        }
    });
}

/// Checks that `resp` refuses new work as a draining worker must: 503 with
/// `Retry-After`, and a retryable `not_ready` error.
pub async fn assert_refused_while_draining(resp: reqwest::Response) {
    assert_eq!(resp.status(), 503);
    assert!(resp.headers().contains_key("retry-after"));
    let e: ErrorBody = resp.json().await.expect("an error body");
    assert_eq!(
        (e.class, e.kind),
        (ErrorClass::Retryable, ErrorKind::NotReady)
    );
}

/// Whether the tests run in CI, where every optional tool is installed and
/// a test that would skip must fail instead.
pub fn in_ci() -> bool {
    std::env::var_os("CI").is_some()
}

/// The path of the workspace binary `name` (`pdserve-decode`, …), beside
/// the running test's own build; `None` when it has not been built (run
/// the tests with `cargo test --workspace`). In CI a missing binary fails.
pub fn workspace_binary(name: &str) -> Option<PathBuf> {
    let exe = std::env::current_exe().ok()?;
    // target/<profile>/deps/<test> → target/<profile>/<name>
    let path = exe.parent()?.parent()?.join(name);
    let found = path.exists();
    assert!(found || !in_ci(), "{name} is not built beside the tests");
    if !found {
        eprintln!("skipped: {name} is not built (cargo test --workspace builds it)");
    }
    found.then_some(path)
}

/// A free TCP port on 127.0.0.1 (free when asked; bind it soon).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

/// Live child processes of `parent`, from /proc.
pub fn children_of(parent: u32) -> Vec<u32> {
    let mut out = Vec::new();
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return out;
    };
    for entry in entries.flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        // pid (comm) state ppid ...: comm may contain spaces, so split after ')'.
        let rest = stat.rsplit_once(')').map(|(_, r)| r).unwrap_or("");
        let fields: Vec<&str> = rest.split_whitespace().collect();
        let ppid = fields.get(1).and_then(|p| p.parse::<u32>().ok());
        if ppid == Some(parent) && fields.first() != Some(&"Z") {
            out.push(pid);
        }
    }
    out
}
