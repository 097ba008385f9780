//! All-reduce (and its rmsnorm form) and `lc_allgather` in a group
//! spanning hosts, on both backends: the one-host operations' checks and
//! epilogue (`AllReduce::check`, `AllReduce::finish`, `LcAllgather::check`),
//! with the data moving between ranks through the plans of
//! `super::hierarchy` over the group's transport across hosts
//! (`Group::across_hosts`) and the level inside each host
//! (`super::inside_host`: symmetric memory for small steps, else
//! `Group::inside_host`), staged in this rank's workspace
//! (`LocalScratch`: device memory on CUDA). Also what the operations across
//! hosts share (`transports`, `gather`, `gather_inside`, `flat`;
//! `super::across_matmul` runs the matmuls).
//!
//! The all-reduce sums level by level in the input's type (each level's
//! sum of floats of 16 bits rounds once), then the average divides the
//! total once (`AllReduce::reduce`: in f32 for floats, truncating for
//! integers). Strided tensors are staged through the workspace. Where
//! every host holds one rank of the group (the level inside a host is the
//! rank alone), the level inside is skipped: the all-reduce is one
//! all-reduce across hosts, and `lc_allgather` into a contiguous output
//! one all-gather straight into it (the members are in rank order), both
//! staging only what is strided (and the average's total). The
//! workspace is made ready before the ranks agree, so that a failure to
//! allocate it fails every rank; a call is agreed once and then kept, as on
//! one host (`agree_across_hosts`), its work across hosts watched
//! (`Group::watched`), and bad input changes nothing.

use super::agree::{agree_across_hosts, Signature};
use super::hierarchy::{piece_rows, AllReducePlan, GatherPlan, Hierarchy};
use super::inside_host::{Inside, Step};
use super::local_scratch::{local_exec, LocalScratch};
use super::workspace::Layout;
use super::{AllReduce, Exec, LcAllgather, ReduceOp};
use crate::array::Array;
use crate::backend::{CallTag, Stream};
use crate::error::{err, Result};
use crate::group::{AcrossHosts, Group};
use std::sync::Arc;

/// The group's transports across hosts and inside this rank's host,
/// whose members must be the plan's (`across`, `inside`).
pub(super) fn transports<'a>(
    group: &'a Group,
    across: &[usize],
    inside: &[usize],
) -> Result<(&'a dyn AcrossHosts, &'a dyn AcrossHosts)> {
    match (group.across_hosts(), group.inside_host()) {
        (Some(a), Some(i)) if a.members() == across && i.members() == inside => Ok((a, i)),
        _ => Err(err!(Internal, "the group's transports are not over the ranks {across:?} and {inside:?}")),
    }
}

/// A contiguous array as one run of elements.
pub(super) fn flat(a: &Array) -> Array {
    Array::contiguous(a.addr, a.dtype, &[a.numel()])
}

/// Pieces of one shape and dtype back to back in staging.
struct Staged {
    staging: u64,
    n: usize,
    dtype: crate::array::DType,
}

impl Staged {
    /// Pieces like `mine` (contiguous) at `staging`.
    fn like(mine: &Array, staging: u64) -> Staged {
        Staged { staging, n: mine.numel(), dtype: mine.dtype }
    }

    /// `count` pieces from piece `i`, as one run.
    fn at(&self, i: usize, count: usize) -> Array {
        Array::contiguous(self.staging + (i * self.n * self.dtype.size()) as u64, self.dtype, &[count * self.n])
    }

    /// Piece `i` into `dst` (its place: any strides).
    fn place(&self, ex: &Exec<'_>, dst: &Array, i: usize) -> Result<()> {
        ex.copy(dst, &Array::contiguous(self.at(i, 1).addr, self.dtype, &dst.shape))
    }
}

/// The level across hosts of [`gather`] and [`gather_remote`]: this rank's
/// piece gathered with the other hosts' into `staging` from piece `at`
/// (one per host, in host order); the staging's pieces.
fn across_first(
    ex: &Exec<'_>,
    plan: &GatherPlan,
    local: &[usize],
    staging: u64,
    piece: &dyn Fn(usize) -> Array,
    at: usize,
) -> Result<Staged> {
    let (across, _) = transports(ex.group, &plan.across, local)?;
    let mine = flat(&piece(ex.rank()));
    let s = Staged::like(&mine, staging);
    across.all_gather(ex.group, &mine, &s.at(at, plan.across.len()), ex.stream, ex.tag)?;
    Ok(s)
}

/// Every rank's piece into its place on this rank through `plan`: across
/// hosts into `staging` (one piece per host), then inside the host after
/// them (every piece, by local index then host; skipped where the rank is
/// alone on its host), then each to its place.
/// `piece(r)`: where rank r's piece goes (any strides; all of one shape and
/// dtype), except `piece(this rank)`: its piece, contiguous (already where
/// it goes, or copied there by the caller). `inside`: the level inside the
/// host, prepared by [`gather_inside`] for these pieces.
pub(super) fn gather(
    ex: &Exec<'_>,
    plan: &GatherPlan,
    inside: &Inside<'_>,
    staging: u64,
    piece: &dyn Fn(usize) -> Array,
) -> Result<()> {
    let local = plan.local_ranks();
    let (s, hosts) = (across_first(ex, plan, &local, staging, piece, 0)?, plan.across.len());
    // Alone on its host, a rank holds every piece after the first level.
    let alone = local.len() == 1;
    if !alone {
        inside.all_gather(ex.group, &s.at(0, hosts), &s.at(hosts, local.len() * hosts), ex.stream)?;
    }
    for (j, (_, pieces)) in plan.inside.iter().enumerate() {
        for (k, &rank) in pieces.iter().enumerate().filter(|&(_, &r)| r != ex.rank()) {
            s.place(ex, &piece(rank), if alone { k } else { hosts + j * hosts + k })?;
        }
    }
    Ok(())
}

/// [`gather`] in two halves, so that the pieces of this host's ranks can
/// be used while the others travel. The local half: every piece of this
/// host's ranks into its place, gathered inside the host into `staging`
/// (its first pieces). Nothing to do alone on a host.
pub(super) fn gather_local(
    ex: &Exec<'_>,
    plan: &GatherPlan,
    inside: &Inside<'_>,
    staging: u64,
    piece: &dyn Fn(usize) -> Array,
) -> Result<()> {
    let local = plan.inside.len();
    if local == 1 {
        return Ok(());
    }
    let mine = flat(&piece(ex.rank()));
    let s = Staged::like(&mine, staging);
    inside.all_gather(ex.group, &mine, &s.at(0, local), ex.stream)?;
    for (j, &(rank, _)) in plan.inside.iter().enumerate().filter(|&(_, &(r, _))| r != ex.rank()) {
        s.place(ex, &piece(rank), j)?;
    }
    Ok(())
}

/// The other half of [`gather_local`]: the pieces of the ranks on other
/// hosts. Across hosts into `staging` after the local half's (one piece
/// per host), the other hosts' packed together and gathered inside the
/// host, then each to its place.
pub(super) fn gather_remote(
    ex: &Exec<'_>,
    plan: &GatherPlan,
    inside: &Inside<'_>,
    staging: u64,
    piece: &dyn Fn(usize) -> Array,
) -> Result<()> {
    let local = plan.local_ranks();
    let hosts = plan.across.len();
    let here = plan.across.iter().position(|&r| r == ex.rank()).unwrap_or(0);
    // One piece per host, then (not alone) the other hosts' packed, then
    // every local rank's of those, by local index.
    let (first, others, gathered) = (local.len(), local.len() + hosts, local.len() + 2 * hosts - 1);
    let s = across_first(ex, plan, &local, staging, piece, first)?;
    let alone = local.len() == 1;
    if !alone {
        let (before, after) = (here, hosts - 1 - here);
        if before > 0 {
            ex.copy(&s.at(others, before), &s.at(first, before))?;
        }
        if after > 0 {
            ex.copy(&s.at(others + before, after), &s.at(first + here + 1, after))?;
        }
        inside.all_gather(ex.group, &s.at(others, hosts - 1), &s.at(gathered, local.len() * (hosts - 1)), ex.stream)?;
    }
    // Where local rank j's piece of host h lies.
    let held = |j: usize, h: usize| match alone {
        true => first + h,
        false => gathered + j * (hosts - 1) + h - usize::from(h > here),
    };
    for (j, (_, pieces)) in plan.inside.iter().enumerate() {
        for (h, &rank) in pieces.iter().enumerate().filter(|&(h, _)| h != here) {
            s.place(ex, &piece(rank), held(j, h))?;
        }
    }
    Ok(())
}

/// Pieces of staging [`gather`] needs; [`gather_local`] and
/// [`gather_remote`] together need `hosts - 1` more.
pub(super) fn gather_staging_pieces(plan: &GatherPlan, halves: bool) -> usize {
    let (local, hosts) = (plan.inside.len(), plan.across.len());
    local * hosts + hosts + if halves { hosts - 1 } else { 0 }
}

/// Collective, after the call's agreement: the level inside the host of
/// gathers of pieces of each of `piece_bytes`, whole ([`gather`]: each
/// step moves every host's piece of each rank of this host) or in
/// `halves` ([`gather_local`], [`gather_remote`]).
pub(super) fn gather_inside<'a>(
    group: &'a Arc<Group>,
    plan: &GatherPlan,
    piece_bytes: &[usize],
    halves: bool,
    tag: CallTag,
    stream: Stream,
) -> Result<Inside<'a>> {
    let local = plan.local_ranks();
    let (_, inside) = transports(group, &plan.across, &local)?;
    let hosts = plan.across.len();
    let steps: Vec<Step> = piece_bytes
        .iter()
        .flat_map(|&b| match halves {
            false => vec![Step::AllGather { bytes: hosts * b }],
            true => vec![Step::AllGather { bytes: b }, Step::AllGather { bytes: (hosts - 1) * b }],
        })
        .collect();
    Inside::prepare(group, inside, &steps, tag, stream)
}

/// Slices start 16 bytes apart at least, as NCCL's and the copies' vector
/// accesses like.
const SLICE_ALIGN_BYTES: usize = 16;

/// Where an all-reduce stages (workspace offsets).
enum Staging {
    /// Several ranks per host, the plan's levels: the input padded to a
    /// block per local rank, where the total lands too; this host's sum of
    /// this rank's block; its total.
    Levels { padded: usize, host_sum: usize, total: usize },
    /// One rank per host, one all-reduce across hosts: `sum` where the
    /// result is made when it cannot be made in the output (strided, or
    /// the norm's input), else the output; `total` where the sum lands
    /// before the average divides it, else where the result is made.
    Alone { sum: Option<usize>, total: Option<usize> },
}

pub fn all_reduce(group: &Arc<Group>, call: Result<AllReduce>, stream: Stream) -> Result<()> {
    let _lock = group.lock_collective();
    group.check_healthy()?;
    let (sig, checked) = match call {
        Ok(c) => (c.signature(None), c.check().map(|()| c)),
        Err(e) => (Signature::new("all_reduce"), Err(e)),
    };
    let ready = checked.and_then(|c| {
        let what = if c.norm.is_some() { "symm_all_reduce_rmsnorm" } else { "symm_all_reduce" };
        let h = Hierarchy::new(group.topology(), group.rank(), what)?;
        let size = c.input.dtype.size();
        let plan = AllReducePlan::new(&h, c.input.numel(), SLICE_ALIGN_BYTES.div_ceil(size));
        let mut layout = Layout::default();
        let staging = if plan.local_ranks.len() == 1 {
            // Every rank decides alike how many all-reduces it issues (one);
            // only where its data lands differs.
            let bytes = c.input.numel() * size;
            let sum = (c.norm.is_some() || !c.output.is_contiguous()).then(|| layout.region(bytes));
            let total = (c.op == ReduceOp::Avg).then(|| layout.region(bytes));
            Staging::Alone { sum, total }
        } else {
            let block = plan.block * size;
            let padded = layout.region(plan.slices.len() * block);
            Staging::Levels { padded, host_sum: layout.region(block), total: layout.region(block) }
        };
        let norm = c.norm_regions(&mut layout);
        let base = LocalScratch::ensure(group, layout.bytes(), stream)?;
        Ok((c, plan, base, staging, norm))
    });
    let tag = agree_across_hosts(group, &sig, ready.as_ref().map(|_| ()).map_err(Clone::clone))?;
    let (c, plan, base, staging, norm) = ready?;
    if c.input.numel() == 0 {
        return Ok(());
    }
    let ex = local_exec(group, base, tag, stream);
    let (across, inside) = transports(group, &plan.across, &plan.local_ranks)?;
    let (block, dtype) = (plan.block * c.input.dtype.size(), c.input.dtype);
    let steps = [Step::ReduceScatter { bytes: block, dtype }, Step::AllGather { bytes: block }];
    let inside = Inside::prepare(group, inside, &steps, tag, stream)?;
    let run = || {
        let (padded, host_sum, total) = match staging {
            Staging::Alone { sum, total } => return reduce_alone(&c, &ex, across, sum, total, norm),
            Staging::Levels { padded, host_sum, total } => (padded, host_sum, total),
        };
        let (dtype, block, world) = (c.input.dtype, plan.block, group.world());
        let run_of = |offset: usize, blocks: usize| Array::contiguous(ex.local(offset), dtype, &[blocks * block]);
        let sum = Array::contiguous(ex.local(padded), dtype, &c.input.shape);
        ex.copy(&sum, &c.input)?;
        let all = run_of(padded, plan.slices.len());
        inside.reduce_scatter(group, &all, &run_of(host_sum, 1), stream)?;
        across.all_reduce(group, &run_of(host_sum, 1), &run_of(total, 1), stream, tag)?;
        // The average divides each block's total once, before it spreads.
        let reduced = match c.op {
            ReduceOp::Sum => total,
            ReduceOp::Avg => {
                c.reduce(&ex, &run_of(host_sum, 1), &[run_of(total, 1)], world)?;
                host_sum
            }
        };
        inside.all_gather(group, &run_of(reduced, 1), &all, stream)?;
        c.finish(&ex, &sum, norm)
    };
    // A rank that stops midway leaves its peers waiting in a transport.
    let what = if c.norm.is_some() { "symm_all_reduce_rmsnorm" } else { "symm_all_reduce" };
    group.watched(stream, what, run).inspect_err(|e| group.fail(e))
}

/// The all-reduce of a rank alone on its host (`Staging::Alone`): the sum
/// across hosts straight from the input (or its contiguous copy) into the
/// output (or the workspace), the average dividing the total once, as the
/// levels do; then the outputs written from the workspace if staged there.
fn reduce_alone(
    c: &AllReduce,
    ex: &Exec<'_>,
    across: &dyn AcrossHosts,
    sum: Option<usize>,
    total: Option<usize>,
    norm: Option<(usize, usize, usize)>,
) -> Result<()> {
    let staged = |offset: usize| Array::contiguous(ex.local(offset), c.input.dtype, &c.input.shape);
    let result = sum.map_or_else(|| c.output.clone(), staged);
    let lands = total.map_or_else(|| result.clone(), staged);
    let send = match c.input.is_contiguous() {
        true => c.input.clone(),
        false => {
            ex.copy(&lands, &c.input)?;
            lands.clone()
        }
    };
    across.all_reduce(ex.group, &flat(&send), &flat(&lands), ex.stream, ex.tag)?;
    if total.is_some() {
        c.reduce(ex, &result, &[lands], ex.group.world())?;
    }
    match sum {
        Some(_) => c.finish(ex, &result, norm),
        None => Ok(()),
    }
}

pub fn lc_allgather(group: &Arc<Group>, call: Result<LcAllgather>, stream: Stream) -> Result<()> {
    let _lock = group.lock_collective();
    group.check_healthy()?;
    let (sig, checked) = match call {
        Ok(c) => (c.signature(None), c.check(group.world()).map(|bytes| (c, bytes))),
        Err(e) => (Signature::new("lc_allgather"), Err(e)),
    };
    let ready = checked.and_then(|(c, bytes)| {
        let h = Hierarchy::new(group.topology(), group.rank(), "symm_lc_allgather")?;
        let plan = GatherPlan::new(&h);
        // Alone on its host with the members in rank order, one all-gather
        // lays every piece in place; either way each rank issues the same
        // one across hosts (`gather` skips the level inside), so ranks may
        // differ in which they take.
        let direct = plan.inside.len() == 1 && plan.across.iter().copied().eq(0..h.world()) && c.output.is_contiguous();
        // This rank's input, contiguous; one piece per host, then every rank's.
        let mut layout = Layout::default();
        let staged = (!c.input.is_contiguous()).then(|| layout.region(bytes));
        let staging = (!direct).then(|| layout.region(gather_staging_pieces(&plan, false) * bytes));
        let base = LocalScratch::ensure(group, layout.bytes(), stream)?;
        Ok((c, plan, base, staged, staging))
    });
    let tag = agree_across_hosts(group, &sig, ready.as_ref().map(|_| ()).map_err(Clone::clone))?;
    let (c, plan, base, staged, staging) = ready?;
    if c.input.numel() == 0 {
        return Ok(());
    }
    let ex = local_exec(group, base, tag, stream);
    let (me, len) = (group.rank(), c.input.shape[0]);
    let inside = gather_inside(group, &plan, &[c.input.numel() * c.input.dtype.size()], false, tag, stream)?;
    let run = || {
        let mine = match staged {
            None => c.input.clone(),
            Some(at) => {
                let s = Array::contiguous(ex.local(at), c.input.dtype, &c.input.shape);
                ex.copy(&s, &c.input)?;
                s
            }
        };
        let Some(staging) = staging else {
            let (across, _) = transports(group, &plan.across, &[me])?;
            return across.all_gather(group, &flat(&mine), &flat(&c.output), stream, tag);
        };
        ex.copy(&c.output.narrow(0, piece_rows(me, len).start, len), &c.input)?;
        let place = |r: usize| if r == me { mine.clone() } else { c.output.narrow(0, piece_rows(r, len).start, len) };
        gather(&ex, &plan, &inside, ex.local(staging), &place)
    };
    group.watched(stream, "symm_lc_allgather", run).inspect_err(|e| group.fail(e))
}

#[cfg(test)]
pub(super) mod tests;

/// The watchdog of a CUDA group on pretend hosts (NCCL between them): a
/// kept call whose peer never comes ends at the group's timeout, and an
/// abort ends it at once; either way the stream goes on and later calls
/// are refused. Named `gpu_*`; skipped without two GPUs or NCCL.
#[cfg(test)]
mod gpu_tests;
