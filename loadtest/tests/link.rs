//! `pdserve-loadtest link` between two network namespaces it did not create:
//! TCP across it sees the delay it adds and the rate it holds, its exit
//! report counts what it carried, and a device that does not exist is
//! refused. Needs root, `ip`, `python3` and
//! `/dev/net/tun` (as CI has); skipped without them.

#![cfg(target_os = "linux")]

use std::io::{BufRead, BufReader, Read};
use std::process::{Child, Command, Stdio};

/// Two namespaces joined by nothing but a TUN device each, removed on drop.
struct Namespaces {
    a: String,
    b: String,
}

const ADDR_A: &str = "10.231.7.1";
const ADDR_B: &str = "10.231.7.2";

fn sh(args: &[&str]) -> bool {
    Command::new(args[0])
        .args(&args[1..])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

impl Namespaces {
    /// `None` where this machine cannot make them (not root, no TUN, no `ip`).
    fn create() -> Option<Self> {
        if !std::path::Path::new("/dev/net/tun").exists() || !sh(&["python3", "-c", "pass"]) {
            return None;
        }
        let pid = std::process::id();
        let ns = Self {
            a: format!("pdlt-a-{pid}"),
            b: format!("pdlt-b-{pid}"),
        };
        for (name, dev, addr) in [(&ns.a, "pdlt-ta", ADDR_A), (&ns.b, "pdlt-tb", ADDR_B)] {
            let cidr = format!("{addr}/24");
            let made = sh(&["ip", "netns", "add", name])
                && sh(&[
                    "ip", "netns", "exec", name, "ip", "tuntap", "add", "dev", dev, "mode", "tun",
                    "vnet_hdr",
                ])
                && sh(&["ip", "-n", name, "addr", "add", &cidr, "dev", dev])
                && sh(&["ip", "-n", name, "link", "set", "lo", "up"])
                && sh(&["ip", "-n", name, "link", "set", dev, "up"]);
            if !made {
                eprintln!("skipped: cannot create network namespaces with TUN devices here");
                return None;
            }
        }
        Some(ns)
    }

    fn exec(&self, ns: &str, program: &[&str]) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", ns]).args(program);
        c
    }
}

impl Drop for Namespaces {
    fn drop(&mut self) {
        sh(&["ip", "netns", "del", &self.a]);
        sh(&["ip", "netns", "del", &self.b]);
    }
}

/// Echoes what it reads on `p` connections; on others, swallows everything
/// and answers one byte at the end.
const SERVER: &str = r#"
import socket, sys
l = socket.socket(); l.bind((sys.argv[1], 9700)); l.listen()
print("up", flush=True)
while True:
    c, _ = l.accept(); c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if c.recv(1) == b"p":
        while (d := c.recv(64)): c.sendall(d)
    else:
        while c.recv(1 << 20): pass
        c.sendall(b"k")
    c.close()
"#;

/// Prints the median of 15 one-byte round trips (ms), then the seconds to
/// send argv[2] bytes and get the answer.
const CLIENT: &str = r#"
import socket, statistics, sys, time
host, size = sys.argv[1], int(sys.argv[2])
c = socket.create_connection((host, 9700), timeout=30)
c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1); c.sendall(b"p")
rtts = []
for _ in range(15):
    t = time.perf_counter(); c.sendall(b"x"); c.recv(64); rtts.append(time.perf_counter() - t)
c.close()
c = socket.create_connection((host, 9700), timeout=30); c.sendall(b"b")
t = time.perf_counter(); c.sendall(b"\0" * size); c.shutdown(socket.SHUT_WR); c.recv(1)
print(statistics.median(rtts) * 1e3, time.perf_counter() - t)
"#;

struct Killed(Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn tcp_across_the_link_sees_its_delay_and_its_rate() {
    let Some(ns) = Namespaces::create() else {
        return;
    };
    let mut server = Killed(
        ns.exec(&ns.b, &["python3", "-c", SERVER, ADDR_B])
            .stdout(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    let mut up = String::new();
    BufReader::new(server.0.stdout.as_mut().unwrap())
        .read_line(&mut up)
        .unwrap();
    assert_eq!(up.trim(), "up");

    // A device that does not exist is refused, not created.
    let typo = Command::new(env!("CARGO_BIN_EXE_pdserve-loadtest"))
        .args(["link", "--ns-a", &ns.a, "--dev-a", "pdlt-ta"])
        .args(["--ns-b", &ns.b, "--dev-b", "pdlt-typo"])
        .output()
        .unwrap();
    assert!(!typo.status.success());
    assert!(String::from_utf8_lossy(&typo.stderr).contains("no such device"));
    assert!(!sh(&["ip", "-n", &ns.b, "link", "show", "pdlt-typo"]));

    // 10 ms each way, 40 Mbit/s.
    let mut link = Killed(
        Command::new(env!("CARGO_BIN_EXE_pdserve-loadtest"))
            .args(["link", "--ns-a", &ns.a, "--dev-a", "pdlt-ta"])
            .args(["--ns-b", &ns.b, "--dev-b", "pdlt-tb"])
            .args(["--delay-ms", "10", "--rate-mbit", "40"])
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    let mut stderr = BufReader::new(link.0.stderr.take().unwrap());
    let mut ready = String::new();
    stderr.read_line(&mut ready).unwrap();
    assert!(ready.starts_with("link ready"), "{ready}");

    // 2 MB at 40 Mbit/s: 0.4 s on the wire.
    let out = ns
        .exec(&ns.a, &["python3", "-c", CLIENT, ADDR_B, "2000000"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).unwrap();
    let figures: Vec<f64> = text
        .split_whitespace()
        .map(|f| f.parse().unwrap())
        .collect();
    let (rtt_ms, bulk_s) = (figures[0], figures[1]);
    assert!(
        (20.0..200.0).contains(&rtt_ms),
        "RTT {rtt_ms} ms across a link of 10 ms each way"
    );
    assert!(
        (0.35..5.0).contains(&bulk_s),
        "2 MB took {bulk_s} s at 40 Mbit/s"
    );

    // SIGTERM: the report, one line per direction.
    assert!(sh(&["kill", "-TERM", &link.0.id().to_string()]));
    assert!(link.0.wait().unwrap().success());
    let mut report = String::new();
    stderr.read_to_string(&mut report).unwrap();
    let forward = report
        .lines()
        .find(|l| l.starts_with(&format!("link {} -> {}", ns.a, ns.b)))
        .unwrap_or_else(|| panic!("no report of {} -> {}:\n{report}", ns.a, ns.b));
    let megabytes: f64 = forward
        .split(", ")
        .find_map(|f| f.strip_suffix(" MB"))
        .and_then(|f| f.parse().ok())
        .unwrap_or_else(|| panic!("{forward}"));
    assert!(megabytes >= 2.0, "{forward}");
    assert!(
        forward.contains(" 0 lost") && forward.contains(" 0 write errors"),
        "{forward}"
    );
}
