//! `symm_lc_allgather`: the ranks' inputs concatenated along dimension 0
//! in rank order, as PyTorch's `_low_contention_all_gather`. Two paths,
//! chosen by `decide::decide_lc_allgather` from agreed facts only (the
//! bytes per rank, the world, whether the backend has the device-side
//! all-gather and every rank a device of its own), and put in the
//! signature:
//!
//! - **copy engines** (large messages): pure copies, each rank pulling
//!   from one peer at a time (its own input first, then the others in
//!   turn), so that on GPUs the copy engines move the peers' data, no SM
//!   is taken from concurrent compute for it (the own part, a copy within
//!   the GPU, the driver runs on SMs), and no two ranks read one peer at
//!   once. The low-contention design; it costs two barriers and a copy
//!   launch per peer, ~25 us before any byte moves.
//! - **lines** (small messages, below a few MiB per rank where the cost
//!   model, `cost::lc_allgather`, predicts it faster): one launch of the
//!   device-side all-gather (`Backend::all_gather`), the one-shot
//!   all-reduce's LL lines placed instead of summed, through the group's
//!   all-reduce buffer; no barrier, a few us. It uses SMs, but for the
//!   microseconds a small message takes, contention does not matter, and
//!   latency does. Any dtype: a copy of bytes. A rank whose input or
//!   output is strided packs (unpacks) it through the workspace around the
//!   launch; every rank lays out room for that, so that whether a rank
//!   packs is its own business.
//!
//! Copy engines: an input that is contiguous and lies in a rendezvoused
//! symmetric buffer is read by the peers in place; otherwise its rank
//! first copies it into its workspace region. Where the input lives is
//! part of the agreed arguments: every rank's input is at the same offset
//! of the same symmetric buffer, or in ordinary memory on every rank.
//! (Peers then know where to read without an exchange per call, which copy
//! engines reading a cached call need; PyTorch's rendezvous of the tensor
//! is collective for the same reason.) Whether the input is contiguous
//! there, and so read in place, is agreed too: ranks whose symmetric inputs
//! differ in that fail with `Mismatch` (a fact allowed to differ could
//! change on one rank while another repeats a call whose agreement it
//! keeps). Barriers before and
//! after the pulls keep a rank from reading an input before its owner
//! wrote it, or after its owner returned and may overwrite it.

use super::agree::Signature;
use super::decide::{decide_lc_allgather, Facts, GatherPath};
use super::symmetric::{Placed, SymmetricPlace};
use super::workspace::Layout;
use super::{check, shape_text, Exec, Prepared};
use crate::array::Array;
use crate::backend::{AllReduceLayout, Stream};
use crate::error::{err, Result};
use crate::group::Group;
use std::sync::Arc;

/// One rank's call, as read from the caller.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct LcAllgather {
    pub input: Array,
    pub output: Array,
}

/// Collective over `group`: see the module documentation. `call` is `Err`
/// when the caller's arguments could not be read; this rank still takes
/// part in the agreement so its peers fail too.
pub fn lc_allgather(group: &Arc<Group>, call: Result<LcAllgather>, stream: Stream) -> Result<()> {
    lc_allgather_by(group, call, stream, None)
}

/// [`lc_allgather`] by `path` (`None`: the decision's), for tests of
/// either path on any backend that has it.
pub(crate) fn lc_allgather_by(
    group: &Arc<Group>,
    call: Result<LcAllgather>,
    stream: Stream,
    path: Option<GatherPath>,
) -> Result<()> {
    if !group.topology().single_host() {
        return super::across_hosts::lc_allgather(group, call, stream);
    }
    let facts = Facts::of(group);
    // A contiguous input in symmetric memory is read in place (copy
    // engines), on every rank alike: where it lies is agreed.
    let (placed, symmetric) = Placed::of(group, call, |c| &c.input);
    let prepare = |Placed { call: c, .. }: Placed<LcAllgather>| {
        let bytes = c.input.numel().saturating_mul(c.input.dtype.size());
        let decision = decide_lc_allgather(&facts, bytes, path);
        let sig = c.signature(symmetric.as_ref()).arg("path", decision.as_ref().map_or("undecided", |d| d.path.name()));
        (sig, decision.and_then(|d| c.prepare(facts.world, symmetric, d.path)))
    };
    match path {
        // A call made again reuses its preparation (`memo`).
        None => super::run_prepared(group, stream, placed, prepare),
        Some(_) => super::run(group, stream, placed.map(prepare)),
    }
}

impl LcAllgather {
    pub(super) fn signature(&self, symmetric: Option<&SymmetricPlace>) -> Signature {
        Signature::new("lc_allgather")
            .arg("input.dtype", self.input.dtype)
            .arg("input.shape", shape_text(&self.input.shape))
            .arg("input memory", SymmetricPlace::describe(symmetric))
    }

    /// The checks of every gather, on one host or across hosts; the
    /// input's bytes.
    pub(super) fn check(&self, world: usize) -> Result<usize> {
        let (input, output) = (&self.input, &self.output);
        check::same_dtype(output, "output", input.dtype, "input")?;
        let mut want = input.shape.clone();
        want[0] = check::mul(want[0], world, "the gathered input")?;
        check::shape_is(output, "output", &want)?;
        check::outputs_disjoint(&[("output".into(), output)], &[("input".into(), input)])?;
        check::mul(input.numel(), input.dtype.size(), "input")
    }

    fn prepare(self, world: usize, symmetric: Option<SymmetricPlace>, path: GatherPath) -> Result<LcPrepared> {
        let staged_bytes = self.check(world)?;
        let gathered_bytes = check::mul(staged_bytes, world, "the gathered input")?;
        let in_place = symmetric.is_some();
        let mut p = LcPrepared {
            call: self,
            path,
            symmetric,
            in_place,
            world,
            staged_bytes,
            gathered_bytes,
            staged: 0,
            packed: None,
            workspace: 0,
        };
        p.lay_out();
        Ok(p)
    }
}

/// Own parts at least this large are copied on the side stream.
const SIDE_COPY_BYTES: usize = 4 << 20;

struct LcPrepared {
    call: LcAllgather,
    path: GatherPath,
    /// Where every rank's input lies in symmetric memory, if it does.
    symmetric: Option<SymmetricPlace>,
    /// Whether every rank's input is read in place there (agreed).
    in_place: bool,
    world: usize,
    staged_bytes: usize,
    /// `world` inputs.
    gathered_bytes: usize,
    /// Copy engines: workspace offset of the staged input of the other ranks.
    staged: usize,
    /// Lines: workspace offsets of the packed input and output, when a
    /// rank's are strided.
    packed: Option<(usize, usize)>,
    workspace: usize,
}

impl LcPrepared {
    /// Workspace, from agreed facts only, so every rank sizes it alike.
    /// Copy engines: the staged input, unless every rank's is read in
    /// place (then the workspace only carries the barriers). Lines: room to
    /// pack this rank's input and output (whether a rank's are strided is
    /// its own business: the small messages the lines take make the room
    /// cheaper than exchanging that fact, which would cost every call its
    /// cached agreement).
    fn lay_out(&mut self) {
        let mut layout = Layout::default();
        (self.staged, self.packed) = match self.path {
            GatherPath::CopyEngines if self.in_place => (0, None),
            GatherPath::CopyEngines => (layout.region(self.staged_bytes), None),
            GatherPath::Lines => (0, Some((layout.region(self.staged_bytes), layout.region(self.gathered_bytes)))),
        };
        self.workspace = layout.bytes();
    }

    /// The lines path: one device-side all-gather between contiguous
    /// arrays, this rank's strided input packed before it and its output
    /// unpacked after it.
    fn lines(&self, ex: &Exec<'_>) -> Result<()> {
        let LcAllgather { input, output } = &self.call;
        if self.staged_bytes == 0 {
            return Ok(());
        }
        let packed = |pick: fn((usize, usize)) -> usize| {
            let region = self.packed.ok_or_else(|| err!(Internal, "a strided lc_allgather has no packing region"))?;
            Ok::<u64, crate::error::Error>(ex.local(pick(region)))
        };
        let src = match input.is_contiguous() {
            true => input.addr,
            false => {
                let at = packed(|(i, _)| i)?;
                ex.copy(&Array::contiguous(at, input.dtype, &input.shape), input)?;
                at
            }
        };
        let dst = match output.is_contiguous() {
            true => output.addr,
            false => packed(|(_, o)| o)?,
        };
        ex.all_gather_lines(src, dst, self.staged_bytes)?;
        if !output.is_contiguous() {
            ex.copy(output, &Array::contiguous(dst, output.dtype, &output.shape))?;
        }
        Ok(())
    }
}

impl Prepared for LcPrepared {
    fn workspace_bytes(&self) -> usize {
        self.workspace
    }

    fn all_reduce_bytes(&self) -> usize {
        match self.path {
            GatherPath::Lines => AllReduceLayout::bytes_for(self.staged_bytes, self.world),
            GatherPath::CopyEngines => 0,
        }
    }

    fn replay_key(&self) -> String {
        format!(
            "{:?} by {:?} in place {:?} on ranks {:?} staged {} packed {:?}",
            self.call, self.path, self.symmetric, self.in_place, self.staged, self.packed
        )
    }

    fn execute(&self, ex: &Exec<'_>) -> Result<()> {
        if self.path == GatherPath::Lines {
            return self.lines(ex);
        }
        let LcAllgather { input, output } = &self.call;
        let source = |r: usize| -> Result<Array> {
            let addr = match &self.symmetric {
                Some(place) if self.in_place => place.on(r)?,
                _ => ex.at(r, self.staged)?,
            };
            Ok(Array::contiguous(addr, input.dtype, &input.shape))
        };
        let (me, len) = (ex.rank(), input.shape[0]);
        let own = output.narrow(0, me * len, len);
        // This rank's part comes straight from its input, or from its staged
        // copy where neither side is contiguous (no one copy maps, say, a
        // transposed input onto padded rows); a large one goes on the side
        // stream, beside the staging copy and the pulls (a small one is not
        // worth the two extra driver calls of the fork).
        let direct = input.is_contiguous() || own.is_contiguous();
        let stage = !self.in_place;
        if stage && !direct {
            ex.copy(&source(me)?, input)?;
        }
        let from = if direct { input.clone() } else { source(me)? };
        let side = if own.numel() * own.dtype.size() >= SIDE_COPY_BYTES { Some(ex.side()?) } else { None };
        match side {
            Some(side) => {
                ex.fork(side)?;
                ex.copy_on(side, &own, &from)?;
            }
            None => ex.copy(&own, &from)?,
        }
        if stage && direct {
            ex.copy(&source(me)?, input)?;
        }
        ex.barrier()?;
        for r in ex.rotation().filter(|&r| r != me) {
            ex.copy(&output.narrow(0, r * len, len), &source(r)?)?;
        }
        ex.barrier()?;
        match side {
            Some(side) => ex.join(side),
            None => Ok(()),
        }
    }
}

#[cfg(test)]
mod gpu;

#[cfg(test)]
mod tests;
