//! All-reduce and all-gather in a group spanning hosts, run through the
//! plans of `super::hierarchy` over the group's transports
//! (`Group::across_hosts`, `Group::inside_host`), with scratch in host
//! memory: only the host backend runs them (pretend hosts of tests); the
//! CUDA backend refuses alike on every rank. (`super::across_matmul` runs
//! the matmul operations on both.)
//!
//! Inputs and outputs must be contiguous. Every call is agreed (no call is
//! kept), so a call that differs between ranks fails on all of them.

use super::agree::{agree_across_hosts, Signature};
use super::hierarchy::{piece_rows, AllReducePlan, GatherPlan, Hierarchy};
use super::{shape_text, AllReduce, LcAllgather, ReduceOp};
use crate::array::Array;
use crate::backend::host::elementwise;
use crate::backend::{BackendKind, Stream};
use crate::error::{err, Result};
use crate::group::{AcrossHosts, Group};

/// `Unsupported` unless this group's operations across hosts can run here
/// (these, on host memory only).
fn runnable(group: &Group, what: &str) -> Result<Hierarchy> {
    if group.backend().kind() != BackendKind::Host {
        return Err(err!(
            Unsupported,
            "{what}: this group spans {} hosts, and {what} across hosts on GPUs is not implemented yet (issue 43); \
             form one group per host",
            group.topology().hosts()
        ));
    }
    Hierarchy::new(group.topology(), group.rank(), what)
}

fn contiguous(a: &Array, name: &str) -> Result<()> {
    if a.is_contiguous() {
        return Ok(());
    }
    Err(err!(Unsupported, "{name} must be contiguous in a group spanning hosts"))
}

/// A zeroed, 8-byte aligned buffer of `count` elements like `like`, and
/// its array.
fn scratch(like: &Array, count: usize) -> (Vec<u64>, Array) {
    let words = vec![0u64; (count * like.dtype.size()).div_ceil(8)];
    let a = Array::contiguous(words.as_ptr() as u64, like.dtype, &[count]);
    (words, a)
}

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

/// `count` elements of `a` from element `start`, flat.
fn part(a: &Array, start: usize, count: usize) -> Array {
    Array::contiguous(a.addr + (start * a.dtype.size()) as u64, a.dtype, &[count])
}

pub fn all_reduce(group: &Group, call: Result<AllReduce>, stream: Stream) -> Result<()> {
    let _lock = group.lock_collective();
    group.check_healthy()?;
    let what = "symm_all_reduce";
    let sig = call.as_ref().map_or_else(
        |_| Signature::new("all_reduce"),
        |c| {
            Signature::new(if c.norm.is_some() { "all_reduce_rmsnorm" } else { "all_reduce" })
                .arg("input.dtype", c.input.dtype)
                .arg("input.shape", shape_text(&c.input.shape))
                .arg("op", c.op.name())
        },
    );
    let checked = call.and_then(|c| {
        let h = runnable(group, what)?;
        if c.norm.is_some() {
            return Err(err!(Unsupported, "symm_all_reduce_rmsnorm is not implemented across hosts yet"));
        }
        if c.output.shape != c.input.shape || c.output.dtype != c.input.dtype {
            return Err(err!(InvalidArgument, "{what}: output must have the input's shape and dtype"));
        }
        contiguous(&c.input, "input")?;
        contiguous(&c.output, "output")?;
        Ok((c, h))
    });
    agree_across_hosts(group, &sig, checked.as_ref().map(|_| ()).map_err(Clone::clone))?;
    let (c, h) = checked?;
    let plan = AllReducePlan::new(&h, c.input.numel(), 1);
    let (across, inside) = transports(group, &plan.across, &plan.local_ranks)?;
    // Slices padded to the first's length, so that each level moves equal blocks.
    let (lw, chunk) = (plan.slices.len(), plan.slices[0].len());
    let (_padded, padded) = scratch(&c.input, lw * chunk);
    elementwise::copy(&part(&padded, 0, c.input.numel()), &part(&c.input, 0, c.input.numel()))?;
    let (_host_sum, host_sum) = scratch(&c.input, chunk);
    inside.reduce_scatter(group, &padded, &host_sum, stream)?;
    let (_sum, sum) = scratch(&c.input, chunk);
    across.all_reduce(group, &host_sum, &sum, stream)?;
    inside.all_gather(group, &sum, &padded, stream)?;
    let (dst, src) = (part(&c.output, 0, c.input.numel()), part(&padded, 0, c.input.numel()));
    match (c.op, c.input.dtype.is_integer()) {
        (ReduceOp::Sum, _) => elementwise::copy(&dst, &src),
        (ReduceOp::Avg, true) => elementwise::reduce_integers(&dst, &[src], h.world()),
        (ReduceOp::Avg, false) => elementwise::reduce(&dst, &[src], 1.0 / h.world() as f32),
    }
}

pub fn lc_allgather(group: &Group, call: Result<LcAllgather>, stream: Stream) -> Result<()> {
    let _lock = group.lock_collective();
    group.check_healthy()?;
    let what = "symm_lc_allgather";
    let sig = call.as_ref().map_or_else(
        |_| Signature::new("lc_allgather"),
        |c| {
            Signature::new("lc_allgather")
                .arg("input.dtype", c.input.dtype)
                .arg("input.shape", shape_text(&c.input.shape))
        },
    );
    let world = group.world();
    let checked = call.and_then(|c| {
        let h = runnable(group, what)?;
        let mut want = c.input.shape.clone();
        if let Some(rows) = want.first_mut() {
            *rows *= world;
        }
        if c.input.shape.is_empty() || c.output.shape != want || c.output.dtype != c.input.dtype {
            return Err(err!(InvalidArgument, "{what}: output must be {} of the input's dtype", shape_text(&want)));
        }
        contiguous(&c.input, "input")?;
        contiguous(&c.output, "output")?;
        Ok((c, h))
    });
    agree_across_hosts(group, &sig, checked.as_ref().map(|_| ()).map_err(Clone::clone))?;
    let (c, h) = checked?;
    let plan = GatherPlan::new(&h);
    let local: Vec<usize> = plan.inside.iter().map(|x| x.0).collect();
    let (across, inside) = transports(group, &plan.across, &local)?;
    let piece = c.input.numel();
    let hosts = plan.across.len();
    let (_staged, staged) = scratch(&c.input, hosts * piece);
    across.all_gather(group, &part(&c.input, 0, piece), &staged, stream)?;
    let (_all, all) = scratch(&c.input, plan.inside.len() * hosts * piece);
    inside.all_gather(group, &staged, &all, stream)?;
    // Block (j, h) of `all` is the piece of the rank with local index j on host h.
    for (j, (_, pieces)) in plan.inside.iter().enumerate() {
        for (k, &rank) in pieces.iter().enumerate() {
            let at = piece_rows(rank, piece).start;
            elementwise::copy(&part(&c.output, at, piece), &part(&all, (j * hosts + k) * piece, piece))?;
        }
    }
    Ok(())
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
