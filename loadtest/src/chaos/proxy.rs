//! A TCP proxy in front of a decode worker that breaks KV streams: the
//! first `faults` connections that start a KV upload (`POST
//! /v1/internal/kv/…`) are cut, or stalled, after `after_bytes`; every
//! other connection passes through untouched.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

/// What happens to a faulted KV upload.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// The connection closes.
    Cut,
    /// The bytes stop flowing; the connection stays open.
    Stall,
}

/// A running proxy; stops when dropped.
pub struct Proxy {
    pub addr: String,
    pub faulted: Arc<AtomicUsize>,
    task: JoinHandle<()>,
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Faulting settings.
#[derive(Debug, Clone, Copy)]
pub struct Plan {
    pub fault: Fault,
    pub faults: usize,
    pub after_bytes: usize,
}

/// Starts a proxy on a free port of 127.0.0.1 to `upstream` (`host:port`).
pub async fn start(upstream: String, plan: Plan) -> anyhow::Result<Proxy> {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?.to_string();
    let faulted = Arc::new(AtomicUsize::new(0));
    let count = faulted.clone();
    let task = tokio::spawn(async move {
        while let Ok((conn, _)) = listener.accept().await {
            let (upstream, count) = (upstream.clone(), count.clone());
            tokio::spawn(async move {
                let _ = relay(conn, &upstream, plan, &count).await;
            });
        }
    });
    Ok(Proxy {
        addr,
        faulted,
        task,
    })
}

async fn relay(
    mut conn: TcpStream,
    upstream: &str,
    plan: Plan,
    faulted: &AtomicUsize,
) -> std::io::Result<()> {
    let mut up = TcpStream::connect(upstream).await?;
    let _ = conn.set_nodelay(true);
    let _ = up.set_nodelay(true);
    let mut head = vec![0u8; 64];
    let n = conn.read(&mut head).await?;
    head.truncate(n);
    let is_kv = head.starts_with(b"POST /v1/internal/kv/");
    let fault = is_kv
        && faulted
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |k| {
                (k < plan.faults).then_some(k + 1)
            })
            .is_ok();
    up.write_all(&head).await?;
    if !fault {
        tokio::io::copy_bidirectional(&mut conn, &mut up).await?;
        return Ok(());
    }
    // Forward the request up to `after_bytes`, then break it.
    let mut sent = head.len();
    let mut buf = vec![0u8; 16 << 10];
    while sent < plan.after_bytes {
        let n = conn.read(&mut buf).await?;
        if n == 0 {
            break;
        }
        let take = n.min(plan.after_bytes - sent);
        up.write_all(&buf[..take]).await?;
        sent += take;
    }
    if plan.fault == Fault::Stall {
        // Hold the upstream open, moving nothing more, until the client
        // gives up (what it still sends is dropped).
        let drain = async { while conn.read(&mut buf).await.unwrap_or(0) > 0 {} };
        let _ = tokio::time::timeout(Duration::from_secs(60), drain).await;
    }
    Ok(())
}
