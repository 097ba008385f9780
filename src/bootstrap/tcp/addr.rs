//! Addresses of the store: the listen address a caller, `SYMM_BOOTSTRAP_ADDR`
//! or the default names, and the address put in ids for peers to dial.

use crate::error::{ensure, err, Result};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, ToSocketAddrs, UdpSocket};

/// Environment variable naming the address `create_unique_id` listens on.
pub const ADDR_ENV: &str = crate::config::BOOTSTRAP_ADDR;
/// Used when neither the caller nor [`ADDR_ENV`] names a listen address:
/// loopback, so a single-host job exposes nothing to the network.
pub const DEFAULT_LISTEN: &str = "127.0.0.1:0";

/// The address to listen on: `listen`, else `$SYMM_BOOTSTRAP_ADDR`, else
/// [`DEFAULT_LISTEN`]. Errors name where the bad address came from.
pub(super) fn listen_addr(listen: Option<&str>) -> Result<SocketAddr> {
    let (spec, source) = match listen {
        Some(s) => (s.to_string(), "listen address"),
        None => match crate::config::bootstrap_addr() {
            Some(s) => (s, ADDR_ENV),
            None => (DEFAULT_LISTEN.to_string(), "default listen address"),
        },
    };
    parse_listen(&spec).map_err(|e| e.context(format!("{source} '{spec}'")))
}

/// Parses a listen address in any of the forms `create_unique_id` accepts.
fn parse_listen(spec: &str) -> Result<SocketAddr> {
    let s = spec.trim();
    ensure!(!s.is_empty(), InvalidArgument, "bootstrap: empty listen address");
    if let Ok(a) = s.parse::<SocketAddr>() {
        return Ok(a);
    }
    let bare = s.strip_prefix('[').and_then(|x| x.strip_suffix(']')).unwrap_or(s);
    if let Ok(ip) = bare.parse::<IpAddr>() {
        return Ok(SocketAddr::new(ip, 0));
    }
    let (host, port) = match s.rsplit_once(':') {
        Some((h, p)) if !h.contains(':') => {
            let port = p.parse::<u16>().map_err(|_| err!(InvalidArgument, "bootstrap: '{p}' is not a port number"))?;
            (h, port)
        }
        _ => (s, 0),
    };
    resolve(host, port)
}

/// Resolves a host name, preferring IPv4 (what clusters use in practice).
pub(crate) fn resolve(host: &str, port: u16) -> Result<SocketAddr> {
    let addrs: Vec<SocketAddr> = (host, port)
        .to_socket_addrs()
        .map_err(|e| err!(InvalidArgument, "bootstrap: cannot resolve host '{host}': {e}"))?
        .collect();
    addrs
        .iter()
        .find(|a| a.is_ipv4())
        .or(addrs.first())
        .copied()
        .ok_or_else(|| err!(InvalidArgument, "bootstrap: host '{host}' has no address"))
}

/// The address to put in ids for a store bound to `local`.
pub(super) fn advertised(local: SocketAddr) -> SocketAddr {
    if !local.ip().is_unspecified() {
        return local;
    }
    SocketAddr::new(routable_ip(local.is_ipv6()), local.port())
}

/// An address of this host that peers can dial: the host name's address if
/// it is not loopback, else the source address of the default route, else
/// loopback (single-host jobs still work).
fn routable_ip(v6_listener: bool) -> IpAddr {
    let usable = |ip: &IpAddr| match ip {
        IpAddr::V4(a) => !a.is_loopback() && !a.is_unspecified(),
        // Link-local addresses need a scope id peers cannot know.
        IpAddr::V6(a) => !a.is_loopback() && !a.is_unspecified() && (a.segments()[0] & 0xffc0) != 0xfe80,
    };
    let family_ok = |ip: &IpAddr| v6_listener || ip.is_ipv4();
    let from_name = hostname_ips().into_iter().find(|ip| usable(ip) && family_ok(ip));
    let from_route = || {
        let mut candidates = vec![route_ip(false)];
        if v6_listener {
            candidates.push(route_ip(true));
        }
        candidates.into_iter().flatten().find(|ip| usable(ip))
    };
    from_name.or_else(from_route).unwrap_or(if v6_listener {
        IpAddr::V6(Ipv6Addr::LOCALHOST)
    } else {
        IpAddr::V4(Ipv4Addr::LOCALHOST)
    })
}

/// Addresses the host name resolves to (often only 127.0.1.1 on Debian).
fn hostname_ips() -> Vec<IpAddr> {
    let mut buf = [0u8; 256];
    // SAFETY: the buffer is valid for its length; gethostname NUL-terminates
    // on success when the name fits.
    let rc = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len() - 1) };
    if rc != 0 {
        return Vec::new();
    }
    let len = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    let Ok(name) = std::str::from_utf8(&buf[..len]) else { return Vec::new() };
    match (name, 0u16).to_socket_addrs() {
        Ok(it) => it.map(|a| a.ip()).collect(),
        Err(_) => Vec::new(),
    }
}

/// The local address the kernel would use to reach a documentation-range
/// address; connecting a UDP socket sends nothing.
fn route_ip(v6: bool) -> Option<IpAddr> {
    let (bind, target) = if v6 { ("[::]:0", "[2001:db8::1]:9") } else { ("0.0.0.0:0", "192.0.2.1:9") };
    let s = UdpSocket::bind(bind).ok()?;
    s.connect(target).ok()?;
    Some(s.local_addr().ok()?.ip())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::ErrorKind;

    #[test]
    fn listen_spec_forms() {
        let p = |s| parse_listen(s).unwrap();
        assert_eq!(p("127.0.0.1:5000"), "127.0.0.1:5000".parse().unwrap());
        assert_eq!(p("[::1]:7"), "[::1]:7".parse().unwrap());
        assert_eq!(p("10.0.0.1"), "10.0.0.1:0".parse().unwrap());
        assert_eq!(p("::1"), "[::1]:0".parse().unwrap());
        assert_eq!(p("[::1]"), "[::1]:0".parse().unwrap());
        assert_eq!(p("localhost:99").port(), 99);
        assert!(p("localhost").ip().is_loopback());
        assert_eq!(parse_listen("localhost:x").unwrap_err().kind, ErrorKind::InvalidArgument);
        assert!(parse_listen("").is_err());
        assert!(parse_listen("no-such-host.invalid").is_err());
    }
}
