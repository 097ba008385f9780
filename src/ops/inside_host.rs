//! The level inside a host of the operations across hosts: each
//! all-gather or reduce-scatter among this host's ranks runs on symmetric
//! memory where that pays, on the LL lines of the device-side collectives
//! (`Backend::all_gather`, `Backend::reduce_scatter`) through the group's
//! all-reduce buffer, which a rendezvous maps among the ranks of each host
//! only; else on the group's transport inside the host (NCCL on CUDA).
//! `decide::inside_on_lines` chooses per step from its size, so every rank
//! of a host takes the same path and the buffer counts the same calls.
//!
//! The all-reduce buffer of a group spanning hosts serves these steps
//! alone (the one-host operations never run there), laid out for the
//! host's ranks (`AllReduceLayout::of(bytes, local world)`).

use super::decide::{all_gather_kernel, inside_on_lines, Facts, InsideStep};
use super::state::Scratch;
use super::workspace;
use crate::array::{Array, DType};
use crate::backend::{AllGatherCall, AllReduceAlgorithm, AllReduceLayout, CallTag, ReduceScatterCall, Stream};
use crate::buffer::Handle;
use crate::error::Result;
use crate::group::{check_transport as check, AcrossHosts, Group, TransportCollective as Collective};
use std::sync::Arc;

/// One step the call may take inside the host, with its bytes per rank
/// (each piece gathered, each chunk reduced).
#[derive(Clone, Copy, Debug)]
pub(super) enum Step {
    AllGather { bytes: usize },
    ReduceScatter { bytes: usize, dtype: DType },
}

/// This call's level inside the host: the transport, and the lines where
/// any of the call's steps takes them.
pub(super) struct Inside<'a> {
    transport: &'a dyn AcrossHosts,
    lines: Option<Lines>,
    /// The call's tag, which its lines carry.
    tag: CallTag,
}

struct Lines {
    facts: Facts,
    buffer: Arc<Handle>,
    /// Where each rank of this host maps the buffer, by local index.
    scratch: Vec<u64>,
    index: usize,
}

/// Whether a step moves on the lines, and its bytes: chosen by the cost
/// model, within what the kernels take (a reduce-scatter sums floats of
/// whole 8-byte lines).
fn on_lines(facts: &Facts, local_world: usize, s: Step) -> (bool, usize) {
    let (what, bytes, fits) = match s {
        Step::AllGather { bytes } => (InsideStep::AllGather, bytes, true),
        Step::ReduceScatter { bytes, dtype } => {
            (InsideStep::ReduceScatter, bytes, matches!(dtype, DType::F32 | DType::BF16 | DType::F16) && bytes % 8 == 0)
        }
    };
    (fits && inside_on_lines(facts, local_world, what, bytes), bytes)
}

impl<'a> Inside<'a> {
    /// Collective, after the call's agreement (every rank passes the same
    /// `steps`): the level over `transport`, whose members are this host's
    /// ranks, with the all-reduce buffer grown to hold the largest step
    /// that takes the lines; `tag`: the agreed call's.
    pub(super) fn prepare(
        group: &Arc<Group>,
        transport: &'a dyn AcrossHosts,
        steps: &[Step],
        tag: CallTag,
        stream: Stream,
    ) -> Result<Inside<'a>> {
        let local = transport.members();
        if local.len() < 2 {
            // Alone on its host (the common case): no step inside it.
            return Ok(Inside { transport, lines: None, tag });
        }
        let facts = Facts::of(group);
        let largest = steps.iter().map(|&s| on_lines(&facts, local.len(), s)).filter(|l| l.0).map(|l| l.1).max();
        let lines = match largest {
            None => None,
            Some(bytes) => {
                let need = AllReduceLayout::bytes_for(bytes, local.len());
                let buffer = workspace::ensure(group, Scratch::AllReduce, need, Some(stream))?;
                if group.backend().is_capturing(stream)? {
                    // The caller's graph replays on it: keep it when it grows.
                    super::state::of(group).pin([&buffer]);
                }
                let scratch = local.iter().map(|&r| buffer.peer_addr(r)).collect::<Result<_>>()?;
                let index = local.iter().position(|&r| r == group.rank()).unwrap_or(0);
                Some(Lines { facts, buffer, scratch, index })
            }
        };
        Ok(Inside { transport, lines, tag })
    }

    /// The lines, where `s` takes them (and the buffer holds it).
    fn lines_for(&self, s: Step) -> Option<&Lines> {
        let world = self.transport.members().len();
        let l = self.lines.as_ref()?;
        let (lines, bytes) = on_lines(&l.facts, world, s);
        (lines && AllReduceLayout::of(l.buffer.buffer().size(), world).holds(bytes)).then_some(l)
    }

    /// As `AcrossHosts::all_gather` over this host's ranks.
    pub(super) fn all_gather(&self, group: &Group, send: &Array, recv: &Array, stream: Stream) -> Result<()> {
        let bytes = send.numel() * send.dtype.size();
        let Some(l) = self.lines_for(Step::AllGather { bytes }) else {
            return self.transport.all_gather(group, send, recv, stream, self.tag);
        };
        check(Collective::AllGather, send, recv, l.scratch.len())?;
        let call = AllGatherCall {
            algorithm: all_gather_kernel(bytes, l.scratch.len()).0,
            rank: l.index,
            world: l.scratch.len(),
            bytes,
            input: send.addr,
            output: recv.addr,
            scratch: l.scratch.clone(),
            scratch_bytes: l.buffer.buffer().size(),
            timeout: group.timeout(),
            tag: self.tag,
        };
        group.backend().all_gather(&call, stream)
    }

    /// As `AcrossHosts::reduce_scatter` over this host's ranks.
    pub(super) fn reduce_scatter(&self, group: &Group, send: &Array, recv: &Array, stream: Stream) -> Result<()> {
        let bytes = recv.numel() * recv.dtype.size();
        let step = Step::ReduceScatter { bytes, dtype: recv.dtype };
        // The staging this sends from is 256-byte aligned on every rank, as
        // the lines want (`ReduceScatterCall::check` refuses otherwise).
        let Some(l) = self.lines_for(step) else {
            return self.transport.reduce_scatter(group, send, recv, stream, self.tag);
        };
        check(Collective::ReduceScatter, send, recv, l.scratch.len())?;
        // The lines, as `on_lines` estimated them.
        let call = ReduceScatterCall {
            algorithm: AllReduceAlgorithm::OneShot,
            rank: l.index,
            world: l.scratch.len(),
            dtype: recv.dtype,
            n: recv.numel(),
            input: send.addr,
            chunk_stride: bytes,
            output: recv.addr,
            scale: 1.0,
            scratch: l.scratch.clone(),
            scratch_bytes: l.buffer.buffer().size(),
            timeout: group.timeout(),
            tag: self.tag,
        };
        group.backend().reduce_scatter(&call, stream)
    }
}
