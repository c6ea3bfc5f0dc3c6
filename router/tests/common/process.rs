//! The router binary with its local supervisor, as a child process of a test.
#![allow(unused_imports)]

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use super::wait_until;

pub use pdserve_testkit::process::{children_of, free_port, in_ci, workspace_binary};

/// The worker binaries sit next to the router's when the workspace is built.
pub fn workers_built() -> bool {
    ["pdserve-prefill", "pdserve-decode"]
        .iter()
        .all(|b| workspace_binary(b).is_some())
}

/// The Python that can `import` each of `modules` (`$PDSERVE_PYTHON`, else
/// `python3`); None when it cannot, which CI never allows.
pub fn python_with(modules: &str) -> Option<String> {
    let python = std::env::var("PDSERVE_PYTHON").unwrap_or_else(|_| "python3".into());
    let import = format!("import {modules}");
    let ok = Command::new(&python)
        .args(["-c", &import])
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    assert!(
        ok || !in_ci(),
        "CI installs the openai package; `{python} -c '{import}'` failed"
    );
    ok.then_some(python)
}

/// What the real-model SDK tests need: the model file, a Python that can
/// `import` each of `modules`, and the worker binaries. None, with a note on
/// what is missing, when this checkout lacks one (CI has them all).
pub fn real_model_sdk(modules: &str) -> Option<(std::path::PathBuf, String)> {
    use pdserve_testkit::{real_model, REAL_MODEL_FILE};
    let Some(model) = real_model() else {
        eprintln!("skipped: {REAL_MODEL_FILE} is not present (deploy/local/fetch-model.sh)");
        return None;
    };
    let Some(python) = python_with(modules) else {
        eprintln!("skipped: the openai Python package is not installed");
        return None;
    };
    workers_built().then_some((model, python))
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

/// The router binary on a free port of loopback, serving the tiny `model`
/// as `MODEL`, with `extra` flags; returns once it listens.
pub async fn router_process(
    model: &pdserve_testkit::tiny::TinyModel,
    extra: &[&str],
) -> pdserve_testkit::process::WorkerProcess {
    use pdserve_testkit::process::{WorkerProcess, WAIT};
    let mut args = vec!["--port", "0", "--served-model-name", super::MODEL];
    args.extend(["--model", model.arg()]);
    args.extend_from_slice(extra);
    WorkerProcess::start(env!("CARGO_BIN_EXE_pdserve-router"), &args, WAIT).await
}
