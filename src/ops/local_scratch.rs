//! The workspace of a group spanning hosts: this rank's memory alone
//! (`Backend::allocate`: device memory on CUDA), where the operations
//! across hosts stage what the transports move. No peer maps it, so it
//! needs no rendezvous.

use super::Exec;
use crate::backend::{Allocation, CallTag, Stream};
use crate::error::{err, Result};
use crate::group::{Attachment, Group};
use crate::sync::lock;
use std::sync::Mutex;

/// A group [`Attachment`]: grown on demand, never shrunk.
#[derive(Default)]
pub(super) struct LocalScratch(Mutex<Held>);

#[derive(Default)]
struct Held {
    now: Option<Box<dyn Allocation>>,
    /// Whether a caller's graph captured a call on `now`.
    captured: bool,
    /// Allocations replaced after a graph captured calls on them: kept
    /// until the group is released, for the graph's replays.
    retired: Vec<Box<dyn Allocation>>,
}

/// Sizes grow in steps of this, so a run of slightly larger calls does not
/// reallocate on every one.
const GROWTH_STEP: usize = 1 << 20;

impl LocalScratch {
    /// The address of at least `bytes` of it, grown (after the work of
    /// earlier calls on `stream` is done) where smaller.
    pub(super) fn ensure(group: &Group, bytes: usize, stream: Stream) -> Result<u64> {
        let this = group.attachment::<LocalScratch>();
        let mut held = lock(&this.0);
        let capturing = group.backend().is_capturing(stream)?;
        if let Some(a) = held.now.as_ref().filter(|a| a.len() >= bytes) {
            let addr = a.addr();
            held.captured |= capturing;
            return Ok(addr);
        }
        // Whole allocation units of the backend (VMM: 2 MiB on Hopper).
        let step = GROWTH_STEP.next_multiple_of(group.backend().granularity());
        let size = bytes
            .max(1)
            .checked_next_multiple_of(step)
            .ok_or_else(|| err!(InvalidArgument, "a workspace of {bytes} bytes is too large"))?;
        if held.now.is_some() {
            group.backend().quiesce(Some(stream)).map_err(|e| e.context("growing the workspace"))?;
        }
        if let (Some(old), true) = (held.now.take(), held.captured) {
            held.retired.push(old);
        }
        let a = group.backend().allocate(size)?;
        let addr = a.addr();
        (held.now, held.captured) = (Some(a), capturing);
        Ok(addr)
    }
}

#[cfg(test)]
impl LocalScratch {
    /// Bytes held now (0 before the first call): what the calls staged.
    pub(super) fn held_bytes(group: &Group) -> usize {
        lock(&group.attachment::<LocalScratch>().0).now.as_ref().map_or(0, |a| a.len())
    }
}

impl Attachment for LocalScratch {
    /// Frees it once the work issued so far has finished (as `OpsState`).
    fn release(&self, group: &Group) {
        let mut held = lock(&self.0);
        if held.now.is_some() || !held.retired.is_empty() {
            let _ = group.backend().quiesce(None);
        }
        *held = Held::default();
    }
}

/// An execution of the agreed call tagged `tag` over this rank's workspace
/// at `base` (from [`LocalScratch::ensure`]), no peer's mapped.
pub(super) fn local_exec(group: &Group, base: u64, tag: CallTag, stream: Stream) -> Exec<'_> {
    Exec { group, base, ws: None, mailbox: None, flags: None, reduce: None, stream, tag }
}
