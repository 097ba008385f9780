//! Sequence parallelism on the host backend: `[batch, seq, hidden]`
//! activations gathered (`fused_ag_mm`) or scattered (`mm_rs`) along dim
//! 1, whose per-rank slices are batches of strided matrices (see
//! `batched_operands`). Worlds 1 to 4, both unfused algorithms, bf16, f16
//! and f32, sequence slices that are not multiples of 8, padded and
//! poisoned outputs whose gaps must stay untouched. Inputs are small
//! integers, so every product sum is exact in f32 and the reference (f64
//! sums, then the documented roundings: each partial to the output type,
//! the f32 sum and scale, the output type) is exact: compared bit for bit.
//! With the same helpers: small shards gathered and small chunks
//! reduce-scattered on the LL lines, and
//! `mm_rs` calls whose layouts differ between ranks.

use super::testing::{host_groups, lines_calls, on_each};
use super::{batched_operands, fused_ag_mm, mm_rs, AgMm, AgMmScales, MmRs, MmRsScales, ReduceOp};
use crate::array::{contiguous_strides, Array, DType};
use crate::backend::Stream;
use crate::cost::Algorithm;
use crate::group::Group;
use half::{bf16, f16};
use std::sync::Arc;

/// Bits no result has (a NaN of each type), so an untouched element shows.
fn poison(dtype: DType) -> u32 {
    match dtype {
        DType::F32 => 0x7fc0_dead,
        _ => 0x7e5a,
    }
}

/// 16-byte aligned elements of one float type, read and written as f64.
struct Buf {
    words: Vec<u128>,
    dtype: DType,
}

impl Buf {
    fn new(len: usize, dtype: DType) -> Buf {
        let mut b = Buf { words: vec![0; (len * dtype.size()).div_ceil(16)], dtype };
        (0..len).for_each(|i| b.set_bits(i, poison(dtype)));
        b
    }
    fn of(values: &[f64], dtype: DType) -> Buf {
        let mut b = Buf::new(values.len(), dtype);
        values.iter().enumerate().for_each(|(i, &v)| b.set_bits(i, encode(dtype, v)));
        b
    }
    fn bytes(&self) -> &[u8] {
        // SAFETY: the vector's storage, viewed as bytes.
        unsafe { std::slice::from_raw_parts(self.words.as_ptr() as *const u8, self.words.len() * 16) }
    }
    fn bits(&self, i: usize) -> u32 {
        let s = self.dtype.size();
        let mut word = [0u8; 4];
        word[..s].copy_from_slice(&self.bytes()[i * s..(i + 1) * s]);
        u32::from_le_bytes(word)
    }
    fn set_bits(&mut self, i: usize, bits: u32) {
        let s = self.dtype.size();
        // SAFETY: as `bytes`, mutably; `i` is inside the buffer.
        let bytes =
            unsafe { std::slice::from_raw_parts_mut(self.words.as_mut_ptr() as *mut u8, self.words.len() * 16) };
        bytes[i * s..(i + 1) * s].copy_from_slice(&bits.to_le_bytes()[..s]);
    }
    fn array(&self, shape: &[usize], strides: &[usize]) -> Array {
        Array { addr: self.words.as_ptr() as u64, dtype: self.dtype, shape: shape.to_vec(), strides: strides.to_vec() }
    }
}

/// `v` rounded once to `dtype` (to nearest even), as bits.
fn encode(dtype: DType, v: f64) -> u32 {
    match dtype {
        DType::F32 => (v as f32).to_bits(),
        DType::BF16 => bf16::from_f64(v).to_bits() as u32,
        DType::F16 => f16::from_f64(v).to_bits() as u32,
        other => panic!("no {other} here"),
    }
}

fn decode(dtype: DType, bits: u32) -> f64 {
    match dtype {
        DType::F32 => f32::from_bits(bits) as f64,
        DType::BF16 => bf16::from_bits(bits as u16).to_f64(),
        DType::F16 => f16::from_bits(bits as u16).to_f64(),
        other => panic!("no {other} here"),
    }
}

/// A small integer, exact in every type.
fn value(tag: usize, i: usize) -> f64 {
    ((i * 7 + tag * 13 + i / 5) % 9) as f64 - 4.0
}

/// (batch, sequence per rank, hidden, n): sequence slices of 3, 5 and 11
/// rows (not multiples of 8), one of 8; a batch of one, whose slice is a
/// matrix (the direct path beside the batched one).
const SHAPES: [(usize, usize, usize, usize); 4] = [(2, 3, 16, 8), (3, 8, 32, 24), (4, 11, 24, 40), (1, 5, 8, 4)];
const DTYPES: [DType; 3] = [DType::BF16, DType::F16, DType::F32];
const ALGORITHMS: [Algorithm; 2] = [Algorithm::Pipelined, Algorithm::Sequential];

/// Elements of the padded, gapped `[batch, seq, n]` output layout: rows of
/// `n + 3`, batches `seq * (n + 3) + 5` apart.
fn padded(batch: usize, seq: usize, n: usize) -> (Vec<usize>, usize) {
    let strides = vec![seq * (n + 3) + 5, n + 3, 1];
    (strides.clone(), (batch - 1) * strides[0] + seq * strides[1])
}

/// The elements of a `[batch, seq, n]` layout with `strides` that hold
/// values: (flat index, b, s, j).
fn elements(batch: usize, seq: usize, n: usize, strides: &[usize]) -> Vec<(usize, usize, usize, usize)> {
    let mut v = Vec::new();
    for b in 0..batch {
        for s in 0..seq {
            for j in 0..n {
                v.push((b * strides[0] + s * strides[1] + j * strides[2], b, s, j));
            }
        }
    }
    v
}

/// Every element outside those is still poison.
fn gaps_untouched(buf: &Buf, len: usize, held: &[(usize, usize, usize, usize)], what: &str) {
    let mut is_held = vec![false; len];
    held.iter().for_each(|&(i, ..)| is_held[i] = true);
    for (i, _) in is_held.iter().enumerate().filter(|(_, &h)| !h) {
        assert_eq!(buf.bits(i), poison(buf.dtype), "{what}: the gap at element {i} was written");
    }
}

/// Rank r's shard `[batch, seq, hidden]` (padded rows when `pad`, still a
/// matrix), `B` `[hidden, n]` (column-major when `col_major`), gathered
/// along dim 1 into a padded, poisoned output, and `ag_out`.
fn ag_mm_case(groups: &[Arc<Group>], shape: (usize, usize, usize, usize), dtype: DType, algorithm: Algorithm) {
    let (batch, seq, hidden, n) = shape;
    let world = groups.len();
    let total = seq * world;
    let (pad, col_major) = (seq % 2 == 1, batch % 2 == 0);
    let a_val = |r: usize, b: usize, s: usize, h: usize| value(r + 1, (b * seq + s) * hidden + h);
    let b_val = |h: usize, j: usize| value(50, h * n + j);
    let (out_strides, out_len) = padded(batch, total, n);
    let got = on_each(groups, |r, g| {
        let a_strides =
            if pad { vec![seq * (hidden + 2), hidden + 2, 1] } else { contiguous_strides(&[batch, seq, hidden]) };
        let mut a = Buf::new(batch * a_strides[0], dtype);
        for (i, b, s, h) in elements(batch, seq, hidden, &a_strides) {
            a.set_bits(i, encode(dtype, a_val(r, b, s, h)));
        }
        let b_strides = if col_major { vec![1, hidden] } else { vec![n, 1] };
        let mut bm = Buf::new(hidden * n, dtype);
        for h in 0..hidden {
            for j in 0..n {
                bm.set_bits(h * b_strides[0] + j * b_strides[1], encode(dtype, b_val(h, j)));
            }
        }
        let out = Buf::new(out_len, dtype);
        let ag = Buf::new(batch * total * hidden, dtype);
        let call = AgMm {
            a_shard: a.array(&[batch, seq, hidden], &a_strides),
            bs: vec![bm.array(&[hidden, n], &b_strides)],
            gather_dim: 1,
            ag_out: Some(ag.array(&[batch, total, hidden], &contiguous_strides(&[batch, total, hidden]))),
            outs: vec![out.array(&[batch, total, n], &out_strides)],
            scales: AgMmScales::default(),
            algorithm: Some(algorithm),
        };
        fused_ag_mm(g, Ok(call), Stream(0)).unwrap();
        (out, ag)
    });
    let what = format!("ag_mm world {world} {shape:?} {dtype} {algorithm:?}");
    let held = elements(batch, total, n, &out_strides);
    for (r, (out, ag)) in got.iter().enumerate() {
        for &(i, b, s, j) in &held {
            let (owner, row) = (s / seq, s % seq);
            let dot: f64 = (0..hidden).map(|h| a_val(owner, b, row, h) * b_val(h, j)).sum();
            let want = encode(dtype, dot);
            assert_eq!(
                out.bits(i),
                want,
                "{what}: rank {r} out[{b}, {s}, {j}] = {}, want {dot}",
                decode(dtype, out.bits(i))
            );
        }
        gaps_untouched(out, out_len, &held, &format!("{what}: rank {r}"));
        for (i, b, s, h) in elements(batch, total, hidden, &contiguous_strides(&[batch, total, hidden])) {
            assert_eq!(
                ag.bits(i),
                encode(dtype, a_val(s / seq, b, s % seq, h)),
                "{what}: rank {r} ag_out[{b}, {s}, {h}]"
            );
        }
    }
}

/// Rank r's `a` `[batch, seq * world, hidden]` with padded rows and gaps
/// between batches (each chunk's rows strided), scattered along dim 1
/// into a padded, poisoned `[batch, seq, n]` output.
fn mm_rs_case(
    groups: &[Arc<Group>],
    shape: (usize, usize, usize, usize),
    dtype: DType,
    algorithm: Algorithm,
    op: ReduceOp,
) {
    let (batch, seq, hidden, n) = shape;
    let world = groups.len();
    let total = seq * world;
    let a_val = |r: usize, b: usize, s: usize, h: usize| value(r + 1, (b * total + s) * hidden + h);
    let b_val = |r: usize, h: usize, j: usize| value(50 + r, h * n + j);
    let (out_strides, out_len) = padded(batch, seq, n);
    let outs = on_each(groups, |r, g| {
        let a_strides = vec![total * (hidden + 1) + 3, hidden + 1, 1];
        let mut a = Buf::new(batch * a_strides[0], dtype);
        for (i, b, s, h) in elements(batch, total, hidden, &a_strides) {
            a.set_bits(i, encode(dtype, a_val(r, b, s, h)));
        }
        let bm = Buf::of(&(0..hidden * n).map(|e| b_val(r, e / n, e % n)).collect::<Vec<_>>(), dtype);
        let out = Buf::new(out_len, dtype);
        let call = MmRs {
            a: a.array(&[batch, total, hidden], &a_strides),
            b: bm.array(&[hidden, n], &[n, 1]),
            scatter_dim: 1,
            op,
            out: out.array(&[batch, seq, n], &out_strides),
            scales: MmRsScales::default(),
            algorithm: Some(algorithm),
        };
        mm_rs(g, Ok(call), Stream(0)).unwrap();
        out
    });
    let what = format!("mm_rs world {world} {shape:?} {dtype} {algorithm:?} {op:?}");
    let held = elements(batch, seq, n, &out_strides);
    let scale = match op {
        ReduceOp::Sum => 1.0f32,
        ReduceOp::Avg => 1.0 / world as f32,
    };
    for (r, out) in outs.iter().enumerate() {
        for &(i, b, s, j) in &held {
            // Each rank's partial in the output type, summed in f32 in rank
            // order (exact: small integers), scaled, rounded once more.
            let row = r * seq + s;
            let partial = |q: usize| {
                let dot: f64 = (0..hidden).map(|h| a_val(q, b, row, h) * b_val(q, h, j)).sum();
                decode(dtype, encode(dtype, dot))
            };
            let sum: f64 = (0..world).map(partial).sum();
            let want = encode(dtype, (scale * sum as f32) as f64);
            assert_eq!(
                out.bits(i),
                want,
                "{what}: rank {r} out[{b}, {s}, {j}] = {}, sum {sum}",
                decode(dtype, out.bits(i))
            );
        }
        gaps_untouched(out, out_len, &held, &format!("{what}: rank {r}"));
    }
}

#[test]
fn gathering_the_sequence_dimension() {
    for world in 1..=4 {
        let groups = host_groups(world);
        for shape in SHAPES {
            for dtype in DTYPES {
                for algorithm in ALGORITHMS {
                    ag_mm_case(&groups, shape, dtype, algorithm);
                }
            }
        }
        groups.iter().for_each(|g| g.release_scratch());
    }
}

#[test]
fn scattering_the_sequence_dimension() {
    for world in 1..=4 {
        let groups = host_groups(world);
        for shape in SHAPES {
            for dtype in DTYPES {
                for algorithm in ALGORITHMS {
                    for op in [ReduceOp::Sum, ReduceOp::Avg] {
                        mm_rs_case(&groups, shape, dtype, algorithm, op);
                    }
                }
            }
        }
        groups.iter().for_each(|g| g.release_scratch());
    }
}

/// Ranks gather small shards on the LL lines when sequential (`Decision::lines`): the same results, padded
/// shards staged first, every call one launch of the device-side
/// all-gather (numbered in the all-reduce buffer), none when pipelined.
#[test]
fn sequential_gathers_small_shards_on_the_lines() {
    for world in [2, 3, 4, 8] {
        let groups = host_groups(world);
        for (i, shape) in SHAPES.into_iter().enumerate() {
            ag_mm_case(&groups, shape, DType::BF16, Algorithm::Sequential);
            ag_mm_case(&groups, shape, DType::BF16, Algorithm::Pipelined);
            for g in &groups {
                assert_eq!(lines_calls(g), Some(i as u32 + 1), "world {world} {shape:?}");
            }
        }
        groups.iter().for_each(|g| g.release_scratch());
    }
}

/// Ranks reduce-scatter small chunks on the LL lines when sequential
/// (`Decision::lines`): the same bits as the other paths (summed in f32 in
/// rank order), into a padded output through the workspace, every call one
/// launch of the device-side reduce-scatter (numbered in the all-reduce
/// buffer), none when pipelined.
#[test]
fn sequential_reduce_scatters_small_chunks_on_the_lines() {
    for world in [2, 3, 4, 8] {
        let groups = host_groups(world);
        let mut calls = 0;
        for shape in SHAPES {
            for op in [ReduceOp::Sum, ReduceOp::Avg] {
                mm_rs_case(&groups, shape, DType::BF16, Algorithm::Sequential, op);
                mm_rs_case(&groups, shape, DType::BF16, Algorithm::Pipelined, op);
                calls += 1;
                for g in &groups {
                    assert_eq!(lines_calls(g), Some(calls), "world {world} {shape:?} {op:?}");
                }
            }
        }
        groups.iter().for_each(|g| g.release_scratch());
    }
}

/// The slices the two operations multiply are the batches the tests above
/// mean to exercise: one strided-batched matmul each, B shared.
#[test]
fn sequence_slices_are_batched_in_place() {
    let t = |addr: u64, shape: &[usize], strides: &[usize]| Array {
        addr,
        dtype: DType::BF16,
        shape: shape.to_vec(),
        strides: strides.to_vec(),
    };
    let b = t(0x9000, &[16, 8], &[8, 1]);
    // Rank 1's slice of a [2, 6, 8] output (seq 3 per rank), from its
    // contiguous [2, 3, 16] shard: 2 matrices of 3 x 8, 48 elements apart.
    let out = t(0x1000, &[2, 6, 8], &[48, 8, 1]).narrow(1, 3, 3);
    let shard = t(0x5000, &[2, 3, 16], &[48, 16, 1]);
    let [d, l, r] = batched_operands(&out, &shard, &b).unwrap();
    assert_eq!((d.addr, d.shape.as_slice(), d.strides.as_slice()), (0x1000 + 48, &[2, 3, 8][..], &[48, 8, 1][..]));
    assert_eq!((l.shape.as_slice(), l.strides.as_slice()), (&[2, 3, 16][..], &[48, 16, 1][..]));
    assert_eq!((r.addr, r.shape.as_slice(), r.strides.as_slice()), (0x9000, &[2, 16, 8][..], &[0, 8, 1][..]));
    // mm_rs: chunk 1 of a padded [2, 6, 16] read in place into a contiguous chunk.
    let a = t(0x5000, &[2, 6, 16], &[6 * 17 + 3, 17, 1]).narrow(1, 3, 3);
    let [_, l, _] = batched_operands(&t(0x1000, &[2, 3, 8], &[24, 8, 1]), &a, &b).unwrap();
    assert_eq!((l.addr, l.strides.as_slice()), (0x5000 + 3 * 17 * 2, &[6 * 17 + 3, 17, 1][..]));
    // Not in place: a transposed output's batches interleave; columns that
    // are not unit-strided; leading shapes that differ.
    let interleaved = t(0x1000, &[2, 6, 8], &[8, 16, 1]).narrow(1, 3, 3);
    assert!(batched_operands(&interleaved, &shard, &b).is_none());
    assert!(batched_operands(&t(0x1000, &[2, 3, 8], &[48, 16, 2]), &shard, &b).is_none());
    assert!(batched_operands(&t(0x1000, &[3, 2, 8], &[48, 8, 1]), &shard, &b).is_none());
}

/// Ranks whose `a` differ in layout (rank 0's a matrix, rank 1's batches
/// padded apart, no matrix) take the same path, scattering dim 0 by each
/// algorithm: the layout is each rank's own business, never agreed.
#[test]
fn layouts_that_differ_between_ranks_scatter_alike() {
    let (batch, seq, hidden, n) = (4, 3, 8, 5);
    let groups = host_groups(2);
    let a_val = |r: usize, b: usize, s: usize, h: usize| value(r + 1, (b * seq + s) * hidden + h);
    let b_val = |r: usize, h: usize, j: usize| value(50 + r, h * n + j);
    for algorithm in ALGORITHMS {
        let outs = on_each(&groups, |r, g| {
            let a_strides =
                if r == 0 { contiguous_strides(&[batch, seq, hidden]) } else { vec![seq * hidden + 5, hidden, 1] };
            let mut a = Buf::new(batch * a_strides[0], DType::F32);
            for (i, b, s, h) in elements(batch, seq, hidden, &a_strides) {
                a.set_bits(i, encode(DType::F32, a_val(r, b, s, h)));
            }
            let bm = Buf::of(&(0..hidden * n).map(|e| b_val(r, e / n, e % n)).collect::<Vec<_>>(), DType::F32);
            let out = Buf::new(batch / 2 * seq * n, DType::F32);
            let call = MmRs {
                a: a.array(&[batch, seq, hidden], &a_strides),
                b: bm.array(&[hidden, n], &[n, 1]),
                scatter_dim: 0,
                op: ReduceOp::Sum,
                out: out.array(&[batch / 2, seq, n], &contiguous_strides(&[batch / 2, seq, n])),
                scales: MmRsScales::default(),
                algorithm: Some(algorithm),
            };
            mm_rs(g, Ok(call), Stream(0)).map(|()| out)
        });
        for (r, out) in outs.into_iter().enumerate() {
            let out = out.unwrap_or_else(|e| panic!("{algorithm:?}: rank {r}: {}", e.msg));
            for (i, b, s, j) in elements(batch / 2, seq, n, &contiguous_strides(&[batch / 2, seq, n])) {
                let want: f64 = (0..2)
                    .map(|q| (0..hidden).map(|h| a_val(q, r * batch / 2 + b, s, h) * b_val(q, h, j)).sum::<f64>())
                    .sum();
                assert_eq!(decode(DType::F32, out.bits(i)), want, "{algorithm:?}: rank {r} out[{b}, {s}, {j}]");
            }
        }
    }
    groups.iter().for_each(|g| g.release_scratch());
}

/// Two ranks scattering matrices by rows, one into a contiguous output
/// (the pipelined path that multiplies onto the pulled partials), one
/// into a padded one: the same result.
#[test]
fn outputs_that_differ_between_ranks_scatter_alike() {
    let (rows, hidden, n) = (2048, 16, 8); // 1024 output rows: two pieces of 512
    let groups = host_groups(2);
    let a_val = |r: usize, i: usize, h: usize| value(r + 1, i * hidden + h);
    let b_val = |r: usize, h: usize, j: usize| value(50 + r, h * n + j);
    for algorithm in ALGORITHMS {
        let outs = on_each(&groups, |r, g| {
            let a =
                Buf::of(&(0..rows * hidden).map(|e| a_val(r, e / hidden, e % hidden)).collect::<Vec<_>>(), DType::F32);
            let bm = Buf::of(&(0..hidden * n).map(|e| b_val(r, e / n, e % n)).collect::<Vec<_>>(), DType::F32);
            let ld = if r == 0 { n } else { n + 3 };
            let out = Buf::new(rows / 2 * ld, DType::F32);
            let call = MmRs {
                a: a.array(&[rows, hidden], &[hidden, 1]),
                b: bm.array(&[hidden, n], &[n, 1]),
                scatter_dim: 0,
                op: ReduceOp::Sum,
                out: out.array(&[rows / 2, n], &[ld, 1]),
                scales: MmRsScales::default(),
                algorithm: Some(algorithm),
            };
            mm_rs(g, Ok(call), Stream(0)).map(|()| (out, ld))
        });
        for (r, out) in outs.into_iter().enumerate() {
            let (out, ld) = out.unwrap_or_else(|e| panic!("{algorithm:?}: rank {r}: {}", e.msg));
            for i in 0..rows / 2 {
                for j in 0..n {
                    let row = r * rows / 2 + i;
                    let want: f64 =
                        (0..2).map(|q| (0..hidden).map(|h| a_val(q, row, h) * b_val(q, h, j)).sum::<f64>()).sum();
                    assert_eq!(decode(DType::F32, out.bits(i * ld + j)), want, "{algorithm:?}: rank {r} out[{i}, {j}]");
                }
            }
        }
    }
    groups.iter().for_each(|g| g.release_scratch());
}
