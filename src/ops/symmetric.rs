//! Where an operation's tensor lies when it is in symmetric memory: the
//! rendezvoused buffer and the offset there. Such a place is part of the
//! call's agreed arguments (every rank's tensor at the same offset of the
//! same buffer, or in ordinary memory on every rank), so that each rank
//! knows where its peers' tensors are without an exchange per call.

use crate::array::Array;
use crate::buffer::{find_symmetric, Handle};
use crate::error::Result;
use crate::group::Group;
use std::sync::Arc;

/// A contiguous tensor's place in a rendezvoused symmetric buffer.
#[derive(Clone)]
pub struct SymmetricPlace {
    buffer: Arc<Handle>,
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
        Some(SymmetricPlace { buffer, offset })
    }

    /// Rank `r`'s tensor at this place, as mapped here.
    pub fn on(&self, r: usize) -> Result<u64> {
        Ok(self.buffer.peer_addr(r)? + self.offset as u64)
    }

    /// The signature's text for a tensor at `place` (`None`: ordinary memory).
    pub fn describe(place: Option<&Self>) -> String {
        match place {
            Some(p) => format!("{p:?}"),
            None => "ordinary memory".to_string(),
        }
    }
}

impl std::fmt::Debug for SymmetricPlace {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "symmetric buffer {:#x} at offset {}", self.buffer.id(), self.offset)
    }
}
