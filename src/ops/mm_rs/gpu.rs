//! `mm_rs` on GPUs (one process, a thread per rank).
//!
//! At decode sizes on `SYMM_TEST_WORLD` GPUs (default 2), sequential: the reduce-scatter on the LL
//! lines (`Decision::lines`) against a float64 reference by relative error, every
//! float dtype, sum and average, into a contiguous and a padded output
//! (poisoned first: an element left unwritten fails), three calls back to
//! back with new values (the repeats replay as one graph), each call one
//! launch counted in the all-reduce buffer, with an all-reduce between
//! them on the same buffer.
//!
//! On two GPUs, the two-rank pipelined path with the peer's chunk computed
//! and announced in pieces (`Decision::pieces`) or whole, forced on small
//! shapes (matrices and `[batch, seq, hidden]` scattered along the
//! sequence, contiguous and padded outputs, pieces the rows do not divide
//! evenly) and chosen by the cost model on a comm-heavy shape
//! (4096 x 2048 x 8192, the rows at every piece's edges checked); bf16
//! against float64 by relative error, outputs poisoned first.
//!
//! Named `gpu_*`; skipped with fewer GPUs.

use super::*;
use crate::backend::cuda::gpu_testing::{gpu_on, rel_err};
use crate::ops::testing::{cuda_groups, gpu_test_world, on_each};
use crate::ops::{all_reduce, AllReduce};
use half::{bf16, f16};

/// Value `i` of a tensor tagged `tag`: small, of both signs, never zero
/// throughout.
fn value(tag: usize, i: usize) -> f64 {
    ((i * 37 + tag * 101) % 23) as f64 / 8.0 - 1.375
}

fn encode(dtype: DType, v: &[f64]) -> Vec<u8> {
    match dtype {
        DType::F32 => v.iter().flat_map(|&x| (x as f32).to_le_bytes()).collect(),
        DType::BF16 => v.iter().flat_map(|&x| bf16::from_f64(x).to_le_bytes()).collect(),
        _ => v.iter().flat_map(|&x| f16::from_f64(x).to_le_bytes()).collect(),
    }
}

fn decode(dtype: DType, b: &[u8]) -> Vec<f32> {
    match dtype {
        DType::F32 => b.chunks(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect(),
        DType::BF16 => b.chunks(2).map(|c| bf16::from_le_bytes(c.try_into().unwrap()).to_f32()).collect(),
        _ => b.chunks(2).map(|c| f16::from_le_bytes(c.try_into().unwrap()).to_f32()).collect(),
    }
}

#[test]
fn gpu_mm_rs_decode_sizes_reduce_scatter_on_the_lines() {
    let world = gpu_test_world();
    let Some(groups) = cuda_groups(world) else { return };
    let tolerance = |d: DType| if d == DType::F32 { 1e-5 } else { 1.5e-2 };
    // (rows of a per rank, a multiple of the world; k, n, padded output)
    let cases = [
        (world * 16_usize.div_ceil(world), 256, 512, false),
        (8 * world, 512, 1024, true),
        (world * 64_usize.div_ceil(world), 1024, 512, false),
    ];
    for dtype in [DType::BF16, DType::F16, DType::F32] {
        for &(m, k, n, padded) in &cases {
            for op in [ReduceOp::Sum, ReduceOp::Avg] {
                let what = format!("{dtype} {m}x{k}x{n} padded {padded} {op:?}");
                let rows = m / world;
                let ld = if padded { n + 8 } else { n };
                on_each(&groups, |r, g| {
                    let gpu = gpu_on(r as i32);
                    let b: Vec<f64> = (0..k * n).map(|i| value(50 + r, i)).collect();
                    let bbuf = gpu.upload(&encode(dtype, &b));
                    let abuf = gpu.alloc(m * k * dtype.size());
                    let outbuf = gpu.alloc(rows * ld * dtype.size());
                    // The all-reduce buffer (its place and size) and its call
                    // count (device memory): a call that grows the buffer counts
                    // from 0 in the new one, which may lie where the old one did.
                    let lines_calls = || {
                        let h = crate::ops::state::of(g).scratch(crate::ops::state::Scratch::AllReduce);
                        h.map_or(((0, 0), 0), |h| {
                            let (addr, size) = (h.buffer().addr(), h.buffer().size());
                            ((addr, size), u32::from_le_bytes(gpu.read_at(addr, 4).try_into().unwrap()))
                        })
                    };
                    for call_no in 0..3 {
                        let a: Vec<f64> = (0..m * k).map(|i| value(r + 10 * call_no, i)).collect();
                        gpu.write_at(abuf.ptr, &encode(dtype, &a));
                        gpu.write_at(outbuf.ptr, &encode(dtype, &vec![f64::NAN; rows * ld]));
                        let before = lines_calls();
                        let call = MmRs {
                            a: Array::contiguous(abuf.ptr, dtype, &[m, k]),
                            b: Array::contiguous(bbuf.ptr, dtype, &[k, n]),
                            scatter_dim: 0,
                            op,
                            out: Array { addr: outbuf.ptr, dtype, shape: vec![rows, n], strides: vec![ld, 1] },
                            scales: MmRsScales::default(),
                            algorithm: Some(Algorithm::Sequential),
                        };
                        mm_rs(g, Ok(call), gpu.stream()).unwrap_or_else(|e| panic!("{what}: {}", e.msg));
                        gpu.sync();
                        let (buffer, count) = lines_calls();
                        let want = if buffer == before.0 { before.1 + 1 } else { 1 };
                        assert_eq!(count, want, "{what}: one launch on the lines");
                        // The reference: every rank's rows of this rank's chunk.
                        let scale = if op == ReduceOp::Avg { 1.0 / world as f64 } else { 1.0 };
                        let mut want = vec![0f64; rows * n];
                        for q in 0..world {
                            for (i, j) in (0..rows).flat_map(|i| (0..n).map(move |j| (i, j))) {
                                let row = r * rows + i;
                                let dot: f64 = (0..k)
                                    .map(|h| value(q + 10 * call_no, row * k + h) * value(50 + q, h * n + j))
                                    .sum();
                                want[i * n + j] += scale * dot;
                            }
                        }
                        let out = decode(dtype, &gpu.read_at(outbuf.ptr, rows * ld * dtype.size()));
                        let got: Vec<f32> = (0..rows).flat_map(|i| out[i * ld..i * ld + n].to_vec()).collect();
                        assert!(got.iter().all(|v| v.is_finite()), "{what}: an element was not written");
                        let err = rel_err(&got, &want);
                        assert!(err < tolerance(dtype), "{what} call {call_no} rank {r}: relative error {err}");
                        if padded {
                            let gaps = (0..rows).flat_map(|i| out[i * ld + n..(i + 1) * ld].to_vec());
                            assert!(gaps.into_iter().all(f32::is_nan), "{what}: padding written");
                        }
                        // An all-reduce on the same buffer in between.
                        let x = gpu.upload(&encode(DType::F32, &[1.0, 2.0, 3.0, 4.0]));
                        let ar = AllReduce {
                            input: Array::contiguous(x.ptr, DType::F32, &[4]),
                            output: Array::contiguous(x.ptr, DType::F32, &[4]),
                            op: ReduceOp::Sum,
                            norm: None,
                            algorithm: None,
                        };
                        all_reduce(g, Ok(ar), gpu.stream()).unwrap();
                        gpu.sync();
                        let summed = decode(DType::F32, &gpu.read_at(x.ptr, 16));
                        assert_eq!(summed, [1.0, 2.0, 3.0, 4.0].map(|v| v * world as f32));
                    }
                });
            }
        }
    }
    groups.iter().for_each(|g| g.release_scratch());
}

/// Both ranks' A times B `[k, n]` (bf16), pipelined, the peer's chunk in
/// pieces where `theirs_in_pieces` says (else as the cost model decides),
/// into an output whose rows are `ld` apart. A is `[2 * seq, k]`
/// scattered by rows (`batch` 0), or `[batch, 2 * seq, k]` along the
/// sequence. `check`: the rows of each rank's chunk compared (of
/// `max(batch, 1) * seq`). Returns the `Decision::pieces` each rank ran.
fn pipelined_case(
    groups: &[Arc<crate::group::Group>],
    (batch, seq, k, n, ld): (usize, usize, usize, usize, usize),
    theirs_in_pieces: Option<bool>,
    check: &[usize],
) -> Vec<usize> {
    let what = format!("batch {batch} seq {seq} x{k}x{n} ld {ld}, peer's chunk in pieces: {theirs_in_pieces:?}");
    let (rows, b0) = (batch.max(1) * seq, batch.max(1));
    let (a_shape, out_shape, out_strides, dim) = match batch {
        0 => (vec![2 * seq, k], vec![seq, n], vec![ld, 1], 0),
        _ => (vec![batch, 2 * seq, k], vec![batch, seq, n], vec![seq * ld, ld, 1], 1),
    };
    // Row i of rank r's chunk comes from row `a_row(r, i)` of A (as [rows, k]).
    let a_row = |r: usize, i: usize| (i / seq) * 2 * seq + r * seq + i % seq;
    on_each(groups, |r, g| {
        let gpu = gpu_on(r as i32);
        let a = gpu.upload(&encode(DType::BF16, &(0..2 * rows * k).map(|i| value(r, i)).collect::<Vec<_>>()));
        let b = gpu.upload(&encode(DType::BF16, &(0..k * n).map(|i| value(50 + r, i)).collect::<Vec<_>>()));
        let out = gpu.upload(&encode(DType::BF16, &vec![f64::NAN; rows * ld]));
        let call = MmRs {
            a: Array::contiguous(a.ptr, DType::BF16, &a_shape),
            b: Array::contiguous(b.ptr, DType::BF16, &[k, n]),
            scatter_dim: dim,
            op: ReduceOp::Sum,
            out: Array { addr: out.ptr, dtype: DType::BF16, shape: out_shape.clone(), strides: out_strides.clone() },
            scales: MmRsScales::default(),
            algorithm: Some(Algorithm::Pipelined),
        };
        let mut ran = 0;
        crate::ops::run_prepared(g, gpu.stream(), Ok(call), |c| {
            let signature = c.signature(None, None);
            let prepared = c.prepare(&Facts::of(g), "cuda", false).map(|mut p| {
                assert!(p.onto_pieces.is_some(), "{what}: not the path onto the pulled partials");
                if let Some(split) = theirs_in_pieces {
                    p.decision.pieces = if split { p.onto_pieces.unwrap_or(1) } else { 1 };
                }
                ran = p.decision.pieces;
                p
            });
            (crate::ops::with_algorithm(signature, prepared.as_ref().map(|p| p.decision.algorithm)), prepared)
        })
        .unwrap_or_else(|e| panic!("{what}: {}", e.msg));
        gpu.sync();
        let got = decode(DType::BF16, &gpu.read_at(out.ptr, rows * ld * 2));
        let (mut mine, mut want) = (Vec::new(), Vec::new());
        for &i in check {
            for j in 0..n {
                mine.push(got[i * ld + j]);
                let row = a_row(r, i);
                want.push(
                    (0..2).map(|q| (0..k).map(|h| value(q, row * k + h) * value(50 + q, h * n + j)).sum::<f64>()).sum(),
                );
            }
            assert!(got[i * ld + n..(i + 1) * ld].iter().all(|v| v.is_nan()), "{what}: rank {r} wrote padding");
        }
        assert!(mine.iter().all(|v| v.is_finite()), "{what}: rank {r} left an element unwritten");
        let err = rel_err(&mine, &want);
        assert!(err < 1.5e-2, "{what}: rank {r} relative error {err} ({b0} batches)");
        ran
    })
}

#[test]
fn gpu_mm_rs_pipelined_in_pieces() {
    let Some(groups) = cuda_groups(2) else { return };
    // Forced, every row checked: 1100 rows make two pieces of 550; a
    // sequence scatter of 3 batches of 400 two pieces of 1 and 2 batches.
    let cases = [
        ((0, 1100, 384, 256, 256), true),
        ((0, 1100, 384, 256, 264), true),
        ((0, 2048, 256, 512, 512), false),
        ((3, 400, 256, 384, 384), true),
        ((3, 400, 256, 384, 392), false),
    ];
    for (shape, split) in cases {
        let rows = shape.0.max(1) * shape.1;
        let ran = pipelined_case(&groups, shape, Some(split), &(0..rows).collect::<Vec<_>>());
        assert!(ran.iter().all(|&p| (p > 1) == split), "{shape:?}: ran {ran:?}");
    }
    // Chosen: comm-heavy, two pieces of 1024 rows; their edges checked.
    let edges: Vec<usize> = (0..2).flat_map(|j| [j * 1024, j * 1024 + 1023]).collect();
    let ran = pipelined_case(&groups, (0, 2048, 2048, 8192, 8192), None, &edges);
    assert_eq!(ran, [2, 2], "4096 x 2048 x 8192 at two ranks: the cost model's pieces");
    groups.iter().for_each(|g| g.release_scratch());
}
