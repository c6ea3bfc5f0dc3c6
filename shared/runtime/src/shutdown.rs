//! Graceful shutdown: SIGTERM or Ctrl-C cancels one root token, and the
//! worker drains its in-flight work under one deadline before it exits.

use std::future::Future;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

/// Cancels `token` on SIGTERM or Ctrl-C (SIGINT).
///
/// The SIGTERM handler is installed before this returns, so a TERM sent as
/// soon as the process says it is listening already drains it rather than
/// killing it. Call it from inside the runtime, before binding.
pub fn cancel_on_signal(token: CancellationToken) {
    let signalled = signal_listener();
    tokio::spawn(async move {
        signalled.await;
        tracing::info!("shutdown signal received: draining");
        token.cancel();
    });
}

/// Installs the handlers now and returns a future that ends on the first
/// SIGTERM or SIGINT.
fn signal_listener() -> impl Future<Output = ()> + Send {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        let install = |kind: SignalKind, name: &str| {
            signal(kind)
                .map_err(|e| tracing::warn!("cannot listen for {name}: {e}"))
                .ok()
        };
        let term = install(SignalKind::terminate(), "SIGTERM");
        let int = install(SignalKind::interrupt(), "SIGINT");
        async move {
            let next = |s: Option<tokio::signal::unix::Signal>| async move {
                match s {
                    Some(mut s) => {
                        s.recv().await;
                    }
                    None => std::future::pending::<()>().await,
                }
            };
            tokio::select! {
                _ = next(term) => {}
                _ = next(int) => {}
            }
        }
    }
    #[cfg(not(unix))]
    async {
        let _ = tokio::signal::ctrl_c().await;
    }
}

/// How long a worker drains after SIGTERM; flattened into each worker's flags.
#[derive(clap::Args, Debug, Clone)]
pub struct DrainArgs {
    /// Seconds to let in-flight work finish after SIGTERM; what is still
    /// running then is cut off.
    #[arg(long, env = "PDSERVE_DRAIN_SECONDS", default_value_t = 30)]
    pub drain_seconds: u64,
}

/// What the drain needs to know about a worker.
pub struct Drain {
    /// Called once when draining starts, with the drain's deadline:
    /// readiness turns 503, new work is refused, and work that cannot end
    /// in time may be handed back.
    pub stop_accepting: Box<dyn FnOnce(std::time::Instant) + Send>,
    /// Work still in flight: queued, running, or delivering its result.
    pub in_flight: Box<dyn Fn() -> u64 + Send + Sync>,
    /// How long in-flight work may take after the signal.
    pub deadline: Duration,
}

/// Streams one HTTP/2 connection may carry at once. A router multiplexes
/// all its streams on a worker over one connection; hyper's default of 200
/// would queue the rest behind them.
pub const MAX_H2_STREAMS: u32 = 1 << 16;

/// The receive window of one HTTP/2 connection, on both ends of a
/// router-to-worker connection. Fixed and large because h2 closes a
/// connection as a flood (`GOAWAY ENHANCE_YOUR_CALM`, "too_many_data_frames")
/// once small DATA frames it has received but the application has not read
/// use up half of it: a decode step sends one token line to every stream at
/// once, and a burst of new requests sends thousands of small bodies. With
/// hyper's 1 MiB default a worker closed the router's connection at about
/// 2,000 requests arriving together.
pub const H2_CONNECTION_WINDOW: u32 = 64 << 20;

/// Serves `app` until `token` is cancelled, then drains: stops accepting
/// work, keeps serving until nothing is in flight (so peers can still
/// deliver KV and streams can finish), then closes. Whatever is still open
/// when the deadline passes is cut off.
///
/// Each connection speaks HTTP/1.1 or, with prior knowledge, cleartext
/// HTTP/2 (what the router uses to multiplex its streams to a worker).
pub async fn serve(
    listener: TcpListener,
    app: axum::Router,
    token: CancellationToken,
    drain: Drain,
) -> std::io::Result<()> {
    use hyper_util::rt::{TokioExecutor, TokioIo};
    use hyper_util::server::conn::auto;
    use hyper_util::server::graceful::GracefulShutdown;
    use hyper_util::service::TowerToHyperService;

    let deadline = drain.deadline;
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http2()
        .max_concurrent_streams(MAX_H2_STREAMS)
        .initial_connection_window_size(H2_CONNECTION_WINDOW);
    let graceful = GracefulShutdown::new();
    let run = async {
        let stop = drained(token.clone(), drain);
        tokio::pin!(stop);
        loop {
            let tcp = tokio::select! {
                _ = &mut stop => break,
                accepted = listener.accept() => match accepted {
                    Ok((tcp, _)) => tcp,
                    Err(e) => {
                        // Out of descriptors, or a connection reset before
                        // it was accepted: the listener itself is fine.
                        tracing::debug!("accept failed: {e}");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                },
            };
            if let Err(e) = tcp.set_nodelay(true) {
                tracing::debug!("cannot set TCP_NODELAY: {e}");
            }
            let svc = TowerToHyperService::new(app.clone());
            let conn = builder.serve_connection_with_upgrades(TokioIo::new(tcp), svc);
            let conn = graceful.watch(conn.into_owned());
            tokio::spawn(async move {
                if let Err(e) = conn.await {
                    tracing::debug!("connection ended: {e}");
                }
            });
        }
        drop(listener);
        graceful.shutdown().await;
    };
    let cut = async {
        token.cancelled().await;
        tokio::time::sleep(deadline).await;
    };
    tokio::select! {
        _ = run => Ok(()),
        _ = cut => {
            tracing::warn!("drain deadline passed: closing the connections still open");
            Ok(())
        }
    }
}

/// Sets TCP_NODELAY on every accepted connection. Streams write one small
/// frame per token; with Nagle's algorithm a frame waits for the ACK of the
/// previous one, which the peer delays by up to 40 ms.
pub fn no_delay(
    listener: TcpListener,
) -> impl axum::serve::Listener<Io = tokio::net::TcpStream, Addr = std::net::SocketAddr> {
    use axum::serve::ListenerExt;
    listener.tap_io(|tcp| {
        if let Err(e) = tcp.set_nodelay(true) {
            tracing::debug!("cannot set TCP_NODELAY: {e}");
        }
    })
}

/// Resolves once draining is done: nothing in flight, or the deadline passed.
async fn drained(token: CancellationToken, drain: Drain) {
    token.cancelled().await;
    let until = tokio::time::Instant::now() + drain.deadline;
    (drain.stop_accepting)(until.into_std());
    let mut tick = tokio::time::interval(Duration::from_millis(20));
    loop {
        let left = (drain.in_flight)();
        if left == 0 {
            tracing::info!("drained");
            return;
        }
        tokio::select! {
            _ = tick.tick() => {}
            _ = tokio::time::sleep_until(until) => {
                tracing::warn!(in_flight = left, "drain deadline passed");
                return;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    use std::sync::Arc;
    use std::time::Instant;

    use super::*;

    fn drain(work: &Arc<AtomicU64>, ready: &Arc<AtomicBool>, deadline: Duration) -> Drain {
        let (work, ready) = (work.clone(), ready.clone());
        Drain {
            stop_accepting: Box::new(move |_| ready.store(false, Ordering::Relaxed)),
            in_flight: Box::new(move || work.load(Ordering::Relaxed)),
            deadline,
        }
    }

    #[tokio::test]
    async fn drain_waits_for_in_flight_work_and_no_longer() {
        let work = Arc::new(AtomicU64::new(2));
        let ready = Arc::new(AtomicBool::new(true));
        let token = CancellationToken::new();
        let done = tokio::spawn(drained(
            token.clone(),
            drain(&work, &ready, Duration::from_secs(30)),
        ));
        token.cancel();
        // Readiness drops at once; the drain still waits for the work.
        let wait = tokio::time::timeout(Duration::from_millis(200), async {
            while ready.load(Ordering::Relaxed) {
                tokio::task::yield_now().await;
            }
        });
        wait.await.expect("readiness turned off");
        assert!(!done.is_finished());
        work.store(0, Ordering::Relaxed);
        tokio::time::timeout(Duration::from_secs(5), done)
            .await
            .expect("drained once idle")
            .unwrap();
    }

    #[tokio::test]
    async fn the_deadline_bounds_a_drain_that_never_empties() {
        let work = Arc::new(AtomicU64::new(1));
        let ready = Arc::new(AtomicBool::new(true));
        let token = CancellationToken::new();
        token.cancel();
        let started = Instant::now();
        let deadline = Duration::from_millis(150);
        tokio::time::timeout(
            Duration::from_secs(5),
            drained(token, drain(&work, &ready, deadline)),
        )
        .await
        .expect("the deadline ended the drain");
        assert!(started.elapsed() >= deadline);
        assert!(!ready.load(Ordering::Relaxed));
    }
}
