//! A group's health: healthy until its first failure (a timeout, a peer's
//! failure, a device error, an operation left half done) or an abort, and
//! failed from then on, so that no later call runs on signal pads that are
//! out of step and returns wrong data as a success.
//!
//! The failure is sticky here and shared with the peers through a
//! [`Board`]: a small shared-memory table, one slot per rank, that every
//! rank of the group maps (all ranks are on one host). A rank that fails
//! writes its slot; waits in progress poll the board (through
//! [`Health::interrupted`]) and end with `Remote` naming that rank, and
//! every later call of every rank is refused with `Aborted`.
//!
//! Work already queued on a device cannot poll host memory, so backends
//! register a waker ([`Health::on_failure`]) that tells it to stop: CUDA
//! writes its asynchronous error record, which the signal waits of its
//! kernels poll.
//!
//! Each slot also says where its rank stands in its sequence of calls
//! ([`CallState`]): a rank whose call fails here learns from the board
//! whether its peers went ahead with that call (then the group must fail,
//! or they wait for it) or failed it too (see `crate::ops::agree`).

use crate::error::{Error, ErrorKind, Result};
use crate::sync::lock;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock};

/// Bytes per rank on the board: state, message length, call, message.
pub const SLOT_BYTES: usize = 256;
const CALL_OFFSET: usize = 8;
const MESSAGE_OFFSET: usize = 16;
const MESSAGE_BYTES: usize = SLOT_BYTES - MESSAGE_OFFSET;

/// Where a rank stands with one of its calls, on the board beside the
/// call's number (the ranks number their collective calls alike).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CallState {
    /// Under an agreement kept from before: this rank runs the call and
    /// waits for its peers' data.
    Going = 1,
    /// The call failed here before any data moved.
    Failed = 2,
    /// This rank exchanges the call's arguments with its peers.
    Agreeing = 3,
}

impl CallState {
    fn of(bits: u64) -> Option<CallState> {
        match bits {
            1 => Some(CallState::Going),
            2 => Some(CallState::Failed),
            3 => Some(CallState::Agreeing),
            _ => None,
        }
    }
}

/// States of a board slot.
const FAILED: u32 = 1;

type Waker = Box<dyn Fn() + Send + Sync>;

pub struct Health {
    rank: usize,
    /// Set once the first failure is recorded (fast path of `check`).
    failed: AtomicU32,
    /// The first failure: its kind and message.
    cause: Mutex<Option<Error>>,
    board: OnceLock<Board>,
    wakers: Mutex<Vec<Waker>>,
}

impl Health {
    pub fn new(rank: usize) -> Health {
        Health {
            rank,
            failed: AtomicU32::new(0),
            cause: Mutex::new(None),
            board: OnceLock::new(),
            wakers: Mutex::new(Vec::new()),
        }
    }

    /// Shares failures with the peers through `board` from now on.
    pub fn attach_board(&self, board: Board) {
        let _ = self.board.set(board);
    }

    /// `f` runs once when the group fails (on the failing thread or the
    /// aborting one): it must return promptly and take no lock a blocked
    /// call may hold.
    pub fn on_failure(&self, f: impl Fn() + Send + Sync + 'static) {
        lock(&self.wakers).push(Box::new(f));
        if self.failed.load(Ordering::Acquire) != 0 {
            let wakers = lock(&self.wakers);
            if let Some(w) = wakers.last() {
                w();
            }
        }
    }

    /// Records `e` as the group's failure unless one is recorded already,
    /// tells the peers, and wakes what waits on this rank.
    pub fn fail(&self, e: &Error) {
        self.record(e, true)
    }

    /// As `fail`; `publish`: whether the peers need to be told (not for a
    /// failure read from the board, which they see there themselves).
    fn record(&self, e: &Error, publish: bool) {
        {
            let mut cause = lock(&self.cause);
            if cause.is_some() {
                return;
            }
            *cause = Some(e.clone());
            self.failed.store(1, Ordering::Release);
        }
        log::warn!("the group failed on rank {}: {}; it refuses every later call", self.rank, e.msg);
        if let (true, Some(b)) = (publish, self.board.get()) {
            b.publish(self.rank, &e.msg);
        }
        for w in lock(&self.wakers).iter() {
            w();
        }
    }

    /// Fails the group on purpose (`symm_group_abort`).
    pub fn abort(&self) {
        self.fail(&Error::new(ErrorKind::Aborted, format!("symm_group_abort was called on rank {}", self.rank)));
    }

    /// The first failure, if any, after looking at the peers' slots.
    pub fn cause(&self) -> Option<Error> {
        self.poll_peers();
        lock(&self.cause).clone()
    }

    /// At the start of a call: `Err(Aborted)` once the group failed here
    /// or on a peer, quoting the first failure.
    pub fn check(&self) -> Result<()> {
        match self.cause() {
            None => Ok(()),
            Some(e) => Err(Error::new(
                ErrorKind::Aborted,
                format!("the group is no longer usable (destroy it and form a new one): {}", e.msg),
            )),
        }
    }

    /// For a wait in progress: the error it should end with now, if the
    /// group failed (its own cause: `Remote` naming the peer, `Aborted`,
    /// `Timeout`...).
    pub fn interrupted(&self) -> Option<Error> {
        if self.failed.load(Ordering::Acquire) != 0 {
            return lock(&self.cause).clone();
        }
        self.poll_peers();
        if self.failed.load(Ordering::Acquire) != 0 {
            return lock(&self.cause).clone();
        }
        None
    }

    /// Posts where this rank stands with its call number `call`; `false`
    /// without a board (ranks on other hosts see no board of this one).
    /// Calls come one at a time (the group's collective lock), and only
    /// this rank writes its word, so the word read back is its last post.
    pub fn post_call(&self, call: u64, state: CallState) -> bool {
        let Some(board) = self.board.get() else { return false };
        let word = board.call(self.rank);
        word.store(CallWord(word.load(Ordering::Relaxed)).next(call, state).0, Ordering::Release);
        true
    }

    /// Where each rank stands with call number `call`: `None` for a rank
    /// that has not reached it yet; for one past it, `Failed` where it
    /// failed that call and `Going` where it ran it (or passed it too long
    /// ago to tell). `None` without a board.
    pub fn calls(&self, call: u64) -> Option<Vec<Option<CallState>>> {
        let board = self.board.get()?;
        Some((0..board.world).map(|r| CallWord(board.call(r).load(Ordering::Acquire)).at(call)).collect())
    }

    /// Takes a peer's published failure as this rank's.
    fn poll_peers(&self) {
        if self.failed.load(Ordering::Acquire) != 0 {
            return;
        }
        if let Some((r, msg)) = self.board.get().and_then(|b| b.first_failure(self.rank)) {
            self.record(&Error::new(ErrorKind::Remote, format!("rank {r} failed: {msg}")), false);
        }
    }
}

/// A rank's word on the board about its calls: the latest call's number,
/// its [`CallState`], and which of the calls before it failed here (bit k:
/// the call `k + 1` before), so that a rank still looking at an earlier
/// call can tell a peer that failed it from one that ran it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct CallWord(u64);

impl CallWord {
    const STATE_BITS: u32 = 2;
    const HISTORY_BITS: u32 = 22;
    const NUMBER_SHIFT: u32 = Self::STATE_BITS + Self::HISTORY_BITS;

    fn number(self) -> u64 {
        self.0 >> Self::NUMBER_SHIFT
    }
    fn history(self) -> u64 {
        (self.0 >> Self::STATE_BITS) & ((1 << Self::HISTORY_BITS) - 1)
    }

    /// The word for call `call` (later than this one) in `state`.
    fn next(self, call: u64, state: CallState) -> CallWord {
        let gap = call.saturating_sub(self.number()).max(1);
        let failed = (CallState::of(self.0 & 3) == Some(CallState::Failed)) as u64;
        let history = match gap < Self::HISTORY_BITS as u64 {
            true => ((self.history() << gap) | (failed << (gap - 1))) & ((1 << Self::HISTORY_BITS) - 1),
            false => 0,
        };
        CallWord(call << Self::NUMBER_SHIFT | history << Self::STATE_BITS | state as u64)
    }

    /// Where this rank stands with call `call` (see [`Health::calls`]).
    fn at(self, call: u64) -> Option<CallState> {
        let latest = self.number();
        if latest < call {
            return None;
        }
        if latest == call {
            return CallState::of(self.0 & 3);
        }
        let back = latest - call - 1;
        match back < Self::HISTORY_BITS as u64 && self.history() >> back & 1 == 1 {
            true => Some(CallState::Failed),
            false => Some(CallState::Going),
        }
    }
}

/// The shared table of failures: `SLOT_BYTES` per rank, in memory every
/// rank maps. Slot layout: `u32` state (0 or `FAILED`, written last with
/// release), `u32` message length, `u64` the rank's [`CallWord`], the
/// message (UTF-8, cut to fit).
pub struct Board {
    addr: usize,
    world: usize,
    /// Keeps the mapping alive.
    _mapping: Box<dyn Send + Sync>,
}

impl Board {
    /// A board over `world * SLOT_BYTES` bytes at `addr`, zeroed by its
    /// creator and kept mapped by `mapping`.
    pub fn new(addr: usize, world: usize, mapping: Box<dyn Send + Sync>) -> Board {
        Board { addr, world, _mapping: mapping }
    }

    fn state(&self, r: usize) -> &AtomicU32 {
        // SAFETY: the slot lies in the live mapping, 4-byte aligned, and
        // every process touches the state word atomically.
        unsafe { &*((self.addr + r * SLOT_BYTES) as *const AtomicU32) }
    }

    fn call(&self, r: usize) -> &AtomicU64 {
        // SAFETY: as for `state`; the slot's offset is 8-byte aligned (the
        // mapping is page-aligned) and the word is only touched atomically.
        unsafe { &*((self.addr + r * SLOT_BYTES + CALL_OFFSET) as *const AtomicU64) }
    }

    fn publish(&self, rank: usize, msg: &str) {
        let mut n = msg.len().min(MESSAGE_BYTES);
        while !msg.is_char_boundary(n) {
            n -= 1;
        }
        let slot = self.addr + rank * SLOT_BYTES;
        // SAFETY: this rank's slot; only this rank writes it, and readers
        // read it only after seeing the state (release below).
        unsafe {
            std::ptr::write_volatile((slot + 4) as *mut u32, n as u32);
            std::ptr::copy_nonoverlapping(msg.as_ptr(), (slot + MESSAGE_OFFSET) as *mut u8, n);
        }
        self.state(rank).store(FAILED, Ordering::Release);
    }

    /// The lowest rank other than `me` that published a failure.
    fn first_failure(&self, me: usize) -> Option<(usize, String)> {
        let r = (0..self.world).find(|&r| r != me && self.state(r).load(Ordering::Acquire) == FAILED)?;
        let slot = self.addr + r * SLOT_BYTES;
        // SAFETY: published (acquire above): length and message are written.
        let n = (unsafe { std::ptr::read_volatile((slot + 4) as *const u32) } as usize).min(MESSAGE_BYTES);
        let mut bytes = vec![0u8; n];
        // SAFETY: as above; n is within the slot.
        unsafe { std::ptr::copy_nonoverlapping((slot + MESSAGE_OFFSET) as *const u8, bytes.as_mut_ptr(), n) };
        Some((r, String::from_utf8_lossy(&bytes).into_owned()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::err;
    use std::sync::atomic::AtomicUsize;
    use std::sync::Arc;

    fn pair() -> (Health, Health, Vec<u64>) {
        let mem = vec![0u64; 2 * SLOT_BYTES / 8];
        let addr = mem.as_ptr() as usize;
        let (a, b) = (Health::new(0), Health::new(1));
        a.attach_board(Board::new(addr, 2, Box::new(())));
        b.attach_board(Board::new(addr, 2, Box::new(())));
        (a, b, mem)
    }

    #[test]
    fn a_failure_is_sticky_and_reaches_the_peer() {
        let (a, b, _mem) = pair();
        assert!(a.check().is_ok() && b.interrupted().is_none());
        a.fail(&err!(Timeout, "barrier on channel 0: rank 1 did not arrive within 5 ms"));
        a.fail(&err!(Internal, "a later failure is not the cause"));
        let e = a.check().unwrap_err();
        assert_eq!(e.kind, ErrorKind::Aborted);
        assert!(e.msg.contains("rank 1 did not arrive"), "{}", e.msg);
        let seen = b.interrupted().unwrap();
        assert_eq!(seen.kind, ErrorKind::Remote);
        assert!(seen.msg.starts_with("rank 0 failed: barrier on channel 0"), "{}", seen.msg);
        assert_eq!(b.check().unwrap_err().kind, ErrorKind::Aborted);
        // The peer's own failure is the remote one, not published back as new.
        assert_eq!(a.cause().unwrap().kind, ErrorKind::Timeout);
    }

    #[test]
    fn abort_wakes_once_and_late_wakers_run_at_once() {
        let h = Health::new(3);
        let woken = Arc::new(AtomicUsize::new(0));
        let w = woken.clone();
        h.on_failure(move || {
            w.fetch_add(1, Ordering::SeqCst);
        });
        h.abort();
        h.abort();
        assert_eq!(woken.load(Ordering::SeqCst), 1);
        assert_eq!(h.cause().unwrap().kind, ErrorKind::Aborted);
        assert!(h.cause().unwrap().msg.contains("symm_group_abort was called on rank 3"));
        let w = woken.clone();
        h.on_failure(move || {
            w.fetch_add(1, Ordering::SeqCst);
        });
        assert_eq!(woken.load(Ordering::SeqCst), 2);
    }

    #[test]
    fn ranks_see_where_their_peers_stand_with_a_call() {
        let (a, b, _mem) = pair();
        assert_eq!(a.calls(1), Some(vec![None, None]));
        assert!(a.post_call(1, CallState::Failed) && b.post_call(1, CallState::Agreeing));
        assert_eq!(b.calls(1), Some(vec![Some(CallState::Failed), Some(CallState::Agreeing)]));
        assert_eq!(b.calls(2), Some(vec![None, None]), "not reached yet");
        b.post_call(2, CallState::Going);
        assert_eq!(a.calls(1).unwrap()[1], Some(CallState::Going), "past it: it ran the call");
        a.post_call(3, CallState::Agreeing);
        assert_eq!(b.calls(1).unwrap()[0], Some(CallState::Failed), "past it: it failed it");
        assert_eq!(b.calls(2).unwrap()[0], Some(CallState::Going), "skipped: not failed here");
        // Beside a published failure, which does not overwrite it.
        b.fail(&err!(Timeout, "{}", "x".repeat(400)));
        assert_eq!(a.calls(2).unwrap()[1], Some(CallState::Going));
        assert_eq!(a.interrupted().unwrap().msg.len(), "rank 1 failed: ".len() + MESSAGE_BYTES);
        assert_eq!(Health::new(0).calls(1), None, "no board");
        assert!(!Health::new(0).post_call(1, CallState::Going));
    }

    #[test]
    fn a_call_word_remembers_recent_failures() {
        let mut w = CallWord(0);
        for call in 1..=30 {
            w = w.next(call, if call % 3 == 0 { CallState::Failed } else { CallState::Going });
        }
        assert_eq!((w.number(), w.at(30)), (30, Some(CallState::Failed)));
        assert_eq!(w.at(31), None);
        for call in 9..30 {
            let want = if call % 3 == 0 { CallState::Failed } else { CallState::Going };
            assert_eq!(w.at(call), Some(want), "call {call}");
        }
        // Too long ago to tell: taken as run.
        assert_eq!(w.at(6), Some(CallState::Going));
        let far = w.next(1000, CallState::Agreeing);
        assert_eq!((far.at(30), far.at(1000)), (Some(CallState::Going), Some(CallState::Agreeing)));
    }

    #[test]
    fn long_messages_are_cut_at_a_character() {
        let (a, b, _mem) = pair();
        a.fail(&err!(Timeout, "{}", "é".repeat(400)));
        let msg = b.interrupted().unwrap().msg;
        assert!(msg.len() <= "rank 0 failed: ".len() + MESSAGE_BYTES && msg.ends_with('é'), "{msg}");
    }
}
