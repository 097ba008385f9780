//! The group's symmetric workspace: one rendezvoused buffer per group that
//! operations stage data in (each rank's region at the same offset, so a
//! peer's region is `peer_addr(r) + offset`) and keep local scratch in; and
//! beside it the mailbox and the flags buffer, which only the fused
//! reduce-scatter uses (its state must survive from one call to the next,
//! see [`Scratch`]).
//!
//! Growing any of them is a rendezvous, hence collective. Every rank decides to
//! grow from the agreed arguments and its current size, both equal on every
//! rank, so all ranks grow together. None shrinks; a grown one starts
//! zeroed, as the first one did.

use super::state::{self, Scratch};
use crate::backend::Stream;
use crate::buffer::{self, Buffer, Handle};
use crate::error::{err, Result};
use crate::group::{Group, Purpose};
use crate::wire::{Reader, Writer};
use std::sync::Arc;

/// Sizes grow in steps of this, so a run of slightly larger calls does not
/// rendezvous on every one.
const GROWTH_STEP: usize = 1 << 20;

/// Regions are aligned to this, as vectorized device copies want.
const ALIGN: usize = 256;

/// Plans the regions of one call's workspace.
#[derive(Debug, Default)]
pub struct Layout {
    end: usize,
}

impl Layout {
    /// Reserves `bytes` and returns their offset.
    pub fn region(&mut self, bytes: usize) -> usize {
        let offset = self.end.next_multiple_of(ALIGN);
        self.end = offset + bytes;
        offset
    }

    pub fn bytes(&self) -> usize {
        self.end
    }
}

/// Collective (with the collective lock held): a scratch buffer of `kind`
/// of at least `bytes`, grown on every rank when the current one is smaller.
/// The one it replaces is freed once the work of earlier calls is done:
/// those on `stream` (the calling operation's), else on the whole device.
pub fn ensure(group: &Arc<Group>, kind: Scratch, bytes: usize, stream: Option<Stream>) -> Result<Arc<Handle>> {
    let old = state::of(group).scratch(kind);
    if let Some(ws) = &old {
        if ws.buffer().size() >= bytes {
            return Ok(ws.clone());
        }
    }
    let size = bytes
        .max(1)
        .checked_next_multiple_of(GROWTH_STEP)
        .ok_or_else(|| err!(InvalidArgument, "a {kind:?} of {bytes} bytes is too large"))?;
    // Earlier calls may still be running on the one this replaces: wait
    // for them first, failing (with the peers) where that cannot be done.
    let quiet = match old {
        Some(_) => group.backend().quiesce(stream).map_err(|e| e.context(format!("growing the {kind:?}"))),
        None => Ok(()),
    };
    // Then free it, before the rendezvous of the new one: freeing and
    // unmapping device memory may wait for the device, or for the peers'
    // devices when they share this process, and until this rank has joined
    // the rendezvous no peer can have launched a kernel that waits for it.
    // Freed after it, a peer's kernel could be spinning for this rank's
    // next step while this rank waited for that kernel (seen on 2 x H200
    // with two ranks in one process: a fused call timed out).
    if quiet.is_ok() && old.is_some() {
        state::of(group).clear_scratch(kind);
        drop(old);
    }
    let buf = match quiet.and_then(|()| Buffer::create(group, size)) {
        Ok(b) => b,
        Err(e) => {
            // Meet the peers at the rendezvous's first exchange, so they
            // fail with this reason instead of waiting for us.
            group.exchange(Purpose::Announce, Err(e.clone()))?;
            return Err(e);
        }
    };
    let ws = buffer::rendezvous_locked(&buf).map_err(|e| e.context(format!("growing the {kind:?}")))?;
    state::of(group).set_scratch(kind, ws.clone());
    Ok(ws)
}

/// Collective: sizes the workspace to at least `bytes` now, so later
/// calls up to that size do not grow it. Every rank must pass the same size.
pub fn reserve(group: &Arc<Group>, bytes: usize) -> Result<()> {
    let _lock = group.lock_collective();
    let all = group.exchange(Purpose::Reserve, Ok(Writer::new().u64(bytes as u64).finish()))?;
    let sizes: Vec<u64> = group.decoded(all.iter().map(|b| Reader::new(b, "workspace size").u64()).collect())?;
    let differ: Vec<String> =
        sizes.iter().enumerate().filter(|&(_, &s)| s != sizes[0]).map(|(r, s)| format!("rank {r} {s}")).collect();
    if !differ.is_empty() {
        let first = sizes[0];
        return Err(err!(
            Mismatch,
            "the ranks reserve different workspace sizes: rank 0 {first} bytes, {}",
            differ.join(", ")
        ));
    }
    ensure(group, Scratch::Workspace, bytes, None).map(drop)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::testing::{host_groups, on_each};

    /// Ranks that reach different collectives (one reserving the
    /// workspace, one in a rendezvous) both fail with `Mismatch`, and the
    /// group with them: neither reads the other's payload as its own (a
    /// size as an announcement, or the reverse).
    #[test]
    fn different_collectives_fail_both_ranks() {
        let gs = host_groups(2);
        let errs = on_each(&gs, |r, g| match r {
            0 => reserve(g, 1 << 20).unwrap_err(),
            _ => Buffer::create(g, 1 << 20).and_then(|b| buffer::rendezvous(&b)).map(drop).unwrap_err(),
        });
        for (r, e) in errs.iter().enumerate() {
            assert_eq!(e.kind, crate::error::ErrorKind::Mismatch, "rank {r}: {e}");
            assert!(e.msg.contains("out of step"), "rank {r}: {e}");
        }
        assert!(gs.iter().all(|g| g.check_healthy().is_err()));
    }

    #[test]
    fn layout_aligns_regions() {
        let mut l = Layout::default();
        assert_eq!(l.region(10), 0);
        assert_eq!(l.region(300), 256);
        assert_eq!(l.bytes(), 556);
    }

    #[test]
    fn grows_in_lockstep_and_is_reused() {
        let gs = host_groups(2);
        let ids = on_each(&gs, |_, g| {
            let _l = g.lock_collective();
            let small = ensure(g, Scratch::Workspace, 100, None).unwrap();
            let again = ensure(g, Scratch::Workspace, GROWTH_STEP, None).unwrap();
            assert!(Arc::ptr_eq(&small, &again));
            let big = ensure(g, Scratch::Workspace, GROWTH_STEP + 1, None).unwrap();
            assert_eq!(big.buffer().size(), 2 * GROWTH_STEP);
            (small.id(), big.id())
        });
        assert_eq!(ids[0], ids[1]);
        assert_ne!(ids[0].0, ids[0].1);
        gs.iter().for_each(|g| g.release_scratch());
    }

    /// The mailbox and the flags buffer are buffers of their own: the
    /// workspace's growth and use never touch them, and a new one starts
    /// zeroed on every rank.
    #[test]
    fn mailbox_and_flags_are_apart_from_the_workspace() {
        let gs = host_groups(2);
        let ids = on_each(&gs, |_, g| {
            let _l = g.lock_collective();
            let ws = ensure(g, Scratch::Workspace, 100, None).unwrap();
            let mb = ensure(g, Scratch::Mailbox, 100, None).unwrap();
            let fl = ensure(g, Scratch::Flags, 100, None).unwrap();
            assert!(ws.id() != mb.id() && mb.id() != fl.id() && fl.id() != ws.id());
            for h in [&mb, &fl] {
                // SAFETY: host memory of `size` bytes, this rank's own.
                let bytes = unsafe { std::slice::from_raw_parts(h.buffer().addr() as *const u8, h.buffer().size()) };
                assert!(bytes.iter().all(|&b| b == 0));
            }
            let ws2 = ensure(g, Scratch::Workspace, 2 * GROWTH_STEP, None).unwrap();
            let mb2 = ensure(g, Scratch::Mailbox, 2 * GROWTH_STEP, None).unwrap();
            assert!(Arc::ptr_eq(&mb2, &state::of(g).scratch(Scratch::Mailbox).unwrap()));
            assert!(
                Arc::ptr_eq(&fl, &state::of(g).scratch(Scratch::Flags).unwrap()),
                "growing the mailbox kept the flags"
            );
            (ws2.id(), mb2.id(), fl.id())
        });
        assert_eq!(ids[0], ids[1]);
        gs.iter().for_each(|g| g.release_scratch());
        let none = |g: &Arc<Group>| {
            [Scratch::Workspace, Scratch::Mailbox, Scratch::Flags].iter().all(|&k| state::of(g).scratch(k).is_none())
        };
        assert!(gs.iter().all(none));
    }

    #[test]
    fn reserve_sizes_must_match() {
        let gs = host_groups(3);
        let res = on_each(&gs, |r, g| reserve(g, if r == 2 { 8 << 20 } else { 4 << 20 }));
        for e in res {
            let e = e.unwrap_err();
            assert_eq!(e.kind, crate::error::ErrorKind::Mismatch);
            assert!(e.msg.contains("rank 0 4194304 bytes, rank 2 8388608"), "{}", e.msg);
        }
        on_each(&gs, |_, g| reserve(g, 3 << 20).unwrap());
        assert!(gs.iter().all(|g| state::of(g).scratch(Scratch::Workspace).unwrap().buffer().size() == 3 << 20));
        gs.iter().for_each(|g| g.release_scratch());
    }

    /// A buffer a caller's graph captured a call on (pinned) stays mapped
    /// when a later call grows it, since the graph replays on it, until the
    /// group is released.
    #[test]
    fn a_pinned_buffer_outlives_its_growth() {
        let gs = host_groups(2);
        let olds = on_each(&gs, |_, g| {
            let _l = g.lock_collective();
            let small = ensure(g, Scratch::Workspace, 100, None).unwrap();
            state::of(g).pin([&small]);
            let (old, addr) = (Arc::downgrade(&small), small.buffer().addr());
            drop(small);
            let big = ensure(g, Scratch::Workspace, GROWTH_STEP + 1, None).unwrap();
            let kept = old.upgrade().expect("the pinned buffer was freed when the workspace grew");
            assert!(state::of(g).is_pinned(kept.id()) && kept.id() != big.id());
            // SAFETY: the buffer is still mapped (the pin holds it).
            unsafe { std::ptr::write_volatile(addr as *mut u8, 7) };
            old
        });
        gs.iter().for_each(|g| g.release_scratch());
        assert!(olds.iter().all(|w| w.upgrade().is_none()), "released with the group");
    }
}
