//! `pdserve-loadtest link`: a network link emulated in user space, for
//! kernels built without `sch_netem`. It joins two network namespaces
//! through a TUN device in each and carries every packet between them with
//! what `netem delay D rate R loss L limit N` would add: serialization at
//! the rate, a one-way delay, independent random loss and a queue limit,
//! each direction on its own.
//!
//! The TUN devices must exist (`ip tuntap add dev NAME mode tun vnet_hdr`,
//! in each namespace, with its address). Without loss the devices take TCP
//! segmentation offload, so the kernel hands over segments of up to 64 KB
//! (still counted by TCP in 1,448-byte MSS) and a 10 Gb/s link needs about
//! 20,000 packets a second, not 830,000. With loss, offload is off and every
//! 1,500-byte packet is dropped or kept on its own, as on a wire.
//!
//! On SIGINT or SIGTERM it prints, per direction, what it carried and how
//! late each packet left against its due time, which bounds the emulator's
//! own error. It stops with an error when a device or either namespace goes
//! away. The rate counts IP bytes (no Ethernet framing), and the headers of
//! an offloaded segment once, so goodput runs a few percent above netem's
//! at the same rate.

use std::collections::VecDeque;
use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::AsRawFd;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use clap::Args;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::run::stats::quantile;

#[derive(Args, Debug)]
pub struct LinkArgs {
    /// The first namespace (as `ip netns` names it) and its TUN device.
    #[arg(long, env = "PDSERVE_LINK_NS_A")]
    ns_a: String,
    #[arg(long, env = "PDSERVE_LINK_DEV_A")]
    dev_a: String,
    /// The second namespace and its TUN device.
    #[arg(long, env = "PDSERVE_LINK_NS_B")]
    ns_b: String,
    #[arg(long, env = "PDSERVE_LINK_DEV_B")]
    dev_b: String,
    /// One-way delay in milliseconds, each direction (half the added RTT).
    #[arg(long, env = "PDSERVE_LINK_DELAY_MS", default_value_t = 0.25)]
    delay_ms: f64,
    /// Link rate in Mbit/s, each direction; 0 for no limit.
    #[arg(long, env = "PDSERVE_LINK_RATE_MBIT", default_value_t = 0.0)]
    rate_mbit: f64,
    /// Percentage of packets dropped at random, each direction.
    #[arg(long, env = "PDSERVE_LINK_LOSS", default_value_t = 0.0)]
    loss: f64,
    /// Packets queued per direction beyond which new ones are dropped (as
    /// netem's `limit`).
    #[arg(long, env = "PDSERVE_LINK_LIMIT", default_value_t = 1000)]
    limit: usize,
    /// Seed of the loss draws.
    #[arg(long, env = "PDSERVE_LINK_SEED", default_value_t = 1)]
    seed: u64,
}

/// What one direction of the link does to a packet: when it leaves, or that
/// it is dropped. Kept apart from the I/O so that it can be tested.
#[derive(Debug)]
struct Shaper {
    /// Seconds per byte on the wire; 0 for no limit.
    per_byte: f64,
    delay: Duration,
    loss: f64,
    limit: usize,
    /// When the wire is free again.
    free_at: Option<Instant>,
    rng: StdRng,
}

#[derive(Debug, PartialEq)]
enum Verdict {
    Leave(Instant),
    Lost,
    OverLimit,
}

impl Shaper {
    fn new(args: &LinkArgs, seed: u64) -> Self {
        Self {
            per_byte: if args.rate_mbit > 0.0 {
                8.0 / (args.rate_mbit * 1e6)
            } else {
                0.0
            },
            delay: Duration::from_secs_f64(args.delay_ms / 1e3),
            loss: args.loss / 100.0,
            limit: args.limit,
            free_at: None,
            rng: StdRng::seed_from_u64(seed),
        }
    }

    /// A packet of `bytes` arrives at `now` with `queued` packets ahead of it.
    fn admit(&mut self, now: Instant, bytes: usize, queued: usize) -> Verdict {
        if self.loss > 0.0 && self.rng.random::<f64>() < self.loss {
            return Verdict::Lost;
        }
        if queued >= self.limit {
            return Verdict::OverLimit;
        }
        let start = self.free_at.map_or(now, |free| free.max(now));
        let sent = start + Duration::from_secs_f64(bytes as f64 * self.per_byte);
        self.free_at = Some(sent);
        Verdict::Leave(sent + self.delay)
    }
}

/// One direction's counters, printed at exit.
#[derive(Debug, Default)]
struct Counters {
    packets: u64,
    bytes: u64,
    lost: u64,
    over_limit: u64,
    write_errors: u64,
    /// Microseconds each packet left after its due time (first million).
    late_us: Vec<f64>,
}

struct Queue {
    packets: Mutex<VecDeque<(Instant, Vec<u8>)>>,
    ready: Condvar,
}

/// The `virtio_net_hdr` in front of every packet read or written.
const VNET_HDR: usize = 10;

/// Attaches to TUN device `dev` of network namespace `ns`: the namespace is
/// entered for the open (a TUN file belongs to the namespace it was opened
/// in) and left again.
fn open_tun(ns: &str, dev: &str, offload: bool) -> Result<File> {
    ensure!(
        !dev.is_empty() && dev.len() < libc::IFNAMSIZ && !dev.contains(['\0', '/', '%']),
        "bad device name {dev:?}"
    );
    let home = File::open("/proc/thread-self/ns/net").context("opening this thread's netns")?;
    let target = File::open(format!("/run/netns/{ns}"))
        .with_context(|| format!("no network namespace {ns}"))?;
    enter(&target).with_context(|| format!("entering network namespace {ns}"))?;
    let opened = attach(dev, offload);
    enter(&home).context("returning to this process's network namespace")?;
    opened.with_context(|| format!("attaching to TUN device {dev} in {ns}"))
}

fn enter(ns: &File) -> std::io::Result<()> {
    // SAFETY: setns on an open namespace file descriptor; affects only this thread.
    if unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

fn attach(dev: &str, offload: bool) -> std::io::Result<File> {
    // TUNSETIFF on a name that does not exist creates a new device; this
    // attaches only to one the caller made.
    let name = std::ffi::CString::new(dev).expect("checked: no NUL");
    // SAFETY: a NUL-terminated name.
    if unsafe { libc::if_nametoindex(name.as_ptr()) } == 0 {
        return Err(std::io::Error::new(
            std::io::ErrorKind::NotFound,
            "no such device (create it with `ip tuntap add dev NAME mode tun vnet_hdr`)",
        ));
    }
    let tun = File::options()
        .read(true)
        .write(true)
        .open("/dev/net/tun")?;
    // struct ifreq: the name, then the flags at byte 16; 40 bytes in all.
    let mut ifreq = [0u8; 40];
    ifreq[..dev.len()].copy_from_slice(dev.as_bytes());
    let flags = (libc::IFF_TUN | libc::IFF_NO_PI | libc::IFF_VNET_HDR) as libc::c_short;
    ifreq[16..18].copy_from_slice(&flags.to_ne_bytes());
    let offloads = match offload {
        true => (libc::TUN_F_CSUM | libc::TUN_F_TSO4 | libc::TUN_F_TSO6) as libc::c_ulong,
        false => 0,
    };
    // SAFETY: TUNSETIFF reads and writes the 40-byte ifreq it is given;
    // TUNSETOFFLOAD takes its flags by value.
    unsafe {
        if libc::ioctl(tun.as_raw_fd(), libc::TUNSETIFF, ifreq.as_mut_ptr()) != 0
            || libc::ioctl(tun.as_raw_fd(), libc::TUNSETOFFLOAD, offloads) != 0
        {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(tun)
}

/// Reads `from`, shapes, queues.
fn receive(mut from: File, mut shaper: Shaper, queue: Arc<Queue>, counters: Arc<Mutex<Counters>>) {
    let mut buf = vec![0u8; 65_536 + VNET_HDR];
    loop {
        let n = match from.read(&mut buf) {
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => {
                // The device (or its namespace) is gone: the link is down,
                // and an emulator with one direction dead must not linger.
                eprintln!("link: reading a TUN device failed, stopping: {e}");
                std::process::exit(1);
            }
        };
        let now = Instant::now();
        let packet = buf[..n].to_vec();
        let mut packets = queue.packets.lock().expect("link queue");
        match shaper.admit(now, n.saturating_sub(VNET_HDR), packets.len()) {
            Verdict::Leave(due) => {
                packets.push_back((due, packet));
                queue.ready.notify_one();
            }
            Verdict::Lost => counters.lock().expect("link counters").lost += 1,
            Verdict::OverLimit => counters.lock().expect("link counters").over_limit += 1,
        }
    }
}

/// Writes each queued packet to `to` once it is due. Departure times only
/// grow (a constant delay after a FIFO wire), so the head is always next.
fn transmit(mut to: File, queue: Arc<Queue>, counters: Arc<Mutex<Counters>>) {
    loop {
        let due = {
            let mut packets = queue.packets.lock().expect("link queue");
            while packets.is_empty() {
                packets = queue.ready.wait(packets).expect("link queue");
            }
            packets[0].0
        };
        wait_until(due);
        let (due, packet) = queue
            .packets
            .lock()
            .expect("link queue")
            .pop_front()
            .expect("only this thread pops");
        let written = to.write(&packet);
        let late = Instant::now().saturating_duration_since(due);
        let mut c = counters.lock().expect("link counters");
        match written {
            Ok(_) => {
                c.packets += 1;
                c.bytes += packet.len().saturating_sub(VNET_HDR) as u64;
                if c.late_us.len() < 1_000_000 {
                    c.late_us.push(late.as_secs_f64() * 1e6);
                }
            }
            Err(_) => c.write_errors += 1,
        }
    }
}

/// A thread wakes from a sleep some tens of microseconds late on a busy
/// machine; the last stretch before a packet is due is spun instead.
const SPIN: Duration = Duration::from_micros(80);

fn wait_until(due: Instant) {
    let now = Instant::now();
    if due > now + SPIN {
        std::thread::sleep(due - now - SPIN);
    }
    while Instant::now() < due {
        std::hint::spin_loop();
    }
}

/// Blocks SIGINT and SIGTERM in this thread (and so in every thread spawned
/// after), for `sigtimedwait` to take them.
fn block_exit_signals() -> libc::sigset_t {
    // SAFETY: plain signal-set manipulation on a zeroed, initialised set.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGINT);
        libc::sigaddset(&mut set, libc::SIGTERM);
        libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
        set
    }
}

pub fn run(args: LinkArgs) -> Result<()> {
    ensure!(
        (0.0..=60_000.0).contains(&args.delay_ms),
        "--delay-ms must be between 0 and 60000"
    );
    ensure!(
        args.rate_mbit == 0.0 || (0.001..=1e7).contains(&args.rate_mbit),
        "--rate-mbit must be 0 (no limit) or between 0.001 and 10000000"
    );
    ensure!(
        (0.0..100.0).contains(&args.loss),
        "--loss is a percentage below 100"
    );
    ensure!(args.limit > 0, "--limit must be > 0");
    // Sleeps to the microsecond, not to the default 50 µs timer slack.
    // SAFETY: prctl with an integer argument.
    unsafe { libc::prctl(libc::PR_SET_TIMERSLACK, 1 as libc::c_ulong) };
    // A panic in any thread (a poisoned queue, a time overflow) stops the
    // link, rather than leaving one direction dead.
    let report = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        report(info);
        std::process::exit(101);
    }));
    let set = block_exit_signals();
    let offload = args.loss == 0.0;
    let a = open_tun(&args.ns_a, &args.dev_a, offload)?;
    let b = open_tun(&args.ns_b, &args.dev_b, offload)?;
    let directions = [
        (
            format!("{} -> {}", args.ns_a, args.ns_b),
            a.try_clone()?,
            b.try_clone()?,
        ),
        (format!("{} -> {}", args.ns_b, args.ns_a), b, a),
    ];
    let mut all = Vec::new();
    for (i, (name, from, to)) in directions.into_iter().enumerate() {
        let queue = Arc::new(Queue {
            packets: Mutex::new(VecDeque::new()),
            ready: Condvar::new(),
        });
        let counters = Arc::new(Mutex::new(Counters::default()));
        let shaper = Shaper::new(&args, args.seed.wrapping_add(i as u64));
        let (q, c) = (queue.clone(), counters.clone());
        std::thread::Builder::new()
            .name(format!("link-rx-{i}"))
            .spawn(move || receive(from, shaper, q, c))?;
        let c = counters.clone();
        std::thread::Builder::new()
            .name(format!("link-tx-{i}"))
            .spawn(move || transmit(to, queue, c))?;
        all.push((name, counters));
    }
    eprintln!(
        "link ready: {}/{} <-> {}/{}: delay {} ms each way, rate {}, loss {}%, offload {}",
        args.ns_a,
        args.dev_a,
        args.ns_b,
        args.dev_b,
        args.delay_ms,
        if args.rate_mbit > 0.0 {
            format!("{} Mbit/s", args.rate_mbit)
        } else {
            "unlimited".into()
        },
        args.loss,
        if offload { "on" } else { "off" },
    );
    let gone = wait_for_exit(&set, [&args.ns_a, &args.ns_b]);
    for (name, counters) in all {
        let mut c = counters.lock().expect("link counters");
        c.late_us.sort_by(f64::total_cmp);
        eprintln!(
            "link {name}: {} packets, {:.1} MB, {} lost, {} over the limit, {} write errors; \
             left after due: p50 {:.0} µs, p99 {:.0} µs",
            c.packets,
            c.bytes as f64 / 1e6,
            c.lost,
            c.over_limit,
            c.write_errors,
            quantile(&c.late_us, 0.5),
            quantile(&c.late_us, 0.99),
        );
    }
    match gone {
        Some(ns) => bail!("network namespace {ns} is gone: the link is down"),
        None => Ok(()),
    }
}

/// Waits for SIGINT or SIGTERM; checks every second that both namespaces
/// still exist (a TUN file keeps its namespace alive after `ip netns del`,
/// so reads would not fail), and returns the first one gone.
fn wait_for_exit<'a>(set: &libc::sigset_t, namespaces: [&'a String; 2]) -> Option<&'a String> {
    let second = libc::timespec {
        tv_sec: 1,
        tv_nsec: 0,
    };
    loop {
        // SAFETY: waits on a set blocked in every thread of the process.
        if unsafe { libc::sigtimedwait(set, std::ptr::null_mut(), &second) } > 0 {
            return None;
        }
        if let Some(ns) = namespaces
            .into_iter()
            .find(|ns| !std::path::Path::new(&format!("/run/netns/{ns}")).exists())
        {
            return Some(ns);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(delay_ms: f64, rate_mbit: f64, loss: f64, limit: usize) -> LinkArgs {
        LinkArgs {
            ns_a: "a".into(),
            dev_a: "ta".into(),
            ns_b: "b".into(),
            dev_b: "tb".into(),
            delay_ms,
            rate_mbit,
            loss,
            limit,
            seed: 7,
        }
    }

    fn leave(v: Verdict) -> Instant {
        match v {
            Verdict::Leave(at) => at,
            other => panic!("expected the packet to leave, got {other:?}"),
        }
    }

    #[test]
    fn back_to_back_packets_queue_behind_each_other_on_the_wire() {
        // 1 Gbit/s: 1,250 bytes take 10 µs; each packet then waits 0.25 ms.
        let mut s = Shaper::new(&args(0.25, 1000.0, 0.0, 1000), 1);
        let t0 = Instant::now();
        let first = leave(s.admit(t0, 1250, 0));
        let second = leave(s.admit(t0, 1250, 1));
        assert_eq!(first - t0, Duration::from_micros(260));
        assert_eq!(second - t0, Duration::from_micros(270));
        // After the wire has gone idle, a packet starts at once.
        let later = t0 + Duration::from_millis(5);
        assert_eq!(
            leave(s.admit(later, 1250, 0)) - later,
            Duration::from_micros(260)
        );
    }

    #[test]
    fn without_a_rate_only_the_delay_is_added() {
        let mut s = Shaper::new(&args(0.5, 0.0, 0.0, 10), 1);
        let t0 = Instant::now();
        for i in 0..5 {
            assert_eq!(
                leave(s.admit(t0, 65_000, i)) - t0,
                Duration::from_micros(500)
            );
        }
    }

    #[test]
    fn a_full_queue_drops_the_newcomer() {
        let mut s = Shaper::new(&args(0.25, 0.0, 0.0, 3), 1);
        let now = Instant::now();
        assert!(matches!(s.admit(now, 100, 2), Verdict::Leave(_)));
        assert_eq!(s.admit(now, 100, 3), Verdict::OverLimit);
    }

    #[test]
    fn loss_drops_about_its_share() {
        let mut s = Shaper::new(&args(0.0, 0.0, 1.0, usize::MAX), 42);
        let now = Instant::now();
        let lost = (0..100_000)
            .filter(|_| s.admit(now, 1500, 0) == Verdict::Lost)
            .count();
        assert!((800..1200).contains(&lost), "{lost} of 100,000 lost at 1%");
    }
}
