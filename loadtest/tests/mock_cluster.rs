//! `pdserve-loadtest run` against a real router over mock-engine workers:
//! the JSON report accounts for exactly the requests sent.

mod common;

use common::cluster;
use pdserve_testkit::tiny::TinyModel;
use serde_json::Value;

async fn loadtest(args: &[&str]) -> Value {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("run.json");
    let report = dir.path().join("report");
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_pdserve-loadtest"))
        .arg("run")
        .args(args)
        .arg("--json")
        .arg(&json)
        .arg("--report")
        .arg(&report)
        .arg("--no-progress")
        .output()
        .await
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("| target |"), "a summary table: {stdout}");
    for f in ["report.md", "cdf_ttft.svg", "cdf_itl.svg", "cdf_e2e.svg"] {
        assert!(report.join(f).exists(), "{f} missing");
    }
    serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_json_report_accounts_for_every_request_sent() {
    let model = TinyModel::new();
    let (url, _, _) = cluster(model.arg()).await;
    let v = loadtest(&[
        "--url",
        &url,
        "--concurrency",
        "4",
        "--requests",
        "30",
        "--input-len",
        "20",
        "--output-len",
        "6",
        "--slo-ttft",
        "60000",
    ])
    .await;
    assert_eq!(v["model"], "tiny", "the model comes from /v1/models");
    let t = &v["points"][0]["targets"][0];
    let s = &t["summary"];
    assert_eq!(t["records"].as_array().unwrap().len(), 30);
    assert_eq!(s["requests"], 30);
    assert_eq!(s["ok"], 30, "{s}");
    assert_eq!(s["completion_tokens"], 30 * 6);
    assert_eq!(s["ttft"]["n"], 30);
    // At most five gaps per six-token stream (a chunk whose bytes end
    // mid-character carries no text and is not a gap of its own).
    let gaps: u64 = t["records"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["itl"].as_array().unwrap().len() as u64)
        .sum();
    assert_eq!(s["itl"]["n"], gaps);
    assert!(gaps > 30 && gaps <= 30 * 5, "{gaps} gaps");
    assert!(s["goodput"].as_f64().unwrap() > 0.0);
    let items: std::collections::BTreeSet<u64> = t["records"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["item"].as_u64().unwrap())
        .collect();
    assert_eq!(items.len(), 30, "every workload item sent once");

    // Side by side: two targets (the same cluster twice) get the same count each.
    let v = loadtest(&[
        "--url",
        &url,
        "--compare",
        &url,
        "--label",
        "a,b",
        "--rate",
        "20",
        "--duration",
        "1",
        "--compare-slice",
        "0.5",
        "--output-len",
        "3",
        "--input-len",
        "8",
    ])
    .await;
    let targets = v["points"][0]["targets"].as_array().unwrap();
    assert_eq!(targets.len(), 2);
    let n: Vec<u64> = targets
        .iter()
        .map(|t| t["summary"]["requests"].as_u64().unwrap())
        .collect();
    assert!(
        n[0] > 5 && n[0] == n[1],
        "the same seeded arrivals for each: {n:?}"
    );
    assert!(targets
        .iter()
        .all(|t| t["summary"]["ok"] == t["summary"]["requests"]));
}
