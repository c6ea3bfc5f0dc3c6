//! Test support: a worker binary run as a child process, as in production,
//! with its address read from its log, SIGTERM, and bounded waits.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use pdserve_protocol::internal::{ErrorBody, ErrorClass};
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
        Self::start(exe, &args, WAIT).await
    }

    /// Waits (bounded) until `/ready` answers 503; says whether it did.
    pub async fn turns_unready(&self) -> bool {
        eventually(WAIT, || async {
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

/// Calls `check` until it returns true, at most for `within`; says whether it did.
pub async fn eventually<F, Fut>(within: Duration, mut check: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let until = tokio::time::Instant::now() + within;
    let mut tick = tokio::time::interval(Duration::from_millis(20));
    while tokio::time::Instant::now() < until {
        if check().await {
            return true;
        }
        tick.tick().await;
    }
    false
}

/// Checks that `resp` refuses new work as a draining worker must: 503 with
/// `Retry-After`, and a retryable `not_ready` error.
pub async fn assert_refused_while_draining(resp: reqwest::Response) {
    assert_eq!(resp.status(), 503);
    assert!(resp.headers().contains_key("retry-after"));
    let e: ErrorBody = resp.json().await.expect("an error body");
    assert_eq!(
        (e.class, e.kind.as_str()),
        (ErrorClass::Retryable, "not_ready")
    );
}
