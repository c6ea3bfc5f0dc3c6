//! The one HTTP client of every call to a worker: generate streams,
//! prefill jobs and health polls share its connections.

use std::time::Duration;

use crate::config::{DispatchConfig, WorkerProtocol};

use pdserve_runtime::shutdown::H2_CONNECTION_WINDOW;

/// A stream's own window: far above one stream's burst of lines.
const H2_STREAM_WINDOW: u32 = 2 << 20;

/// The client, per `--worker-protocol`, sending the internal token.
pub(super) fn worker_client(
    cfg: &DispatchConfig,
    token: &pdserve_runtime::auth::InternalToken,
) -> reqwest::Client {
    let client = reqwest::Client::builder()
        .pool_idle_timeout(pdserve_runtime::net::POOL_IDLE_TIMEOUT)
        .default_headers(token.client_headers())
        .connect_timeout(cfg.connect_timeout)
        .tcp_nodelay(true);
    let client = match cfg.worker_protocol {
        WorkerProtocol::Http1 => client.http1_only(),
        // Pings keep an idle multiplexed connection's failure from
        // surfacing only on the next request. The connection window is
        // large and fixed (see `H2_CONNECTION_WINDOW`): an adaptive window
        // starts at 64 KiB and broke at about 150 streams.
        WorkerProtocol::Http2 => client
            .http2_prior_knowledge()
            .http2_keep_alive_interval(Duration::from_secs(10))
            .http2_keep_alive_timeout(Duration::from_secs(20))
            .http2_keep_alive_while_idle(true)
            .http2_initial_connection_window_size(H2_CONNECTION_WINDOW)
            .http2_initial_stream_window_size(H2_STREAM_WINDOW),
    };
    client.build().unwrap_or_default()
}
