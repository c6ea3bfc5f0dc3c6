//! What the load generator's tests share: mock workers served in-process.

use clap::Parser;
use pdserve_testkit::http::{bind, serve_on};

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
