//! Sampling processes from `/proc` during a run: resident memory, open file
//! descriptors and threads of the watched pids and of every descendant of
//! the watched parents (re-discovered at each sample, so workers that a
//! router starts later are picked up).
//!
//! The parsers take the files' text, so they are tested on any platform;
//! only [`sample`] reads `/proc`, and it yields nothing where there is none.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use super::scrape::Sample;

/// Series name of resident memory in bytes (`VmRSS`).
pub const RSS_BYTES: &str = "proc_rss_bytes";
/// Series name of open file descriptors (entries of `/proc/PID/fd`).
pub const OPEN_FDS: &str = "proc_open_fds";
/// Series name of the thread count (`Threads`).
pub const THREADS: &str = "proc_threads";

/// Which processes to sample.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Watch {
    /// Sampled as they are.
    pub pids: Vec<u32>,
    /// Sampled with every process below them in the process tree.
    pub children_of: Vec<u32>,
}

impl Watch {
    /// Whether nothing is watched.
    pub fn is_empty(&self) -> bool {
        self.pids.is_empty() && self.children_of.is_empty()
    }
}

/// What `/proc/PID/status` tells about one process.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Status {
    /// The short command name (`Name:`, at most 15 bytes).
    pub name: String,
    /// Resident memory in bytes, absent for kernel threads and zombies.
    pub rss_bytes: Option<u64>,
    pub threads: Option<u64>,
}

/// Parses the fields of `/proc/PID/status` that are sampled.
pub fn parse_status(text: &str) -> Status {
    let mut s = Status::default();
    for line in text.lines() {
        let Some((key, value)) = line.split_once(':') else {
            continue;
        };
        let value = value.trim();
        match key {
            "Name" => s.name = value.to_string(),
            "VmRSS" => s.rss_bytes = parse_kib(value),
            "Threads" => s.threads = value.parse().ok(),
            _ => {}
        }
    }
    s
}

/// `"1234 kB"` in bytes.
fn parse_kib(value: &str) -> Option<u64> {
    let mut parts = value.split_whitespace();
    let n: u64 = parts.next()?.parse().ok()?;
    match parts.next() {
        Some("kB") | None => Some(n * 1024),
        Some(_) => None,
    }
}

/// The parent pid in `/proc/PID/stat`. The command name in parentheses may
/// itself hold spaces and parentheses, so fields are counted after the last `)`.
pub fn parse_stat_ppid(text: &str) -> Option<u32> {
    let (_, rest) = text.rsplit_once(')')?;
    let mut fields = rest.split_whitespace();
    let _state = fields.next()?;
    fields.next()?.parse().ok()
}

/// The program's file name from `/proc/PID/cmdline` (NUL-separated argv).
pub fn parse_cmdline_name(text: &str) -> Option<String> {
    let argv0 = text.split('\0').next()?.split_whitespace().next()?;
    let name = argv0.rsplit('/').next()?;
    (!name.is_empty()).then(|| name.to_string())
}

/// Every pid in `roots` and every process below one of them, given each
/// process's parent.
pub fn descendants(parents: &BTreeMap<u32, u32>, roots: &[u32]) -> BTreeSet<u32> {
    let mut children: BTreeMap<u32, Vec<u32>> = BTreeMap::new();
    for (&pid, &ppid) in parents {
        children.entry(ppid).or_default().push(pid);
    }
    let mut found = BTreeSet::new();
    let mut todo: Vec<u32> = roots.to_vec();
    while let Some(pid) = todo.pop() {
        if found.insert(pid) {
            todo.extend(children.get(&pid).into_iter().flatten());
        }
    }
    found
}

/// The parent of every process under `root` (a `/proc`).
fn read_parents(root: &Path) -> BTreeMap<u32, u32> {
    let Ok(entries) = std::fs::read_dir(root) else {
        return BTreeMap::new();
    };
    entries
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter_map(|pid| {
            let stat = std::fs::read_to_string(root.join(pid.to_string()).join("stat")).ok()?;
            Some((pid, parse_stat_ppid(&stat)?))
        })
        .collect()
}

/// The pids to sample now.
pub fn discover(watch: &Watch, root: &Path) -> BTreeSet<u32> {
    let mut pids: BTreeSet<u32> = watch.pids.iter().copied().collect();
    if !watch.children_of.is_empty() {
        pids.extend(descendants(&read_parents(root), &watch.children_of));
    }
    pids
}

/// `value` made safe inside a quoted Prometheus label.
pub fn label_value(value: &str) -> String {
    value.replace('\\', "\\\\").replace('"', "\\\"")
}

/// One process's samples at `t`; none if it is gone or unreadable.
fn sample_pid(root: &Path, pid: u32, t: f64) -> Vec<Sample> {
    let dir = root.join(pid.to_string());
    let Ok(status) = std::fs::read_to_string(dir.join("status")) else {
        return Vec::new();
    };
    let status = parse_status(&status);
    let name = std::fs::read(dir.join("cmdline"))
        .ok()
        .and_then(|b| parse_cmdline_name(&String::from_utf8_lossy(&b)))
        .unwrap_or(status.name);
    let fds = std::fs::read_dir(dir.join("fd")).map(|d| d.count() as u64);
    let labels = format!("{{pid=\"{pid}\",name=\"{}\"}}", label_value(&name));
    [
        (RSS_BYTES, status.rss_bytes),
        (OPEN_FDS, fds.ok()),
        (THREADS, status.threads),
    ]
    .into_iter()
    .filter_map(|(series, value)| {
        Some(Sample {
            t,
            series: format!("{series}{labels}"),
            value: value? as f64,
        })
    })
    .collect()
}

/// The watched pids that are not running (all of them without a `/proc`).
pub fn missing(watch: &Watch) -> Vec<u32> {
    let root = Path::new("/proc");
    (watch.pids.iter().chain(&watch.children_of))
        .copied()
        .filter(|pid| !root.join(pid.to_string()).exists())
        .collect()
}

/// Samples every watched process at `t` from `/proc`.
pub fn sample(watch: &Watch, t: f64) -> Vec<Sample> {
    let root = Path::new("/proc");
    discover(watch, root)
        .into_iter()
        .flat_map(|pid| sample_pid(root, pid, t))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const STATUS: &str = "Name:\tpdserve-router\nUmask:\t0022\nState:\tS (sleeping)\nPid:\t4242\nPPid:\t1\nVmPeak:\t  900000 kB\nVmRSS:\t   51200 kB\nRssAnon:\t   40000 kB\nThreads:\t17\n";

    #[test]
    fn status_gives_name_rss_in_bytes_and_threads() {
        let s = parse_status(STATUS);
        assert_eq!(s.name, "pdserve-router");
        assert_eq!(s.rss_bytes, Some(51_200 * 1024));
        assert_eq!(s.threads, Some(17));
    }

    #[test]
    fn a_kernel_thread_has_no_rss() {
        let s = parse_status("Name:\tkthreadd\nThreads:\t1\n");
        assert_eq!((s.rss_bytes, s.threads), (None, Some(1)));
    }

    #[test]
    fn ppid_is_read_after_the_last_parenthesis() {
        let stat = "4243 (pdserve (decode) w) S 4242 4243 4000 0 -1 4194560 1234";
        assert_eq!(parse_stat_ppid(stat), Some(4242));
        assert_eq!(parse_stat_ppid("1 (init) S 0 1 1"), Some(0));
        assert_eq!(parse_stat_ppid("garbage"), None);
    }

    #[test]
    fn cmdline_name_is_the_program_file_name() {
        let cmd = "/opt/bin/pdserve-prefill-worker\0--port\08001\0";
        assert_eq!(
            parse_cmdline_name(cmd).as_deref(),
            Some("pdserve-prefill-worker")
        );
        assert_eq!(parse_cmdline_name(""), None);
    }

    #[test]
    fn descendants_cover_the_whole_subtree_and_nothing_else() {
        // 10 → 11 → 13, 10 → 12; 20 → 21 is another tree.
        let parents = BTreeMap::from([(10, 1), (11, 10), (12, 10), (13, 11), (20, 1), (21, 20)]);
        let got: Vec<u32> = descendants(&parents, &[10]).into_iter().collect();
        assert_eq!(got, vec![10, 11, 12, 13]);
    }

    #[test]
    fn label_values_are_escaped() {
        assert_eq!(label_value(r#"a"b\c"#), r#"a\"b\\c"#);
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn samples_this_process() {
        let me = std::process::id();
        let watch = Watch {
            pids: vec![me],
            children_of: Vec::new(),
        };
        let s = sample(&watch, 2.0);
        let value = |name: &str| {
            s.iter()
                .find(|x| x.series.starts_with(&format!("{name}{{pid=\"{me}\"")))
                .map(|x| x.value)
        };
        assert!(value(RSS_BYTES).unwrap() > 0.0);
        assert!(value(OPEN_FDS).unwrap() >= 3.0);
        assert!(value(THREADS).unwrap() >= 1.0);
        assert!(s.iter().all(|x| x.t == 2.0));
    }
}
