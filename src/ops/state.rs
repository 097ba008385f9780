//! What the operations keep per group between calls (a group
//! [`Attachment`]): the symmetric scratch buffers they move data through,
//! the call signatures every rank agreed on, and the calls prepared under
//! them (see `agree` and `memo`).

use crate::backend::CallTag;
use crate::buffer::Handle;
use crate::group::{Attachment, Group};
use crate::sync::lock;
use std::any::Any;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// The symmetric buffers the operations keep per group.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scratch {
    /// Staging and scratch that every call reuses.
    Workspace = 0,
    /// The fused reduce-scatter's inboxes, which the peers' kernels push
    /// into: no other work may write this memory.
    Mailbox = 1,
    /// The fused reduce-scatter's state: the count of calls (which lets
    /// one call follow another with no barrier) and the tile flags, every
    /// word an epoch no later than the last call's, whatever the shape.
    /// A buffer of its own: laid out by the call's shape in the mailbox,
    /// one shape's flags lay where another shape's peers had pushed
    /// partials, which then read as flags already set.
    Flags = 2,
    /// The device-side all-reduce's buffer (and `lc_allgather`'s lines'):
    /// its count of calls, the flags and the data lines they number
    /// (`backend::AllReduceLayout`). No other work writes it, so calls of
    /// any size and either operation follow one another with no barrier.
    AllReduce = 3,
}

impl Scratch {
    const COUNT: usize = 4;
}

/// A workload cycling through more distinct calls than this re-agrees
/// after each wrap-around; memory stays bounded.
pub const MAX_AGREED: usize = 1024;

/// A call the operations prepared (see `memo`), type-erased.
pub type Prepared = Arc<dyn Any + Send + Sync>;

#[derive(Default)]
pub struct OpsState {
    /// This rank's collective calls so far: the ranks make them in the
    /// same order, so a number names the same call on every rank.
    calls: AtomicU64,
    /// Signatures of calls all ranks agreed on, so that repeats skip the
    /// exchange. Every rank inserts and clears in the same order (inserts
    /// follow an exchange all ranks took part in), so the sets stay equal.
    /// Keyed by the encoded signature, the same on every rank; each with
    /// its call's tag, made once.
    agreed: Mutex<HashMap<Vec<u8>, CallTag>>,
    /// Prepared calls by a hash of their arguments. Each stands for a
    /// signature in `agreed`, so both are emptied together.
    prepared: Mutex<HashMap<u64, Vec<Prepared>>>,
    /// The scratch buffers by [`Scratch`], grown collectively on demand.
    /// They refer back to the group, so `release` breaks the cycle when the
    /// caller gives the group up.
    scratch: [Mutex<Option<Arc<Handle>>>; Scratch::COUNT],
    /// Scratch buffers a caller's graph captured a call with, by id: held
    /// until the group is released, so that a scratch buffer grown later
    /// does not free memory the graph's replays still use.
    pinned: Mutex<HashMap<u64, Arc<Handle>>>,
}

impl Attachment for OpsState {
    /// Frees the scratch buffers once the work issued so far has finished
    /// (it may still use them). They are freed even if waiting fails: the
    /// device is then broken, and its next call says so.
    fn release(&self, group: &Group) {
        if self.scratch.iter().any(|s| lock(s).is_some()) || !lock(&self.pinned).is_empty() {
            let _ = group.backend().quiesce(None);
        }
        self.scratch.iter().for_each(|s| drop(lock(s).take()));
        lock(&self.pinned).clear();
    }
}

/// The operations' state of `group`.
pub fn of(group: &Group) -> Arc<OpsState> {
    group.attachment::<OpsState>()
}

impl OpsState {
    /// The number of the call starting now (from 1).
    pub fn next_call(&self) -> u64 {
        self.calls.fetch_add(1, Ordering::Relaxed) + 1
    }

    /// The tag of this signature if every rank agreed on it before.
    pub fn agreed_tag(&self, signature: &[u8]) -> Option<CallTag> {
        lock(&self.agreed).get(signature).copied()
    }

    #[cfg(test)]
    fn is_agreed(&self, signature: &[u8]) -> bool {
        self.agreed_tag(signature).is_some()
    }

    /// Records a signature every rank just agreed on (call on every rank,
    /// right after the exchange that showed the agreement); whether it is
    /// new.
    pub fn mark_agreed(&self, signature: Vec<u8>) -> bool {
        let mut agreed = lock(&self.agreed);
        if agreed.len() >= MAX_AGREED {
            agreed.clear();
            // A prepared call skips the agreement as its signature is agreed.
            lock(&self.prepared).clear();
        }
        let tag = CallTag::of(&signature);
        agreed.insert(signature, tag).is_none()
    }

    /// The calls prepared under `hash` (see [`OpsState::keep_prepared`]).
    pub fn prepared(&self, hash: u64) -> Vec<Prepared> {
        lock(&self.prepared).get(&hash).cloned().unwrap_or_default()
    }

    /// Keeps a call prepared, checked and agreed on (its signature is in
    /// the agreed set now), under a hash of its arguments, for identical
    /// calls to reuse.
    pub fn keep_prepared(&self, hash: u64, call: Prepared) {
        let mut prepared = lock(&self.prepared);
        if prepared.len() >= MAX_AGREED {
            prepared.clear();
        }
        prepared.entry(hash).or_default().push(call);
    }

    /// The scratch buffer of `kind`, if one was made.
    pub fn scratch(&self, kind: Scratch) -> Option<Arc<Handle>> {
        lock(&self.scratch[kind as usize]).clone()
    }

    /// Replaces a scratch buffer (the old one is freed once no call uses it).
    pub fn set_scratch(&self, kind: Scratch, h: Arc<Handle>) {
        *lock(&self.scratch[kind as usize]) = Some(h);
    }

    /// Forgets a scratch buffer (freed once no call uses it, unless pinned).
    pub fn clear_scratch(&self, kind: Scratch) {
        *lock(&self.scratch[kind as usize]) = None;
    }

    /// Holds `handles` until the group is released: a caller's graph
    /// captured a call that uses them.
    pub fn pin<'a>(&self, handles: impl IntoIterator<Item = &'a Arc<Handle>>) {
        let mut pinned = lock(&self.pinned);
        for h in handles {
            pinned.entry(h.id()).or_insert_with(|| h.clone());
        }
    }

    /// Whether the buffer `id` is pinned (see [`OpsState::pin`]).
    #[cfg(test)]
    pub fn is_pinned(&self, id: u64) -> bool {
        lock(&self.pinned).contains_key(&id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::testing::host_groups;

    /// Prepared calls stand for agreed signatures: when the agreed set
    /// wraps around, they are forgotten with it.
    #[test]
    fn prepared_calls_are_forgotten_with_the_agreed_signatures() {
        let g = host_groups(1).pop().unwrap();
        let s = of(&g);
        s.keep_prepared(7, Arc::new(1u8));
        s.keep_prepared(7, Arc::new(2u8));
        assert_eq!(s.prepared(7).len(), 2);
        assert!(s.prepared(8).is_empty());
        for i in 0..MAX_AGREED {
            assert!(s.mark_agreed(i.to_le_bytes().to_vec()));
            assert!(i + 1 == MAX_AGREED || !s.mark_agreed(i.to_le_bytes().to_vec()), "agreed before");
        }
        assert_eq!(of(&g).prepared(7).len(), 2, "the agreed set has not wrapped yet");
        s.mark_agreed(b"one more".to_vec());
        assert!(s.prepared(7).is_empty());
        assert!(s.is_agreed(b"one more") && !s.is_agreed(&0usize.to_le_bytes()));
    }
}
