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
use crate::backend::Stream;
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
    across.all_gather(ex.group, &mine, &s.at(at, plan.across.len()), ex.stream)?;
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
    Inside::prepare(group, inside, &steps, stream)
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
    agree_across_hosts(group, &sig, ready.as_ref().map(|_| ()).map_err(Clone::clone))?;
    let (c, plan, base, staging, norm) = ready?;
    if c.input.numel() == 0 {
        return Ok(());
    }
    let ex = local_exec(group, base, stream);
    let (across, inside) = transports(group, &plan.across, &plan.local_ranks)?;
    let (block, dtype) = (plan.block * c.input.dtype.size(), c.input.dtype);
    let steps = [Step::ReduceScatter { bytes: block, dtype }, Step::AllGather { bytes: block }];
    let inside = Inside::prepare(group, inside, &steps, stream)?;
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
        across.all_reduce(group, &run_of(host_sum, 1), &run_of(total, 1), stream)?;
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
    across.all_reduce(ex.group, &flat(&send), &flat(&lands), ex.stream)?;
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
    agree_across_hosts(group, &sig, ready.as_ref().map(|_| ()).map_err(Clone::clone))?;
    let (c, plan, base, staged, staging) = ready?;
    if c.input.numel() == 0 {
        return Ok(());
    }
    let ex = local_exec(group, base, stream);
    let (me, len) = (group.rank(), c.input.shape[0]);
    let inside = gather_inside(group, &plan, &[c.input.numel() * c.input.dtype.size()], false, stream)?;
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
            return across.all_gather(group, &flat(&mine), &flat(&c.output), stream);
        };
        ex.copy(&c.output.narrow(0, piece_rows(me, len).start, len), &c.input)?;
        let place = |r: usize| if r == me { mine.clone() } else { c.output.narrow(0, piece_rows(r, len).start, len) };
        gather(&ex, &plan, &inside, ex.local(staging), &place)
    };
    group.watched(stream, "symm_lc_allgather", run).inspect_err(|e| group.fail(e))
}

#[cfg(test)]
pub(super) mod tests {
    use super::super::testing::{host_groups, on_each, on_hosts, on_hosts_with};
    use super::super::{all_reduce as all_reduce_op, lc_allgather as lc_allgather_op, Norm};
    use super::*;
    use crate::array::DType;
    use crate::error::ErrorKind;
    use std::sync::Arc;

    pub(in crate::ops) const PLACEMENTS: &[&[&str]] =
        &[&["a", "b"], &["a", "b", "a", "b"], &["a", "a", "b", "b"], &["b", "a", "a", "b"], &["a", "b", "c", "d"]];

    /// World 8: two hosts of four, four hosts of two (interleaved).
    pub(in crate::ops) const PLACEMENTS_8: &[&[&str]] =
        &[&["a", "a", "a", "a", "b", "b", "b", "b"], &["a", "b", "c", "d", "a", "b", "c", "d"]];

    fn arr<T>(v: &[T], dtype: DType, shape: &[usize]) -> Array {
        Array::contiguous(v.as_ptr() as u64, dtype, shape)
    }

    /// Every rank's all-reduce output, f32 (sum or average) and i32 (sum).
    fn reduce_on(groups: &[Arc<Group>], shape: &[usize], op: ReduceOp) -> Vec<(Vec<f32>, Vec<i32>)> {
        let n: usize = shape.iter().product();
        on_each(groups, |r, g| {
            let input: Vec<f32> = (0..n).map(|i| (r * 100 + i) as f32 - 50.0).collect();
            let output = vec![f32::NAN; n];
            let call = AllReduce {
                input: arr(&input, DType::F32, shape),
                output: arr(&output, DType::F32, shape),
                op,
                norm: None,
                algorithm: None,
            };
            all_reduce_op(g, Ok(call), Stream(0)).unwrap();
            let input: Vec<i32> = (0..n).map(|i| i32::MAX - (r * 7 + i) as i32).collect();
            let out = vec![-1i32; n];
            let call = AllReduce {
                input: arr(&input, DType::I32, shape),
                output: arr(&out, DType::I32, shape),
                op: ReduceOp::Sum,
                norm: None,
                algorithm: None,
            };
            all_reduce_op(g, Ok(call), Stream(0)).unwrap();
            (output, out)
        })
    }

    /// Against a reference in f64 (exact here) and the one-host group's
    /// result, at worlds 2 and 4, sizes that do not split evenly.
    #[test]
    fn all_reduce_matches_one_host() {
        all_reduce_matches_one_host_on(PLACEMENTS);
    }

    /// World 8 (see `PLACEMENTS_8`): the all-reduce and the gather as one
    /// host computes them.
    #[test]
    fn all_reduce_and_gather_at_world_8_match_one_host() {
        all_reduce_matches_one_host_on(PLACEMENTS_8);
        for hosts in PLACEMENTS_8 {
            let (groups, one) = (on_hosts(hosts), host_groups(8));
            for rows in [1, 2] {
                assert_eq!(gather_on(&groups, rows), gather_on(&one, rows), "{hosts:?} rows {rows}");
            }
        }
    }

    fn all_reduce_matches_one_host_on(placements: &[&[&str]]) {
        for hosts in placements {
            let world = hosts.len();
            let groups = on_hosts(hosts);
            let one = host_groups(world);
            for shape in [&[7][..], &[3, 5], &[1]] {
                let n: usize = shape.iter().product();
                for op in [ReduceOp::Sum, ReduceOp::Avg] {
                    let got = reduce_on(&groups, shape, op);
                    let want = reduce_on(&one, shape, op);
                    let scale = if op == ReduceOp::Avg { world as f64 } else { 1.0 };
                    let reference: Vec<f32> = (0..n)
                        .map(|i| ((0..world).map(|r| (r * 100 + i) as f64 - 50.0).sum::<f64>() / scale) as f32)
                        .collect();
                    let ints: Vec<i32> = (0..n)
                        .map(|i| (0..world).fold(0i32, |s, r| s.wrapping_add(i32::MAX - (r * 7 + i) as i32)))
                        .collect();
                    for r in 0..world {
                        assert_eq!(got[r].0, reference, "{hosts:?} {shape:?} {op:?} rank {r}");
                        assert_eq!(got[r].0, want[r].0);
                        assert_eq!(got[r].1, ints, "{hosts:?} {shape:?} int32 rank {r}");
                        assert_eq!(got[r].1, want[r].1);
                    }
                }
            }
            // The workspace of the one-host group holds it.
            one.iter().for_each(|g| g.release_scratch());
        }
    }

    fn gather_on(groups: &[Arc<Group>], rows: usize) -> Vec<Vec<f32>> {
        let world = groups.len();
        on_each(groups, |r, g| {
            let input: Vec<f32> = (0..rows * 3).map(|i| (r * 1000 + i) as f32 + 0.25).collect();
            let output = vec![f32::NAN; world * rows * 3];
            let call = LcAllgather {
                input: arr(&input, DType::F32, &[rows, 3]),
                output: arr(&output, DType::F32, &[world * rows, 3]),
            };
            lc_allgather_op(g, Ok(call), Stream(0)).unwrap();
            output
        })
    }

    /// Rank order whatever the placement, as on one host.
    #[test]
    fn lc_allgather_matches_one_host() {
        for hosts in PLACEMENTS {
            let world = hosts.len();
            let (groups, one) = (on_hosts(hosts), host_groups(world));
            for rows in [1, 2] {
                let want: Vec<f32> =
                    (0..world).flat_map(|r| (0..rows * 3).map(move |i| (r * 1000 + i) as f32 + 0.25)).collect();
                let single = gather_on(&one, rows);
                for (r, got) in gather_on(&groups, rows).iter().enumerate() {
                    assert_eq!(got, &want, "{hosts:?} rows {rows} rank {r}");
                    assert_eq!(got, &single[r]);
                }
            }
            one.iter().for_each(|g| g.release_scratch());
        }
    }

    /// The all-reduce (sum) of `input` (f32) on this rank, into a poisoned output.
    fn summed(g: &Arc<Group>, input: &[f32]) -> Result<Vec<f32>> {
        let n = input.len();
        let output = vec![f32::NAN; n];
        let call = AllReduce {
            input: arr(input, DType::F32, &[n]),
            output: arr(&output, DType::F32, &[n]),
            op: ReduceOp::Sum,
            norm: None,
            algorithm: None,
        };
        all_reduce_op(g, Ok(call), Stream(0)).map(|()| output)
    }

    /// The all-reduce (sum) of `n` ones on this rank.
    fn sum_of_ones(g: &Arc<Group>, n: usize) -> Result<Vec<f32>> {
        summed(g, &vec![1f32; n])
    }

    /// The level inside a host moves each step on the LL lines (counted in
    /// every rank's all-reduce buffer) where `decide::inside_on_lines`
    /// takes them: both steps of a small all-reduce, the gather alone of a
    /// middling one, neither of a large one, never for ranks alone on
    /// their hosts; every result equals one host's.
    #[test]
    fn the_level_inside_a_host_takes_the_lines_for_small_steps() {
        use super::super::decide::{inside_on_lines, Facts, InsideStep};
        use super::super::testing::lines_buffer;
        for hosts in [&["a", "a", "b", "b"], &["a", "b", "a", "b"], &["a", "b", "c", "d"]] {
            let (groups, one) = (on_hosts(hosts), host_groups(4));
            let local = groups[0].topology().local_world();
            for (n, lines_if_shared) in [(64, 2), (1 << 17, 1), (1 << 20, 0)] {
                let input = |r: usize| (0..n).map(|i| ((r * 7 + i) % 13) as f32 - 6.0).collect::<Vec<f32>>();
                let want = on_each(&one, |r, g| summed(g, &input(r)).unwrap());
                let counts = on_each(&groups, |r, g| {
                    let before = lines_buffer(g);
                    assert_eq!(summed(g, &input(r)).unwrap(), want[r], "{hosts:?} n {n} rank {r}");
                    match (before, lines_buffer(g)) {
                        (Some((id, was)), Some((now_id, now))) if id == now_id => now - was,
                        (_, after) => after.map_or(0, |(_, now)| now), // a new buffer counts from 0
                    }
                });
                let block = n / local * 4;
                let facts = Facts::of(&groups[0]);
                let chosen = [InsideStep::ReduceScatter, InsideStep::AllGather]
                    .into_iter()
                    .filter(|&s| inside_on_lines(&facts, local, s, block))
                    .count() as u32;
                let expected = if local == 1 { 0 } else { lines_if_shared };
                assert_eq!((chosen, counts), (expected, vec![expected; 4]), "{hosts:?} n {n}");
            }
        }
    }

    /// A call that differs between ranks, or hosts of unequal sizes, fail
    /// on every rank; the group stays usable after a mismatch.
    #[test]
    fn mismatch_and_unequal_hosts_fail_every_rank() {
        let groups = on_hosts(&["a", "b", "a", "b"]);
        let errs = on_each(&groups, |r, g| sum_of_ones(g, if r == 2 { 5 } else { 4 }).unwrap_err());
        for e in errs {
            assert_eq!(e.kind, ErrorKind::Mismatch, "{}", e.msg);
        }
        assert!(gather_on(&groups, 1)[3].iter().all(|v| !v.is_nan()));
        let uneven = on_hosts(&["a", "a", "b"]);
        for e in on_each(&uneven, |_, g| {
            let (input, output) = (vec![1f32; 2], vec![f32::NAN; 6]);
            let call = LcAllgather { input: arr(&input, DType::F32, &[2]), output: arr(&output, DType::F32, &[6]) };
            lc_allgather_op(g, Ok(call), Stream(0)).unwrap_err()
        }) {
            assert_eq!(e.kind, ErrorKind::Unsupported);
            assert!(e.msg.contains("different numbers of ranks"), "{}", e.msg);
        }
    }

    /// A kept call (agreed before) that one rank alone changes: that rank
    /// agrees while its peers move data, and every rank fails instead of
    /// reading the other's bytes: with `Mismatch` (out of step) where all
    /// meet in an exchange; where the changed rank's partner on its host
    /// waits for it on the LL lines they share, that one at the group's
    /// timeout (as on one host), and the ranks waiting for it in an
    /// exchange likewise, or sooner with the first of them to fail
    /// (`Remote`). The group then refuses every call. Checking every call
    /// keeps it usable.
    #[test]
    fn a_kept_call_changed_on_one_rank_fails_every_rank() {
        for (hosts, always) in
            [(&["a", "b", "c", "d"], false), (&["a", "b", "a", "b"], false), (&["a", "b", "a", "b"], true)]
        {
            let groups = on_hosts_with(hosts, always);
            let call = sum_of_ones;
            let got = on_each(&groups, |r, g| {
                let first = call(g, 4).unwrap();
                let changed = call(g, if r == 2 { 5 } else { 4 });
                (first, changed, call(g, 4))
            });
            for (r, (first, changed, after)) in got.into_iter().enumerate() {
                assert_eq!(first, vec![4.0; 4]);
                let e = changed.unwrap_err();
                let lines = !always && hosts[0] == hosts[2];
                match e.kind {
                    ErrorKind::Mismatch => assert!(always || e.msg.contains("out of step"), "{}", e.msg),
                    // Whichever rank's wait ends first fails the others with `Remote`.
                    ErrorKind::Timeout | ErrorKind::Remote => assert!(lines, "rank {r} on {hosts:?}: {}", e.msg),
                    _ => panic!("rank {r} on {hosts:?}: {:?} {}", e.kind, e.msg),
                }
                match (always, after) {
                    (true, after) => assert_eq!(after.unwrap(), vec![4.0; 4]),
                    (false, after) => assert_eq!(after.unwrap_err().kind, ErrorKind::Aborted),
                }
            }
        }
    }

    /// A `[rows, cols]` tensor in host memory whose rows are `ld` elements
    /// apart (`ld > cols`: strided), every byte poisoned (0xa5) first.
    struct M {
        _data: Vec<u64>,
        a: Array,
    }

    impl M {
        fn new(dtype: DType, rows: usize, cols: usize, ld: usize, fill: impl Fn(usize) -> f64) -> M {
            let data = vec![u64::from_ne_bytes([0xa5; 8]); (rows * ld * dtype.size()).div_ceil(8) + 1];
            let a = Array { addr: data.as_ptr() as u64, dtype, shape: vec![rows, cols], strides: vec![ld, 1] };
            let m = M { _data: data, a };
            (0..rows * cols).for_each(|i| m.set(i, fill(i)));
            m
        }

        fn at(&self, i: usize) -> *mut u8 {
            let (row, col) = (i / self.a.shape[1], i % self.a.shape[1]);
            (self.a.addr as usize + (row * self.a.strides[0] + col) * self.a.dtype.size()) as *mut u8
        }

        fn set(&self, i: usize, v: f64) {
            let p = self.at(i);
            // SAFETY: inside `_data`, which this tensor owns.
            unsafe {
                match self.a.dtype {
                    DType::F32 => (p as *mut f32).write_unaligned(v as f32),
                    DType::BF16 => (p as *mut u16).write_unaligned(half::bf16::from_f64(v).to_bits()),
                    DType::I8 => (p as *mut i8).write(v as i8),
                    DType::U8 => p.write(v as u8),
                    DType::I32 => (p as *mut i32).write_unaligned(v as i32),
                    DType::I64 => (p as *mut i64).write_unaligned(v as i64),
                    d => panic!("{d}"),
                }
            }
        }

        fn get(&self, i: usize) -> f64 {
            let p = self.at(i);
            // SAFETY: as in `set`.
            unsafe {
                match self.a.dtype {
                    DType::F32 => (p as *const f32).read_unaligned() as f64,
                    DType::BF16 => half::bf16::from_bits((p as *const u16).read_unaligned()).to_f64(),
                    DType::I8 => (p as *const i8).read() as f64,
                    DType::U8 => p.read() as f64,
                    DType::I32 => (p as *const i32).read_unaligned() as f64,
                    DType::I64 => (p as *const i64).read_unaligned() as f64,
                    d => panic!("{d}"),
                }
            }
        }

        fn values(&self) -> Vec<f64> {
            (0..self.a.numel()).map(|i| self.get(i)).collect()
        }

        /// Whether every byte outside the elements is still poison.
        fn padding_untouched(&self) -> bool {
            let size = self.a.dtype.size();
            let base = self.a.addr as usize;
            let mut inside = vec![false; self.a.shape[0] * self.a.strides[0] * size];
            for i in 0..self.a.numel() {
                let at = self.at(i) as usize - base;
                inside[at..at + size].iter_mut().for_each(|b| *b = true);
            }
            // SAFETY: `_data` holds at least `inside.len()` bytes.
            let bytes = unsafe { std::slice::from_raw_parts(base as *const u8, inside.len()) };
            bytes.iter().zip(&inside).all(|(&b, &e)| e || b == 0xa5)
        }
    }

    /// Rank r's element i for `dtype`: small integers (exact in every
    /// dtype), near the top of the 8-bit types so that their sums wrap.
    fn input_value(dtype: DType, r: usize, i: usize) -> f64 {
        let small = ((r * 7 + i * 3) % 11) as f64 - 5.0;
        match dtype {
            DType::I8 => 120.0 + small,
            DType::U8 => 250.0 + small,
            _ => small,
        }
    }

    /// The reference in f64, or i128 arithmetic for integers: wrapping
    /// sums, averages truncated toward zero.
    fn reduced(dtype: DType, op: ReduceOp, world: usize, i: usize) -> f64 {
        let bits = 8 * dtype.size() as u32;
        let sum: f64 = (0..world).map(|r| input_value(dtype, r, i)).sum();
        if !dtype.is_integer() {
            return if op == ReduceOp::Avg { sum / world as f64 } else { sum };
        }
        let m = (sum as i128).rem_euclid(1 << bits);
        let wrapped = if dtype != DType::U8 && m >= 1 << (bits - 1) { m - (1 << bits) } else { m };
        (if op == ReduceOp::Avg { wrapped / world as i128 } else { wrapped }) as f64
    }

    /// (in place, row stride of input and output past the row's length)
    const LAYOUTS: &[(bool, usize)] = &[(false, 0), (false, 3), (true, 0), (true, 2)];

    /// Every rank's output of an all-reduce of `[3, 5]`, rank r's layout
    /// `layout(r)`: (in place, input row padding, output row padding).
    fn reduce_with_layouts(
        groups: &[Arc<Group>],
        dtype: DType,
        op: ReduceOp,
        layout: impl Fn(usize) -> (bool, usize, usize) + Sync,
    ) -> Vec<M> {
        let (rows, cols) = (3, 5);
        on_each(groups, |r, g| {
            let (in_place, in_pad, out_pad) = layout(r);
            let input = M::new(dtype, rows, cols, cols + in_pad, |i| input_value(dtype, r, i));
            let output = (!in_place).then(|| M::new(dtype, rows, cols, cols + out_pad, |_| f64::NAN));
            let out = output.as_ref().unwrap_or(&input).a.clone();
            let call = AllReduce { input: input.a.clone(), output: out, op, norm: None, algorithm: None };
            all_reduce_op(g, Ok(call), Stream(0)).unwrap();
            output.unwrap_or(input)
        })
    }

    /// Every rank's output of an all-reduce of `[3, 5]` in `layout` (in
    /// place, padding: the output's one more).
    fn reduce_layout_on(groups: &[Arc<Group>], dtype: DType, op: ReduceOp, (in_place, pad): (bool, usize)) -> Vec<M> {
        reduce_with_layouts(groups, dtype, op, |_| (in_place, pad, pad + 1))
    }

    /// Every dtype of the one-host op, sum and average, strided and in
    /// place: against the reference and the one-host group's bits; the
    /// outputs' padding is left alone.
    #[test]
    fn all_reduce_dtypes_and_layouts_match_one_host() {
        let cases = [
            (DType::BF16, ReduceOp::Avg),
            (DType::F32, ReduceOp::Sum),
            (DType::I8, ReduceOp::Avg),
            (DType::U8, ReduceOp::Sum),
            (DType::U8, ReduceOp::Avg),
            (DType::I32, ReduceOp::Avg),
            (DType::I64, ReduceOp::Sum),
        ];
        for hosts in PLACEMENTS {
            let world = hosts.len();
            let (groups, one) = (on_hosts(hosts), host_groups(world));
            for (dtype, op) in cases {
                for &layout in LAYOUTS {
                    let got = reduce_layout_on(&groups, dtype, op, layout);
                    let single = reduce_layout_on(&one, dtype, op, layout);
                    let want: Vec<f64> = (0..15).map(|i| reduced(dtype, op, world, i)).collect();
                    for r in 0..world {
                        let what = format!("{hosts:?} {dtype} {op:?} (in place, pad) {layout:?} rank {r}");
                        assert_eq!(got[r].values(), want, "{what}");
                        assert_eq!(got[r].values(), single[r].values(), "{what}: one host");
                        assert!(got[r].padding_untouched(), "{what}: padding written");
                    }
                }
            }
            one.iter().for_each(|g| g.release_scratch());
        }
    }

    /// Every rank's (out, residual_out) of an all_reduce_rmsnorm of `[4,
    /// 6]`, strided, residual_out apart or `residual` itself.
    /// `x_pad(r)`: rank r's row stride of x past the row's length.
    fn rmsnorm_on(groups: &[Arc<Group>], dtype: DType, in_place: bool, x_pad: fn(usize) -> usize) -> Vec<(M, M)> {
        let (rows, hidden) = (4, 6);
        on_each(groups, |r, g| {
            let x = M::new(dtype, rows, hidden, hidden + x_pad(r), |i| input_value(dtype, r, i));
            let residual = M::new(dtype, rows, hidden, hidden + 1, |i| (i % 5) as f64 - 2.0);
            let weight = M::new(dtype, 1, hidden, hidden, |i| 0.5 + i as f64 * 0.25);
            let out = M::new(dtype, rows, hidden, hidden + 3, |_| f64::NAN);
            let residual_out = if in_place { None } else { Some(M::new(dtype, rows, hidden, hidden, |_| f64::NAN)) };
            let norm = Norm {
                residual: residual.a.clone(),
                weight: Array::contiguous(weight.a.addr, dtype, &[hidden]),
                eps: 1e-5,
                residual_out: residual_out.as_ref().unwrap_or(&residual).a.clone(),
            };
            let call = AllReduce {
                input: x.a.clone(),
                output: out.a.clone(),
                op: ReduceOp::Sum,
                norm: Some(norm),
                algorithm: None,
            };
            all_reduce_op(g, Ok(call), Stream(0)).unwrap();
            (out, residual_out.unwrap_or(residual))
        })
    }

    /// The norm of the reduced sum, against f64 and the one-host group's
    /// bits (the sums are exact, and both run the backend's norm on them).
    #[test]
    fn all_reduce_rmsnorm_matches_one_host() {
        let (rows, hidden) = (4, 6);
        for hosts in PLACEMENTS {
            let world = hosts.len();
            let (groups, one) = (on_hosts(hosts), host_groups(world));
            for (dtype, tolerance) in [(DType::F32, 1e-6), (DType::BF16, 1e-2)] {
                for in_place in [false, true] {
                    let r_out: Vec<f64> = (0..rows * hidden)
                        .map(|i| reduced(dtype, ReduceOp::Sum, world, i) + (i % 5) as f64 - 2.0)
                        .collect();
                    let want: Vec<f64> = (0..rows * hidden)
                        .map(|i| {
                            let row = &r_out[i / hidden * hidden..][..hidden];
                            let rms = (row.iter().map(|v| v * v).sum::<f64>() / hidden as f64 + 1e-5).sqrt();
                            r_out[i] / rms * (0.5 + (i % hidden) as f64 * 0.25)
                        })
                        .collect();
                    // x contiguous on even ranks (sent as it is where alone on a host).
                    let x_pad = if in_place { |_| 2 } else { |r| 2 * (r % 2) };
                    let got = rmsnorm_on(&groups, dtype, in_place, x_pad);
                    let single = rmsnorm_on(&one, dtype, in_place, x_pad);
                    for r in 0..world {
                        let what = format!("{hosts:?} {dtype} in place {in_place} rank {r}");
                        let (out, res) = &got[r];
                        assert_eq!(res.values(), r_out, "{what}: residual_out");
                        for (g, w) in out.values().iter().zip(&want) {
                            assert!((g - w).abs() <= tolerance * w.abs().max(1.0), "{what}: out {g} vs {w}");
                        }
                        assert_eq!(out.values(), single[r].0.values(), "{what}: one host");
                        assert!(out.padding_untouched() && res.padding_untouched(), "{what}: padding written");
                    }
                }
            }
            one.iter().for_each(|g| g.release_scratch());
        }
    }

    /// A call invalid on one rank fails on every rank (`Remote` on the
    /// others) and writes nothing; so does an rmsnorm of integers.
    #[test]
    fn invalid_calls_fail_every_rank_and_change_nothing() {
        let groups = on_hosts(&["a", "b", "b", "a"]);
        for odd in [1, 3] {
            let results = on_each(&groups, |r, g| {
                let input = M::new(DType::F32, 2, 4, 4, |i| i as f64);
                let output = M::new(DType::F32, 2, 4 + (r == odd) as usize, 6, |_| f64::NAN);
                let call = AllReduce {
                    input: input.a.clone(),
                    output: output.a.clone(),
                    op: ReduceOp::Sum,
                    norm: None,
                    algorithm: None,
                };
                let e = all_reduce_op(g, Ok(call), Stream(0)).unwrap_err();
                let gathered = M::new(DType::F32, 8 + (r == odd) as usize, 4, 4, |_| f64::NAN);
                let call = LcAllgather { input: input.a.clone(), output: gathered.a.clone() };
                let e2 = lc_allgather_op(g, Ok(call), Stream(0)).unwrap_err();
                let untouched = output.values().iter().chain(&gathered.values()).all(|v| v.is_nan());
                (e, e2, untouched)
            });
            for (r, (e, e2, untouched)) in results.into_iter().enumerate() {
                let want = if r == odd { ErrorKind::InvalidArgument } else { ErrorKind::Remote };
                assert_eq!((e.kind, e2.kind), (want, want), "rank {r}: {} / {}", e.msg, e2.msg);
                assert!(untouched, "rank {r}");
            }
        }
        for e in on_each(&groups, |_, g| {
            let (x, res, w) = (
                M::new(DType::I32, 2, 4, 4, |i| i as f64),
                M::new(DType::I32, 2, 4, 4, |_| 1.0),
                M::new(DType::I32, 1, 4, 4, |_| 1.0),
            );
            let out = M::new(DType::I32, 2, 4, 4, |_| -7.0);
            let norm = Norm {
                residual: res.a.clone(),
                weight: Array::contiguous(w.a.addr, DType::I32, &[4]),
                eps: 1e-6,
                residual_out: res.a.clone(),
            };
            let call = AllReduce {
                input: x.a.clone(),
                output: out.a.clone(),
                op: ReduceOp::Sum,
                norm: Some(norm),
                algorithm: None,
            };
            let e = all_reduce_op(g, Ok(call), Stream(0)).unwrap_err();
            assert!(out.values().iter().all(|&v| v == -7.0) && res.values().iter().all(|&v| v == 1.0));
            e
        }) {
            assert_eq!(e.kind, ErrorKind::InvalidArgument, "{}", e.msg);
        }
        // Still usable.
        assert!(gather_on(&groups, 2).iter().all(|o| o.iter().all(|v| !v.is_nan())));
    }

    /// Strided inputs and outputs of the gather, rank order whatever the
    /// placement; padding left alone.
    #[test]
    fn lc_allgather_strided_matches_one_host() {
        for hosts in PLACEMENTS {
            let world = hosts.len();
            let (groups, one) = (on_hosts(hosts), host_groups(world));
            let run = |groups: &[Arc<Group>]| {
                on_each(groups, |r, g| {
                    let input = M::new(DType::BF16, 3, 4, 7, |i| input_value(DType::BF16, r, i));
                    let output = M::new(DType::BF16, 3 * world, 4, 5, |_| f64::NAN);
                    let call = LcAllgather { input: input.a.clone(), output: output.a.clone() };
                    lc_allgather_op(g, Ok(call), Stream(0)).unwrap();
                    output
                })
            };
            let (got, single) = (run(&groups), run(&one));
            let want: Vec<f64> =
                (0..world).flat_map(|r| (0..12).map(move |i| input_value(DType::BF16, r, i))).collect();
            for r in 0..world {
                assert_eq!(got[r].values(), want, "{hosts:?} rank {r}");
                assert_eq!(got[r].values(), single[r].values());
                assert!(got[r].padding_untouched(), "{hosts:?} rank {r}: padding written");
            }
            one.iter().for_each(|g| g.release_scratch());
        }
    }

    /// Layouts of one rank's all-reduce: (in place, input's row padding,
    /// output's): contiguous (straight into the output where alone on a
    /// host), input strided, output strided, in place, strided in place.
    const RANK_LAYOUTS: &[(bool, usize, usize)] =
        &[(false, 0, 0), (false, 3, 0), (false, 0, 2), (true, 0, 0), (true, 2, 2)];

    /// Every rank's output of an all-reduce of `[3, 5]`, rank r in
    /// `RANK_LAYOUTS[(r + shift) % len]`.
    fn reduce_mixed_on(groups: &[Arc<Group>], dtype: DType, op: ReduceOp, shift: usize) -> Vec<M> {
        reduce_with_layouts(groups, dtype, op, |r| RANK_LAYOUTS[(r + shift) % RANK_LAYOUTS.len()])
    }

    /// Ranks whose layouts differ (some straight into their output, some
    /// staged) in one call: against the reference and the one-host
    /// group's bits, padding left alone.
    #[test]
    fn all_reduce_with_layouts_differing_between_ranks() {
        let cases = [
            (DType::F32, ReduceOp::Sum),
            (DType::BF16, ReduceOp::Avg),
            (DType::I32, ReduceOp::Avg),
            (DType::I8, ReduceOp::Sum),
        ];
        for hosts in PLACEMENTS {
            let world = hosts.len();
            let (groups, one) = (on_hosts(hosts), host_groups(world));
            for (dtype, op) in cases {
                let want: Vec<f64> = (0..15).map(|i| reduced(dtype, op, world, i)).collect();
                for shift in 0..RANK_LAYOUTS.len() {
                    let got = reduce_mixed_on(&groups, dtype, op, shift);
                    let single = reduce_mixed_on(&one, dtype, op, shift);
                    for r in 0..world {
                        let what = format!("{hosts:?} {dtype} {op:?} shift {shift} rank {r}");
                        assert_eq!(got[r].values(), want, "{what}");
                        assert_eq!(got[r].values(), single[r].values(), "{what}: one host");
                        assert!(got[r].padding_untouched(), "{what}: padding written");
                    }
                }
            }
            one.iter().for_each(|g| g.release_scratch());
        }
    }

    /// Layouts of one rank's gather: (input's row padding, output's).
    const GATHER_LAYOUTS: &[(usize, usize)] = &[(0, 0), (3, 0), (0, 2), (3, 2)];

    /// Ranks whose gather layouts differ (contiguous outputs straight from
    /// the transport where alone on a host, strided ones staged) in one
    /// call, rank order whatever the placement; padding left alone.
    #[test]
    fn lc_allgather_with_layouts_differing_between_ranks() {
        for hosts in PLACEMENTS {
            let world = hosts.len();
            let (groups, one) = (on_hosts(hosts), host_groups(world));
            let want: Vec<f64> = (0..world).flat_map(|r| (0..12).map(move |i| input_value(DType::I32, r, i))).collect();
            for shift in 0..GATHER_LAYOUTS.len() {
                let run = |groups: &[Arc<Group>]| {
                    on_each(groups, |r, g| {
                        let (in_pad, out_pad) = GATHER_LAYOUTS[(r + shift) % GATHER_LAYOUTS.len()];
                        let input = M::new(DType::I32, 3, 4, 4 + in_pad, |i| input_value(DType::I32, r, i));
                        let output = M::new(DType::I32, 3 * world, 4, 4 + out_pad, |_| -77.0);
                        let call = LcAllgather { input: input.a.clone(), output: output.a.clone() };
                        lc_allgather_op(g, Ok(call), Stream(0)).unwrap();
                        output
                    })
                };
                let (got, single) = (run(&groups), run(&one));
                for r in 0..world {
                    assert_eq!(got[r].values(), want, "{hosts:?} shift {shift} rank {r}");
                    assert_eq!(got[r].values(), single[r].values());
                    assert!(got[r].padding_untouched(), "{hosts:?} shift {shift} rank {r}: padding written");
                }
            }
            one.iter().for_each(|g| g.release_scratch());
        }
    }

    /// Where every rank is alone on its host, contiguous calls stage
    /// nothing (the workspace stays at its least, under one piece): the
    /// sum and the gather go straight between input and output. A strided
    /// gather output, or two ranks per host, stage through it.
    #[test]
    fn alone_on_a_host_contiguous_calls_stage_nothing() {
        let n = 1 << 19; // 2 MiB of f32 per rank: more than the least workspace
        let piece = n * 4;
        for (hosts, host_count) in [(&["a", "b"][..], 2), (&["a", "b", "c", "d"], 4), (&["a", "a", "b", "b"], 2)] {
            let world = hosts.len();
            let alone = host_count == world;
            let groups = on_hosts(hosts);
            let held = on_each(&groups, |r, g| {
                let value = |p: usize, i: usize| ((p * 3 + i) % 1000) as f32 - 500.0;
                let input: Vec<f32> = (0..n).map(|i| value(r, i)).collect();
                let output = summed(g, &input).unwrap();
                let want = |i: usize| (0..world).map(|p| value(p, i) as f64).sum::<f64>() as f32;
                assert!(output.iter().enumerate().all(|(i, &v)| v == want(i)), "{hosts:?} rank {r}: all_reduce");
                let gathered = vec![f32::NAN; world * n];
                let call = LcAllgather {
                    input: arr(&input, DType::F32, &[n]),
                    output: arr(&gathered, DType::F32, &[world * n]),
                };
                lc_allgather_op(g, Ok(call), Stream(0)).unwrap();
                assert!(
                    gathered.iter().enumerate().all(|(i, &v)| v == value(i / n, i % n)),
                    "{hosts:?} rank {r}: gather"
                );
                let contiguous = LocalScratch::held_bytes(g);
                // Every other element of the output: staged.
                let wide = vec![f32::NAN; 2 * world * n];
                let strided =
                    Array { addr: wide.as_ptr() as u64, dtype: DType::F32, shape: vec![world * n], strides: vec![2] };
                let call = LcAllgather { input: arr(&input, DType::F32, &[n]), output: strided };
                lc_allgather_op(g, Ok(call), Stream(0)).unwrap();
                let ok =
                    wide.iter()
                        .enumerate()
                        .all(|(i, &v)| if i % 2 == 1 { v.is_nan() } else { v == value(i / 2 / n, i / 2 % n) });
                assert!(ok, "{hosts:?} rank {r}: strided gather");
                (contiguous, LocalScratch::held_bytes(g))
            });
            for (r, (contiguous, strided)) in held.into_iter().enumerate() {
                let what = format!("{hosts:?} rank {r}: workspace {contiguous} then {strided} bytes");
                assert_eq!(contiguous < piece, alone, "{what}");
                // A piece per host, then every rank's.
                assert!(strided >= (host_count + world) * piece, "{what}");
            }
        }
    }
}

/// The watchdog of a CUDA group on pretend hosts (NCCL between them): a
/// kept call whose peer never comes ends at the group's timeout, and an
/// abort ends it at once; either way the stream goes on and later calls
/// are refused. Named `gpu_*`; skipped without two GPUs or NCCL.
#[cfg(test)]
mod gpu_tests {
    use super::super::lc_allgather as lc_allgather_op;
    use super::*;
    use crate::array::DType;
    use crate::backend::cuda::gpu_testing::{gpu_on, report_skipped};
    use crate::backend::cuda::{driver, nccl};
    use crate::backend::BackendChoice;
    use crate::bootstrap::local::local_bootstraps;
    use crate::error::ErrorKind;
    use crate::group::GroupConfig;
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    fn groups(timeout: Duration) -> Vec<Arc<Group>> {
        groups_on(&["a", "b"], timeout)
    }

    /// A CUDA group whose rank r is on GPU r and pretend host `hosts[r]`.
    fn groups_on(hosts: &[&str], timeout: Duration) -> Vec<Arc<Group>> {
        std::thread::scope(|s| {
            let hs: Vec<_> = local_bootstraps(hosts.len())
                .into_iter()
                .zip(hosts)
                .enumerate()
                .map(|(r, (b, h))| {
                    let cfg = GroupConfig {
                        backend: Some(BackendChoice::Cuda),
                        timeout: Some(timeout),
                        host_id: Some(h.to_string()),
                        ..Default::default()
                    };
                    s.spawn(move || Group::new(Box::new(b), r as i32, &cfg).expect("a CUDA group on pretend hosts"))
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    /// Both ranks make a call (agreed, then kept), then rank 0 alone makes
    /// it again: `stop(group)` runs on rank 0 while it waits. Returns how
    /// long rank 0's stream took to get past the lone call, and rank 0's
    /// group.
    fn lone_kept_call(timeout: Duration, stop: impl Fn(&Group) + Sync) -> (Duration, Arc<Group>) {
        let gs = groups(timeout);
        let n = 1 << 16;
        let waited = std::thread::scope(|s| {
            let hs: Vec<_> = gs
                .iter()
                .map(|g| {
                    let stop = &stop;
                    s.spawn(move || {
                        let gpu = gpu_on(g.device());
                        let input = gpu.upload(&vec![g.rank() as f32 + 0.5; n]);
                        let output = gpu.upload(&vec![f32::NAN; 2 * n]);
                        let call = || LcAllgather {
                            input: Array::contiguous(input.ptr, DType::F32, &[n]),
                            output: Array::contiguous(output.ptr, DType::F32, &[2 * n]),
                        };
                        for _ in 0..2 {
                            lc_allgather_op(g, Ok(call()), gpu.stream()).unwrap();
                        }
                        gpu.sync();
                        let got = output.read::<f32>(2 * n);
                        assert!(got[..n].iter().all(|&v| v == 0.5) && got[n..].iter().all(|&v| v == 1.5));
                        if g.rank() != 0 {
                            return None;
                        }
                        let t = Instant::now();
                        lc_allgather_op(g, Ok(call()), gpu.stream()).expect("a kept call is enqueued");
                        std::thread::sleep(Duration::from_millis(200));
                        stop(g);
                        gpu.sync();
                        Some(t.elapsed())
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).find_map(|w| w).unwrap()
        });
        gs[1].abort();
        (waited, gs[0].clone())
    }

    #[test]
    fn gpu_a_kept_call_without_its_peer_times_out_or_aborts() {
        if driver::device_count() < 2 || nccl::load().is_err() {
            report_skipped();
            return;
        }
        let (waited, g) = lone_kept_call(Duration::from_secs(2), |_| {});
        assert!(waited >= Duration::from_secs(2) && waited < Duration::from_secs(20), "{waited:?}");
        let e = g.failure().expect("the group failed");
        assert_eq!(e.kind, ErrorKind::Timeout, "{}", e.msg);
        assert!(e.msg.contains("symm_lc_allgather across hosts did not finish"), "{}", e.msg);
        let (n, gpu) = (4, gpu_on(g.device()));
        let (input, output) = (gpu.upload(&[1f32; 4]), gpu.upload(&[f32::NAN; 8]));
        let call = LcAllgather {
            input: Array::contiguous(input.ptr, DType::F32, &[n]),
            output: Array::contiguous(output.ptr, DType::F32, &[2 * n]),
        };
        assert_eq!(lc_allgather_op(&g, Ok(call), gpu.stream()).unwrap_err().kind, ErrorKind::Aborted);
        // An abort ends the wait long before a minute's timeout.
        let (waited, g) = lone_kept_call(Duration::from_secs(60), |g| g.abort());
        assert!(waited < Duration::from_secs(10), "{waited:?}");
        assert_eq!(g.failure().expect("aborted").kind, ErrorKind::Aborted);
    }

    /// Two pretend hosts of two GPUs each: the level inside each host on
    /// the LL lines (both steps of a small all-reduce, the gather of a
    /// middling one; `decide::inside_on_lines`) and through NCCL (a large
    /// one), and gathers on the lines, against exact sums (small integers)
    /// and every rank's rows; outputs poisoned. Skipped without four GPUs.
    #[test]
    fn gpu_the_level_inside_a_host_on_symmetric_memory() {
        if driver::device_count() < 4 || nccl::load().is_err() {
            report_skipped();
            return;
        }
        for hosts in [["a", "a", "b", "b"], ["a", "b", "b", "a"]] {
            let gs = groups_on(&hosts, Duration::from_secs(30));
            let value = |r: usize, i: usize| ((r * 5 + i) % 11) as f32 - 5.0;
            std::thread::scope(|s| {
                for g in &gs {
                    s.spawn(move || {
                        let (r, gpu) = (g.rank(), gpu_on(g.device()));
                        for n in [1024, 1 << 17, 1 << 21] {
                            let input = gpu.upload(&(0..n).map(|i| value(r, i)).collect::<Vec<_>>());
                            let output = gpu.upload(&vec![f32::NAN; n]);
                            let call = AllReduce {
                                input: Array::contiguous(input.ptr, DType::F32, &[n]),
                                output: Array::contiguous(output.ptr, DType::F32, &[n]),
                                op: ReduceOp::Sum,
                                norm: None,
                                algorithm: None,
                            };
                            for _ in 0..2 {
                                super::super::all_reduce(g, Ok(call.clone()), gpu.stream()).unwrap();
                            }
                            gpu.sync();
                            let got = output.read::<f32>(n);
                            let bad = (0..n).filter(|&i| got[i] != (0..4).map(|q| value(q, i)).sum::<f32>()).count();
                            assert_eq!(bad, 0, "{hosts:?} all-reduce of {n}: {bad} wrong on rank {r}");
                            let rows = n / 1024;
                            let gathered = gpu.upload(&vec![f32::NAN; 4 * n]);
                            let call = LcAllgather {
                                input: Array::contiguous(input.ptr, DType::F32, &[rows, 1024]),
                                output: Array::contiguous(gathered.ptr, DType::F32, &[4 * rows, 1024]),
                            };
                            lc_allgather_op(g, Ok(call), gpu.stream()).unwrap();
                            gpu.sync();
                            let got = gathered.read::<f32>(4 * n);
                            let bad = (0..4 * n).filter(|&i| got[i] != value(i / n, i % n)).count();
                            assert_eq!(bad, 0, "{hosts:?} gather of {n}: {bad} wrong on rank {r}");
                        }
                    });
                }
            });
            assert!(gs.iter().all(|g| g.check_healthy().is_ok()));
        }
    }

    /// Calls across hosts captured into a CUDA graph (after an eager call
    /// of each made their buffers) and replayed with new inputs: an
    /// all-reduce and a gather, on two pretend hosts of one GPU each, and
    /// of two where four GPUs exist (the level inside on the lines). Exact
    /// sums of small integers; outputs poisoned before each replay.
    #[test]
    fn gpu_calls_across_hosts_replay_as_graphs() {
        use crate::backend::cuda::driver::check;
        use cudarc::driver::sys;
        if driver::device_count() < 2 || nccl::load().is_err() {
            report_skipped();
            return;
        }
        let placements: &[&[&str]] =
            if driver::device_count() >= 4 { &[&["a", "b"], &["a", "a", "b", "b"]] } else { &[&["a", "b"]] };
        for hosts in placements {
            let gs = groups_on(hosts, Duration::from_secs(30));
            let world = hosts.len();
            let value = |r: usize, i: usize, k: usize| ((r * 5 + i + 3 * k) % 11) as f32 - 5.0;
            let n = 4096;
            std::thread::scope(|s| {
                for g in &gs {
                    s.spawn(move || {
                        let (r, gpu) = (g.rank(), gpu_on(g.device()));
                        let input = gpu.upload(&vec![0f32; n]);
                        let (summed, gathered) = (gpu.upload(&vec![0f32; n]), gpu.upload(&vec![0f32; world * n]));
                        let enqueue = || -> Result<()> {
                            let reduce = AllReduce {
                                input: Array::contiguous(input.ptr, DType::F32, &[n]),
                                output: Array::contiguous(summed.ptr, DType::F32, &[n]),
                                op: ReduceOp::Sum,
                                norm: None,
                                algorithm: None,
                            };
                            super::super::all_reduce(g, Ok(reduce), gpu.stream())?;
                            let gather = LcAllgather {
                                input: Array::contiguous(input.ptr, DType::F32, &[n / 256, 256]),
                                output: Array::contiguous(gathered.ptr, DType::F32, &[world * n / 256, 256]),
                            };
                            lc_allgather_op(g, Ok(gather), gpu.stream())
                        };
                        enqueue().unwrap();
                        gpu.sync();
                        let st = gpu.stream().0 as sys::CUstream;
                        let mode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL;
                        // SAFETY: our own stream; graph handles made and destroyed here.
                        unsafe {
                            check(sys::cuStreamBeginCapture_v2(st, mode), "cuStreamBeginCapture").unwrap();
                            let issued = enqueue();
                            let mut graph = std::ptr::null_mut();
                            check(sys::cuStreamEndCapture(st, &mut graph), "cuStreamEndCapture").unwrap();
                            issued.unwrap();
                            let mut exec = std::ptr::null_mut();
                            check(sys::cuGraphInstantiateWithFlags(&mut exec, graph, 0), "cuGraphInstantiate").unwrap();
                            for k in 0..3 {
                                input.write(&(0..n).map(|i| value(r, i, k)).collect::<Vec<_>>());
                                summed.write(&vec![f32::NAN; n]);
                                gathered.write(&vec![f32::NAN; world * n]);
                                check(sys::cuGraphLaunch(exec, st), "cuGraphLaunch").unwrap();
                                gpu.sync();
                                let got = summed.read::<f32>(n);
                                let want = |i: usize| (0..world).map(|q| value(q, i, k)).sum::<f32>();
                                let bad = (0..n).filter(|&i| got[i] != want(i)).count();
                                assert_eq!(bad, 0, "{hosts:?} replay {k}: {bad} sums wrong on rank {r}");
                                let got = gathered.read::<f32>(world * n);
                                let bad = (0..world * n).filter(|&i| got[i] != value(i / n, i % n, k)).count();
                                assert_eq!(bad, 0, "{hosts:?} replay {k}: {bad} gathered wrong on rank {r}");
                            }
                            sys::cuGraphExecDestroy(exec);
                            sys::cuGraphDestroy(graph);
                        }
                        g.backend().check_async_error().unwrap();
                    });
                }
            });
            assert!(gs.iter().all(|g| g.check_healthy().is_ok()));
        }
    }
}
