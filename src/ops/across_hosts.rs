//! All-reduce (and its rmsnorm form) and `lc_allgather` in a group
//! spanning hosts, on both backends: the one-host operations' checks and
//! epilogue (`AllReduce::check`, `AllReduce::finish`, `LcAllgather::check`),
//! with the data moving between ranks through the plans of
//! `super::hierarchy` over the group's transports (`Group::across_hosts`,
//! `Group::inside_host`), staged in this rank's workspace
//! (`LocalScratch`: device memory on CUDA). Also what the operations across
//! hosts share (`transports`, `gather`, `flat`; `super::across_matmul` runs
//! the matmuls).
//!
//! The all-reduce sums level by level in the input's type (NCCL's sum for
//! floats of 16 bits rounds at each level), then the average divides the
//! total once (`AllReduce::reduce`: in f32 for floats, truncating for
//! integers). Strided tensors are staged through the workspace. The
//! workspace is made ready before the ranks agree, so that a failure to
//! allocate it fails every rank; every call is agreed (no call is kept),
//! so one that differs between ranks fails on all of them, and bad input
//! changes nothing.

use super::agree::{agree_across_hosts, Signature};
use super::hierarchy::{piece_rows, AllReducePlan, GatherPlan, Hierarchy};
use super::local_scratch::{local_exec, LocalScratch};
use super::workspace::Layout;
use super::{AllReduce, Exec, LcAllgather, ReduceOp};
use crate::array::Array;
use crate::backend::Stream;
use crate::error::{err, Result};
use crate::group::{AcrossHosts, Group};

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

/// Every rank's piece into its place on this rank through `plan`: across
/// hosts into `staging` (one piece per host), then inside the host after
/// them (every piece, by local index then host), then each to its place.
/// `piece(r)`: where rank r's piece goes (any strides; all of one shape and
/// dtype), except `piece(this rank)`: its piece, contiguous (already where
/// it goes, or copied there by the caller).
pub(super) fn gather(ex: &Exec<'_>, plan: &GatherPlan, staging: u64, piece: &dyn Fn(usize) -> Array) -> Result<()> {
    let local: Vec<usize> = plan.inside.iter().map(|x| x.0).collect();
    let (across, inside) = transports(ex.group, &plan.across, &local)?;
    let mine = flat(&piece(ex.rank()));
    let (n, dtype, hosts) = (mine.numel(), mine.dtype, plan.across.len());
    let at = |i: usize, pieces: usize| Array::contiguous(staging + (i * n * dtype.size()) as u64, dtype, &[pieces * n]);
    across.all_gather(ex.group, &mine, &at(0, hosts), ex.stream)?;
    inside.all_gather(ex.group, &at(0, hosts), &at(hosts, local.len() * hosts), ex.stream)?;
    for (j, (_, pieces)) in plan.inside.iter().enumerate() {
        for (k, &rank) in pieces.iter().enumerate() {
            if rank != ex.rank() {
                let dst = piece(rank);
                ex.copy(&dst, &Array::contiguous(at(hosts + j * hosts + k, 1).addr, dtype, &dst.shape))?;
            }
        }
    }
    Ok(())
}

/// Slices start 16 bytes apart at least, as NCCL's and the copies' vector
/// accesses like.
const SLICE_ALIGN_BYTES: usize = 16;

pub fn all_reduce(group: &Group, call: Result<AllReduce>, stream: Stream) -> Result<()> {
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
        // The input padded to a block per local rank, where the total lands
        // too; this host's sum of this rank's block; its total.
        let (mut layout, block) = (Layout::default(), plan.block * size);
        let padded = layout.region(plan.slices.len() * block);
        let (host_sum, total) = (layout.region(block), layout.region(block));
        let norm = c.norm_regions(&mut layout);
        let base = LocalScratch::ensure(group, layout.bytes(), stream)?;
        Ok((c, plan, base, [padded, host_sum, total], norm))
    });
    agree_across_hosts(group, &sig, ready.as_ref().map(|_| ()).map_err(Clone::clone))?;
    let (c, plan, base, [padded, host_sum, total], norm) = ready?;
    if c.input.numel() == 0 {
        return Ok(());
    }
    let ex = local_exec(group, base, stream);
    let run = || {
        let (across, inside) = transports(group, &plan.across, &plan.local_ranks)?;
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
    run().inspect_err(|e| group.fail(e))
}

pub fn lc_allgather(group: &Group, call: Result<LcAllgather>, stream: Stream) -> Result<()> {
    let _lock = group.lock_collective();
    group.check_healthy()?;
    let (sig, checked) = match call {
        Ok(c) => (c.signature(None), c.check(group.world()).map(|bytes| (c, bytes))),
        Err(e) => (Signature::new("lc_allgather"), Err(e)),
    };
    let ready = checked.and_then(|(c, bytes)| {
        let h = Hierarchy::new(group.topology(), group.rank(), "symm_lc_allgather")?;
        // This rank's input, contiguous; one piece per host, then every rank's.
        let mut layout = Layout::default();
        let staged = layout.region(bytes);
        let staging = layout.region((h.hosts() + h.world()) * bytes);
        let base = LocalScratch::ensure(group, layout.bytes(), stream)?;
        Ok((c, GatherPlan::new(&h), base, staged, staging))
    });
    agree_across_hosts(group, &sig, ready.as_ref().map(|_| ()).map_err(Clone::clone))?;
    let (c, plan, base, staged, staging) = ready?;
    if c.input.numel() == 0 {
        return Ok(());
    }
    let ex = local_exec(group, base, stream);
    let (me, len) = (group.rank(), c.input.shape[0]);
    let run = || {
        let mine = match c.input.is_contiguous() {
            true => c.input.clone(),
            false => {
                let s = Array::contiguous(ex.local(staged), c.input.dtype, &c.input.shape);
                ex.copy(&s, &c.input)?;
                s
            }
        };
        ex.copy(&c.output.narrow(0, piece_rows(me, len).start, len), &c.input)?;
        let place = |r: usize| if r == me { mine.clone() } else { c.output.narrow(0, piece_rows(r, len).start, len) };
        gather(&ex, &plan, ex.local(staging), &place)
    };
    run().inspect_err(|e| group.fail(e))
}

#[cfg(test)]
pub(super) mod tests {
    use super::super::testing::{host_config, host_groups, on_each};
    use super::super::{all_reduce as all_reduce_op, lc_allgather as lc_allgather_op};
    use super::*;
    use crate::array::DType;
    use crate::bootstrap::local::local_bootstraps;
    use crate::error::ErrorKind;
    use crate::group::GroupConfig;
    use std::sync::Arc;

    /// Host-backend groups whose rank r is on pretend host `hosts[r]`.
    pub(in crate::ops) fn on_hosts(hosts: &[&str]) -> Vec<Arc<Group>> {
        std::thread::scope(|s| {
            let hs: Vec<_> = local_bootstraps(hosts.len())
                .into_iter()
                .zip(hosts)
                .map(|(b, h)| {
                    let cfg = GroupConfig { host_id: Some(h.to_string()), ..host_config(false) };
                    s.spawn(move || Group::new(Box::new(b), 0, &cfg).unwrap())
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    pub(in crate::ops) const PLACEMENTS: &[&[&str]] =
        &[&["a", "b"], &["a", "b", "a", "b"], &["a", "a", "b", "b"], &["b", "a", "a", "b"], &["a", "b", "c", "d"]];

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
        for hosts in PLACEMENTS {
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

    /// A call that differs between ranks, or hosts of unequal sizes, fail
    /// on every rank; the group stays usable after a mismatch.
    #[test]
    fn mismatch_and_unequal_hosts_fail_every_rank() {
        let groups = on_hosts(&["a", "b", "a", "b"]);
        let errs = on_each(&groups, |r, g| {
            let n = if r == 2 { 5 } else { 4 };
            let (input, output) = (vec![1f32; n], vec![f32::NAN; n]);
            let call = AllReduce {
                input: arr(&input, DType::F32, &[n]),
                output: arr(&output, DType::F32, &[n]),
                op: ReduceOp::Sum,
                norm: None,
                algorithm: None,
            };
            all_reduce_op(g, Ok(call), Stream(0)).unwrap_err()
        });
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
}
