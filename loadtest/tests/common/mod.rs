//! What the load generator's tests share: mock workers served in-process.

use clap::Parser;
use pdserve_testkit::http::{bind, serve_on, wait_ready};
use tokio_util::sync::CancellationToken;

/// A mock worker of `pool` on the GGUF `model`, served on a free port; its URL.
pub async fn mock(model: &str, pool: &str, extra: &[&str]) -> String {
    let (listener, url) = bind().await;
    let mut argv = vec!["mock", "--pool", pool, "--model", model];
    argv.extend_from_slice(extra);
    let args = pdserve_mock_worker::Args::parse_from(argv);
    let app = pdserve_mock_worker::build(&args, url.clone())
        .unwrap()
        .app();
    serve_on(listener, app);
    url
}

/// A router (disaggregated) over one mock prefill and one mock decode
/// worker, in-process; the URLs of the router, the prefill and the decode worker.
pub async fn cluster(model: &str) -> (String, String, String) {
    let decode = mock(model, "decode", &[]).await;
    let prefill = mock(model, "prefill", &["--decode-url", &decode]).await;
    let args = pdserve_router::Args::try_parse_from([
        "pdserve-router",
        "--model",
        model,
        "--served-model-name",
        "tiny",
        "--mode",
        "disaggregated",
        "--health-interval-ms",
        "50",
        &format!("--prefill-url={prefill}"),
        &format!("--decode-url={decode}"),
    ])
    .unwrap();
    let (listener, router) = bind().await;
    pdserve_router::spawn(&args, listener, CancellationToken::new()).unwrap();
    wait_ready(&router).await;
    (router, prefill, decode)
}
