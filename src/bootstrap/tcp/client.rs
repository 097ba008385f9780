//! The client: one rank's persistent connection to its group's store.

use super::check_rank;
use super::server::{hosted_namespace, Namespace};
use super::stream::{Stream, Target};
use super::wire::{read_frame, Reply, Request, FRAME_CAP, PROTOCOL};
use super::MAX_ROUND_TIMEOUT_MS;
use crate::bootstrap::unique_id::{UniqueId, SECRET_BYTES};
use crate::bootstrap::Bootstrap;
use crate::error::{ensure, err, Error, Result};
use crate::sync::{self, lock};
use std::fmt;
use std::io;
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
    addr: Target,
    conn: Mutex<Conn>,
    /// This group's namespace at the store, when this process hosts it.
    pub(super) hosted: Option<Arc<Namespace>>,
}

struct Conn {
    /// None once a transport failure left the stream in an unknown state.
    stream: Option<Stream>,
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
        let hosted = hosted_namespace(addr, &id.secret());
        Self::join(&Target::Tcp(addr), &id.secret(), rank, world, timeout, false, hosted)
    }

    /// Connects to the store at `target` and joins the group of `secret`.
    /// With `host_may_be_late`, a store that does not know the group yet
    /// (the host has not made it) is asked again until `timeout`, and
    /// running out of time is a timeout; otherwise its refusal is final.
    /// `hosted` is the group's namespace when this process hosts it.
    pub(super) fn join(
        target: &Target,
        secret: &[u8; SECRET_BYTES],
        rank: usize,
        world: usize,
        timeout: Duration,
        host_may_be_late: bool,
        hosted: Option<Arc<Namespace>>,
    ) -> Result<Self> {
        check_rank(rank, world)?;
        let deadline = deadline_after(timeout);
        let mut backoff = Duration::from_millis(5);
        let stream = loop {
            let stream = dial(target, deadline, timeout, host_may_be_late)?;
            stream.set_nodelay();
            let refusal = match hello(&stream, target, secret, rank, world, deadline)? {
                None => break stream,
                Some(msg) => msg,
            };
            let left = deadline.saturating_duration_since(Instant::now());
            if !host_may_be_late {
                return Err(err!(Bootstrap, "{refusal}"));
            }
            if left.is_zero() {
                return Err(err!(
                    Timeout,
                    "bootstrap: rank 0 did not open this group at the store at {target} within {} ms \
                     (do all ranks share the group's secret? the store answers: {refusal})",
                    timeout.as_millis()
                ));
            }
            thread::sleep(backoff.min(left));
            backoff = (backoff * 2).min(Duration::from_millis(100));
        };
        let conn = Mutex::new(Conn { stream: Some(stream), seq: 0 });
        Ok(TcpBootstrap { rank, world, addr: target.clone(), conn, hosted })
    }

    /// Sends one round and reads its reply; `Err` here means the transport
    /// failed (the connection is then unusable).
    fn round(&self, stream: &Stream, seq: u64, data: &[u8], timeout: Duration) -> Result<Vec<u8>> {
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
fn dial(target: &Target, deadline: Instant, timeout: Duration, host_may_be_late: bool) -> Result<Stream> {
    let mut backoff = Duration::from_millis(5);
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let attempt = left.clamp(Duration::from_millis(1), Duration::from_secs(5));
        let e = match target.dial(attempt) {
            Ok(s) => return Ok(s),
            // Someone else holds the name: waiting will not help.
            Err(e) if e.kind() == io::ErrorKind::PermissionDenied => {
                return Err(err!(Bootstrap, "bootstrap: refusing the store at {target}: {e}"))
            }
            Err(e) => e,
        };
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(if host_may_be_late {
                err!(
                    Timeout,
                    "bootstrap: rank 0 did not open the group's store at {target} within {} ms: {e}",
                    timeout.as_millis()
                )
            } else {
                err!(Bootstrap, "bootstrap: cannot reach the store at {target} within {} ms: {e}", timeout.as_millis())
            });
        }
        thread::sleep(backoff.min(left));
        backoff = (backoff * 2).min(Duration::from_millis(100));
    }
}

/// Presents the secret and rank. `Some(message)` when the store does not
/// know the secret; its other refusals come back as its error.
fn hello(
    stream: &Stream,
    target: &Target,
    secret: &[u8; SECRET_BYTES],
    rank: usize,
    world: usize,
    deadline: Instant,
) -> Result<Option<String>> {
    let wait = deadline.saturating_duration_since(Instant::now()).max(Duration::from_secs(2));
    let lost = |e: io::Error| err!(Bootstrap, "bootstrap: handshake with the store at {target} failed: {e}");
    stream.set_write_timeout(Some(wait)).map_err(lost)?;
    stream.set_read_timeout(Some(wait)).map_err(lost)?;
    let req = Request::Hello { protocol: PROTOCOL, secret: *secret, rank: rank as u32, world: world as u32 };
    req.write_to(&mut &*stream).map_err(lost)?;
    let body = read_frame(&mut &*stream, 1 << 16).map_err(lost)?;
    match Reply::decode(&body)? {
        Reply::Refused(msg) => Ok(Some(msg.to_string())),
        r => r.into_result().map(|_| None),
    }
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

#[cfg(test)]
impl TcpBootstrap {
    /// Closes the connection as a process that ends does: no goodbye.
    pub(crate) fn vanish(mut self) {
        sync::get_mut(&mut self.conn).stream.take();
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
