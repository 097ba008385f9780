//! Where an operation's tensor lies when it is in symmetric memory: the
//! rendezvoused buffer and the offset there. Such a place is part of the
//! call's agreed arguments (every rank's tensor at the same offset of the
//! same buffer, or in ordinary memory on every rank), so that each rank
//! knows where its peers' tensors are without an exchange per call.

use crate::array::Array;
use crate::buffer::{find_symmetric, Handle};
use crate::error::{err, Result};
use crate::group::Group;
use std::sync::{Arc, Weak};

/// A contiguous tensor's place in a rendezvoused symmetric buffer. Held
/// weakly: a call kept for reuse (`memo`) must not keep the caller's
/// buffer alive or findable after the caller released it.
#[derive(Clone)]
pub struct SymmetricPlace {
    buffer: Weak<Handle>,
    id: u64,
    offset: usize,
}

impl SymmetricPlace {
    /// `t`'s place, when it is contiguous in one of `group`'s rendezvoused
    /// buffers.
    pub fn of(group: &Group, t: &Array) -> Option<Self> {
        if !t.is_contiguous() {
            return None;
        }
        Self::holding(group, t)
    }

    /// Where `t` starts, when all of it lies in one of `group`'s
    /// rendezvoused buffers (whatever its strides).
    pub fn holding(group: &Group, t: &Array) -> Option<Self> {
        let buffer = find_symmetric(group, t.byte_range())?;
        let offset = (t.addr - buffer.buffer().addr()) as usize;
        Some(SymmetricPlace { buffer: Arc::downgrade(&buffer), id: buffer.id(), offset })
    }

    /// Rank `r`'s tensor at this place, as mapped here.
    pub fn on(&self, r: usize) -> Result<u64> {
        let buffer = self.buffer.upgrade().ok_or_else(|| {
            err!(InvalidArgument, "symmetric buffer {:#x} was released while an operation read it", self.id)
        })?;
        Ok(buffer.peer_addr(r)? + self.offset as u64)
    }

    /// The buffer's id and the offset: equal for equal places.
    fn key(&self) -> (u64, usize) {
        (self.id, self.offset)
    }

    /// The signature's text for a tensor at `place` (`None`: ordinary memory).
    pub fn describe(place: Option<&Self>) -> String {
        match place {
            Some(p) => format!("{p:?}"),
            None => "ordinary memory".to_string(),
        }
    }
}

/// A call and where one of its tensors lies: which buffers are live decides
/// that, so a kept call (`memo`) is found again only for the same place.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Placed<C> {
    pub call: C,
    place: Option<(u64, usize)>,
}

impl<C> Placed<C> {
    /// `call` and the place of its tensor `tensor(call)`, if symmetric.
    pub fn of(group: &Group, call: Result<C>, tensor: impl Fn(&C) -> &Array) -> (Result<Self>, Option<SymmetricPlace>) {
        match call {
            Ok(call) => {
                let place = SymmetricPlace::of(group, tensor(&call));
                (Ok(Placed { place: place.as_ref().map(SymmetricPlace::key), call }), place)
            }
            Err(e) => (Err(e), None),
        }
    }
}

impl std::fmt::Debug for SymmetricPlace {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "symmetric buffer {:#x} at offset {}", self.id, self.offset)
    }
}

/// How the peers use a rank's tensor that lies in symmetric memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PeerAccess {
    /// The peers read it where it is (no staging copy into the workspace).
    Read,
    /// The peers may write into it where it is.
    Write,
}

/// One argument an operation uses in place when it lies in a rendezvoused
/// symmetric buffer (at the same offset on every rank; contiguous, except
/// `lc_allgather`'s input, read in place from each rank whose input there
/// is contiguous).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SymmetricArg {
    /// The parameter's name in `include/symm.h`.
    pub name: &'static str,
    pub access: PeerAccess,
}

const fn arg(name: &'static str, access: PeerAccess) -> SymmetricArg {
    SymmetricArg { name, access }
}

/// Every operation (its C name without `symm_`) and the arguments it uses
/// in place from symmetric memory: what the `SymmetricPlace` lookups of
/// each operation's module do, in one table for frameworks that choose
/// where to allocate (a compiler placing buffers in symmetric memory).
pub const SYMMETRIC_ARGS: &[(&str, &[SymmetricArg])] = &[
    ("fused_ag_mm", &[arg("a_shard", PeerAccess::Read)]),
    ("mm_rs", &[arg("out", PeerAccess::Write)]),
    ("lc_allgather", &[arg("input", PeerAccess::Read)]),
    ("all_reduce", &[arg("input", PeerAccess::Read)]),
    ("all_reduce_rmsnorm", &[arg("input", PeerAccess::Read)]),
];

/// The arguments `operation` uses in place from symmetric memory, or
/// `None` for an unknown operation.
pub fn symmetric_args(operation: &str) -> Option<&'static [SymmetricArg]> {
    SYMMETRIC_ARGS.iter().find(|(op, _)| *op == operation).map(|(_, args)| *args)
}
