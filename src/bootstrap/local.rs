//! Several ranks in one process (JAX drives all local GPUs from one process),
//! exchanging through shared memory instead of sockets.
//!
//! The round engine here, `Exchange`, is also what the TCP store runs for
//! each group: a connection thread there plays the part a rank's thread plays
//! here, so both report timeouts and mismatches identically.

use super::{name_ranks, Bootstrap};
use crate::error::{err, Error, Result};
use crate::sync::{self, lock};
use std::collections::hash_map::Entry;
use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// How long a failed round is remembered, so that ranks arriving late learn
/// why it failed instead of waiting out a timeout of their own.
const FAILED_ROUND_TTL: Duration = Duration::from_secs(600);

/// Creates the `n` ranks of an in-process group; element `r` is rank `r`.
/// Each is meant to be driven by its own thread.
pub fn local_bootstraps(n: usize) -> Vec<LocalBootstrap> {
    let exchange = Arc::new(Exchange::new());
    (0..n).map(|rank| LocalBootstrap { rank, world: n, exchange: exchange.clone(), seq: Mutex::new(0) }).collect()
}

/// One rank of an in-process group.
pub struct LocalBootstrap {
    rank: usize,
    world: usize,
    exchange: Arc<Exchange>,
    /// Rounds are matched by how many collectives each rank has issued, so
    /// the counter advances on failure too: all ranks see the same round fail
    /// and stay in step afterwards.
    seq: Mutex<u64>,
}

impl fmt::Debug for LocalBootstrap {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "LocalBootstrap(rank {} of {})", self.rank, self.world)
    }
}

impl Bootstrap for LocalBootstrap {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world(&self) -> usize {
        self.world
    }

    fn allgather(&self, data: &[u8], timeout: Duration) -> Result<Vec<u8>> {
        // Holding the lock for the whole round serializes collectives issued
        // concurrently on one rank, which would otherwise mismatch rounds.
        let mut seq = lock(&self.seq);
        let this = *seq;
        *seq += 1;
        let all = self.exchange.contribute(this, self.rank, self.world, data, timeout)?;
        Ok(all.as_ref().clone())
    }
}

/// All-gather rounds of one group, keyed by sequence number.
pub(crate) struct Exchange {
    state: Mutex<State>,
    /// Signalled whenever a round completes or fails.
    cond: Condvar,
}

struct State {
    rounds: HashMap<u64, Round>,
    /// Set when the group is known to be broken (e.g. two processes claim
    /// one rank); every round from then on fails with this error.
    poisoned: Option<Error>,
    /// A rank known to be gone (`lost`), and the error its absence gives:
    /// every round that still needs it fails with it at once.
    gone: Option<(usize, Error)>,
}

enum Outcome {
    Done(Arc<Vec<u8>>),
    Failed(Error),
}

struct Round {
    world: usize,
    len: usize,
    /// The rank whose contribution fixed `world` and `len`, for messages.
    first: usize,
    buf: Vec<u8>,
    /// Ranks seen in this round (contributed, or came after it failed).
    arrived: Vec<bool>,
    arrived_count: usize,
    /// Ranks that have been handed the outcome. A rank that has arrived but
    /// is not served yet is a thread waiting on the round.
    served: usize,
    outcome: Option<Outcome>,
    failed_at: Option<Instant>,
    /// Failed because a waiter's timeout passed (a later rank came late).
    timed_out: bool,
}

impl Round {
    fn new(world: usize, len: usize, first: usize) -> Result<Self> {
        let total = world
            .checked_mul(len)
            .ok_or_else(|| err!(InvalidArgument, "bootstrap: {world} x {len} bytes overflows"))?;
        Ok(Round {
            world,
            len,
            first,
            buf: vec![0; total],
            arrived: vec![false; world],
            arrived_count: 0,
            served: 0,
            outcome: None,
            failed_at: None,
            timed_out: false,
        })
    }

    fn is_open(&self) -> bool {
        self.outcome.is_none()
    }

    /// Marks `rank` as seen; false if it was seen already in this round.
    fn mark_arrived(&mut self, rank: usize) -> bool {
        if rank >= self.world || self.arrived[rank] {
            return false;
        }
        self.arrived[rank] = true;
        self.arrived_count += 1;
        true
    }

    /// Whether the round is open and waits for `rank`'s contribution.
    fn needs(&self, rank: usize) -> bool {
        self.is_open() && self.arrived.get(rank) == Some(&false)
    }

    fn fail(&mut self, e: Error) {
        if self.is_open() {
            self.buf = Vec::new();
            self.outcome = Some(Outcome::Failed(e));
            self.failed_at = Some(Instant::now());
        }
    }

    fn failure(&self) -> Option<Error> {
        match &self.outcome {
            Some(Outcome::Failed(e)) => Some(e.clone()),
            _ => None,
        }
    }

    /// Checks a contribution against the round; the error names both sides.
    fn check(&self, seq: u64, rank: usize, world: usize, len: usize) -> Result<()> {
        if world != self.world {
            return Err(err!(
                Mismatch,
                "bootstrap: rank {rank} gave world size {world} but rank {} gave {} (round {seq})",
                self.first,
                self.world
            ));
        }
        if self.arrived[rank] {
            return Err(err!(
                Mismatch,
                "bootstrap: rank {rank} contributed twice to round {seq} \
                 (do two processes claim rank {rank}?)"
            ));
        }
        if len != self.len {
            return Err(err!(
                Mismatch,
                "bootstrap: rank {rank} sent {len} bytes but rank {} sent {} (round {seq})",
                self.first,
                self.len
            ));
        }
        Ok(())
    }

    fn store(&mut self, rank: usize, data: &[u8]) {
        self.buf[rank * self.len..(rank + 1) * self.len].copy_from_slice(data);
        self.mark_arrived(rank);
        if self.arrived_count == self.world {
            let all = std::mem::take(&mut self.buf);
            self.outcome = Some(Outcome::Done(Arc::new(all)));
        }
    }

    fn missing(&self) -> Vec<usize> {
        (0..self.world).filter(|&r| !self.arrived[r]).collect()
    }

    /// Nobody is waiting on it any more (everyone who arrived was served).
    fn idle(&self) -> bool {
        self.served == self.arrived_count
    }
}

impl Exchange {
    pub(crate) fn new() -> Self {
        Exchange {
            state: Mutex::new(State { rounds: HashMap::new(), poisoned: None, gone: None }),
            cond: Condvar::new(),
        }
    }

    /// Contributes `data` as `rank` of `world` to round `seq` and waits until
    /// every rank has contributed (returning the rank-ordered concatenation),
    /// the round fails, or `timeout` passes (failing the round for everyone,
    /// naming the ranks that did not arrive).
    pub(crate) fn contribute(
        &self,
        seq: u64,
        rank: usize,
        world: usize,
        data: &[u8],
        timeout: Duration,
    ) -> Result<Arc<Vec<u8>>> {
        if world == 0 || rank >= world {
            return Err(err!(InvalidArgument, "bootstrap: rank {rank} is not in a world of {world}"));
        }
        let mut st = lock(&self.state);
        if let Some(e) = &st.poisoned {
            return Err(e.clone());
        }
        let round = match st.rounds.entry(seq) {
            Entry::Occupied(o) => o.into_mut(),
            Entry::Vacant(v) => v.insert(Round::new(world, data.len(), rank)?),
        };
        if let Err(e) = self.admit(round, seq, rank, world, data) {
            Self::serve_rejected(&mut st, seq, rank);
            return Err(e);
        }
        let state = &mut *st;
        if let (Some((gone, e)), Some(round)) = (&state.gone, state.rounds.get_mut(&seq)) {
            if round.needs(*gone) {
                round.fail(e.clone());
            }
        }
        self.wait(st, seq, world, timeout)
    }

    /// `rank` will not contribute again (its connection to the store closed
    /// without a goodbye): the open rounds that still need it, and every
    /// later one, fail with `e` at once instead of at their timeout. Rounds
    /// it contributed to go on.
    pub(crate) fn lost(&self, rank: usize, e: Error) {
        let mut st = lock(&self.state);
        for round in st.rounds.values_mut() {
            if round.needs(rank) {
                round.fail(e.clone());
            }
        }
        st.gone.get_or_insert((rank, e));
        self.cond.notify_all();
    }

    /// Adds a contribution to the round, or fails the whole round if it does
    /// not fit, so every participant hears of the problem instead of hanging.
    fn admit(&self, round: &mut Round, seq: u64, rank: usize, world: usize, data: &[u8]) -> Result<()> {
        if let Some(e) = round.failure() {
            // A rank arriving at a round that timed out is one the others
            // waited for: told so, not only that it "did not arrive".
            return Err(match round.timed_out {
                true => e.context(format!("bootstrap: rank {rank} came after the others gave up")),
                false => e,
            });
        }
        if let Err(e) = round.check(seq, rank, world, data.len()) {
            round.fail(e.clone());
            self.cond.notify_all();
            return Err(e);
        }
        round.store(rank, data);
        if !round.is_open() {
            self.cond.notify_all();
        }
        Ok(())
    }

    /// A rank turned away from a failed round counts as served if it had not
    /// been seen there before, so the round can be forgotten once every rank
    /// has heard the news.
    fn serve_rejected(st: &mut State, seq: u64, rank: usize) {
        let round = st.rounds.get_mut(&seq).expect("round exists while being admitted");
        if round.mark_arrived(rank) {
            round.served += 1;
        }
        Self::finish(st, seq);
    }

    fn wait(&self, mut st: MutexGuard<'_, State>, seq: u64, world: usize, timeout: Duration) -> Result<Arc<Vec<u8>>> {
        let deadline = Instant::now().checked_add(timeout);
        loop {
            // A round is removed only once every rank that arrived was
            // served, and this rank has arrived but is not served yet.
            let round = st.rounds.get_mut(&seq).expect("round outlives its waiters");
            if round.is_open() && deadline.is_some_and(|d| Instant::now() >= d) {
                let missing = round.missing();
                let e = err!(
                    Timeout,
                    "bootstrap: {} of {world} did not arrive within {} ms",
                    name_ranks(&missing),
                    timeout.as_millis()
                );
                log::warn!("{}", e.msg);
                round.fail(e);
                round.timed_out = true;
                self.cond.notify_all();
            }
            if let Some(outcome) = &round.outcome {
                let result = match outcome {
                    Outcome::Done(all) => Ok(all.clone()),
                    Outcome::Failed(e) => Err(e.clone()),
                };
                round.served += 1;
                Self::finish(&mut st, seq);
                return result;
            }
            st = match deadline {
                Some(d) => {
                    let left = d.saturating_duration_since(Instant::now());
                    sync::wait_timeout(&self.cond, st, left)
                }
                None => sync::wait(&self.cond, st),
            };
        }
    }

    /// Forgets a round once every rank has been served, and sweeps failed
    /// rounds whose stragglers never came, so memory stays bounded.
    fn finish(st: &mut State, seq: u64) {
        let Some(round) = st.rounds.get(&seq) else { return };
        let failed = round.failure().is_some();
        if round.served == round.world {
            st.rounds.remove(&seq);
        }
        if failed {
            st.rounds.retain(|_, r| !(r.idle() && r.failed_at.is_some_and(|t| t.elapsed() > FAILED_ROUND_TTL)));
        }
    }

    /// Fails every open round and all future ones with `e`.
    pub(crate) fn poison(&self, e: Error) {
        let mut st = lock(&self.state);
        for round in st.rounds.values_mut() {
            round.fail(e.clone());
        }
        st.poisoned.get_or_insert(e);
        self.cond.notify_all();
    }

    /// Rounds not yet forgotten (open, or failed with stragglers unserved).
    #[cfg(test)]
    pub(crate) fn open_rounds(&self) -> usize {
        lock(&self.state).rounds.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bootstrap::{allgather_var, on_ranks};
    use crate::error::ErrorKind;
    use std::thread;

    const T: Duration = Duration::from_secs(10);

    #[test]
    fn allgather_in_rank_order() {
        for n in 1..=4 {
            let out = on_ranks(local_bootstraps(n), |b| {
                let r = b.rank() as u8;
                b.allgather(&[r, r + 100], T).unwrap()
            });
            let want: Vec<u8> = (0..n as u8).flat_map(|r| [r, r + 100]).collect();
            assert!(out.iter().all(|o| *o == want));
        }
    }

    #[test]
    fn many_rounds_free_memory() {
        let bs = local_bootstraps(3);
        let probe = bs[0].exchange.clone();
        on_ranks(bs, |b| {
            for i in 0..2000u32 {
                let all = b.allgather(&i.to_le_bytes(), T).unwrap();
                assert_eq!(all.len(), 12);
                assert_eq!(&all[8..12], &i.to_le_bytes());
            }
            b.allgather(&[0], T).unwrap();
        });
        assert_eq!(probe.open_rounds(), 0);
    }

    #[test]
    fn variable_lengths() {
        let out = on_ranks(local_bootstraps(3), |b| allgather_var(b, &vec![7u8; b.rank() * 2], T).unwrap());
        for o in out {
            assert_eq!(o, vec![vec![], vec![7; 2], vec![7; 4]]);
        }
    }

    /// Rank r's payload of `len` bytes: distinct bytes, none of them the
    /// zero padding.
    fn payload(r: usize, len: usize) -> Vec<u8> {
        (0..len).map(|i| ((i * 7 + r * 13) % 251 + 1) as u8).collect()
    }

    #[test]
    fn variable_lengths_around_the_first_exchange() {
        // Short payloads take one exchange; one longer than the first
        // exchange carries makes every rank take a second, whatever the
        // length of its own.
        for lens in [[0, 1, 504], [504, 503, 0], [505, 0, 3], [2000, 505, 504], [0, 0, 0]] {
            let out = on_ranks(local_bootstraps(3), move |b| {
                let all = allgather_var(b, &payload(b.rank(), lens[b.rank()]), T).unwrap();
                (all, *lock(&b.seq))
            });
            let rounds = if lens.iter().any(|&n| n > 504) { 2 } else { 1 };
            for (all, taken) in out {
                assert_eq!(all, (0..3).map(|r| payload(r, lens[r])).collect::<Vec<_>>(), "{lens:?}");
                assert_eq!(taken, rounds, "{lens:?}");
            }
        }
    }

    #[test]
    fn timeout_names_missing_ranks() {
        let bs = local_bootstraps(4);
        let short = Duration::from_millis(300);
        // The first rank's deadline fails the round for all, so a rank that
        // came later may hear of it sooner than its own timeout.
        let start = Instant::now();
        let out = on_ranks(bs, move |b| {
            if b.rank() >= 2 {
                return None;
            }
            let e = b.allgather(&[1], short).unwrap_err();
            assert!(start.elapsed() >= short);
            Some(e)
        });
        for e in out.into_iter().flatten() {
            assert_eq!(e.kind, ErrorKind::Timeout);
            assert_eq!(e.msg, "bootstrap: ranks [2, 3] of 4 did not arrive within 300 ms");
        }
    }

    #[test]
    fn late_rank_learns_of_failure_and_round_is_freed() {
        let bs = local_bootstraps(2);
        let short = Duration::from_millis(100);
        let e = bs[0].allgather(&[1], short).unwrap_err();
        assert_eq!(e.msg, "bootstrap: rank 1 of 2 did not arrive within 100 ms");
        assert_eq!(bs[0].exchange.open_rounds(), 1);
        // Rank 1 comes late to round 0: it gets the error at once, told it was the late one...
        let t = Instant::now();
        let late = bs[1].allgather(&[1], T).unwrap_err();
        assert_eq!(late.kind, ErrorKind::Timeout);
        assert_eq!(late.msg, format!("bootstrap: rank 1 came after the others gave up: {}", e.msg));
        assert!(t.elapsed() < Duration::from_secs(1));
        // ...the round is forgotten, and the group is still in step.
        assert_eq!(bs[0].exchange.open_rounds(), 0);
        let out = on_ranks(bs, |b| b.allgather(&[b.rank() as u8], T).unwrap());
        assert!(out.iter().all(|o| o == &[0, 1]));
    }

    #[test]
    fn length_mismatch_fails_everyone() {
        let out = on_ranks(local_bootstraps(3), |b| b.allgather(&vec![0; 4 + (b.rank() == 2) as usize], T));
        for r in out {
            let e = r.unwrap_err();
            assert_eq!(e.kind, ErrorKind::Mismatch, "{e}");
            assert!(e.msg.contains("bytes"), "{e}");
        }
    }

    #[test]
    fn duplicate_and_world_mismatch_in_exchange() {
        let ex = Arc::new(Exchange::new());
        let ex2 = ex.clone();
        let waiter = thread::spawn(move || ex2.contribute(0, 1, 3, &[1], T));
        while ex.open_rounds() == 0 {
            thread::sleep(Duration::from_millis(1));
        }
        let dup = ex.contribute(0, 1, 3, &[1], T).unwrap_err();
        assert_eq!(dup.kind, ErrorKind::Mismatch);
        assert!(dup.msg.contains("contributed twice"), "{dup}");
        assert_eq!(waiter.join().unwrap().unwrap_err(), dup);

        let ex2 = ex.clone();
        let waiter = thread::spawn(move || ex2.contribute(1, 0, 2, &[1], T));
        while ex.open_rounds() < 2 {
            thread::sleep(Duration::from_millis(1));
        }
        let e = ex.contribute(1, 1, 3, &[1], T).unwrap_err();
        assert_eq!(e.kind, ErrorKind::Mismatch);
        assert!(e.msg.contains("world size 3"), "{e}");
        assert_eq!(waiter.join().unwrap().unwrap_err(), e);
    }

    #[test]
    fn poison_fails_open_and_future_rounds() {
        let ex = Arc::new(Exchange::new());
        let ex2 = ex.clone();
        let waiter = thread::spawn(move || ex2.contribute(0, 0, 2, &[1], T));
        while ex.open_rounds() == 0 {
            thread::sleep(Duration::from_millis(1));
        }
        ex.poison(err!(Mismatch, "broken"));
        assert_eq!(waiter.join().unwrap().unwrap_err().msg, "broken");
        assert_eq!(ex.contribute(5, 1, 2, &[1], T).unwrap_err().msg, "broken");
    }

    #[test]
    fn invalid_rank_rejected() {
        let ex = Exchange::new();
        assert_eq!(ex.contribute(0, 2, 2, &[], T).unwrap_err().kind, ErrorKind::InvalidArgument);
        assert!(local_bootstraps(0).is_empty());
    }
}
