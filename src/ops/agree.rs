//! Agreement: before an operation moves data, every rank learns that every
//! other rank makes the same call (else all fail with `Mismatch`) and can
//! make it (else all fail: the failing rank with its own error, the others
//! with `Remote` carrying it), so a bad call never hangs or corrupts data.
//!
//! Each rank describes its call by a [`Signature`]: the arguments that must
//! agree (operation, dtype, shapes, dims, reduce op, number of B, where an
//! input read in place lives). Signatures are exchanged over the bootstrap.
//!
//! The exchange is a round trip through the bootstrap, too slow to repeat
//! on every call of a GPU pipeline, so a signature that every rank sent
//! identically is cached (`state`) and a later call with the same
//! signature skips the exchange. (So every argument a peer must know is one
//! every rank passes alike: a fact that may differ between ranks could
//! change on a peer while this rank repeats its cached call.) The
//! trade-off: after a signature has been
//! agreed, a rank that alone changes its call is no longer reported here;
//! the peers then wait at the operation's first signal and fail with
//! `Timeout` naming it. If both calls were agreed before, each carries its
//! tag (a hash of its signature, `CallTag`) in its signals and LL lines,
//! so ranks that meet on the same signals or lines fail the group with
//! `Mismatch` there instead of succeeding on each other's data (see
//! `CallTag` for what is still read on CUDA; ranks whose calls meet on
//! different ones time out; the transport's steps (NCCL) across and
//! inside hosts carry no tag yet). A timeout fails the group, so later
//! calls are refused instead of running on signals out of step.
//! `SYMM_CHECK_ARGS=always` (or the group flag
//! `SYMM_GROUP_CHECK_ARGS_ALWAYS`) exchanges on every call instead.
//!
//! A call that fails on a rank before any data moves (its arguments
//! invalid there, or unreadable) must not leave peers waiting for it. On
//! one host every rank posts where it stands with each call on the group's
//! board (`crate::health::CallState`), and a rank whose call failed looks
//! there: a peer that went ahead under a kept agreement waits for this
//! rank's data, so the group fails and that peer stops at once with
//! `Remote`; peers that exchange arguments get this rank's error through
//! the exchange; where every rank failed the call, nobody waits and the
//! group stays usable. Across hosts, a rank that fails a kept call alone
//! fails the group.

use super::state;
use crate::backend::CallTag;
use crate::error::{err, Error, Result};
use crate::group::{Group, Purpose};
use crate::health::CallState;
use crate::sync::{spin_until, Ended};
use crate::wire::{Reader, Writer};
use std::fmt::Display;
use std::time::Instant;

#[derive(Clone, Debug, PartialEq, Eq)]
struct Field {
    name: String,
    value: String,
}

/// A compact, human-readable description of one rank's call.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Signature {
    fields: Vec<Field>,
}

impl Signature {
    pub fn new(operation: &str) -> Signature {
        Signature::default().arg("operation", operation)
    }

    /// An argument every rank must pass identically.
    pub fn arg(mut self, name: impl Into<String>, value: impl Display) -> Signature {
        self.fields.push(Field { name: name.into(), value: value.to_string() });
        self
    }

    fn encode(&self) -> Vec<u8> {
        let mut w = Writer::new().u32(self.fields.len() as u32);
        for f in &self.fields {
            w = w.str(&f.name).str(&f.value);
        }
        w.finish()
    }

    fn decode(b: &[u8]) -> Result<Signature> {
        let mut r = Reader::new(b, "call signature");
        let n = r.u32()?;
        let fields = (0..n).map(|_| Ok(Field { name: r.str()?, value: r.str()? })).collect::<Result<_>>()?;
        Ok(Signature { fields })
    }

    fn get(&self, name: &str) -> Option<&str> {
        self.fields.iter().find(|f| f.name == name).map(|f| f.value.as_str())
    }
}

/// The outcome of an agreement: whether the signature was agreed for the
/// first time, and the call's tag (the same on every rank).
#[derive(Debug)]
pub struct Agreed {
    pub first: bool,
    pub tag: CallTag,
}

/// Collective: agrees on this rank's call number `call` (`OpsState::next_call`).
/// `sig` is this rank's signature (`None` when the call could not even be
/// read, in which case `local` is the error); `local` is whether this
/// rank's call is valid.
pub fn agree(group: &Group, sig: Option<&Signature>, local: Result<()>, call: u64) -> Result<Agreed> {
    agree_through(group, sig, local, Some(call), |payload| group.exchange(Purpose::Agreement, payload))
}

/// As [`agree`] for a group spanning hosts, through its transport across
/// hosts, with the same trade-off: an agreed call is kept. A rank that
/// alone changes a kept call leaves its peers waiting in NCCL, which the
/// group's watchdog ends (`Timeout`, see `crate::backend::cuda::nccl_watch`);
/// on the bootstrap's transport its agreement meets their data and every
/// rank fails with `Mismatch`.
pub fn agree_across_hosts(group: &Group, sig: &Signature, local: Result<()>) -> Result<CallTag> {
    agree_through(group, Some(sig), local, None, |payload| group.exchange(Purpose::Agreement, payload)).map(|a| a.tag)
}

/// [`agree`], the signatures exchanged by `exchange`; `call`: the call's
/// number, where the ranks post where they stand with it (one host).
fn agree_through(
    group: &Group,
    sig: Option<&Signature>,
    local: Result<()>,
    call: Option<u64>,
    exchange: impl FnOnce(Result<Vec<u8>>) -> Result<Vec<Vec<u8>>>,
) -> Result<Agreed> {
    let encoded = sig.map(Signature::encode);
    let kept = encoded.as_ref().and_then(|b| state::of(group).agreed_tag(b)).filter(|_| !group.check_args_always());
    let posted = |s: CallState| call.is_some_and(|c| group.post_call(c, s));
    match (&local, kept) {
        (Ok(()), Some(tag)) => {
            posted(CallState::Going);
            return Ok(Agreed { first: false, tag });
        }
        (Ok(()), None) => {
            posted(CallState::Agreeing);
        }
        (Err(e), _) if group.world() > 1 && posted(CallState::Failed) => {
            let call = call.expect("posted");
            match peers_of_failed(group, call) {
                Peers::Agreeing => {} // they learn this rank's error in the exchange
                Peers::Failed => return Err(e.clone()),
                Peers::Waiting(why) => {
                    group.fail(&e.clone().context(why));
                    return Err(e.clone());
                }
            }
        }
        (Err(e), Some(_)) => {
            // Across hosts: peers making this call skip the exchange as
            // well and go on to wait for this rank, which will not come.
            if group.world() > 1 {
                group.fail(&e.clone().context("a call whose arguments the ranks had agreed on failed here"));
            }
            return Err(e.clone());
        }
        (Err(_), None) => {}
    }
    let payload = local.and_then(|()| encoded.ok_or_else(|| err!(Internal, "a valid call without a signature")));
    let all = exchange(payload)?;
    let sigs: Vec<Signature> = group.decoded(all.iter().map(|b| Signature::decode(b)).collect())?;
    check_same(&sigs)?;
    let tag = CallTag::of(&all[group.rank()]);
    let first = state::of(group).mark_agreed(all[group.rank()].clone());
    Ok(Agreed { first, tag })
}

/// What the peers of a rank whose call failed before moving data do with
/// that call.
enum Peers {
    /// Every peer failed it too: nobody waits for anybody.
    Failed,
    /// None went ahead, and some exchange arguments: they take this rank's
    /// error from the exchange.
    Agreeing,
    /// A peer waits (or may) for this rank's part of the call: why.
    Waiting(String),
}

/// Waits, at most the group's timeout, until every peer has posted call
/// number `call` (which failed on this rank), and says what they do.
fn peers_of_failed(group: &Group, call: u64) -> Peers {
    let Some(mut states) = group.calls(call) else { return Peers::Waiting("the board is gone".into()) };
    let going = |states: &[Option<CallState>]| states.iter().position(|s| *s == Some(CallState::Going));
    let settled = |states: &mut Vec<Option<CallState>>| {
        *states = group.calls(call).unwrap_or_default();
        going(states).is_some() || states.iter().all(Option::is_some)
    };
    let deadline = Instant::now() + group.timeout();
    match spin_until(|| settled(&mut states), || group.failure(), deadline) {
        Err(Ended::Failed(_)) => Peers::Failed, // failed already: nothing more to tell
        Err(Ended::TimedOut) => {
            let r = states.iter().position(Option::is_none).unwrap_or(0);
            Peers::Waiting(format!("rank {r} did not reach this call within {:?}", group.timeout()))
        }
        Ok(()) => match going(&states) {
            Some(r) => {
                Peers::Waiting(format!("rank {r} went ahead with this call, whose arguments the ranks had agreed on"))
            }
            None if states.contains(&Some(CallState::Agreeing)) => Peers::Agreeing,
            None => Peers::Failed,
        },
    }
}

/// Every rank's arguments against rank 0's, so that all ranks report the
/// same message.
fn check_same(sigs: &[Signature]) -> Result<()> {
    const SHOWN: usize = 4;
    let first = &sigs[0];
    let mut diffs = Vec::new();
    for (r, s) in sigs.iter().enumerate().skip(1) {
        for f in &first.fields {
            match s.get(&f.name) {
                Some(v) if v == f.value => {}
                Some(v) => diffs.push(format!("{} is {} on rank 0 but {v} on rank {r}", f.name, f.value)),
                None => diffs.push(format!("{} is {} on rank 0 but absent on rank {r}", f.name, f.value)),
            }
        }
        for f in s.fields.iter().filter(|f| first.get(&f.name).is_none()) {
            diffs.push(format!("{} is absent on rank 0 but {} on rank {r}", f.name, f.value));
        }
    }
    if diffs.is_empty() {
        return Ok(());
    }
    let more = diffs.len().saturating_sub(SHOWN);
    diffs.truncate(SHOWN);
    let tail = if more > 0 { format!(" (and {more} more)") } else { String::new() };
    Err(Error::new(
        crate::error::ErrorKind::Mismatch,
        format!("the ranks passed different arguments: {}{tail}", diffs.join("; ")),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bootstrap::{local::local_bootstraps, Bootstrap};
    use crate::error::ErrorKind;
    use crate::ops::testing::{host_config, on_each};
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    use std::time::Duration;

    /// Counts the all-gathers a rank makes, to see exchanges skipped.
    struct Counting<B> {
        inner: B,
        calls: Arc<AtomicUsize>,
    }

    impl<B: Bootstrap> Bootstrap for Counting<B> {
        fn rank(&self) -> usize {
            self.inner.rank()
        }
        fn world(&self) -> usize {
            self.inner.world()
        }
        fn allgather(&self, data: &[u8], timeout: Duration) -> Result<Vec<u8>> {
            self.calls.fetch_add(1, Ordering::SeqCst);
            self.inner.allgather(data, timeout)
        }
    }

    /// An in-process group whose ranks count their all-gathers; rank r on
    /// pretend host `hosts[r]` if given, else all on one host.
    fn counting_groups(world: usize, always: bool, hosts: Option<&[&str]>) -> Vec<(Arc<Group>, Arc<AtomicUsize>)> {
        std::thread::scope(|s| {
            let hs: Vec<_> = local_bootstraps(world)
                .into_iter()
                .enumerate()
                .map(|(r, b)| {
                    let host_id = hosts.map(|h| h[r].to_string());
                    let cfg = crate::group::GroupConfig { host_id, ..host_config(always) };
                    s.spawn(move || {
                        let calls = Arc::new(AtomicUsize::new(0));
                        let g = Group::new(Box::new(Counting { inner: b, calls: calls.clone() }), 0, &cfg).unwrap();
                        (g, calls)
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    /// Runs `f(rank, group, all-gathers so far)` on every rank of a new
    /// counting group, with the collective lock held as operations do.
    fn on_group<T: Send>(
        world: usize,
        always: bool,
        f: impl Fn(usize, &Group, &dyn Fn() -> usize) -> T + Sync,
    ) -> Vec<T> {
        on_group_of(counting_groups(world, always, None), f)
    }

    fn on_group_of<T: Send>(
        groups: Vec<(Arc<Group>, Arc<AtomicUsize>)>,
        f: impl Fn(usize, &Group, &dyn Fn() -> usize) -> T + Sync,
    ) -> Vec<T> {
        let gs: Vec<Arc<Group>> = groups.iter().map(|(g, _)| g.clone()).collect();
        on_each(&gs, |r, g| {
            let _lock = g.lock_collective();
            f(r, g, &|| groups[r].1.load(Ordering::SeqCst))
        })
    }

    #[test]
    fn agreed_signatures_skip_the_exchange_unless_always() {
        for always in [false, true] {
            let skipped = on_group(3, always, |_, g, calls| {
                assert!(agree_next(g, Some(&sig(0, &[4, 8])), Ok(())).unwrap().first, "agreed for the first time");
                let before = calls();
                assert!(!agree_next(g, Some(&sig(0, &[4, 8])), Ok(())).unwrap().first, "agreed before");
                let repeat = calls() - before;
                assert!(agree_next(g, Some(&sig(1, &[4, 8])), Ok(())).unwrap().first);
                (repeat, calls() - before)
            });
            for (repeat, total) in skipped {
                assert_eq!(repeat == 0, !always);
                assert!(total > repeat, "a new signature is exchanged");
            }
        }
    }

    /// Across hosts as on one host: an agreed call skips the exchange
    /// unless every call is checked; a differing first call is no agreement.
    #[test]
    fn agreed_signatures_across_hosts_skip_the_exchange_unless_always() {
        for always in [false, true] {
            let groups = counting_groups(4, always, Some(&["a", "b", "a", "b"]));
            let got = on_group_of(groups, |r, g, calls| {
                agree_across_hosts(g, &sig(0, &[4, 8]), Ok(())).unwrap();
                let before = calls();
                agree_across_hosts(g, &sig(0, &[4, 8]), Ok(())).unwrap();
                let repeat = calls() - before;
                let differing = agree_across_hosts(g, &sig(r % 2, &[2, 8]), Ok(())).unwrap_err();
                (repeat, differing.kind)
            });
            for (repeat, differing) in got {
                assert_eq!(repeat == 0, !always);
                assert_eq!(differing, ErrorKind::Mismatch);
            }
        }
    }

    #[test]
    fn a_local_failure_reaches_every_rank() {
        let res = on_group(3, false, |r, g, _| {
            let local = if r == 1 { Err(err!(InvalidArgument, "out.shape is wrong")) } else { Ok(()) };
            agree_next(g, Some(&sig(0, &[4, 8])), local)
        });
        assert_eq!(res[1].as_ref().unwrap_err().kind, ErrorKind::InvalidArgument);
        for r in [0, 2] {
            let e = res[r].as_ref().unwrap_err();
            assert_eq!(e.kind, ErrorKind::Remote);
            assert!(e.msg.contains("rank 1: out.shape is wrong"), "{}", e.msg);
        }
    }

    #[test]
    fn differing_calls_fail_everywhere_and_are_not_cached() {
        let res = on_group(2, false, |r, g, calls| {
            let first = agree_next(g, Some(&sig(r, &[4, 8])), Ok(()));
            let before = calls();
            let again = agree_next(g, Some(&sig(r, &[4, 8])), Ok(()));
            (first, again, calls() - before)
        });
        for (first, again, exchanged) in res {
            let e = first.unwrap_err();
            assert_eq!(e.kind, ErrorKind::Mismatch);
            assert!(e.msg.contains("gather_dim is 0 on rank 0 but 1 on rank 1"), "{}", e.msg);
            assert_eq!(again.unwrap_err().kind, ErrorKind::Mismatch);
            assert!(exchanged > 0);
        }
    }

    #[test]
    fn a_local_failure_on_an_agreed_call_returns_at_once() {
        let res = on_group(2, false, |_, g, calls| {
            agree_next(g, Some(&sig(0, &[4, 8])), Ok(())).unwrap();
            let before = calls();
            let e = agree_next(g, Some(&sig(0, &[4, 8])), Err(err!(InvalidArgument, "bad"))).unwrap_err();
            (e.kind, calls() - before)
        });
        assert!(res.iter().all(|&(kind, exchanged)| kind == ErrorKind::InvalidArgument && exchanged == 0));
    }

    /// Where every rank failed a kept call, nobody waits: each reports its
    /// own error and the group stays usable; the next call runs.
    #[test]
    fn a_call_every_rank_fails_leaves_the_group_usable() {
        for unreadable in [false, true] {
            let res = on_group(3, false, |r, g, _| {
                agree_next(g, Some(&sig(0, &[4, 8])), Ok(())).unwrap();
                let bad = err!(InvalidArgument, "out overlaps a_shard on rank {r}");
                let e = agree_next(g, (!unreadable || r == 1).then(|| sig(0, &[4, 8])).as_ref(), Err(bad)).unwrap_err();
                (e, g.failure(), agree_next(g, Some(&sig(0, &[4, 8])), Ok(())).map(|a| a.first))
            });
            for (r, (e, failure, next)) in res.into_iter().enumerate() {
                assert_eq!(e.kind, ErrorKind::InvalidArgument);
                assert!(e.msg.contains(&format!("on rank {r}")), "{}", e.msg);
                assert!(failure.is_none(), "{failure:?}");
                assert!(!next.unwrap());
            }
        }
    }

    /// A rank that fails a kept call alone (readable or not) fails the
    /// group at once: its peer, gone ahead to wait for its data, stops.
    #[test]
    fn a_rank_failing_a_kept_call_alone_fails_the_group_at_once() {
        for unreadable in [false, true] {
            let res = on_group(2, false, |r, g, _| {
                agree_next(g, Some(&sig(0, &[4, 8])), Ok(())).unwrap();
                let start = Instant::now();
                let got = match r {
                    1 => agree_next(
                        g,
                        (!unreadable).then(|| sig(0, &[4, 8])).as_ref(),
                        Err(err!(InvalidArgument, "bad")),
                    ),
                    _ => agree_next(g, Some(&sig(0, &[4, 8])), Ok(())),
                };
                // As an operation's first wait for the peer would.
                while g.failure().is_none() && start.elapsed() < Duration::from_secs(2) {
                    std::thread::sleep(Duration::from_millis(1));
                }
                (got.map(|a| a.first), g.failure(), start.elapsed())
            });
            assert_eq!(res[0].0, Ok(false));
            assert_eq!(res[1].0.as_ref().unwrap_err().kind, ErrorKind::InvalidArgument);
            for (_, failure, took) in &res {
                assert!(failure.as_ref().unwrap().msg.contains("rank 0 went ahead with this call"), "{failure:?}");
                assert!(*took < Duration::from_secs(1), "{took:?}");
            }
        }
    }

    /// A rank that fails a kept call while its peer exchanges a new one
    /// joins the exchange: the peer learns the error, the group stays.
    #[test]
    fn a_failed_kept_call_meets_an_exchanging_peer_in_the_exchange() {
        let res = on_group(2, false, |r, g, _| {
            agree_next(g, Some(&sig(0, &[4, 8])), Ok(())).unwrap();
            let got = match r {
                0 => agree_next(g, Some(&sig(0, &[4, 8])), Err(err!(InvalidArgument, "bad here"))),
                _ => agree_next(g, Some(&sig(0, &[2, 8])), Ok(())),
            };
            (got.map(|a| a.first), g.failure())
        });
        assert_eq!(res[0].0.as_ref().unwrap_err().kind, ErrorKind::InvalidArgument);
        let e = res[1].0.as_ref().unwrap_err();
        assert!(e.kind == ErrorKind::Remote && e.msg.contains("bad here"), "{e:?}");
        assert!(res.iter().all(|(_, failure)| failure.is_none()));
    }

    fn agree_next(g: &Group, sig: Option<&Signature>, local: Result<()>) -> Result<Agreed> {
        agree(g, sig, local, state::of(g).next_call())
    }

    fn sig(dim: usize, shape: &[usize]) -> Signature {
        Signature::new("ag_mm").arg("gather_dim", dim).arg("a_shard.shape", format!("{shape:?}"))
    }

    #[test]
    fn encodes_and_decodes() {
        let s = sig(1, &[4, 8]);
        assert_eq!(Signature::decode(&s.encode()).unwrap(), s);
        assert!(Signature::decode(&s.encode()[..5]).is_err());
    }

    #[test]
    fn reports_differences_against_rank_0() {
        assert!(check_same(&[sig(0, &[4, 8]), sig(0, &[4, 8])]).is_ok());
        let e = check_same(&[sig(0, &[4, 8]), sig(0, &[4, 8]), sig(1, &[2, 8])]).unwrap_err();
        assert_eq!(e.kind, crate::error::ErrorKind::Mismatch);
        assert!(e.msg.contains("gather_dim is 0 on rank 0 but 1 on rank 2"), "{}", e.msg);
        assert!(e.msg.contains("a_shard.shape is [4, 8] on rank 0 but [2, 8] on rank 2"), "{}", e.msg);
        let extra = sig(0, &[4, 8]).arg("bs[1].shape", "[8, 2]");
        let e = check_same(&[sig(0, &[4, 8]), extra]).unwrap_err();
        assert!(e.msg.contains("bs[1].shape is absent on rank 0 but [8, 2] on rank 1"), "{}", e.msg);
    }

    #[test]
    fn long_reports_are_cut() {
        let many = |v: usize| (0..10).fold(Signature::new("x"), |s, i| s.arg(format!("f{i}"), v));
        let e = check_same(&[many(0), many(1)]).unwrap_err();
        assert!(e.msg.ends_with("(and 6 more)"), "{}", e.msg);
    }
}
