//! The embedded TCP store and its client.
//!
//! `create_unique_id` starts (once per listen address and process) a small
//! server on background threads and returns an id carrying its address and
//! a fresh secret. Every rank then opens one persistent connection with
//! [`TcpBootstrap::connect`] and runs all-gather rounds through it.
//!
//! Each secret is its own namespace (one group): the store runs an
//! `Exchange` per secret, keyed by the clients' sequence numbers, so groups
//! sharing a store never see each other's rounds. The store also remembers
//! which connection holds each rank, so two processes claiming one rank
//! break the group loudly (every participant gets `Mismatch`) rather than
//! mixing their data.
//!
//! The store lives until the process exits; a finished round's data is
//! dropped as soon as every rank has received it.

use super::local::Exchange;
use super::unique_id::{ct_eq, random_secret, UniqueId, SECRET_BYTES};
use super::Bootstrap;
use crate::error::{ensure, err, Error, Result};
use once_cell::sync::Lazy;
use std::collections::HashMap;
use std::fmt;
use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener, TcpStream, ToSocketAddrs, UdpSocket};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread;
use std::time::{Duration, Instant};

/// Environment variable naming the address `create_unique_id` listens on.
pub const ADDR_ENV: &str = "SYMM_BOOTSTRAP_ADDR";
/// Used when neither the caller nor [`ADDR_ENV`] names a listen address:
/// loopback, so a single-host job exposes nothing to the network.
pub const DEFAULT_LISTEN: &str = "127.0.0.1:0";

/// Largest world size the store accepts (a sanity bound, not a design limit).
const MAX_WORLD: usize = 1 << 16;
/// A client that connects but says nothing is dropped after this long.
const HELLO_TIMEOUT: Duration = Duration::from_secs(10);
/// A client that stops reading its replies is dropped after this long.
const WRITE_TIMEOUT: Duration = Duration::from_secs(60);
/// Round timeouts are clamped to this so deadline arithmetic cannot overflow.
const MAX_ROUND_TIMEOUT_MS: u64 = 7 * 24 * 3600 * 1000;
/// How long a dropped client waits for the store to acknowledge its goodbye.
const BYE_TIMEOUT: Duration = Duration::from_secs(1);
/// How long a rank hosting the store waits, when it lets go of its group,
/// for replies still being written to other ranks (see `Group::linger`).
const LINGER: Duration = Duration::from_secs(2);

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

// ---------------------------------------------------------------------------
// Wire format
// ---------------------------------------------------------------------------

/// The store's protocol, in one place.
///
/// Every message is a frame: `u32` body length, then the body. Integers are
/// little-endian. Bodies start with a tag byte:
///
/// | message | body                                                               |
/// |---------|--------------------------------------------------------------------|
/// | Hello   | 1, protocol `u32`, secret `[u8; 32]`, rank `u32`, world `u32`      |
/// | Gather  | 2, seq `u64`, rank `u32`, world `u32`, timeout_ms `u64`, payload   |
/// | Bye     | 3                                                                  |
/// | Ok      | 0, data (Hello/Bye: empty; Gather: all payloads in rank order)     |
/// | Err     | 1, error kind `u8`, UTF-8 message                                  |
///
/// The client sends Hello first and waits for Ok; then any number of Gather
/// (each answered by Ok or Err), then optionally Bye.
pub(crate) mod wire {
    use crate::error::{err, Error, ErrorKind, Result};
    use std::io::{self, BufWriter, Read, Write};

    /// Largest frame anyone sends or accepts.
    pub const FRAME_CAP: usize = 1 << 30;
    /// Largest frame accepted before the peer has proven it knows the secret,
    /// so garbage cannot make the store allocate more than this.
    pub const HELLO_CAP: usize = 1024;
    /// Bumped on any incompatible change to the messages.
    pub const PROTOCOL: u32 = 1;
    /// Bytes of a Gather body before the payload.
    pub const GATHER_HEADER: usize = 1 + 8 + 4 + 4 + 8;

    const TAG_HELLO: u8 = 1;
    const TAG_GATHER: u8 = 2;
    const TAG_BYE: u8 = 3;
    const TAG_OK: u8 = 0;
    const TAG_ERR: u8 = 1;

    #[derive(Clone, Debug, PartialEq, Eq)]
    pub enum Request<'a> {
        Hello { protocol: u32, secret: [u8; 32], rank: u32, world: u32 },
        Gather { seq: u64, rank: u32, world: u32, timeout_ms: u64, payload: &'a [u8] },
        Bye,
    }

    #[derive(Clone, Debug, PartialEq, Eq)]
    pub enum Reply<'a> {
        Ok(&'a [u8]),
        Err(ErrorKind, &'a str),
    }

    /// Error kinds by wire code; the position in this table is the code.
    const KINDS: [ErrorKind; 12] = [
        ErrorKind::InvalidArgument,
        ErrorKind::InvalidHandle,
        ErrorKind::Unsupported,
        ErrorKind::Timeout,
        ErrorKind::Bootstrap,
        ErrorKind::Mismatch,
        ErrorKind::OutOfMemory,
        ErrorKind::Cuda,
        ErrorKind::NoDevice,
        ErrorKind::System,
        ErrorKind::Remote,
        ErrorKind::Internal,
    ];

    fn kind_code(k: ErrorKind) -> u8 {
        KINDS.iter().position(|&x| x == k).unwrap_or(4) as u8
    }

    fn kind_from_code(c: u8) -> ErrorKind {
        KINDS.get(c as usize).copied().unwrap_or(ErrorKind::Bootstrap)
    }

    impl Request<'_> {
        /// Writes the request as one frame (the payload is not copied).
        pub fn write_to(&self, w: &mut impl Write) -> io::Result<()> {
            match self {
                Request::Hello { protocol, secret, rank, world } => {
                    let mut b = vec![TAG_HELLO];
                    b.extend_from_slice(&protocol.to_le_bytes());
                    b.extend_from_slice(secret);
                    b.extend_from_slice(&rank.to_le_bytes());
                    b.extend_from_slice(&world.to_le_bytes());
                    write_frame(w, &[&b])
                }
                Request::Gather { seq, rank, world, timeout_ms, payload } => {
                    let mut h = Vec::with_capacity(GATHER_HEADER);
                    h.push(TAG_GATHER);
                    h.extend_from_slice(&seq.to_le_bytes());
                    h.extend_from_slice(&rank.to_le_bytes());
                    h.extend_from_slice(&world.to_le_bytes());
                    h.extend_from_slice(&timeout_ms.to_le_bytes());
                    write_frame(w, &[&h, payload])
                }
                Request::Bye => write_frame(w, &[&[TAG_BYE]]),
            }
        }
    }

    impl<'a> Request<'a> {
        pub fn decode(body: &'a [u8]) -> Result<Self> {
            let mut c = Cursor(body);
            let req = match c.u8()? {
                TAG_HELLO => Request::Hello {
                    protocol: c.u32()?,
                    secret: c.take(32)?.try_into().unwrap(),
                    rank: c.u32()?,
                    world: c.u32()?,
                },
                TAG_GATHER => Request::Gather {
                    seq: c.u64()?,
                    rank: c.u32()?,
                    world: c.u32()?,
                    timeout_ms: c.u64()?,
                    payload: c.rest(),
                },
                TAG_BYE => Request::Bye,
                t => return Err(malformed(&format!("unknown request tag {t}"))),
            };
            c.end()?;
            Ok(req)
        }
    }

    impl Reply<'_> {
        pub fn write_to(&self, w: &mut impl Write) -> io::Result<()> {
            match self {
                Reply::Ok(data) => write_frame(w, &[&[TAG_OK], data]),
                Reply::Err(kind, msg) => write_frame(w, &[&[TAG_ERR, kind_code(*kind)], msg.as_bytes()]),
            }
        }
    }

    impl<'a> Reply<'a> {
        pub fn decode(body: &'a [u8]) -> Result<Self> {
            let mut c = Cursor(body);
            match c.u8()? {
                TAG_OK => Ok(Reply::Ok(c.rest())),
                TAG_ERR => {
                    let kind = kind_from_code(c.u8()?);
                    let msg = std::str::from_utf8(c.rest()).map_err(|_| malformed("error text is not UTF-8"))?;
                    Ok(Reply::Err(kind, msg))
                }
                t => Err(malformed(&format!("unknown reply tag {t}"))),
            }
        }

        /// The error a client reports for this reply, if it is one.
        pub fn into_result(self) -> Result<&'a [u8]> {
            match self {
                Reply::Ok(d) => Ok(d),
                Reply::Err(kind, msg) => Err(Error::new(kind, msg)),
            }
        }
    }

    /// Writes one frame made of `parts`, coalescing small writes.
    pub fn write_frame(w: &mut impl Write, parts: &[&[u8]]) -> io::Result<()> {
        let len: usize = parts.iter().map(|p| p.len()).sum();
        if len > FRAME_CAP {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("message of {len} bytes exceeds the {FRAME_CAP}-byte frame limit"),
            ));
        }
        let mut w = BufWriter::with_capacity(64 << 10, w);
        w.write_all(&(len as u32).to_le_bytes())?;
        for p in parts {
            w.write_all(p)?;
        }
        w.flush()
    }

    /// Reads one frame of at most `cap` bytes. Memory grows with the bytes
    /// that actually arrive, never with what the header claims.
    pub fn read_frame(r: &mut impl Read, cap: usize) -> io::Result<Vec<u8>> {
        let mut len = [0u8; 4];
        r.read_exact(&mut len)?;
        let len = u32::from_le_bytes(len) as usize;
        if len > cap {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("frame of {len} bytes exceeds the limit of {cap}"),
            ));
        }
        let mut body = Vec::with_capacity(len.min(1 << 20));
        r.take(len as u64).read_to_end(&mut body)?;
        if body.len() != len {
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
        Ok(body)
    }

    fn malformed(what: &str) -> Error {
        err!(Bootstrap, "bootstrap: malformed store message: {what}")
    }

    /// Reads fields off the front of a body.
    struct Cursor<'a>(&'a [u8]);

    impl<'a> Cursor<'a> {
        fn take(&mut self, n: usize) -> Result<&'a [u8]> {
            if self.0.len() < n {
                return Err(malformed("message is truncated"));
            }
            let (head, tail) = self.0.split_at(n);
            self.0 = tail;
            Ok(head)
        }
        fn u8(&mut self) -> Result<u8> {
            Ok(self.take(1)?[0])
        }
        fn u32(&mut self) -> Result<u32> {
            Ok(u32::from_le_bytes(self.take(4)?.try_into().unwrap()))
        }
        fn u64(&mut self) -> Result<u64> {
            Ok(u64::from_le_bytes(self.take(8)?.try_into().unwrap()))
        }
        fn rest(&mut self) -> &'a [u8] {
            std::mem::take(&mut self.0)
        }
        fn end(&self) -> Result<()> {
            if self.0.is_empty() {
                Ok(())
            } else {
                Err(malformed("trailing bytes"))
            }
        }
    }
}

use wire::{read_frame, Reply, Request, FRAME_CAP, HELLO_CAP, PROTOCOL};

// ---------------------------------------------------------------------------
// Creating ids and hosting stores
// ---------------------------------------------------------------------------

/// Starts (or reuses) this process's store on the listen address and returns
/// a new group id with a fresh secret.
///
/// The address comes from `listen`, else `$SYMM_BOOTSTRAP_ADDR`, else
/// `127.0.0.1:0`. Accepted forms: `ip:port`, `[ipv6]:port`, `host:port`,
/// `ip`, `host` (a missing port means an ephemeral one). When the address is
/// unspecified (`0.0.0.0`, `::`) the id carries a routable address of this
/// host instead, so peers on other hosts can dial it.
pub fn create_unique_id(listen: Option<&str>) -> Result<UniqueId> {
    let (spec, source) = match listen {
        Some(s) => (s.to_string(), "listen address"),
        None => match std::env::var(ADDR_ENV).ok().filter(|s| !s.trim().is_empty()) {
            Some(s) => (s, ADDR_ENV),
            None => (DEFAULT_LISTEN.to_string(), "default listen address"),
        },
    };
    let addr = parse_listen(&spec).map_err(|e| e.context(format!("{source} '{spec}'")))?;
    let secret = random_secret()?;
    let server = server_for(addr, secret)?;
    Ok(UniqueId::new(server.advertised, secret))
}

/// Hosts a store on exactly `listen` (reusing this process's store there, if
/// any) for the group with `secret`. Used by the env bootstrap on rank 0.
pub fn host_store(listen: SocketAddr, secret: [u8; SECRET_BYTES]) -> Result<UniqueId> {
    let server = server_for(listen, secret)?;
    Ok(UniqueId::new(server.advertised, secret))
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
fn advertised(local: SocketAddr) -> SocketAddr {
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

// ---------------------------------------------------------------------------
// The store
// ---------------------------------------------------------------------------

/// This process's stores by requested listen address. The pid detects a
/// forked child, which inherits the table but not the serving threads.
struct Registry {
    pid: u32,
    servers: HashMap<SocketAddr, Arc<Server>>,
}

static REGISTRY: Lazy<Mutex<Registry>> =
    Lazy::new(|| Mutex::new(Registry { pid: std::process::id(), servers: HashMap::new() }));

/// This process's store on `listen`, started if needed, serving the group
/// of `secret`.
fn server_for(listen: SocketAddr, secret: [u8; SECRET_BYTES]) -> Result<Arc<Server>> {
    let mut reg = lock(&REGISTRY);
    if reg.pid != std::process::id() {
        reg.pid = std::process::id();
        reg.servers.clear();
    }
    if let Some(s) = reg.servers.get(&listen) {
        s.register(secret);
        return Ok(s.clone());
    }
    let s = Server::start(listen, secret)?;
    reg.servers.insert(listen, s.clone());
    Ok(s)
}

struct Server {
    advertised: SocketAddr,
    groups: Mutex<Vec<Arc<Group>>>,
    next_conn: AtomicU64,
}

/// One namespace: the ranks presenting one secret.
struct Group {
    secret: [u8; SECRET_BYTES],
    exchange: Exchange,
    /// rank -> id of the connection holding it.
    claims: Mutex<HashMap<usize, u64>>,
    /// Requests read but not yet answered, and its change signal.
    in_flight: Mutex<usize>,
    answered: Condvar,
    /// Tests hold back the replies to one rank, to open the window between
    /// a round's outcome and its reply reaching that rank.
    #[cfg(test)]
    slow_replies_to: Mutex<Option<usize>>,
}

impl Group {
    fn new(secret: [u8; SECRET_BYTES]) -> Self {
        Group {
            secret,
            exchange: Exchange::new(),
            claims: Mutex::new(HashMap::new()),
            in_flight: Mutex::new(0),
            answered: Condvar::new(),
            #[cfg(test)]
            slow_replies_to: Mutex::new(None),
        }
    }

    /// Counts a request as in flight until the guard drops (after its reply
    /// is written or has failed to be).
    fn begin_request(&self) -> InFlight<'_> {
        *lock(&self.in_flight) += 1;
        InFlight(self)
    }

    /// Waits, at most `limit`, until no request is in flight. The rank that
    /// hosts the store calls this before it returns: when a round fails, its
    /// own reply can arrive before the other ranks' replies are written, and
    /// if its process then exits they would see the store vanish instead of
    /// the round's error (say, a timeout naming the missing rank). A peer
    /// still waiting on a round the host will never join only delays this
    /// by `limit`.
    fn linger(&self, limit: Duration) {
        let deadline = Instant::now() + limit;
        let mut n = lock(&self.in_flight);
        while *n > 0 {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return;
            }
            n = self.answered.wait_timeout(n, left).unwrap_or_else(|p| p.into_inner()).0;
        }
    }
}

/// One request in flight at the store (see `Group::begin_request`).
struct InFlight<'a>(&'a Group);

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        *lock(&self.0.in_flight) -= 1;
        self.0.answered.notify_all();
    }
}

impl Server {
    /// Binds and serves `listen`, with the group of `secret` registered
    /// before the first connection is accepted: env-bootstrap ranks dial
    /// as soon as the port is open, and must not be refused in between.
    fn start(listen: SocketAddr, secret: [u8; SECRET_BYTES]) -> Result<Arc<Server>> {
        let listener =
            TcpListener::bind(listen).map_err(|e| err!(Bootstrap, "bootstrap: cannot listen on {listen}: {e}"))?;
        let local = listener.local_addr().map_err(|e| err!(Bootstrap, "bootstrap: store on {listen}: {e}"))?;
        let server = Arc::new(Server {
            advertised: advertised(local),
            groups: Mutex::new(Vec::new()),
            next_conn: AtomicU64::new(0),
        });
        server.register(secret);
        let s = server.clone();
        thread::Builder::new()
            .name("symm-store".into())
            .spawn(move || s.accept_loop(listener))
            .map_err(|e| Error::os("bootstrap: cannot start the store thread", e))?;
        Ok(server)
    }

    fn register(&self, secret: [u8; SECRET_BYTES]) {
        let mut groups = lock(&self.groups);
        if !groups.iter().any(|g| g.secret == secret) {
            groups.push(Arc::new(Group::new(secret)));
        }
    }

    /// The group whose secret matches, comparing against every registered
    /// secret in constant time.
    fn find_group(&self, secret: &[u8]) -> Option<Arc<Group>> {
        let groups = lock(&self.groups);
        let mut found = None;
        for g in groups.iter() {
            if ct_eq(&g.secret, secret) {
                found = Some(g.clone());
            }
        }
        found
    }

    fn accept_loop(self: Arc<Self>, listener: TcpListener) {
        for conn in listener.incoming() {
            match conn {
                Ok(stream) => {
                    let s = self.clone();
                    // If no thread can be had the connection is dropped and
                    // the client sees it closed.
                    let _ = thread::Builder::new().name("symm-store-conn".into()).spawn(move || s.serve(stream));
                }
                // Out of fds or similar: back off instead of spinning.
                Err(_) => thread::sleep(Duration::from_millis(10)),
            }
        }
    }

    /// Serves one client connection until it says goodbye or goes away.
    fn serve(&self, stream: TcpStream) {
        let _ = stream.set_nodelay(true);
        let _ = stream.set_write_timeout(Some(WRITE_TIMEOUT));
        let _ = stream.set_read_timeout(Some(HELLO_TIMEOUT));
        let conn = self.next_conn.fetch_add(1, Ordering::Relaxed);
        let (group, rank) = match self.handshake(&stream, conn) {
            Ok(x) => x,
            Err(e) => {
                let _ = send_err(&stream, &e);
                return;
            }
        };
        let claim = Claim { group: &group, rank, conn };
        if Reply::Ok(&[]).write_to(&mut &stream).is_err() {
            return;
        }
        // Ranks may idle for long between rounds; keepalive instead of a
        // read timeout notices peers whose host vanished.
        let _ = stream.set_read_timeout(None);
        set_keepalive(&stream);
        let said_bye = serve_requests(&stream, &group, rank);
        // Release the rank before acknowledging the goodbye, so a successor
        // connecting right after can claim it.
        drop(claim);
        if said_bye {
            let _ = Reply::Ok(&[]).write_to(&mut &stream);
        }
    }

    /// Reads the client's hello, checks its secret and claims its rank.
    fn handshake(&self, stream: &TcpStream, conn: u64) -> Result<(Arc<Group>, usize)> {
        let body = read_frame(&mut &*stream, HELLO_CAP).map_err(|e| err!(Bootstrap, "bootstrap: bad hello: {e}"))?;
        let Request::Hello { protocol, secret, rank, world } = Request::decode(&body)? else {
            return Err(err!(Bootstrap, "bootstrap: expected a hello first"));
        };
        ensure!(
            protocol == PROTOCOL,
            InvalidArgument,
            "bootstrap: client speaks store protocol {protocol}, this store speaks {PROTOCOL}: \
             all ranks must use the same symm release"
        );
        let group = self.find_group(&secret).ok_or_else(|| {
            err!(
                Bootstrap,
                "bootstrap: the store at {} refused the connection: wrong secret \
                 (is the unique id from another group or an earlier run?)",
                self.advertised
            )
        })?;
        let (rank, world) = (rank as usize, world as usize);
        check_rank(rank, world)?;
        claim(&group, rank, conn)?;
        Ok((group, rank))
    }
}

/// Answers the requests of the client holding `rank` until it says goodbye
/// (true) or the connection ends or breaks (false).
fn serve_requests(stream: &TcpStream, group: &Group, rank: usize) -> bool {
    while let Ok(body) = read_frame(&mut &*stream, FRAME_CAP) {
        let sent = match Request::decode(&body) {
            Ok(Request::Gather { seq, rank: r, world, timeout_ms, payload }) => {
                let _in_flight = group.begin_request();
                let result = gather(group, rank, seq, r, world, timeout_ms, payload);
                #[cfg(test)]
                if *lock(&group.slow_replies_to) == Some(rank) {
                    thread::sleep(Duration::from_millis(300));
                }
                match result {
                    Ok(all) => Reply::Ok(all.as_slice()).write_to(&mut &*stream),
                    Err(e) => send_err(stream, &e),
                }
            }
            Ok(Request::Bye) => return true,
            Ok(Request::Hello { .. }) => {
                let _ = send_err(stream, &err!(Bootstrap, "bootstrap: unexpected second hello"));
                return false;
            }
            Err(e) => {
                let _ = send_err(stream, &e);
                return false;
            }
        };
        if sent.is_err() {
            return false;
        }
    }
    false
}

/// Validates what a client says about itself.
fn check_rank(rank: usize, world: usize) -> Result<()> {
    ensure!(
        (1..=MAX_WORLD).contains(&world),
        InvalidArgument,
        "bootstrap: world size {world} is out of range (1..={MAX_WORLD})"
    );
    ensure!(rank < world, InvalidArgument, "bootstrap: rank {rank} is out of range for world size {world}");
    Ok(())
}

/// Records that connection `conn` is rank `rank`. A second live claimant
/// means two processes were given one rank: the group is poisoned so every
/// rank fails now rather than exchanging garbage.
fn claim(group: &Group, rank: usize, conn: u64) -> Result<()> {
    let mut claims = lock(&group.claims);
    if claims.contains_key(&rank) {
        let e = err!(Mismatch, "bootstrap: rank {rank} was claimed by two processes (check RANK / rank arguments)");
        group.exchange.poison(e.clone());
        return Err(e);
    }
    claims.insert(rank, conn);
    Ok(())
}

/// Releases a rank claim when its connection ends, however it ends.
struct Claim<'a> {
    group: &'a Group,
    rank: usize,
    conn: u64,
}

impl Drop for Claim<'_> {
    fn drop(&mut self) {
        let mut claims = lock(&self.group.claims);
        if claims.get(&self.rank) == Some(&self.conn) {
            claims.remove(&self.rank);
        }
    }
}

/// Runs one all-gather request of the client holding `claimed`.
fn gather(
    group: &Group,
    claimed: usize,
    seq: u64,
    rank: u32,
    world: u32,
    timeout_ms: u64,
    payload: &[u8],
) -> Result<Arc<Vec<u8>>> {
    let (rank, world) = (rank as usize, world as usize);
    ensure!(rank == claimed, InvalidArgument, "bootstrap: connection of rank {claimed} sent a request as rank {rank}");
    check_rank(rank, world)?;
    ensure!(
        payload.len().saturating_mul(world) < FRAME_CAP,
        InvalidArgument,
        "bootstrap: {world} x {} bytes exceeds the store's {FRAME_CAP}-byte limit",
        payload.len()
    );
    let timeout = Duration::from_millis(timeout_ms.min(MAX_ROUND_TIMEOUT_MS));
    group.exchange.contribute(seq, rank, world, payload, timeout)
}

fn send_err(stream: &TcpStream, e: &Error) -> io::Result<()> {
    Reply::Err(e.kind, &e.msg).write_to(&mut &*stream)
}

fn set_keepalive(stream: &TcpStream) {
    let on: libc::c_int = 1;
    // SAFETY: a valid socket fd and a c_int option value of the right size.
    unsafe {
        libc::setsockopt(
            stream.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_KEEPALIVE,
            (&on as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        );
    }
}

// ---------------------------------------------------------------------------
// The client
// ---------------------------------------------------------------------------

/// One rank's persistent connection to a group's store.
pub struct TcpBootstrap {
    rank: usize,
    world: usize,
    addr: SocketAddr,
    conn: Mutex<Conn>,
    /// The group at the store, when this process hosts it.
    hosted: Option<Arc<Group>>,
}

struct Conn {
    /// None once a transport failure left the stream in an unknown state.
    stream: Option<TcpStream>,
    /// Advances on every round, failed ones included, so all ranks stay in
    /// step after a failure that every rank saw.
    seq: u64,
}

impl TcpBootstrap {
    /// Connects rank `rank` of `world` to the store named by `id`, retrying
    /// until `timeout` while the store is not up yet.
    pub fn connect(id: &UniqueId, rank: usize, world: usize, timeout: Duration) -> Result<Self> {
        check_rank(rank, world)?;
        let addr = id.addr()?;
        let deadline = deadline_after(timeout);
        let stream = dial(addr, deadline, timeout)?;
        let _ = stream.set_nodelay(true);
        hello(&stream, addr, &id.secret(), rank, world, deadline)?;
        let hosted = hosted_group(addr, &id.secret());
        Ok(TcpBootstrap { rank, world, addr, conn: Mutex::new(Conn { stream: Some(stream), seq: 0 }), hosted })
    }

    /// The store's address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Sends one round and reads its reply; `Err` here means the transport
    /// failed (the connection is then unusable).
    fn round(&self, stream: &TcpStream, seq: u64, data: &[u8], timeout: Duration) -> Result<Vec<u8>> {
        let timeout_ms = u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX);
        let req = Request::Gather { seq, rank: self.rank as u32, world: self.world as u32, timeout_ms, payload: data };
        let wait = reply_wait(timeout);
        let lost = |e: io::Error| self.transport_error(seq, wait, e);
        stream.set_write_timeout(Some(wait)).map_err(lost)?;
        req.write_to(&mut &*stream).map_err(lost)?;
        stream.set_read_timeout(Some(wait)).map_err(lost)?;
        read_frame(&mut &*stream, FRAME_CAP).map_err(lost)
    }

    fn transport_error(&self, seq: u64, wait: Duration, e: io::Error) -> Error {
        match e.kind() {
            io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => err!(
                Bootstrap,
                "bootstrap: the store at {} did not answer round {seq} within {} ms",
                self.addr,
                wait.as_millis()
            ),
            _ => err!(Bootstrap, "bootstrap: lost the connection to the store at {}: {e}", self.addr),
        }
    }
}

/// The group of `secret` at the store advertised as `addr`, if this process
/// runs that store.
fn hosted_group(addr: SocketAddr, secret: &[u8; SECRET_BYTES]) -> Option<Arc<Group>> {
    let reg = lock(&REGISTRY);
    if reg.pid != std::process::id() {
        return None;
    }
    reg.servers.values().filter(|s| s.advertised == addr).find_map(|s| s.find_group(secret))
}

/// `timeout` from now, saturating far in the future for huge timeouts.
fn deadline_after(timeout: Duration) -> Instant {
    let now = Instant::now();
    now.checked_add(timeout).unwrap_or_else(|| now + Duration::from_millis(MAX_ROUND_TIMEOUT_MS))
}

/// How long a client waits for a round's reply: a little past the round's
/// own timeout (the store answers by then), so a dead store never hangs us.
fn reply_wait(timeout: Duration) -> Duration {
    let cap = Duration::from_millis(MAX_ROUND_TIMEOUT_MS);
    timeout.min(cap) + Duration::from_secs(1) + timeout.min(cap) / 20
}

/// Connects, retrying until the deadline (ranks may start before the store).
fn dial(addr: SocketAddr, deadline: Instant, timeout: Duration) -> Result<TcpStream> {
    let mut backoff = Duration::from_millis(10);
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let attempt = left.clamp(Duration::from_millis(1), Duration::from_secs(5));
        let e = match TcpStream::connect_timeout(&addr, attempt) {
            Ok(s) => return Ok(s),
            Err(e) => e,
        };
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(err!(
                Bootstrap,
                "bootstrap: cannot reach the store at {addr} within {} ms: {e}",
                timeout.as_millis()
            ));
        }
        thread::sleep(backoff.min(left));
        backoff = (backoff * 2).min(Duration::from_millis(500));
    }
}

/// Presents the secret and rank; the store's refusal comes back as its error.
fn hello(
    stream: &TcpStream,
    addr: SocketAddr,
    secret: &[u8; SECRET_BYTES],
    rank: usize,
    world: usize,
    deadline: Instant,
) -> Result<()> {
    let wait = deadline.saturating_duration_since(Instant::now()).max(Duration::from_secs(2));
    let lost = |e: io::Error| err!(Bootstrap, "bootstrap: handshake with the store at {addr} failed: {e}");
    stream.set_write_timeout(Some(wait)).map_err(lost)?;
    stream.set_read_timeout(Some(wait)).map_err(lost)?;
    let req = Request::Hello { protocol: PROTOCOL, secret: *secret, rank: rank as u32, world: world as u32 };
    req.write_to(&mut &*stream).map_err(lost)?;
    let body = read_frame(&mut &*stream, 1 << 16).map_err(lost)?;
    Reply::decode(&body)?.into_result().map(|_| ())
}

impl fmt::Debug for TcpBootstrap {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "TcpBootstrap(rank {} of {}, store {})", self.rank, self.world, self.addr)
    }
}

impl Bootstrap for TcpBootstrap {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world(&self) -> usize {
        self.world
    }

    fn allgather(&self, data: &[u8], timeout: Duration) -> Result<Vec<u8>> {
        ensure!(
            data.len().saturating_mul(self.world) < FRAME_CAP,
            InvalidArgument,
            "bootstrap: {} x {} bytes exceeds the store's {FRAME_CAP}-byte limit",
            self.world,
            data.len()
        );
        let mut conn = lock(&self.conn);
        let seq = conn.seq;
        conn.seq += 1;
        let Some(stream) = conn.stream.as_ref() else {
            return Err(err!(Bootstrap, "bootstrap: the connection to the store at {} was lost earlier", self.addr));
        };
        let body = match self.round(stream, seq, data, timeout) {
            Ok(b) => b,
            Err(e) => {
                conn.stream = None;
                return Err(e);
            }
        };
        let all = Reply::decode(&body)?.into_result()?;
        ensure!(
            all.len() == data.len() * self.world,
            Bootstrap,
            "bootstrap: the store answered {} bytes, expected {}",
            all.len(),
            data.len() * self.world
        );
        Ok(all.to_vec())
    }
}

impl Drop for TcpBootstrap {
    /// Says goodbye so the store releases this rank at once (a new client
    /// for the same rank may follow immediately); on the hosting process,
    /// lets the replies owed to other ranks go out first.
    fn drop(&mut self) {
        let conn = self.conn.get_mut().unwrap_or_else(|p| p.into_inner());
        if let Some(stream) = conn.stream.take() {
            let _ = stream.set_write_timeout(Some(BYE_TIMEOUT));
            let _ = stream.set_read_timeout(Some(BYE_TIMEOUT));
            if Request::Bye.write_to(&mut &stream).is_ok() {
                let _ = read_frame(&mut &stream, 1 << 16);
            }
        }
        if let Some(group) = &self.hosted {
            group.linger(LINGER);
        }
    }
}

/// Rounds the store for `id` still holds (for tests and leak checks).
#[cfg(test)]
fn open_rounds(id: &UniqueId) -> usize {
    let addr = id.addr().expect("an id of this process's store");
    hosted_group(addr, &id.secret()).map_or(0, |g| g.exchange.open_rounds())
}

#[cfg(test)]
mod tests {
    use super::wire::*;
    use super::*;
    use crate::bootstrap::on_ranks;
    use crate::error::ErrorKind;
    use std::io::{Read, Write};

    const T: Duration = Duration::from_secs(10);
    const SHORT: Duration = Duration::from_millis(300);

    fn connect_all(id: &UniqueId, world: usize) -> Vec<TcpBootstrap> {
        (0..world).map(|r| TcpBootstrap::connect(id, r, world, T).unwrap()).collect()
    }

    #[test]
    fn wire_roundtrip() {
        let reqs = [
            Request::Hello { protocol: 1, secret: [9; 32], rank: 3, world: 4 },
            Request::Gather { seq: 1 << 40, rank: 2, world: 5, timeout_ms: 77, payload: b"xyz" },
            Request::Gather { seq: 0, rank: 0, world: 1, timeout_ms: 0, payload: b"" },
            Request::Bye,
        ];
        for r in &reqs {
            let mut buf = Vec::new();
            r.write_to(&mut buf).unwrap();
            let body = read_frame(&mut buf.as_slice(), FRAME_CAP).unwrap();
            assert_eq!(&Request::decode(&body).unwrap(), r);
        }
        let replies = [Reply::Ok(b"abc"), Reply::Err(ErrorKind::Timeout, "late")];
        for r in &replies {
            let mut buf = Vec::new();
            r.write_to(&mut buf).unwrap();
            let body = read_frame(&mut buf.as_slice(), FRAME_CAP).unwrap();
            assert_eq!(&Reply::decode(&body).unwrap(), r);
        }
        let e = Reply::Err(ErrorKind::Mismatch, "m").into_result().unwrap_err();
        assert_eq!((e.kind, e.msg.as_str()), (ErrorKind::Mismatch, "m"));
    }

    #[test]
    fn wire_rejects_garbage() {
        assert!(Request::decode(&[]).is_err());
        assert!(Request::decode(&[9]).is_err());
        assert!(Request::decode(&[1, 0, 0]).is_err());
        assert!(Request::decode(&[3, 0]).is_err());
        assert!(Reply::decode(&[1, 3, 0xff]).is_err());
        // Oversized and truncated frames.
        let big = (HELLO_CAP as u32 + 1).to_le_bytes();
        let e = read_frame(&mut big.as_slice(), HELLO_CAP).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidData);
        let short = [5u8, 0, 0, 0, 1, 2];
        assert!(read_frame(&mut short.as_slice(), HELLO_CAP).is_err());
    }

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

    #[test]
    fn unspecified_listen_advertises_a_dialable_address() {
        let a = advertised("0.0.0.0:1234".parse().unwrap());
        assert!(!a.ip().is_unspecified());
        assert!(a.is_ipv4());
        assert_eq!(a.port(), 1234);
        let id = create_unique_id(Some("0.0.0.0")).unwrap();
        let ip = id.addr().unwrap().ip();
        assert!(!ip.is_unspecified());
        let bs = connect_all(&id, 1);
        assert_eq!(bs[0].allgather(b"q", T).unwrap(), b"q");
    }

    #[test]
    fn allgather_one_to_four_ranks() {
        for world in 1..=4 {
            let id = create_unique_id(None).unwrap();
            let out = on_ranks(connect_all(&id, world), |b| {
                let mut last = Vec::new();
                for i in 0..5u8 {
                    last = b.allgather(&[b.rank() as u8, i], T).unwrap();
                }
                b.barrier(T).unwrap();
                last
            });
            let want: Vec<u8> = (0..world as u8).flat_map(|r| [r, 4]).collect();
            assert!(out.iter().all(|o| *o == want));
            assert_eq!(open_rounds(&id), 0);
        }
    }

    #[test]
    fn ids_share_one_store_but_not_rounds() {
        let a = create_unique_id(Some("127.0.0.1:0")).unwrap();
        let b = create_unique_id(Some("127.0.0.1")).unwrap();
        assert_eq!(a.addr().unwrap(), b.addr().unwrap());
        assert_ne!(a.secret(), b.secret());
        let ga = connect_all(&a, 2);
        let gb = connect_all(&b, 2);
        let mut all = Vec::new();
        for (i, c) in ga.into_iter().chain(gb).enumerate() {
            all.push(thread::spawn(move || c.allgather(&[i as u8], T).unwrap()));
        }
        let out: Vec<_> = all.into_iter().map(|h| h.join().unwrap()).collect();
        assert_eq!(out, [vec![0, 1], vec![0, 1], vec![2, 3], vec![2, 3]]);
    }

    #[test]
    fn many_rounds_leave_nothing_behind() {
        let id = create_unique_id(None).unwrap();
        on_ranks(connect_all(&id, 2), |b| {
            for i in 0..10_000u32 {
                let all = b.allgather(&i.to_le_bytes(), T).unwrap();
                assert_eq!(&all[4..], &i.to_le_bytes());
            }
        });
        assert_eq!(open_rounds(&id), 0);
    }

    #[test]
    fn timeout_names_missing_ranks() {
        let id = create_unique_id(None).unwrap();
        let bs = connect_all(&id, 4);
        let out = on_ranks(bs, |b| (b.rank() < 2).then(|| b.allgather(&[1], SHORT).unwrap_err()));
        for e in out.into_iter().flatten() {
            assert_eq!(e.kind, ErrorKind::Timeout);
            assert_eq!(e.msg, "bootstrap: ranks [2, 3] of 4 did not arrive within 300 ms");
        }
    }

    /// Peers of the hosting rank get the round's own error even when the
    /// host returns at once: its bootstrap holds on until their replies
    /// are written (a process exit right after would otherwise cut them off).
    #[test]
    fn hosting_rank_lets_owed_replies_out_before_it_returns() {
        let id = create_unique_id(None).unwrap();
        let peer = TcpBootstrap::connect(&id, 1, 3, T).unwrap();
        let host = TcpBootstrap::connect(&id, 0, 3, T).unwrap();
        let group = host.hosted.clone().expect("this process hosts the store");
        *lock(&group.slow_replies_to) = Some(1);
        let waiting = thread::spawn(move || peer.allgather(&[1], T).unwrap_err());
        while *lock(&group.in_flight) == 0 {
            thread::sleep(Duration::from_millis(1));
        }
        let e = host.allgather(&[0], SHORT).unwrap_err();
        assert_eq!(e.kind, ErrorKind::Timeout);
        drop(host);
        assert_eq!(*lock(&group.in_flight), 0, "a reply to the peer was still unwritten");
        let e = waiting.join().unwrap();
        assert_eq!(e.kind, ErrorKind::Timeout, "{e}");
        assert!(e.msg.contains("rank 2 of 3"), "{e}");
    }

    /// A peer waiting on a round the host never joins delays the host's
    /// goodbye by at most `LINGER`.
    #[test]
    fn hosting_rank_lingers_for_a_bounded_time() {
        let id = create_unique_id(None).unwrap();
        let peer = TcpBootstrap::connect(&id, 1, 2, T).unwrap();
        let host = TcpBootstrap::connect(&id, 0, 2, T).unwrap();
        let group = host.hosted.clone().unwrap();
        let wait = LINGER + Duration::from_secs(1);
        let waiting = thread::spawn(move || peer.allgather(&[1], wait).unwrap_err());
        while *lock(&group.in_flight) == 0 {
            thread::sleep(Duration::from_millis(1));
        }
        let t = Instant::now();
        drop(host);
        let held = t.elapsed();
        assert!(held >= LINGER - Duration::from_millis(50) && held < wait, "held {held:?}");
        assert_eq!(waiting.join().unwrap().kind, ErrorKind::Timeout);
    }

    #[test]
    fn wrong_secret_is_refused() {
        let id = create_unique_id(None).unwrap();
        let forged = UniqueId::new(id.addr().unwrap(), [0x5a; 32]);
        let e = TcpBootstrap::connect(&forged, 0, 1, T).unwrap_err();
        assert_eq!(e.kind, ErrorKind::Bootstrap);
        assert!(e.msg.contains("wrong secret"), "{e}");
    }

    #[test]
    fn duplicate_rank_fails_the_group() {
        let id = create_unique_id(None).unwrap();
        let r0 = TcpBootstrap::connect(&id, 0, 2, T).unwrap();
        let r1 = TcpBootstrap::connect(&id, 1, 2, T).unwrap();
        let waiting = thread::spawn(move || r0.allgather(&[0], T));
        let e = TcpBootstrap::connect(&id, 1, 2, T).unwrap_err();
        assert_eq!(e.kind, ErrorKind::Mismatch);
        assert!(e.msg.contains("rank 1 was claimed by two processes"), "{e}");
        // Both legitimate-looking ranks hear about it instead of hanging.
        assert_eq!(waiting.join().unwrap().unwrap_err(), e);
        assert_eq!(r1.allgather(&[1], T).unwrap_err(), e);
    }

    #[test]
    fn rank_is_released_on_drop() {
        let id = create_unique_id(None).unwrap();
        for _ in 0..3 {
            let bs = connect_all(&id, 2);
            let out = on_ranks(bs, |b| b.allgather(&[b.rank() as u8], T).unwrap());
            assert_eq!(out, [vec![0, 1], vec![0, 1]]);
        }
    }

    #[test]
    fn world_and_length_mismatch_reported_to_all() {
        let id = create_unique_id(None).unwrap();
        let a = TcpBootstrap::connect(&id, 0, 2, T).unwrap();
        let b = TcpBootstrap::connect(&id, 1, 3, T).unwrap();
        let ha = thread::spawn(move || a.allgather(&[0], T));
        let eb = b.allgather(&[1], T).unwrap_err();
        let ea = ha.join().unwrap().unwrap_err();
        assert_eq!(eb.kind, ErrorKind::Mismatch);
        assert!(eb.msg.contains("world size"), "{eb}");
        assert_eq!(ea, eb);

        let id = create_unique_id(None).unwrap();
        let out = on_ranks(connect_all(&id, 3), |b| b.allgather(&vec![0; 1 + b.rank() / 2], T));
        for r in out {
            let e = r.unwrap_err();
            assert_eq!(e.kind, ErrorKind::Mismatch);
            assert!(e.msg.contains("bytes"), "{e}");
        }
    }

    #[test]
    fn unreachable_store_is_a_bootstrap_error() {
        let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let id = UniqueId::new(SocketAddr::new(Ipv4Addr::LOCALHOST.into(), port), [1; 32]);
        let t = Instant::now();
        let e = TcpBootstrap::connect(&id, 0, 2, SHORT).unwrap_err();
        assert_eq!(e.kind, ErrorKind::Bootstrap);
        assert!(e.msg.contains(&format!("127.0.0.1:{port}")), "{e}");
        assert!(t.elapsed() >= SHORT && t.elapsed() < SHORT * 5);
    }

    #[test]
    fn late_store_is_waited_for() {
        let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let listen = SocketAddr::new(Ipv4Addr::LOCALHOST.into(), port);
        let secret = random_secret().unwrap();
        let id = UniqueId::new(listen, secret);
        let client = thread::spawn(move || TcpBootstrap::connect(&id, 0, 1, T));
        thread::sleep(Duration::from_millis(100));
        let hosted = host_store(listen, secret).unwrap();
        assert_eq!(hosted.addr().unwrap(), listen);
        let c = client.join().unwrap().unwrap();
        assert_eq!(c.allgather(b"hi", T).unwrap(), b"hi");
    }

    #[test]
    fn host_store_bind_failure_names_address() {
        let taken = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = taken.local_addr().unwrap();
        let e = host_store(addr, [2; 32]).unwrap_err();
        assert_eq!(e.kind, ErrorKind::Bootstrap);
        assert!(e.msg.contains(&addr.to_string()), "{e}");
    }

    /// A store that accepts the hello and then never answers, or hangs up.
    fn fake_store(hang_up: bool) -> UniqueId {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        thread::spawn(move || {
            let (mut s, _) = l.accept().unwrap();
            read_frame(&mut s, HELLO_CAP).unwrap();
            Reply::Ok(&[]).write_to(&mut s).unwrap();
            let _ = read_frame(&mut s, FRAME_CAP);
            if !hang_up {
                thread::sleep(Duration::from_secs(5));
            }
        });
        UniqueId::new(addr, [3; 32])
    }

    #[test]
    fn dead_store_never_hangs_a_caller() {
        for hang_up in [true, false] {
            let c = TcpBootstrap::connect(&fake_store(hang_up), 0, 2, T).unwrap();
            assert!(c.hosted.is_none());
            let t = Instant::now();
            let e = c.allgather(&[1], SHORT).unwrap_err();
            assert_eq!(e.kind, ErrorKind::Bootstrap, "{e}");
            assert!(t.elapsed() < reply_wait(SHORT) + Duration::from_millis(500));
            let e2 = c.allgather(&[1], SHORT).unwrap_err();
            assert!(e2.msg.contains("lost earlier"), "{e2}");
        }
    }

    #[test]
    fn garbage_is_refused_without_allocating() {
        let id = create_unique_id(None).unwrap();
        let mut s = TcpStream::connect(id.addr().unwrap()).unwrap();
        s.write_all(&u32::MAX.to_le_bytes()).unwrap();
        s.set_read_timeout(Some(T)).unwrap();
        let body = read_frame(&mut s, 1 << 16).unwrap();
        let e = Reply::decode(&body).unwrap().into_result().unwrap_err();
        assert_eq!(e.kind, ErrorKind::Bootstrap);
        assert!(e.msg.contains("exceeds"), "{e}");
        // ...and the store hangs up.
        let mut rest = Vec::new();
        assert_eq!(s.read_to_end(&mut rest).unwrap(), 0);
    }

    #[test]
    fn validates_rank_and_world() {
        let id = create_unique_id(None).unwrap();
        for (r, w) in [(2, 2), (0, 0)] {
            let e = TcpBootstrap::connect(&id, r, w, T).unwrap_err();
            assert_eq!(e.kind, ErrorKind::InvalidArgument);
        }
        let bad = UniqueId([0; 128]);
        assert_eq!(TcpBootstrap::connect(&bad, 0, 1, T).unwrap_err().kind, ErrorKind::InvalidArgument);
    }
}
