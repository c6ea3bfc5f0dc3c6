//! The router binary with its local supervisor, as a child process of a test.

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use super::wait_until;

pub fn in_ci() -> bool {
    std::env::var_os("CI").is_some()
}

/// The worker binaries sit next to the router's when the workspace is built.
pub fn workers_built() -> bool {
    let dir = Path::new(env!("CARGO_BIN_EXE_pdserve-router"))
        .parent()
        .unwrap()
        .to_path_buf();
    let ok = ["pdserve-prefill", "pdserve-decode"]
        .iter()
        .all(|b| dir.join(b).exists());
    assert!(
        ok || !in_ci(),
        "the worker binaries are missing next to pdserve-router"
    );
    if !ok {
        eprintln!("skipped: build the workspace first (cargo test --release --workspace)");
    }
    ok
}

pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

pub struct Router {
    pub child: Child,
    pub url: String,
}

impl Router {
    pub fn start(model: &Path, name: &str, extra: &[&str]) -> Self {
        let port = free_port();
        let child = Command::new(env!("CARGO_BIN_EXE_pdserve-router"))
            .args(["--port", &port.to_string(), "--served-model-name", name])
            .arg("--model")
            .arg(model)
            .args([
                "--local-prefill",
                "1",
                "--local-decode",
                "1",
                "--drain-seconds",
                "5",
            ])
            .args(["--health-interval-ms", "100"])
            .args(extra)
            .env("PDSERVE_LOG", "warn")
            .stdin(Stdio::null())
            .spawn()
            .unwrap();
        Self {
            child,
            url: format!("http://127.0.0.1:{port}"),
        }
    }

    pub async fn wait_ready(&self, within: Duration) {
        let url = format!("{}/ready", self.url);
        wait_until(within, || async {
            let r = reqwest::get(&url).await;
            r.map(|r| r.status() == 200).unwrap_or(false)
        })
        .await;
    }

    pub fn workers(&self) -> Vec<u32> {
        children_of(self.child.id())
    }

    pub fn signal(&self, pid: u32, sig: &str) {
        let ok = Command::new("kill")
            .args([sig, &pid.to_string()])
            .status()
            .unwrap();
        assert!(ok.success());
    }
}

impl Drop for Router {
    fn drop(&mut self) {
        let workers = self.workers();
        let _ = self.child.kill();
        for pid in workers {
            let _ = Command::new("kill")
                .args(["-KILL", &pid.to_string()])
                .status();
        }
    }
}

/// Live child processes of `parent`, from /proc.
pub fn children_of(parent: u32) -> Vec<u32> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        // pid (comm) state ppid ...: comm may contain spaces, so split after ')'.
        let rest = stat.rsplit_once(')').map(|(_, r)| r).unwrap_or("");
        let fields: Vec<&str> = rest.split_whitespace().collect();
        if fields.get(1).and_then(|p| p.parse::<u32>().ok()) == Some(parent) && fields[0] != "Z" {
            out.push(pid);
        }
    }
    out
}
