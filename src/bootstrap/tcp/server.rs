//! The store: a server per listen address, serving each group's namespace
//! (the ranks presenting one secret) on a thread per connection.

use super::addr::advertised;
use super::check_rank;
use super::wire::{read_frame, Reply, Request, FRAME_CAP, HELLO_CAP, PROTOCOL};
use super::MAX_ROUND_TIMEOUT_MS;
use crate::bootstrap::local::Exchange;
use crate::bootstrap::unique_id::{ct_eq, SECRET_BYTES};
use crate::error::{ensure, err, Error, Result};
use crate::sync::{self, lock};
use once_cell::sync::Lazy;
use std::collections::HashMap;
use std::io;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread;
use std::time::{Duration, Instant};

/// A client that connects but says nothing is dropped after this long.
const HELLO_TIMEOUT: Duration = Duration::from_secs(10);
/// A client that stops reading its replies is dropped after this long.
const WRITE_TIMEOUT: Duration = Duration::from_secs(60);

/// This process's stores by requested listen address. The pid detects a
/// forked child, which inherits the table but not the serving threads.
struct Stores {
    pid: u32,
    servers: HashMap<SocketAddr, Arc<Server>>,
}

static STORES: Lazy<Mutex<Stores>> =
    Lazy::new(|| Mutex::new(Stores { pid: std::process::id(), servers: HashMap::new() }));

/// This process's store on `listen`, started if needed, serving the group
/// of `secret`.
pub(super) fn server_for(listen: SocketAddr, secret: [u8; SECRET_BYTES]) -> Result<Arc<Server>> {
    let mut stores = lock(&STORES);
    if stores.pid != std::process::id() {
        stores.pid = std::process::id();
        stores.servers.clear();
    }
    if let Some(s) = stores.servers.get(&listen) {
        s.register(secret);
        return Ok(s.clone());
    }
    let s = Server::start(listen, secret)?;
    stores.servers.insert(listen, s.clone());
    Ok(s)
}

pub(super) struct Server {
    pub(super) advertised: SocketAddr,
    namespaces: Mutex<Vec<Arc<Namespace>>>,
    next_conn: AtomicU64,
}

/// One group's namespace at the store: the ranks presenting one secret.
pub(super) struct Namespace {
    secret: [u8; SECRET_BYTES],
    pub(super) exchange: Exchange,
    /// rank -> id of the connection holding it.
    claims: Mutex<HashMap<usize, u64>>,
    /// Requests read but not yet answered, and its change signal.
    pub(super) in_flight: Mutex<usize>,
    answered: Condvar,
    /// Tests hold back the replies to one rank, to open the window between
    /// a round's outcome and its reply reaching that rank.
    #[cfg(test)]
    pub(super) slow_replies_to: Mutex<Option<usize>>,
}

impl Namespace {
    fn new(secret: [u8; SECRET_BYTES]) -> Self {
        Namespace {
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
    pub(super) fn linger(&self, limit: Duration) {
        let deadline = Instant::now() + limit;
        let mut n = lock(&self.in_flight);
        while *n > 0 {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return;
            }
            n = sync::wait_timeout(&self.answered, n, left);
        }
    }
}

/// One request in flight at the store (see `Namespace::begin_request`).
struct InFlight<'a>(&'a Namespace);

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        *lock(&self.0.in_flight) -= 1;
        self.0.answered.notify_all();
    }
}

impl Server {
    /// Binds and serves `listen`, with the namespace of `secret` registered
    /// before the first connection is accepted: env-bootstrap ranks dial
    /// as soon as the port is open, and must not be refused in between.
    fn start(listen: SocketAddr, secret: [u8; SECRET_BYTES]) -> Result<Arc<Server>> {
        let listener =
            TcpListener::bind(listen).map_err(|e| err!(Bootstrap, "bootstrap: cannot listen on {listen}: {e}"))?;
        let local = listener.local_addr().map_err(|e| err!(Bootstrap, "bootstrap: store on {listen}: {e}"))?;
        let server = Arc::new(Server {
            advertised: advertised(local),
            namespaces: Mutex::new(Vec::new()),
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
        let mut namespaces = lock(&self.namespaces);
        if !namespaces.iter().any(|n| n.secret == secret) {
            namespaces.push(Arc::new(Namespace::new(secret)));
        }
    }

    /// The namespace whose secret matches, comparing against every
    /// registered secret in constant time.
    fn find_namespace(&self, secret: &[u8]) -> Option<Arc<Namespace>> {
        let namespaces = lock(&self.namespaces);
        let mut found = None;
        for n in namespaces.iter() {
            if ct_eq(&n.secret, secret) {
                found = Some(n.clone());
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
        let (ns, rank) = match self.handshake(&stream, conn) {
            Ok(x) => x,
            Err(e) => {
                let _ = send_err(&stream, &e);
                return;
            }
        };
        let claim = Claim { ns: &ns, rank, conn };
        if Reply::Ok(&[]).write_to(&mut &stream).is_err() {
            return;
        }
        // Ranks may idle for long between rounds; keepalive instead of a
        // read timeout notices peers whose host vanished.
        let _ = stream.set_read_timeout(None);
        set_keepalive(&stream);
        let said_bye = serve_requests(&stream, &ns, rank);
        // Release the rank before acknowledging the goodbye, so a successor
        // connecting right after can claim it.
        drop(claim);
        if said_bye {
            let _ = Reply::Ok(&[]).write_to(&mut &stream);
        }
    }

    /// Reads the client's hello, checks its secret and claims its rank.
    fn handshake(&self, stream: &TcpStream, conn: u64) -> Result<(Arc<Namespace>, usize)> {
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
        let ns = self.find_namespace(&secret).ok_or_else(|| {
            err!(
                Bootstrap,
                "bootstrap: the store at {} refused the connection: wrong secret \
                 (is the unique id from another group or an earlier run?)",
                self.advertised
            )
        })?;
        let (rank, world) = (rank as usize, world as usize);
        check_rank(rank, world)?;
        claim(&ns, rank, conn)?;
        Ok((ns, rank))
    }
}

/// Answers the requests of the client holding `rank` until it says goodbye
/// (true) or the connection ends or breaks (false).
fn serve_requests(stream: &TcpStream, ns: &Namespace, rank: usize) -> bool {
    while let Ok(body) = read_frame(&mut &*stream, FRAME_CAP) {
        let sent = match Request::decode(&body) {
            Ok(Request::Gather { seq, rank: r, world, timeout_ms, payload }) => {
                let _in_flight = ns.begin_request();
                let result = gather(ns, rank, seq, r, world, timeout_ms, payload);
                #[cfg(test)]
                if *lock(&ns.slow_replies_to) == Some(rank) {
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

/// Records that connection `conn` is rank `rank`. A second live claimant
/// means two processes were given one rank: the namespace is poisoned so
/// every rank fails now rather than exchanging garbage.
fn claim(ns: &Namespace, rank: usize, conn: u64) -> Result<()> {
    let mut claims = lock(&ns.claims);
    if claims.contains_key(&rank) {
        let e = err!(Mismatch, "bootstrap: rank {rank} was claimed by two processes (check RANK / rank arguments)");
        ns.exchange.poison(e.clone());
        return Err(e);
    }
    claims.insert(rank, conn);
    Ok(())
}

/// Releases a rank claim when its connection ends, however it ends.
struct Claim<'a> {
    ns: &'a Namespace,
    rank: usize,
    conn: u64,
}

impl Drop for Claim<'_> {
    fn drop(&mut self) {
        let mut claims = lock(&self.ns.claims);
        if claims.get(&self.rank) == Some(&self.conn) {
            claims.remove(&self.rank);
        }
    }
}

/// Runs one all-gather request of the client holding `claimed`.
fn gather(
    ns: &Namespace,
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
    ns.exchange.contribute(seq, rank, world, payload, timeout)
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

/// The namespace of `secret` at the store advertised as `addr`, if this
/// process runs that store.
pub(super) fn hosted_namespace(addr: SocketAddr, secret: &[u8; SECRET_BYTES]) -> Option<Arc<Namespace>> {
    let stores = lock(&STORES);
    if stores.pid != std::process::id() {
        return None;
    }
    stores.servers.values().filter(|s| s.advertised == addr).find_map(|s| s.find_namespace(secret))
}

/// Rounds the store for `id` still holds (for tests and leak checks).
#[cfg(test)]
pub(super) fn open_rounds(id: &crate::bootstrap::unique_id::UniqueId) -> usize {
    let addr = id.addr().expect("an id of this process's store");
    hosted_namespace(addr, &id.secret()).map_or(0, |n| n.exchange.open_rounds())
}
