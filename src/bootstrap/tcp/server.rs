//! The store: a server per listen address, serving each group's namespace
//! (the ranks presenting one secret) on a thread per authenticated
//! connection.
//!
//! Strangers cost little: a connection that has not yet proven it knows a
//! secret gets one deadline for its whole hello, and at most
//! `Limits::max_pending` such connections exist at once (a new one drops
//! the oldest; a real rank sends its hello as soon as it connects, so it is
//! through long before many others arrive). Namespaces are freed when their
//! group is done, and those nobody has joined are capped.

use super::addr::advertised;
use super::check_rank;
use super::stream::{Listener, Stream, Target};
use super::wire::{read_frame, Reply, Request, FRAME_CAP, HELLO_CAP, PROTOCOL};
use super::MAX_ROUND_TIMEOUT_MS;
use crate::bootstrap::local::Exchange;
use crate::bootstrap::unique_id::{ct_eq, SECRET_BYTES};
use crate::error::{ensure, err, Error, Result};
use crate::sync::{self, lock};
use once_cell::sync::Lazy;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::io::{self, Read};
use std::net::SocketAddr;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread;
use std::time::{Duration, Instant};

/// A client that stops reading its replies is dropped after this long.
const WRITE_TIMEOUT: Duration = Duration::from_secs(60);

/// What one server lets strangers and forgotten ids cost.
#[derive(Clone, Copy, Debug)]
pub(super) struct Limits {
    /// From accept to a verified hello, however slowly it arrives.
    pub(super) handshake: Duration,
    /// Connections still in their handshake.
    pub(super) max_pending: usize,
    /// Namespaces with nobody connected (ids made but not used yet, or
    /// groups some rank never joined); beyond this the oldest is dropped.
    pub(super) max_idle: usize,
}

impl Limits {
    pub(super) const DEFAULT: Limits = Limits { handshake: Duration::from_secs(10), max_pending: 64, max_idle: 4096 };
}

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
    let s = Server::start(&Target::Tcp(listen), secret, Limits::DEFAULT, None)?;
    stores.servers.insert(listen, s.clone());
    Ok(s)
}

/// Serves one env group on the abstract Unix socket `name` until all
/// `world` ranks have joined or `until` passes, whichever is first; then
/// the name is released (the next group of these processes binds its own).
/// Returns the group's namespace.
pub(super) fn host_unix(name: &[u8], secret: [u8; SECRET_BYTES], until: Instant) -> Result<Arc<Namespace>> {
    let server = Server::start(&Target::Unix(name.to_vec()), secret, Limits::DEFAULT, Some(until))?;
    Ok(server.find_namespace(&secret).expect("registered at start"))
}

pub(super) struct Server {
    pub(super) advertised: Target,
    /// In registration order (the oldest idle one is dropped first).
    namespaces: Mutex<Vec<Arc<Namespace>>>,
    next_conn: AtomicU64,
    /// Connections in their handshake, by id (ids grow, so the first is the
    /// oldest), each with a handle to cut it off.
    pending: Mutex<BTreeMap<u64, Stream>>,
    limits: Limits,
    /// For a one-group server: stop accepting at this time...
    accept_until: Option<Instant>,
    /// ...or once this is set (its group is complete).
    closed: AtomicBool,
    /// Handshake threads alive (tests check the bound).
    #[cfg(test)]
    pub(super) handshakes: std::sync::atomic::AtomicUsize,
}

/// One group's namespace at the store: the ranks presenting one secret.
pub(super) struct Namespace {
    secret: [u8; SECRET_BYTES],
    pub(super) exchange: Exchange,
    members: Mutex<Members>,
    /// Requests read but not yet answered, and its change signal.
    pub(super) in_flight: Mutex<usize>,
    answered: Condvar,
    /// Tests hold back the replies to one rank, to open the window between
    /// a round's outcome and its reply reaching that rank.
    #[cfg(test)]
    pub(super) slow_replies_to: Mutex<Option<usize>>,
}

#[derive(Default)]
struct Members {
    /// rank -> id of the connection holding it.
    claims: HashMap<usize, u64>,
    /// Every rank that has ever joined, and the world size the first said.
    joined: HashSet<usize>,
    world: usize,
}

impl Members {
    fn complete(&self) -> bool {
        self.world > 0 && self.joined.len() == self.world
    }
}

impl Namespace {
    fn new(secret: [u8; SECRET_BYTES]) -> Self {
        Namespace {
            secret,
            exchange: Exchange::new(),
            members: Mutex::new(Members::default()),
            in_flight: Mutex::new(0),
            answered: Condvar::new(),
            #[cfg(test)]
            slow_replies_to: Mutex::new(None),
        }
    }

    /// Nobody is connected.
    fn idle(&self) -> bool {
        lock(&self.members).claims.is_empty()
    }

    /// Every rank has joined and left: nothing can use the namespace again.
    fn done(&self) -> bool {
        let m = lock(&self.members);
        m.complete() && m.claims.is_empty()
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
    /// Binds and serves `target`, with the namespace of `secret` registered
    /// before the first connection is accepted: env-bootstrap ranks dial
    /// as soon as the port is open, and must not be refused in between.
    pub(super) fn start(
        target: &Target,
        secret: [u8; SECRET_BYTES],
        limits: Limits,
        accept_until: Option<Instant>,
    ) -> Result<Arc<Server>> {
        let listener = target.bind().map_err(|e| err!(Bootstrap, "bootstrap: cannot listen on {target}: {e}"))?;
        let advertised = match listener.tcp_addr() {
            Ok(Some(local)) => Target::Tcp(advertised(local)),
            Ok(None) => target.clone(),
            Err(e) => return Err(err!(Bootstrap, "bootstrap: store on {target}: {e}")),
        };
        let server = Arc::new(Server {
            advertised,
            namespaces: Mutex::new(Vec::new()),
            next_conn: AtomicU64::new(0),
            pending: Mutex::new(BTreeMap::new()),
            limits,
            accept_until,
            closed: AtomicBool::new(false),
            #[cfg(test)]
            handshakes: Default::default(),
        });
        server.register(secret);
        let s = server.clone();
        thread::Builder::new()
            .name("symm-store".into())
            .spawn(move || s.accept_loop(listener))
            .map_err(|e| Error::os("bootstrap: cannot start the store thread", e))?;
        Ok(server)
    }

    /// The advertised address of a TCP store.
    pub(super) fn tcp_addr(&self) -> SocketAddr {
        match &self.advertised {
            Target::Tcp(a) => *a,
            Target::Unix(_) => unreachable!("TCP stores are the only ones with ids"),
        }
    }

    pub(super) fn register(&self, secret: [u8; SECRET_BYTES]) {
        let mut namespaces = lock(&self.namespaces);
        if namespaces.iter().any(|n| n.secret == secret) {
            return;
        }
        namespaces.push(Arc::new(Namespace::new(secret)));
        // Only a store holding more namespaces than the idle cap looks for
        // idle ones, so the common case costs nothing.
        if namespaces.len() > self.limits.max_idle {
            if let Some(i) = namespaces.iter().position(|n| n.idle()) {
                namespaces.remove(i);
                log::warn!(
                    "bootstrap: the store at {} holds more than {} unused group ids; \
                     the oldest was dropped",
                    self.advertised,
                    self.limits.max_idle
                );
            }
        }
    }

    /// Forgets a namespace whose group is done.
    fn forget(&self, ns: &Arc<Namespace>) {
        lock(&self.namespaces).retain(|n| !Arc::ptr_eq(n, ns));
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

    /// Namespaces held (for tests and leak checks).
    #[cfg(test)]
    pub(super) fn namespaces(&self) -> usize {
        lock(&self.namespaces).len()
    }

    /// Connections in their handshake (for tests).
    #[cfg(test)]
    pub(super) fn pending(&self) -> usize {
        lock(&self.pending).len()
    }

    fn accepting(&self) -> bool {
        !self.closed.load(Ordering::Relaxed) && self.accept_until.is_none_or(|t| Instant::now() < t)
    }

    fn accept_loop(self: Arc<Self>, listener: Listener) {
        while self.accepting() {
            // A one-group server wakes now and then to see whether to stop.
            if self.accept_until.is_some() && !readable(&listener, Duration::from_millis(50)) {
                continue;
            }
            match listener.accept() {
                Ok(stream) => self.admit(stream),
                Err(e) if e.kind() == io::ErrorKind::PermissionDenied => {}
                // Out of fds or similar: back off instead of spinning.
                Err(_) => thread::sleep(Duration::from_millis(10)),
            }
        }
    }

    /// Starts a connection's handshake on its own thread, first cutting off
    /// the oldest pending one if there are too many.
    fn admit(self: &Arc<Self>, stream: Stream) {
        let conn = self.next_conn.fetch_add(1, Ordering::Relaxed);
        let Ok(handle) = stream.try_clone() else { return };
        {
            let mut pending = lock(&self.pending);
            pending.insert(conn, handle);
            while pending.len() > self.limits.max_pending {
                let (_, oldest) = pending.pop_first().expect("not empty");
                let _ = oldest.shutdown();
            }
        }
        let s = self.clone();
        // If no thread can be had the connection is dropped and the client
        // sees it closed.
        if thread::Builder::new().name("symm-store-conn".into()).spawn(move || s.serve(stream, conn)).is_err() {
            lock(&self.pending).remove(&conn);
        }
    }

    /// Serves one client connection until it says goodbye or goes away.
    fn serve(&self, stream: Stream, conn: u64) {
        stream.set_nodelay();
        let deadline = Instant::now() + self.limits.handshake;
        let handshake = {
            #[cfg(test)]
            let _alive = Counted::new(&self.handshakes);
            self.handshake(&stream, conn, deadline)
        };
        let refused = |reply: Reply| {
            lock(&self.pending).remove(&conn);
            let _ = stream.set_write_timeout(Some(left(deadline).max(Duration::from_millis(100))));
            let _ = reply.write_to(&mut &stream);
        };
        let (ns, rank) = match handshake {
            Ok(Some(x)) => x,
            Ok(None) => {
                let msg = format!(
                    "bootstrap: the store at {} refused the connection: wrong secret (is the unique id \
                     from another group, an earlier run, or a group that has finished?)",
                    self.advertised
                );
                return refused(Reply::Refused(&msg));
            }
            Err(e) => return refused(Reply::Err(e.kind, &e.msg)),
        };
        let claim = Claim { server: self, ns: &ns, rank, conn };
        let _ = stream.set_write_timeout(Some(WRITE_TIMEOUT));
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
        } else if !ns.done() {
            // Gone without a goodbye: the others hear it now, not at their timeout.
            let world = lock(&ns.members).world;
            ns.exchange.lost(
                rank,
                err!(
                    Timeout,
                    "bootstrap: rank {rank} of {world} closed its connection to the store without a goodbye (its \
                     process ended, or its bootstrap failed): it will not arrive"
                ),
            );
        }
    }

    /// Reads the client's hello by `deadline`, checks its secret and claims
    /// its rank; None when no namespace has the secret.
    fn handshake(&self, stream: &Stream, conn: u64, deadline: Instant) -> Result<Option<(Arc<Namespace>, usize)>> {
        let body = read_frame(&mut Before { stream, deadline }, HELLO_CAP)
            .map_err(|e| err!(Bootstrap, "bootstrap: bad hello: {e}"))?;
        let Request::Hello { protocol, secret, rank, world } = Request::decode(&body)? else {
            return Err(err!(Bootstrap, "bootstrap: expected a hello first"));
        };
        ensure!(
            protocol == PROTOCOL,
            InvalidArgument,
            "bootstrap: client speaks store protocol {protocol}, this store speaks {PROTOCOL}: \
             all ranks must use the same symm release"
        );
        let Some(ns) = self.find_namespace(&secret) else { return Ok(None) };
        let (rank, world) = (rank as usize, world as usize);
        check_rank(rank, world)?;
        // Authenticated: from here on the connection is no stranger's. If it
        // was cut off as the oldest pending one meanwhile, it is gone.
        ensure!(
            lock(&self.pending).remove(&conn).is_some(),
            Bootstrap,
            "bootstrap: the store at {} dropped the connection: too many connections were waiting \
             to authenticate",
            self.advertised
        );
        if claim(&ns, rank, world, conn)? && self.accept_until.is_some() {
            self.closed.store(true, Ordering::Relaxed);
        }
        Ok(Some((ns, rank)))
    }
}

/// Time left until `deadline`.
fn left(deadline: Instant) -> Duration {
    deadline.saturating_duration_since(Instant::now())
}

/// Reads from a stream, failing once `deadline` has passed: the hello's
/// deadline covers all its reads, so dripping bytes buys no time.
struct Before<'a> {
    stream: &'a Stream,
    deadline: Instant,
}

impl Read for Before<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let left = left(self.deadline);
        if left.is_zero() {
            return Err(io::Error::new(io::ErrorKind::TimedOut, "the hello did not arrive in time"));
        }
        self.stream.set_read_timeout(Some(left))?;
        (&mut &*self.stream).read(buf)
    }
}

/// Whether `listener` has a connection to accept within `wait`.
fn readable(listener: &Listener, wait: Duration) -> bool {
    let mut p = libc::pollfd { fd: listener.as_raw_fd(), events: libc::POLLIN, revents: 0 };
    // SAFETY: one valid pollfd.
    let n = unsafe { libc::poll(&mut p, 1, wait.as_millis() as libc::c_int) };
    n > 0
}

/// Counts a live thread in `c` for as long as it exists.
#[cfg(test)]
struct Counted<'a>(&'a std::sync::atomic::AtomicUsize);

#[cfg(test)]
impl<'a> Counted<'a> {
    fn new(c: &'a std::sync::atomic::AtomicUsize) -> Self {
        c.fetch_add(1, Ordering::SeqCst);
        Counted(c)
    }
}

#[cfg(test)]
impl Drop for Counted<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Answers the requests of the client holding `rank` until it says goodbye
/// (true) or the connection ends or breaks (false).
fn serve_requests(stream: &Stream, ns: &Namespace, rank: usize) -> bool {
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

/// Records that connection `conn` is rank `rank` of `world`; true when
/// this made every rank of the group joined. A second live claimant while
/// the group forms means two processes were given one rank: the namespace
/// is poisoned so every rank fails now rather than exchanging garbage.
/// Once every rank has joined, the group is formed and a claimant is a
/// stray process reusing its unique id: it alone is refused.
fn claim(ns: &Namespace, rank: usize, world: usize, conn: u64) -> Result<bool> {
    let mut m = lock(&ns.members);
    if m.claims.contains_key(&rank) {
        if m.complete() {
            return Err(err!(
                Mismatch,
                "bootstrap: rank {rank} of this unique id's group is taken by a formed group (a unique id serves \
                 one group: get a new one for another)"
            ));
        }
        let e = err!(Mismatch, "bootstrap: rank {rank} was claimed by two processes (check RANK / rank arguments)");
        ns.exchange.poison(e.clone());
        return Err(e);
    }
    m.claims.insert(rank, conn);
    if m.world == 0 {
        m.world = world;
    }
    // A rank outside the first world said is a mismatch the first round
    // reports; it does not count towards completing the group.
    if rank < m.world {
        m.joined.insert(rank);
    }
    Ok(m.complete())
}

/// Releases a rank claim when its connection ends, however it ends, and
/// forgets the namespace once its group is done.
struct Claim<'a> {
    server: &'a Server,
    ns: &'a Arc<Namespace>,
    rank: usize,
    conn: u64,
}

impl Drop for Claim<'_> {
    fn drop(&mut self) {
        {
            let mut m = lock(&self.ns.members);
            if m.claims.get(&self.rank) == Some(&self.conn) {
                m.claims.remove(&self.rank);
            }
        }
        if self.ns.done() {
            self.server.forget(self.ns);
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

fn send_err(stream: &Stream, e: &Error) -> io::Result<()> {
    Reply::Err(e.kind, &e.msg).write_to(&mut &*stream)
}

fn set_keepalive(stream: &Stream) {
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
    let addr = Target::Tcp(addr);
    stores.servers.values().filter(|s| s.advertised == addr).find_map(|s| s.find_namespace(secret))
}

/// Rounds the store for `id` still holds (for tests and leak checks).
#[cfg(test)]
pub(super) fn open_rounds(id: &crate::bootstrap::unique_id::UniqueId) -> usize {
    let addr = id.addr().expect("an id of this process's store");
    hosted_namespace(addr, &id.secret()).map_or(0, |n| n.exchange.open_rounds())
}
