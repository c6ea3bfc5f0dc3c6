//! The chaos suite's cases 1–6 (`pdserve-loadtest chaos`) on the mock
//! engine over the tiny model's tokenizer, as CI runs them: every case must
//! pass, and its JSON must say so.

use std::process::Command;

use pdserve_testkit::process::workspace_binary;
use pdserve_testkit::tiny::TinyModel;
use serde_json::Value;

#[test]
fn chaos_cases_one_to_six_pass_on_the_mock_engine() {
    // The router and the mock worker are other packages' binaries.
    let Some(router) = workspace_binary("pdserve-router") else {
        return;
    };
    if workspace_binary("pdserve-mock-worker").is_none() {
        return;
    }
    let model = TinyModel::new();
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("chaos.json");
    let out = Command::new(env!("CARGO_BIN_EXE_pdserve-loadtest"))
        .args(["chaos", "--engine", "mock", "--model", model.arg()])
        .args(["--cases", "1,2,3,4,5,6", "--stop-seconds", "15"])
        .arg("--bin-dir")
        .arg(router.parent().unwrap())
        .arg("--json")
        .arg(&json)
        .output()
        .expect("run pdserve-loadtest chaos");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(stdout.contains("6 passed, 0 failed"), "{stdout}");
    let report: Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    assert_eq!(report["passed"], 6, "{report}");
    let cases = report["cases"].as_array().unwrap();
    let measured = |case: usize, key: &str| -> String {
        let m = cases[case - 1]["measured"].as_array().unwrap();
        let pair = m
            .iter()
            .find(|p| p[0] == key)
            .unwrap_or_else(|| panic!("{key}: {report}"));
        pair[1].as_str().unwrap().to_string()
    };
    // The faults hit streams, which migrated and came out the same.
    for case in [1, 3, 5] {
        assert_ne!(measured(case, "migrated"), "0", "{report}");
        assert_eq!(measured(case, "differ"), "0", "{report}");
    }
}
