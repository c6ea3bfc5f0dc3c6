//! Network rules shared by the router and the workers: what a worker URL may
//! be, which hosts may register, and the process's file-descriptor limit.

use std::net::IpAddr;

/// A worker's base URL, checked and normalised to `scheme://host:port`: an
/// absolute http(s) URL with a host and an explicit port, and nothing else
/// (no user, path, query or fragment).
pub fn worker_base(raw: &str) -> Result<String, String> {
    let url = url::Url::parse(raw).map_err(|e| format!("`{raw}` is not a URL: {e}"))?;
    if !matches!(url.scheme(), "http" | "https") {
        return Err(format!("`{raw}` is not an http(s) URL"));
    }
    let host = url
        .host_str()
        .filter(|h| !h.is_empty())
        .ok_or_else(|| format!("`{raw}` has no host"))?;
    if !has_explicit_port(raw) {
        return Err(format!("`{raw}` names no port"));
    }
    if !url.username().is_empty() || url.password().is_some() {
        return Err(format!("`{raw}` carries credentials"));
    }
    if !matches!(url.path(), "" | "/") || url.query().is_some() || url.fragment().is_some() {
        return Err(format!(
            "`{raw}` must be a base URL (no path, query or fragment)"
        ));
    }
    let port = url.port_or_known_default().unwrap_or_default();
    Ok(format!("{}://{host}:{port}", url.scheme()))
}

/// Whether the authority of `raw` ends in `:port`.
fn has_explicit_port(raw: &str) -> bool {
    let rest = raw.split_once("://").map_or("", |(_, r)| r);
    let authority = rest.split(['/', '?', '#']).next().unwrap_or("");
    let host_port = authority.rsplit('@').next().unwrap_or("");
    let after_host = match host_port.rfind(']') {
        Some(i) => &host_port[i + 1..],
        None => host_port,
    };
    after_host
        .rsplit_once(':')
        .is_some_and(|(_, p)| !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()))
}

/// Hosts that may register as workers: CIDRs (`10.0.0.0/8`), addresses
/// and exact host names. Empty: any host.
#[derive(Debug, Clone, Default)]
pub struct HostAllow {
    nets: Vec<(IpAddr, u8)>,
    names: Vec<String>,
}

impl HostAllow {
    /// Parses `--worker-allow` entries.
    pub fn parse(entries: &[String]) -> Result<Self, String> {
        let mut allow = Self::default();
        for entry in entries.iter().map(|e| e.trim()).filter(|e| !e.is_empty()) {
            match entry.split_once('/') {
                Some((ip, bits)) => {
                    let ip: IpAddr = ip.parse().map_err(|_| format!("bad CIDR `{entry}`"))?;
                    let max = if ip.is_ipv4() { 32 } else { 128 };
                    let bits: u8 = bits.parse().map_err(|_| format!("bad CIDR `{entry}`"))?;
                    if bits > max {
                        return Err(format!("bad CIDR `{entry}`"));
                    }
                    allow.nets.push((ip, bits));
                }
                None => match entry.trim_matches(['[', ']']).parse::<IpAddr>() {
                    Ok(ip) => allow.nets.push((ip, if ip.is_ipv4() { 32 } else { 128 })),
                    Err(_) => allow.names.push(entry.to_ascii_lowercase()),
                },
            }
        }
        Ok(allow)
    }

    pub fn is_empty(&self) -> bool {
        self.nets.is_empty() && self.names.is_empty()
    }

    /// Whether a worker at `host` (a name or an address, as a URL gives it)
    /// may register.
    pub fn allows(&self, host: &str) -> bool {
        if self.is_empty() {
            return true;
        }
        match host.trim_matches(['[', ']']).parse::<IpAddr>() {
            Ok(ip) => self.nets.iter().any(|&(net, bits)| in_net(ip, net, bits)),
            Err(_) => self.names.iter().any(|n| n.eq_ignore_ascii_case(host)),
        }
    }
}

fn in_net(ip: IpAddr, net: IpAddr, bits: u8) -> bool {
    let (ip, net, width) = match (ip, net) {
        (IpAddr::V4(a), IpAddr::V4(b)) => (u32::from(a) as u128, u32::from(b) as u128, 32),
        (IpAddr::V6(a), IpAddr::V6(b)) => (u128::from(a), u128::from(b), 128),
        _ => return false,
    };
    let shift = width - bits as u32;
    shift >= width || (ip >> shift) == (net >> shift)
}

/// The host of a URL `worker_base` accepted.
pub fn host_of(base: &str) -> &str {
    let rest = base.split_once("://").map_or(base, |(_, r)| r);
    match rest.rfind(':') {
        Some(i) => &rest[..i],
        None => rest,
    }
}

/// Raises the soft limit on open files to the hard limit (a router holds two
/// sockets per stream); returns the limit now in force.
pub fn raise_nofile_limit() -> std::io::Result<u64> {
    // SAFETY: getrlimit/setrlimit only read and write the struct we pass.
    unsafe {
        let mut lim = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) != 0 {
            return Err(std::io::Error::last_os_error());
        }
        if lim.rlim_cur < lim.rlim_max {
            let raised = libc::rlimit {
                rlim_cur: lim.rlim_max,
                rlim_max: lim.rlim_max,
            };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &raised) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            lim.rlim_cur = lim.rlim_max;
        }
        // rlim_t is u64 on Linux, but not everywhere.
        #[allow(clippy::unnecessary_cast)]
        Ok(lim.rlim_cur as u64)
    }
}

/// Whether an I/O error is this process running out of file descriptors
/// (EMFILE/ENFILE): not a sign that the peer is down.
pub fn is_fd_exhaustion(e: &(dyn std::error::Error + 'static)) -> bool {
    causes(e).any(|err| {
        err.downcast_ref::<std::io::Error>()
            .is_some_and(|io| matches!(io.raw_os_error(), Some(libc::EMFILE) | Some(libc::ENFILE)))
    })
}

/// An error and its causes, outermost first.
fn causes<'a>(
    e: &'a (dyn std::error::Error + 'static),
) -> impl Iterator<Item = &'a (dyn std::error::Error + 'static)> {
    std::iter::successors(Some(e), |err| err.source())
}

/// An error with its causes, `outer: inner: root`: reqwest's own message
/// ("error sending request") says nothing of what failed underneath.
pub fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut out = e.to_string();
    for err in causes(e).skip(1) {
        let s = err.to_string();
        if !out.ends_with(&s) {
            out.push_str(": ");
            out.push_str(&s);
        }
    }
    out
}

/// How long an internal client keeps an idle pooled connection. Short, so
/// that after a burst the connections (and their file descriptors) on both
/// ends go back to their baseline within seconds, not minutes.
pub const POOL_IDLE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_error_chain_names_every_cause_once() {
        let root = std::io::Error::new(std::io::ErrorKind::ConnectionReset, "reset by peer");
        let outer = std::io::Error::other(root);
        // io::Error::other(root) displays as the root: said once.
        assert_eq!(error_chain(&outer), "reset by peer");
        #[derive(Debug)]
        struct Sending(std::io::Error);
        impl std::fmt::Display for Sending {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("error sending request")
            }
        }
        impl std::error::Error for Sending {
            fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
                Some(&self.0)
            }
        }
        let e = Sending(std::io::Error::new(
            std::io::ErrorKind::BrokenPipe,
            "broken pipe",
        ));
        assert_eq!(error_chain(&e), "error sending request: broken pipe");
    }

    #[test]
    fn worker_urls_are_absolute_http_with_host_and_port() {
        assert_eq!(
            worker_base("http://10.0.0.1:8200/").unwrap(),
            "http://10.0.0.1:8200"
        );
        assert_eq!(
            worker_base("https://Node-1:443").unwrap(),
            "https://node-1:443"
        );
        assert_eq!(worker_base("http://[::1]:9").unwrap(), "http://[::1]:9");
        for bad in [
            "10.0.0.1:8200",
            "ftp://a:1",
            "http://a",
            "http://:80",
            "http://u:p@a:1",
            "http://a:1/x",
            "http://a:1?q",
            "file:///etc/passwd",
            "",
        ] {
            assert!(worker_base(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn fd_exhaustion_is_found_through_error_sources() {
        #[derive(Debug)]
        struct Wrap(std::io::Error);
        impl std::fmt::Display for Wrap {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("connect failed")
            }
        }
        impl std::error::Error for Wrap {
            fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
                Some(&self.0)
            }
        }
        let emfile = Wrap(std::io::Error::from_raw_os_error(libc::EMFILE));
        assert!(is_fd_exhaustion(&emfile));
        let refused = Wrap(std::io::Error::from(std::io::ErrorKind::ConnectionRefused));
        assert!(!is_fd_exhaustion(&refused));
    }

    #[test]
    fn the_allow_list_matches_cidrs_addresses_and_names() {
        let allow =
            HostAllow::parse(&["10.0.0.0/8".into(), "::1".into(), "Node-1".into()]).unwrap();
        assert!(allow.allows("10.2.3.4"));
        assert!(!allow.allows("11.0.0.1"));
        assert!(allow.allows("[::1]"));
        assert!(allow.allows("node-1"));
        assert!(!allow.allows("node-2"));
        assert!(HostAllow::default().allows("anything"));
        assert!(HostAllow::parse(&["1.2.3.4/33".into()]).is_err());
        assert!(HostAllow::parse(&["0.0.0.0/0".into()])
            .unwrap()
            .allows("8.8.8.8"));
        assert_eq!(host_of("http://[::1]:9"), "[::1]");
    }
}
