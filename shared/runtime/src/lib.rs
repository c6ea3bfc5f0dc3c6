//! Process plumbing shared by every pdserve binary: metric names, logging,
//! tracing, graceful shutdown, the internal token and network rules.

pub mod auth;
pub mod metrics;
pub mod net;
pub mod otel;
pub mod shutdown;
pub mod telemetry;

/// Runs a binary's async `main` on a multi-threaded runtime built here, so a
/// binary sets its environment (thread-pool sizes) before any thread exists.
/// It first raises the open-files limit to the hard limit.
pub fn run<F: std::future::Future>(main: F) -> F::Output {
    match net::raise_nofile_limit() {
        Ok(n) => tracing::debug!(open_files = n, "open-files limit"),
        Err(e) => tracing::warn!("cannot raise the open-files limit: {e}"),
    }
    let out = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap_or_else(|e| {
            tracing::error!("cannot start the async runtime: {e}");
            std::process::exit(1)
        })
        .block_on(main);
    // Spans the process finished last (a drained request's) still go out.
    otel::flush(std::time::Duration::from_secs(3));
    out
}
