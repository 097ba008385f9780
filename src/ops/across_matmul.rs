//! `fused_ag_mm` and `mm_rs` in a group spanning hosts, on both backends:
//! the one-host operations' checks, workspace layout and matmuls
//! (`AgMmPrepared`, `MmRsPrepared`), with the data moving between ranks
//! through the plans of `super::hierarchy`: across hosts over the group's
//! transport (`Group::across_hosts`), inside each host through
//! `super::inside_host` (symmetric memory for small steps). A is gathered
//! before the matmuls, except that where the shards' matmuls are
//! compute-bound the shards of this host's ranks are gathered first and
//! multiplied while the other hosts' travel (`AgMmPrepared::overlaps_gather`).
//! Every chunk of the product is made before the reduce-scatter, whose
//! levels sum in the partials' type (the output's, f32 for an fp8 one): a
//! pipeline of NCCL sends and receives beside the matmuls measured slower
//! than NCCL's reduce-scatter after them on its network transport.
//!
//! The workspace is this rank's memory alone (`LocalScratch`), laid out
//! as the one-host call's, then the transports' staging; it is made ready
//! before the ranks agree, so that a failure to allocate it fails every
//! rank. A call is agreed once and then kept, as on one host
//! (`agree_across_hosts`), its work across hosts watched (`Group::watched`),
//! and bad input changes nothing.

use super::across_hosts::{
    flat, gather, gather_inside, gather_local, gather_remote, gather_staging_pieces, transports,
};
use super::agree::{agree_across_hosts, Signature};
use super::hierarchy::{GatherPlan, Hierarchy, ScatterPlan};
use super::inside_host::{Inside, Step};
use super::local_scratch::{local_exec, LocalScratch};
use super::workspace::Layout;
use super::{ag_mm, AgMm, Exec, MmRs, Prepared};
use crate::array::Array;
use crate::backend::Stream;
use crate::error::Result;
use crate::group::Group;
use std::sync::Arc;

pub fn fused_ag_mm(group: &Arc<Group>, call: Result<AgMm>, stream: Stream) -> Result<()> {
    let _lock = group.lock_collective();
    group.check_healthy()?;
    let (sig, prepared) = match call {
        Ok(c) => ag_mm::prepare_unfused(group, c),
        Err(e) => (Signature::new("fused_ag_mm"), Err(e)),
    };
    let ready = prepared.and_then(|p| {
        let h = Hierarchy::new(group.topology(), group.rank(), "symm_fused_ag_mm")?;
        let (plan, overlap) = (GatherPlan::new(&h), p.overlaps_gather(group.world()));
        // Staging: the pieces the gathers move (one per host, every rank's).
        let (mut layout, piece) = (Layout::default(), p.piece_bytes());
        layout.region(p.workspace_bytes());
        let staging = layout.region(gather_staging_pieces(&plan, overlap) * piece);
        let base = LocalScratch::ensure(group, layout.bytes(), stream)?;
        Ok((p, plan, overlap, base, staging))
    });
    let tag = agree_across_hosts(group, &sig, ready.as_ref().map(|_| ()).map_err(Clone::clone))?;
    let (p, plan, overlap, base, staging) = ready?;
    let ex = local_exec(group, base, tag, stream);
    let size = |a: Array| a.numel() * a.dtype.size();
    let pieces = [Some(size(p.staged_shard(&ex, 0))), p.staged_row_scales(&ex, 0).map(size)];
    let inside = gather_inside(group, &plan, &pieces.into_iter().flatten().collect::<Vec<_>>(), overlap, tag, stream)?;
    // Every rank's shard (and row scales) into its place on `ex`'s stream:
    // all of them, or (`Half`) those of this host's ranks or of the others.
    #[derive(Clone, Copy, PartialEq)]
    enum Half {
        All,
        Local,
        Remote,
    }
    let (world, me) = (group.world(), group.rank());
    let local_ranks = plan.local_ranks();
    let gather_into = |ex: &Exec<'_>, half: Half| -> Result<()> {
        // Alone on its host with the members in rank order, the staged
        // pieces (this rank's among them, back to back in rank order) are
        // gathered in place by one all-gather across hosts.
        let alone = local_ranks.len() == 1 && plan.across.iter().copied().eq(0..world);
        let pieces = |piece: &dyn Fn(usize) -> Array| -> Result<()> {
            let (first, mine) = (piece(0), flat(&piece(me)));
            let bytes = (mine.numel() * mine.dtype.size()) as u64;
            if !alone || (0..world).any(|r| piece(r).addr != first.addr + r as u64 * bytes) {
                let staging = ex.local(staging);
                return match half {
                    Half::All => gather(ex, &plan, &inside, staging, piece),
                    Half::Local => gather_local(ex, &plan, &inside, staging, piece),
                    Half::Remote => gather_remote(ex, &plan, &inside, staging, piece),
                };
            }
            if half == Half::Local {
                return Ok(()); // this rank's piece is in place
            }
            let (across, _) = transports(group, &plan.across, &[me])?;
            let all = Array::contiguous(first.addr, mine.dtype, &[world * mine.numel()]);
            across.all_gather(group, &mine, &all, ex.stream, ex.tag)
        };
        pieces(&|r| p.staged_shard(ex, r))?;
        if p.staged_row_scales(ex, 0).is_some() {
            pieces(&|r| p.staged_row_scales(ex, r).expect("row-wise"))?;
        }
        Ok(())
    };
    let run = || {
        p.stage(&ex, stream)?;
        if !overlap {
            gather_into(&ex, Half::All)?;
            return p.multiply_gathered(&ex);
        }
        // This host's shards gathered on the main stream and multiplied
        // while a side stream gathers the other hosts' (after the local
        // half: both read this rank's staged shard); theirs once landed.
        gather_into(&ex, Half::Local)?;
        let side = ex.side()?;
        ex.fork(side)?;
        gather_into(&local_exec(group, base, tag, side), Half::Remote)?;
        p.multiply_staged(&ex, &local_ranks)?;
        ex.join(side)?;
        let others: Vec<usize> = (0..world).filter(|r| !local_ranks.contains(r)).collect();
        p.multiply_staged(&ex, &others)?;
        p.finish_staged(&ex)
    };
    // A rank that stops midway leaves its peers waiting in a transport.
    group.watched(stream, "symm_fused_ag_mm", run).inspect_err(|e| group.fail(e))
}

pub fn mm_rs(group: &Arc<Group>, call: Result<MmRs>, stream: Stream) -> Result<()> {
    let _lock = group.lock_collective();
    group.check_healthy()?;
    let (sig, prepared) = match call {
        Ok(c) => super::mm_rs::prepare_unfused(group, c),
        Err(e) => (Signature::new("mm_rs"), Err(e)),
    };
    let ready = prepared.and_then(|p| {
        let h = Hierarchy::new(group.topology(), group.rank(), "symm_mm_rs")?;
        // Staging: every chunk, by local index then host (inside the host);
        // this host's sums of one local index's chunks (across hosts); the
        // total of this rank's chunk.
        let (mut layout, chunk) = (Layout::default(), p.chunk_bytes());
        layout.region(p.workspace_bytes());
        let send = layout.region(h.world() * chunk);
        let host_sums = layout.region(h.hosts() * chunk);
        let total = layout.region(chunk);
        let base = LocalScratch::ensure(group, layout.bytes(), stream)?;
        Ok((p, ScatterPlan::new(&h), base, [send, host_sums, total]))
    });
    let tag = agree_across_hosts(group, &sig, ready.as_ref().map(|_| ()).map_err(Clone::clone))?;
    let (p, plan, base, [send, host_sums, total]) = ready?;
    let ex = local_exec(group, base, tag, stream);
    let (across, inside) = transports(group, &plan.across, &plan.local_ranks)?;
    let hosts = plan.across.len();
    let (n, dtype) = (p.product_chunk(&ex, 0).numel(), p.product_chunk(&ex, 0).dtype);
    let inside =
        Inside::prepare(group, inside, &[Step::ReduceScatter { bytes: hosts * n * dtype.size(), dtype }], tag, stream)?;
    let alone = plan.local_ranks.len() == 1 && plan.across.iter().copied().eq(0..group.world());
    let run = || {
        p.products(&ex)?;
        let total_chunk = p.chunk(ex.local(total));
        if alone {
            // Alone on its host with the members in rank order: the chunks,
            // back to back in rank order, are reduce-scattered as they lie.
            let all = Array::contiguous(p.product_chunk(&ex, 0).addr, dtype, &[hosts * n]);
            across.reduce_scatter(group, &all, &flat(&total_chunk), stream, tag)?;
            return p.reduce_into_out(&ex, &[total_chunk]);
        }
        let block = |offset: usize, i: usize| flat(&p.chunk(ex.local(offset + i * p.chunk_bytes())));
        for (j, pieces) in plan.pieces.iter().enumerate() {
            for (k, &rank) in pieces.iter().enumerate() {
                ex.copy(&block(send, j * hosts + k), &flat(&p.product_chunk(&ex, rank)))?;
            }
        }
        let run_of = |offset: usize, blocks: usize| Array::contiguous(ex.local(offset), dtype, &[blocks * n]);
        inside.reduce_scatter(
            group,
            &run_of(send, plan.local_ranks.len() * hosts),
            &run_of(host_sums, hosts),
            stream,
        )?;
        across.reduce_scatter(group, &run_of(host_sums, hosts), &run_of(total, 1), stream, tag)?;
        p.reduce_into_out(&ex, &[p.chunk(ex.local(total))])
    };
    group.watched(stream, "symm_mm_rs", run).inspect_err(|e| group.fail(e))
}

/// Against a reference in f64 (exact: small integers) and the same call
/// on a one-host group, at worlds 2 and 4 on pretend hosts (contiguous,
/// interleaved, one rank per host), outputs poisoned; fp8 against the
/// one-host group, bit for bit (`fp8_out_tests` checks that one against a
/// reference).
#[cfg(test)]
mod tests {
    use super::super::across_hosts::tests::{PLACEMENTS, PLACEMENTS_8};
    use super::super::testing::on_hosts;
    use super::super::testing::{host_groups, on_each};
    use super::super::{fused_ag_mm as ag_op, mm_rs as rs_op, AgMmScales, MmRsScales, ReduceOp};
    use super::*;
    use crate::array::DType;
    use crate::error::ErrorKind;
    use crate::fp8::Fp8;

    /// A tensor in host memory, contiguous or with every dimension padded
    /// by one element (a layout no matrix view covers past two dims).
    struct T {
        data: Vec<u128>,
        a: Array,
    }

    impl T {
        fn new(dtype: DType, shape: &[usize], padded: bool, fill: impl Fn(usize) -> f32) -> T {
            let mut strides = vec![1; shape.len()];
            for i in (0..shape.len().saturating_sub(1)).rev() {
                strides[i] = strides[i + 1] * (shape[i + 1] + padded as usize);
            }
            let span = shape.iter().zip(&strides).map(|(n, s)| (n - 1) * s).sum::<usize>() + 1;
            let data = vec![u128::from_ne_bytes([0xa5; 16]); (span * dtype.size()).div_ceil(16) + 1];
            let a = Array { addr: data.as_ptr() as u64, dtype, shape: shape.to_vec(), strides };
            let t = T { data, a };
            (0..t.a.numel()).for_each(|i| t.set(i, fill(i)));
            t
        }

        /// A poisoned output.
        fn out(dtype: DType, shape: &[usize], padded: bool) -> T {
            T::new(dtype, shape, padded, |_| f32::NAN)
        }

        /// Byte address of logical element `i` (row-major order).
        fn at(&self, i: usize) -> *mut u8 {
            let (mut rest, mut off) = (i, 0);
            for (n, s) in self.a.shape.iter().zip(&self.a.strides).rev() {
                off += (rest % n) * s;
                rest /= n;
            }
            (self.a.addr as usize + off * self.a.dtype.size()) as *mut u8
        }

        fn set(&self, i: usize, v: f32) {
            let p = self.at(i);
            // SAFETY: inside `data`, which this tensor owns.
            unsafe {
                match self.a.dtype {
                    DType::F32 => (p as *mut f32).write_unaligned(v),
                    DType::BF16 => (p as *mut u16).write_unaligned(half::bf16::from_f32(v).to_bits()),
                    DType::F8E4M3 => p.write(Fp8::E4M3.encode(v)),
                    d => panic!("{d}"),
                }
            }
        }

        /// Every element, in logical order (raw bits, so NaN compares).
        fn bits(&self) -> Vec<u32> {
            (0..self.a.numel())
                .map(|i| {
                    let p = self.at(i);
                    // SAFETY: as in `set`.
                    unsafe {
                        match self.a.dtype.size() {
                            4 => (p as *const u32).read_unaligned(),
                            2 => (p as *const u16).read_unaligned() as u32,
                            _ => p.read() as u32,
                        }
                    }
                })
                .collect()
        }

        fn f32s(&self) -> Vec<f32> {
            assert_eq!(self.a.dtype, DType::F32);
            self.bits().into_iter().map(f32::from_bits).collect()
        }
    }

    fn value(tag: usize, r: usize, i: usize) -> f32 {
        ((tag * 5 + r * 7 + i * 3) % 9) as f32 - 4.0
    }

    /// `[m, k] @ [k, n]` in f64, row-major.
    fn matmul(a: &[f64], b: &[f64], k: usize, n: usize) -> Vec<f64> {
        let m = a.len() / k;
        (0..m * n).map(|e| (0..k).map(|j| a[e / n * k + j] * b[j * n + e % n]).sum()).collect()
    }

    /// Rank r's shard along `dim` of the concatenation of `world` tensors of
    /// `shape` (row-major values), in f64.
    fn concat(parts: &[Vec<f64>], shape: &[usize], dim: usize) -> Vec<f64> {
        let (outer, inner) = (shape[..dim].iter().product::<usize>(), shape[dim..].iter().product::<usize>());
        (0..outer).flat_map(|o| parts.iter().flat_map(move |p| p[o * inner..(o + 1) * inner].to_vec())).collect()
    }

    #[derive(Clone, Copy)]
    struct AgCase {
        shard: &'static [usize],
        dim: usize,
        ns: &'static [usize],
        padded: bool,
    }

    const AG_CASES: &[AgCase] = &[
        AgCase { shard: &[3, 8], dim: 0, ns: &[4, 6], padded: false },
        AgCase { shard: &[3, 8], dim: 0, ns: &[5], padded: true },
        AgCase { shard: &[2, 3, 4], dim: 1, ns: &[5, 3], padded: false },
        AgCase { shard: &[2, 3, 4], dim: 0, ns: &[2], padded: true },
        AgCase { shard: &[2, 3, 4], dim: 2, ns: &[3, 2], padded: true },
        AgCase { shard: &[3, 4], dim: 1, ns: &[4], padded: false },
        // Compute-bound shards: this host's shards' matmuls overlap the gather.
        AgCase { shard: &[800, 8], dim: 0, ns: &[4, 6], padded: false },
        AgCase { shard: &[2, 400, 8], dim: 1, ns: &[3], padded: true },
    ];

    /// Every rank's outputs then `ag_out`, as bits.
    fn ag_mm_on(groups: &[Arc<Group>], c: AgCase) -> Vec<Vec<Vec<u32>>> {
        let world = groups.len();
        let last = c.shard.len() - 1;
        let mut gathered = c.shard.to_vec();
        gathered[c.dim] *= world;
        on_each(groups, |r, g| {
            let a = T::new(DType::F32, c.shard, c.padded, |i| value(0, r, i));
            let bs: Vec<T> =
                c.ns.iter()
                    .enumerate()
                    .map(|(t, &n)| T::new(DType::F32, &[gathered[last], n], false, |i| value(1 + t, r, i)))
                    .collect();
            let outs: Vec<T> =
                c.ns.iter().map(|&n| T::out(DType::F32, &[&gathered[..last], &[n][..]].concat(), c.padded)).collect();
            let ag = T::out(DType::F32, &gathered, !c.padded);
            let call = AgMm {
                a_shard: a.a.clone(),
                bs: bs.iter().map(|b| b.a.clone()).collect(),
                gather_dim: c.dim as i64,
                ag_out: Some(ag.a.clone()),
                outs: outs.iter().map(|o| o.a.clone()).collect(),
                scales: AgMmScales::default(),
                algorithm: None,
            };
            ag_op(g, Ok(call), Stream(0)).unwrap();
            outs.iter().chain([&ag]).map(T::bits).collect()
        })
    }

    #[test]
    fn fused_ag_mm_matches_one_host() {
        ag_mm_matches_one_host(PLACEMENTS, AG_CASES);
    }

    fn ag_mm_matches_one_host(placements: &[&[&str]], cases: &[AgCase]) {
        for hosts in placements {
            let world = hosts.len();
            let (groups, one) = (on_hosts(hosts), host_groups(world));
            for &c in cases {
                let last = c.shard.len() - 1;
                let numel: usize = c.shard.iter().product();
                let parts: Vec<Vec<f64>> =
                    (0..world).map(|r| (0..numel).map(|i| value(0, r, i) as f64).collect()).collect();
                let a = concat(&parts, c.shard, c.dim);
                let k = if c.dim == last { c.shard[last] * world } else { c.shard[last] };
                let got = ag_mm_on(&groups, c);
                let single = ag_mm_on(&one, c);
                for r in 0..world {
                    let what = format!("{hosts:?} shard {:?} dim {} rank {r}", c.shard, c.dim);
                    for (t, &n) in c.ns.iter().enumerate() {
                        let b: Vec<f64> = (0..k * n).map(|i| value(1 + t, r, i) as f64).collect();
                        let want: Vec<u32> = matmul(&a, &b, k, n).iter().map(|&x| (x as f32).to_bits()).collect();
                        assert_eq!(got[r][t], want, "{what} outs[{t}]");
                    }
                    let want_ag: Vec<u32> = a.iter().map(|&x| (x as f32).to_bits()).collect();
                    assert_eq!(got[r][c.ns.len()], want_ag, "{what} ag_out");
                    assert_eq!(got[r], single[r], "{what}: one host");
                }
            }
            one.iter().for_each(|g| g.release_scratch());
        }
    }

    #[derive(Clone, Copy)]
    struct RsCase {
        shape: &'static [usize],
        dim: usize,
        n: usize,
        op: ReduceOp,
        padded: bool,
    }

    const RS_CASES: &[RsCase] = &[
        RsCase { shape: &[8, 6], dim: 0, n: 5, op: ReduceOp::Sum, padded: false },
        RsCase { shape: &[8, 6], dim: 0, n: 3, op: ReduceOp::Avg, padded: true },
        RsCase { shape: &[2, 4, 6], dim: 1, n: 3, op: ReduceOp::Sum, padded: true },
        RsCase { shape: &[4, 3, 6], dim: 0, n: 2, op: ReduceOp::Avg, padded: false },
        RsCase { shape: &[3, 5], dim: 1, n: 8, op: ReduceOp::Sum, padded: true },
        RsCase { shape: &[2, 3, 5], dim: 2, n: 4, op: ReduceOp::Avg, padded: false },
        // Compute-bound chunks.
        RsCase { shape: &[3200, 6], dim: 0, n: 5, op: ReduceOp::Sum, padded: false },
        RsCase { shape: &[800, 6], dim: 1, n: 8, op: ReduceOp::Avg, padded: true },
        RsCase { shape: &[2, 1600, 4], dim: 1, n: 3, op: ReduceOp::Sum, padded: false },
    ];

    fn mm_rs_on(groups: &[Arc<Group>], c: RsCase) -> Vec<Vec<u32>> {
        let world = groups.len();
        let (last, k) = (c.shape.len() - 1, c.shape[c.shape.len() - 1]);
        let mut chunk = c.shape.to_vec();
        chunk[last] = c.n;
        chunk[c.dim] /= world;
        on_each(groups, |r, g| {
            let a = T::new(DType::F32, c.shape, c.padded, |i| value(0, r, i));
            let b = T::new(DType::F32, &[k, c.n], false, |i| value(1, r, i));
            let out = T::out(DType::F32, &chunk, c.padded);
            let call = MmRs {
                a: a.a.clone(),
                b: b.a.clone(),
                scatter_dim: c.dim as i64,
                op: c.op,
                out: out.a.clone(),
                scales: MmRsScales::default(),
                algorithm: None,
            };
            rs_op(g, Ok(call), Stream(0)).unwrap();
            out.bits()
        })
    }

    #[test]
    fn mm_rs_matches_one_host() {
        mm_rs_matches_one_host_on(PLACEMENTS, RS_CASES);
    }

    fn mm_rs_matches_one_host_on(placements: &[&[&str]], cases: &[RsCase]) {
        for hosts in placements {
            let world = hosts.len();
            let (groups, one) = (on_hosts(hosts), host_groups(world));
            for &c in cases {
                let (last, k) = (c.shape.len() - 1, c.shape[c.shape.len() - 1]);
                let numel: usize = c.shape.iter().product();
                let mut total = vec![0f64; numel / k * c.n];
                for r in 0..world {
                    let a: Vec<f64> = (0..numel).map(|i| value(0, r, i) as f64).collect();
                    let b: Vec<f64> = (0..k * c.n).map(|i| value(1, r, i) as f64).collect();
                    total.iter_mut().zip(matmul(&a, &b, k, c.n)).for_each(|(t, p)| *t += p);
                }
                if c.op == ReduceOp::Avg {
                    total.iter_mut().for_each(|t| *t /= world as f64);
                }
                let mut full = c.shape.to_vec();
                full[last] = c.n;
                let (outer, len) = (full[..c.dim].iter().product::<usize>(), full[c.dim] / world);
                let inner: usize = full[c.dim + 1..].iter().product();
                let got = mm_rs_on(&groups, c);
                let single = mm_rs_on(&one, c);
                for r in 0..world {
                    let want: Vec<u32> = (0..outer)
                        .flat_map(|o| {
                            let start = (o * full[c.dim] + r * len) * inner;
                            total[start..start + len * inner].to_vec()
                        })
                        .map(|x| (x as f32).to_bits())
                        .collect();
                    let what = format!("{hosts:?} {:?} dim {} {:?} rank {r}", c.shape, c.dim, c.op);
                    assert_eq!(got[r], want, "{what}");
                    assert_eq!(got[r], single[r], "{what}: one host");
                }
            }
            one.iter().for_each(|g| g.release_scratch());
        }
    }

    /// World 8 on two hosts of four ranks and four hosts of two
    /// (interleaved): both matmuls as one host computes them.
    #[test]
    fn matmuls_at_world_8_match_one_host() {
        ag_mm_matches_one_host(PLACEMENTS_8, &[AG_CASES[0], AG_CASES[2], AG_CASES[6]]);
        let compute_bound = RsCase { shape: &[6400, 6], dim: 0, n: 5, op: ReduceOp::Avg, padded: true };
        mm_rs_matches_one_host_on(PLACEMENTS_8, &[RS_CASES[0], RS_CASES[4], compute_bound]);
    }

    /// fp8: e4m3 operands with row-wise scales; fused_ag_mm into bf16 and
    /// fp8 outputs (with a bias and a result scale), mm_rs into an fp8
    /// `out` with a bias, and into bf16 with tensor-wise scales.
    /// `rows` per shard (from 320, fp8's matmuls split to overlap).
    fn fp8_on(groups: &[Arc<Group>], rows: usize) -> Vec<Vec<Vec<u32>>> {
        let world = groups.len();
        let (k, n) = (32, 16);
        let e4 = DType::F8E4M3;
        let small = |tag: usize, r: usize, i: usize| value(tag, r, i) * 0.5;
        on_each(groups, |r, g| {
            let col_major = |tag: usize, kk: usize, n: usize| {
                let t = T::new(e4, &[n, kk], false, |i| small(tag, r, i));
                T { a: Array { shape: vec![kk, n], strides: vec![1, kk], ..t.a.clone() }, data: t.data }
            };
            let f32s = |shape: &[usize], f: &dyn Fn(usize) -> f32| T::new(DType::F32, shape, false, f);
            let a = T::new(e4, &[rows, k], false, |i| small(0, r, i));
            let row_scale = f32s(&[rows, 1], &|i| 2f32.powi((r + i) as i32 % 3 - 1));
            let b = col_major(1, k, n);
            let col_scale = f32s(&[1, n], &|i| 2f32.powi(i as i32 % 2));
            let bias = T::new(DType::BF16, &[n], false, |i| i as f32 * 0.25 - 1.0);
            let result_scale = f32s(&[1], &|_| 4.0);
            let out_bf16 = T::out(DType::BF16, &[rows * world, n], false);
            let out_fp8 = T::out(e4, &[rows * world, n], true);
            let call = AgMm {
                a_shard: a.a.clone(),
                bs: vec![b.a.clone(), b.a.clone()],
                gather_dim: 0,
                ag_out: None,
                outs: vec![out_bf16.a.clone(), out_fp8.a.clone()],
                scales: AgMmScales {
                    a_scale: Some(row_scale.a.clone()),
                    b_scales: Some(vec![col_scale.a.clone(), col_scale.a.clone()]),
                    biases: Some(vec![None, Some(bias.a.clone())]),
                    result_scales: Some(vec![None, Some(result_scale.a.clone())]),
                },
                algorithm: None,
            };
            ag_op(g, Ok(call), Stream(0)).unwrap();
            let a = T::new(e4, &[rows * world, k], false, |i| small(2, r, i));
            let row_scale = f32s(&[rows * world, 1], &|i| 2f32.powi((r + i) as i32 % 3 - 1));
            let rs_fp8 = T::out(e4, &[rows, n], false);
            let call = MmRs {
                a: a.a.clone(),
                b: b.a.clone(),
                scatter_dim: 0,
                op: ReduceOp::Sum,
                out: rs_fp8.a.clone(),
                scales: MmRsScales {
                    a_scale: Some(row_scale.a.clone()),
                    b_scale: Some(col_scale.a.clone()),
                    bias: Some(bias.a.clone()),
                    result_scale: Some(result_scale.a.clone()),
                },
                algorithm: None,
            };
            rs_op(g, Ok(call), Stream(0)).unwrap();
            let tensor_scale = f32s(&[1], &|_| 0.5);
            let wide = col_major(3, k, n * world);
            let rs_bf16 = T::out(DType::BF16, &[rows * world, n], true);
            let call = MmRs {
                a: a.a.clone(),
                b: wide.a.clone(),
                scatter_dim: 1,
                op: ReduceOp::Avg,
                out: rs_bf16.a.clone(),
                scales: MmRsScales {
                    a_scale: Some(tensor_scale.a.clone()),
                    b_scale: Some(tensor_scale.a.clone()),
                    bias: None,
                    result_scale: None,
                },
                algorithm: None,
            };
            rs_op(g, Ok(call), Stream(0)).unwrap();
            let outs = [out_bf16, out_fp8, rs_fp8, rs_bf16];
            for (i, t) in outs.iter().enumerate() {
                let poison = T::out(t.a.dtype, &[1], false).bits()[0];
                assert!(t.bits().iter().all(|&x| x != poison), "rank {r} output {i}: poison left");
            }
            outs.iter().map(T::bits).collect()
        })
    }

    #[test]
    fn fp8_matches_one_host() {
        for hosts in PLACEMENTS {
            let world = hosts.len();
            let (groups, one) = (on_hosts(hosts), host_groups(world));
            for rows in [4, 400] {
                let (got, single) = (fp8_on(&groups, rows), fp8_on(&one, rows));
                for r in 0..world {
                    for (i, (g, s)) in got[r].iter().zip(&single[r]).enumerate() {
                        assert_eq!(g, s, "{hosts:?} {rows} rows, rank {r} output {i}");
                    }
                }
            }
            one.iter().for_each(|g| g.release_scratch());
        }
    }

    /// A call that differs between ranks fails with `Mismatch` on every
    /// rank, one invalid on one rank fails every rank (`Remote` on the
    /// others); neither writes an output, and the group stays usable.
    #[test]
    fn bad_calls_fail_every_rank_and_change_nothing() {
        let groups = on_hosts(&["a", "b", "a", "b"]);
        let world = groups.len();
        // (the odd rank, its B's extra rows (invalid), its extra N and rows of a (valid, different))
        for (odd, k_extra, more, kind) in [(2, 0, 2, ErrorKind::Mismatch), (1, 1, 0, ErrorKind::InvalidArgument)] {
            let results = on_each(&groups, |r, g| {
                let (k, n) = if r == odd { (4 + k_extra, 3 + more) } else { (4, 3) };
                let a = T::new(DType::F32, &[2, 4], false, |i| value(0, r, i));
                let b = T::new(DType::F32, &[k, n], false, |i| value(1, r, i));
                let out = T::out(DType::F32, &[2 * world, n], false);
                let call = AgMm {
                    a_shard: a.a.clone(),
                    bs: vec![b.a.clone()],
                    gather_dim: 0,
                    ag_out: None,
                    outs: vec![out.a.clone()],
                    scales: AgMmScales::default(),
                    algorithm: None,
                };
                let e = ag_op(g, Ok(call), Stream(0)).unwrap_err();
                let rows = if r == odd { 4 + 4 * more } else { 4 };
                let a = T::new(DType::F32, &[rows, 4], false, |i| value(0, r, i));
                let rs_out = T::out(DType::F32, &[rows / world, n], false);
                let call = MmRs {
                    a: a.a.clone(),
                    b: b.a.clone(),
                    scatter_dim: 0,
                    op: ReduceOp::Sum,
                    out: rs_out.a.clone(),
                    scales: MmRsScales::default(),
                    algorithm: None,
                };
                let e2 = rs_op(g, Ok(call), Stream(0)).unwrap_err();
                (e, e2, out.f32s().iter().chain(&rs_out.f32s()).all(|x| x.is_nan()))
            });
            for (r, (e, e2, untouched)) in results.into_iter().enumerate() {
                for e in [e, e2] {
                    let want = if kind == ErrorKind::Mismatch || r == odd { kind } else { ErrorKind::Remote };
                    assert_eq!(e.kind, want, "rank {r}: {}", e.msg);
                }
                assert!(untouched, "rank {r}");
            }
        }
        // Still usable.
        let got = mm_rs_on(&groups, RS_CASES[0]);
        assert!(got.iter().all(|o| o.iter().all(|&x| !f32::from_bits(x).is_nan())));
        // Hosts of unequal sizes: Unsupported on every rank.
        let uneven = on_hosts(&["a", "a", "b"]);
        for e in on_each(&uneven, |r, g| {
            let a = T::new(DType::F32, &[3, 4], false, |i| value(0, r, i));
            let b = T::new(DType::F32, &[4, 2], false, |i| value(1, r, i));
            let out = T::out(DType::F32, &[1, 2], false);
            let call = MmRs {
                a: a.a.clone(),
                b: b.a.clone(),
                scatter_dim: 0,
                op: ReduceOp::Sum,
                out: out.a.clone(),
                scales: MmRsScales::default(),
                algorithm: None,
            };
            rs_op(g, Ok(call), Stream(0)).unwrap_err()
        }) {
            assert_eq!(e.kind, ErrorKind::Unsupported);
            assert!(e.msg.contains("different numbers of ranks"), "{}", e.msg);
        }
    }
}
