//! The client: one rank's persistent connection to its group's store.

use super::check_rank;
use super::server::{hosted_namespace, Namespace};
use super::wire::{read_frame, Reply, Request, FRAME_CAP, PROTOCOL};
use super::MAX_ROUND_TIMEOUT_MS;
use crate::bootstrap::unique_id::{UniqueId, SECRET_BYTES};
use crate::bootstrap::Bootstrap;
use crate::error::{ensure, err, Error, Result};
use crate::sync::{self, lock};
use std::fmt;
use std::io;
use std::net::{SocketAddr, TcpStream};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

/// How long a dropped client waits for the store to acknowledge its goodbye.
const BYE_TIMEOUT: Duration = Duration::from_secs(1);
/// How long a rank hosting the store waits, when it lets go of its group,
/// for replies still being written to other ranks (see `Namespace::linger`).
pub(super) const LINGER: Duration = Duration::from_secs(2);

/// One rank's persistent connection to a group's store.
pub struct TcpBootstrap {
    rank: usize,
    world: usize,
    addr: SocketAddr,
    conn: Mutex<Conn>,
    /// This group's namespace at the store, when this process hosts it.
    pub(super) hosted: Option<Arc<Namespace>>,
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
        let hosted = hosted_namespace(addr, &id.secret());
        Ok(TcpBootstrap { rank, world, addr, conn: Mutex::new(Conn { stream: Some(stream), seq: 0 }), hosted })
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

/// `timeout` from now, saturating far in the future for huge timeouts.
fn deadline_after(timeout: Duration) -> Instant {
    let now = Instant::now();
    now.checked_add(timeout).unwrap_or_else(|| now + Duration::from_millis(MAX_ROUND_TIMEOUT_MS))
}

/// How long a client waits for a round's reply: a little past the round's
/// own timeout (the store answers by then), so a dead store never hangs us.
pub(super) fn reply_wait(timeout: Duration) -> Duration {
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
        let conn = sync::get_mut(&mut self.conn);
        if let Some(stream) = conn.stream.take() {
            let _ = stream.set_write_timeout(Some(BYE_TIMEOUT));
            let _ = stream.set_read_timeout(Some(BYE_TIMEOUT));
            if Request::Bye.write_to(&mut &stream).is_ok() {
                let _ = read_frame(&mut &stream, 1 << 16);
            }
        }
        if let Some(ns) = &self.hosted {
            ns.linger(LINGER);
        }
    }
}
