//! A failed group stays failed on every rank: after a timeout, a lost
//! exchange, a rank failing alone on an agreed call, or an abort, every
//! later operation of every rank is refused (`Aborted`), waits in progress
//! end early, and a new group works.

use super::lc_allgather::{lc_allgather, LcAllgather};
use super::testing::{host_config, on_each};
use crate::array::{Array, DType};
use crate::backend::Stream;
use crate::error::{ErrorKind, Result};
use crate::group::Group;
use std::sync::Arc;
use std::time::{Duration, Instant};

fn groups(world: usize, timeout: Duration) -> Vec<Arc<Group>> {
    Group::new_local(&vec![0; world], &crate::group::GroupConfig { timeout: Some(timeout), ..host_config(false) })
        .unwrap()
}

/// One rank's gather of `rows` rows of 3 f32 from ordinary memory;
/// `overlap` makes its output overlap its input (invalid).
fn gather(g: &Arc<Group>, rows: usize, overlap: bool) -> Result<Vec<f32>> {
    let world = g.world();
    let mut input: Vec<f32> = (0..rows * 3).map(|i| (g.rank() * 100 + i) as f32).collect();
    let mut out = vec![0f32; world * rows * 3 + rows * 3];
    let at = if overlap { input.as_mut_ptr() as u64 } else { out.as_mut_ptr() as u64 };
    let call = LcAllgather {
        input: Array::contiguous(input.as_mut_ptr() as u64, DType::F32, &[rows, 3]),
        output: Array::contiguous(at, DType::F32, &[world * rows, 3]),
    };
    lc_allgather(g, Ok(call), Stream(0)).map(|()| out[..world * rows * 3].to_vec())
}

fn refused(r: Result<Vec<f32>>) -> String {
    let e = r.expect_err("a failed group refuses");
    assert_eq!(e.kind, ErrorKind::Aborted, "{}", e.msg);
    e.msg
}

/// The case: a rank changes its arguments on a call agreed
/// before. Both ranks time out; later calls fail on both with `Aborted`
/// (they used to succeed with wrong data), and a new group works.
#[test]
fn a_timeout_fails_every_later_call_on_every_rank() {
    let gs = groups(2, Duration::from_millis(300));
    let results = on_each(&gs, |r, g| {
        gather(g, 2, false).unwrap();
        let changed = gather(g, if r == 1 { 3 } else { 2 }, false).unwrap_err();
        let later: Vec<String> = (0..3).map(|_| refused(gather(g, 2, false))).collect();
        (changed, later, g.failure().unwrap())
    });
    // The first rank to time out stops the other, which then names it.
    assert!(results.iter().any(|(changed, _, _)| changed.kind == ErrorKind::Timeout));
    for (changed, later, cause) in results {
        assert!(matches!(changed.kind, ErrorKind::Timeout | ErrorKind::Remote), "{}", changed.msg);
        assert!(later.iter().all(|m| m.contains("no longer usable")), "{later:?}");
        assert!(matches!(cause.kind, ErrorKind::Timeout | ErrorKind::Remote), "{cause:?}");
    }
    let fresh = groups(2, Duration::from_secs(10));
    let outs = on_each(&fresh, |_, g| gather(g, 2, false).unwrap());
    assert_eq!(outs[0], outs[1]);
    assert_eq!(outs[0][6], 100.0);
}

/// A rank failing alone on a call its peers skip agreeing on fails the
/// group; the peer, already waiting for it, stops at once with `Remote`
/// naming it, well before its timeout.
#[test]
fn a_rank_failing_alone_stops_its_peers_at_once() {
    let gs = groups(2, Duration::from_secs(30));
    let results = on_each(&gs, |r, g| {
        gather(g, 2, false).unwrap();
        if r == 1 {
            // Rank 0 is waiting for this rank by then.
            std::thread::sleep(Duration::from_millis(200));
        }
        let start = Instant::now();
        let e = gather(g, 2, r == 1).unwrap_err();
        (e, start.elapsed(), refused(gather(g, 2, false)))
    });
    let (e0, waited, later0) = &results[0];
    assert_eq!(e0.kind, ErrorKind::Remote, "{}", e0.msg);
    assert!(e0.msg.contains("rank 1 failed") && e0.msg.contains("output overlaps input"), "{}", e0.msg);
    assert!(*waited < Duration::from_secs(5), "{waited:?}");
    assert!(later0.contains("rank 1 failed"), "{later0}");
    assert_eq!(results[1].0.kind, ErrorKind::InvalidArgument);
}

/// A bad argument on a call the ranks exchange fails that call on every
/// rank, and nothing more: the group keeps working.
#[test]
fn a_reported_bad_argument_leaves_the_group_working() {
    let gs = groups(2, Duration::from_secs(10));
    let results = on_each(&gs, |r, g| {
        let bad = gather(g, 4, r == 0).unwrap_err().kind;
        (bad, gather(g, 4, false).map(|o| o.len()), g.failure())
    });
    assert_eq!(results[0].0, ErrorKind::InvalidArgument);
    assert_eq!(results[1].0, ErrorKind::Remote);
    for (_, ok, failure) in results {
        assert_eq!(ok.unwrap(), 24);
        assert!(failure.is_none());
    }
}

/// `abort` from another thread ends a call blocked waiting for a peer
/// that never comes, promptly; the peer then finds the group failed.
#[test]
fn abort_from_another_thread_ends_a_blocked_call() {
    let gs = groups(2, Duration::from_secs(60));
    on_each(&gs, |_, g| gather(g, 2, false).unwrap());
    let (blocked, waited) = std::thread::scope(|s| {
        let call = s.spawn(|| {
            let start = Instant::now();
            (gather(&gs[0], 2, false), start.elapsed())
        });
        std::thread::sleep(Duration::from_millis(200));
        let start = Instant::now();
        gs[0].abort();
        assert!(start.elapsed() < Duration::from_millis(100), "abort returns at once");
        call.join().unwrap()
    });
    let e = blocked.unwrap_err();
    assert_eq!(e.kind, ErrorKind::Aborted, "{}", e.msg);
    assert!(e.msg.contains("symm_group_abort was called on rank 0"), "{}", e.msg);
    assert!(waited < Duration::from_secs(5), "{waited:?}");
    let seen = gs[1].failure().unwrap();
    assert_eq!(seen.kind, ErrorKind::Remote);
    assert!(seen.msg.contains("rank 0 failed: symm_group_abort"), "{}", seen.msg);
    assert!(refused(gather(&gs[1], 2, false)).contains("rank 0 failed"));
}
