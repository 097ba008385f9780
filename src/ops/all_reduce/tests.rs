//! The all-reduce on the host backend against a float64 reference, at
//! worlds 1 to 4, into poisoned outputs; and every bad call failing on
//! every rank.

use super::*;
use crate::buffer::{rendezvous, Buffer};
use crate::error::ErrorKind;
use crate::ops::testing::{host_groups, on_each};
use half::{bf16, f16};

const POISON: f32 = -1024.0;

fn encode(dtype: DType, v: &[f32]) -> Vec<u8> {
    match dtype {
        DType::F32 => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        DType::BF16 => v.iter().flat_map(|x| bf16::from_f32(*x).to_le_bytes()).collect(),
        DType::F16 => v.iter().flat_map(|x| f16::from_f32(*x).to_le_bytes()).collect(),
        _ => unreachable!(),
    }
}

fn decode(dtype: DType, b: &[u8]) -> Vec<f32> {
    match dtype {
        DType::F32 => b.chunks(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect(),
        DType::BF16 => b.chunks(2).map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
        DType::F16 => b.chunks(2).map(|c| f16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
        _ => unreachable!(),
    }
}

/// Values in [-2, 2), representable in every dtype, different per seed.
fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            ((x >> 40) % 512) as f32 / 128.0 - 2.0
        })
        .collect()
}

fn tolerance(dtype: DType) -> f64 {
    match dtype {
        DType::F32 => 1e-5,
        _ => 2e-2,
    }
}

/// A tensor of `shape` over `mem` (bytes) with `strides` (`None`: contiguous).
fn tensor(mem: &mut [u8], dtype: DType, shape: &[usize], strides: Option<&[usize]>) -> Array {
    let strides = strides.map_or_else(|| crate::array::contiguous_strides(shape), |s| s.to_vec());
    Array { addr: mem.as_mut_ptr() as u64, dtype, shape: shape.to_vec(), strides }
}

/// Element offsets of a tensor's elements in row-major index order.
fn offsets(shape: &[usize], strides: &[usize]) -> Vec<usize> {
    let n: usize = shape.iter().product();
    (0..n)
        .map(|flat| {
            let (mut rem, mut off) = (flat, 0);
            for d in (0..shape.len()).rev() {
                off += rem % shape[d] * strides[d];
                rem /= shape[d];
            }
            off
        })
        .collect()
}

/// Memory for a (possibly strided) tensor of `shape`, filled with `poison`
/// and the elements `v` at their places.
fn fill(dtype: DType, shape: &[usize], strides: &[usize], v: &[f32], poison: f32) -> Vec<u8> {
    let offs = offsets(shape, strides);
    let len = offs.iter().max().map_or(0, |m| m + 1);
    let mut all = vec![poison; len];
    for (o, x) in offs.iter().zip(v) {
        all[*o] = *x;
    }
    encode(dtype, &all)
}

fn read(dtype: DType, mem: &[u8], shape: &[usize], strides: &[usize]) -> Vec<f32> {
    let all = decode(dtype, mem);
    offsets(shape, strides).iter().map(|&o| all[o]).collect()
}

#[derive(Clone, Copy, Debug)]
struct Case {
    world: usize,
    dtype: DType,
    n: usize,
    op: ReduceOp,
    algorithm: Option<AllReduceAlgorithm>,
    strided: bool,
    in_place: bool,
}

/// Runs `case` on a fresh group and checks every rank's output against
/// the float64 sum, and that no element outside the output changed.
fn run_case(c: Case) {
    let groups = host_groups(c.world);
    let shape = [c.n];
    // A strided view: every other element of a twice-as-long buffer.
    let strides: Vec<usize> = if c.strided { vec![2] } else { vec![1] };
    let inputs: Vec<Vec<f32>> = (0..c.world).map(|r| values(c.n, r as u64 * 31 + c.n as u64)).collect();
    let quant: Vec<Vec<f32>> = inputs.iter().map(|v| decode(c.dtype, &encode(c.dtype, v))).collect();
    let scale = if c.op == ReduceOp::Avg { 1.0 / c.world as f64 } else { 1.0 };
    let want: Vec<f64> = (0..c.n).map(|i| quant.iter().map(|v| v[i] as f64).sum::<f64>() * scale).collect();
    let got = on_each(&groups, |r, g| {
        let mut inp = fill(c.dtype, &shape, &strides, &inputs[r], POISON);
        let mut out = fill(c.dtype, &shape, &strides, &vec![POISON; c.n], POISON);
        let input = tensor(&mut inp, c.dtype, &shape, Some(&strides));
        let output = if c.in_place { input.clone() } else { tensor(&mut out, c.dtype, &shape, Some(&strides)) };
        let call = AllReduce { input, output, op: c.op, norm: None, algorithm: c.algorithm };
        all_reduce(g, Ok(call), Stream(0)).unwrap();
        let mem = if c.in_place { &inp } else { &out };
        let all = decode(c.dtype, mem);
        let used: std::collections::HashSet<usize> = offsets(&shape, &strides).into_iter().collect();
        for (i, v) in all.iter().enumerate().filter(|(i, _)| !used.contains(i)) {
            assert_eq!(*v, POISON, "{c:?}: element {i} outside the output was written");
        }
        read(c.dtype, mem, &shape, &strides)
    });
    for (r, out) in got.iter().enumerate() {
        for i in 0..c.n {
            let err = (out[i] as f64 - want[i]).abs();
            assert!(
                err <= tolerance(c.dtype) * (1.0 + want[i].abs()),
                "{c:?} rank {r} element {i}: {} vs {}",
                out[i],
                want[i]
            );
        }
        assert_eq!(out, &got[0], "{c:?}: ranks disagree");
    }
    groups.iter().for_each(|g| g.release_scratch());
}

#[test]
fn matches_float64_at_worlds_1_to_4() {
    for world in 1..=4 {
        for dtype in [DType::F32, DType::BF16, DType::F16] {
            for algorithm in [None, Some(AllReduceAlgorithm::OneShot), Some(AllReduceAlgorithm::TwoShot)] {
                for n in [1, 3, 1000, 4099] {
                    let op = if n % 2 == 0 { ReduceOp::Avg } else { ReduceOp::Sum };
                    run_case(Case { world, dtype, n, op, algorithm, strided: false, in_place: false });
                }
            }
        }
    }
}

#[test]
fn in_place_and_strided() {
    for world in [2, 3] {
        for algorithm in [Some(AllReduceAlgorithm::OneShot), Some(AllReduceAlgorithm::TwoShot)] {
            for (strided, in_place) in [(false, true), (true, false), (true, true)] {
                for op in [ReduceOp::Sum, ReduceOp::Avg] {
                    run_case(Case { world, dtype: DType::BF16, n: 517, op, algorithm, strided, in_place });
                }
            }
        }
    }
}

/// A multi-dimensional input whose leading dimensions do not collapse.
#[test]
fn any_shape_and_transposed_views() {
    let groups = host_groups(2);
    let (shape, strides) = ([3usize, 4, 5], [5usize, 15, 1]); // a permuted [4, 3, 5]
    let outs = on_each(&groups, |r, g| {
        let v = values(60, r as u64 + 5);
        let mut inp = fill(DType::F32, &shape, &strides, &v, POISON);
        let mut out = fill(DType::F32, &shape, &[20, 5, 1], &[POISON; 60], POISON);
        let call = AllReduce {
            input: tensor(&mut inp, DType::F32, &shape, Some(&strides)),
            output: tensor(&mut out, DType::F32, &shape, None),
            op: ReduceOp::Sum,
            norm: None,
            algorithm: Some(AllReduceAlgorithm::TwoShot),
        };
        all_reduce(g, Ok(call), Stream(0)).unwrap();
        (v, decode(DType::F32, &out))
    });
    for i in 0..60 {
        assert_eq!(outs[0].1[i], outs[0].0[i] + outs[1].0[i]);
        assert_eq!(outs[1].1[i], outs[0].1[i]);
    }
    groups.iter().for_each(|g| g.release_scratch());
}

/// An input in a symmetric buffer is read where it is: no staging space.
#[test]
fn symmetric_input_is_read_in_place() {
    let groups = host_groups(3);
    let n = 1 << 18; // 1 MiB of f32
    let res = on_each(&groups, |r, g| {
        let buf = Buffer::create(g, 4 * n).unwrap();
        let h = rendezvous(&buf).unwrap();
        // SAFETY: the buffer holds n f32s.
        let mine = unsafe { std::slice::from_raw_parts_mut(buf.addr() as *mut f32, n) };
        mine.iter_mut().enumerate().for_each(|(i, v)| *v = (i % 97) as f32 + r as f32);
        let mut out = vec![POISON; n];
        let mut kept = Vec::new();
        for algorithm in [AllReduceAlgorithm::OneShot, AllReduceAlgorithm::TwoShot] {
            let call = AllReduce {
                input: Array::contiguous(buf.addr(), DType::F32, &[n]),
                output: Array::contiguous(out.as_mut_ptr() as u64, DType::F32, &[n]),
                op: ReduceOp::Sum,
                norm: None,
                algorithm: Some(algorithm),
            };
            all_reduce(g, Ok(call.clone()), Stream(0)).unwrap();
            assert!((0..n).all(|i| out[i] == 3.0 * (i % 97) as f32 + 3.0), "{algorithm:?}");
            kept.push(call);
        }
        // The calls are kept for the input's place, and found again only
        // while the input is in that place.
        let found = |c: &AllReduce| {
            let (key, _) = Placed::of(g, Ok(c.clone()), |c| &c.input);
            crate::ops::memo::find::<Placed<AllReduce>, ArPrepared>(g, &key.unwrap()).is_some()
        };
        assert!(kept.iter().all(found));
        drop(h);
        assert!(!kept.iter().any(found));
        crate::ops::state::of(g).scratch(crate::ops::state::Scratch::Workspace).unwrap().buffer().size()
    });
    // Staging would need 4 MiB on top of the sums' 8 MiB.
    assert!(res.iter().all(|&ws| ws < 12 * n), "{res:?}");
    groups.iter().for_each(|g| g.release_scratch());
}

/// The fused form against float64: `r = sum + residual`, `out = r /
/// sqrt(mean(r^2) + eps) * w`, with residual_out in place or apart, and
/// strided operands.
#[test]
fn rmsnorm_matches_float64() {
    for world in [1, 2, 3, 4] {
        for dtype in [DType::F32, DType::BF16, DType::F16] {
            for (tokens, hidden) in [(1, 8), (3, 64), (5, 33)] {
                for algorithm in [Some(AllReduceAlgorithm::OneShot), Some(AllReduceAlgorithm::TwoShot)] {
                    for (in_place, strided) in [(false, false), (true, false), (false, true)] {
                        rmsnorm_case(world, dtype, tokens, hidden, algorithm, in_place, strided);
                    }
                }
            }
        }
    }
}

fn rmsnorm_case(
    world: usize,
    dtype: DType,
    tokens: usize,
    hidden: usize,
    algorithm: Option<AllReduceAlgorithm>,
    in_place: bool,
    strided: bool,
) {
    let groups = host_groups(world);
    let shape = [tokens, hidden];
    let n = tokens * hidden;
    let q = |v: Vec<f32>| decode(dtype, &encode(dtype, &v));
    let inputs: Vec<Vec<f32>> = (0..world).map(|r| q(values(n, r as u64 + 100))).collect();
    let residual = q(values(n, 7));
    let weight = q(values(hidden, 8));
    let eps = 1e-5f32;
    // Reference: the sum rounded as an all-reduce's output, then in f64.
    let sum = q((0..n).map(|i| inputs.iter().map(|v| v[i] as f64).sum::<f64>() as f32).collect());
    let r: Vec<f64> = (0..n).map(|i| sum[i] as f64 + residual[i] as f64).collect();
    let mut want = vec![0f64; n];
    for t in 0..tokens {
        let row = &r[t * hidden..(t + 1) * hidden];
        let inv = 1.0 / (row.iter().map(|x| x * x).sum::<f64>() / hidden as f64 + eps as f64).sqrt();
        for i in 0..hidden {
            want[t * hidden + i] = row[i] * inv * weight[i] as f64;
        }
    }
    // Strided: row pitch hidden + 3.
    let st: Vec<usize> = if strided { vec![hidden + 3, 1] } else { vec![hidden, 1] };
    let what = format!("world {world} {dtype} {tokens}x{hidden} {algorithm:?} in place {in_place} strided {strided}");
    let got = on_each(&groups, |rk, g| {
        let mut inp = fill(dtype, &shape, &st, &inputs[rk], POISON);
        let mut res = fill(dtype, &shape, &st, &residual, POISON);
        let mut w = encode(dtype, &weight);
        let mut out = fill(dtype, &shape, &st, &vec![POISON; n], POISON);
        let mut ro = fill(dtype, &shape, &st, &vec![POISON; n], POISON);
        let residual_t = tensor(&mut res, dtype, &shape, Some(&st));
        let residual_out = if in_place { residual_t.clone() } else { tensor(&mut ro, dtype, &shape, Some(&st)) };
        let call = AllReduce {
            input: tensor(&mut inp, dtype, &shape, Some(&st)),
            output: tensor(&mut out, dtype, &shape, Some(&st)),
            op: ReduceOp::Sum,
            norm: Some(Norm {
                residual: residual_t,
                weight: tensor(&mut w, dtype, &[hidden], None),
                eps,
                residual_out,
            }),
            algorithm,
        };
        all_reduce(g, Ok(call), Stream(0)).unwrap();
        let ro_mem = if in_place { &res } else { &ro };
        (read(dtype, &out, &shape, &st), read(dtype, ro_mem, &shape, &st))
    });
    let tol = tolerance(dtype) * 2.0;
    for (rk, (out, ro)) in got.iter().enumerate() {
        for i in 0..n {
            assert!((ro[i] as f64 - r[i]).abs() <= tol * (1.0 + r[i].abs()), "{what} rank {rk} residual_out {i}");
            assert!(
                (out[i] as f64 - want[i]).abs() <= tol * (1.0 + want[i].abs()),
                "{what} rank {rk} out {i}: {} vs {}",
                out[i],
                want[i]
            );
        }
    }
    groups.iter().for_each(|g| g.release_scratch());
}

/// What `bad(rank)` makes of a call on each rank of a 3-rank group: every
/// rank's error kind and message; outputs stay poisoned.
fn failing(bad: impl Fn(usize, &mut AllReduce) + Sync) -> Vec<(ErrorKind, String)> {
    let groups = host_groups(3);
    let res = on_each(&groups, |r, g| {
        let mut inp = encode(DType::BF16, &values(64, r as u64));
        let mut out = encode(DType::BF16, &[POISON; 64]);
        let mut call = AllReduce {
            input: tensor(&mut inp, DType::BF16, &[8, 8], None),
            output: tensor(&mut out, DType::BF16, &[8, 8], None),
            op: ReduceOp::Sum,
            norm: None,
            algorithm: None,
        };
        bad(r, &mut call);
        let e = all_reduce(g, Ok(call), Stream(0)).unwrap_err();
        assert!(decode(DType::BF16, &out).iter().all(|&v| v == POISON), "rank {r}: output written");
        (e.kind, e.msg)
    });
    groups.iter().for_each(|g| g.release_scratch());
    res
}

#[test]
fn mismatched_shapes_dtypes_ops_and_algorithms_fail_everywhere() {
    let shape = failing(|r, c| {
        if r == 1 {
            c.input.shape = vec![4, 8];
            c.input.strides = vec![8, 1];
            c.output.shape = vec![4, 8];
            c.output.strides = vec![8, 1];
        }
    });
    for (kind, msg) in &shape {
        assert_eq!(*kind, ErrorKind::Mismatch, "{msg}");
        assert!(msg.contains("input.shape is [8, 8] on rank 0 but [4, 8] on rank 1"), "{msg}");
    }
    let dtype = failing(|r, c| {
        if r == 2 {
            c.input.dtype = DType::F16;
            c.output.dtype = DType::F16;
        }
    });
    assert!(dtype
        .iter()
        .all(|(k, m)| *k == ErrorKind::Mismatch && m.contains("input.dtype is bf16 on rank 0 but f16")));
    let op = failing(|r, c| c.op = if r == 0 { ReduceOp::Avg } else { ReduceOp::Sum });
    assert!(op.iter().all(|(k, m)| *k == ErrorKind::Mismatch && m.contains("op is avg on rank 0 but sum")));
    let algo = failing(|r, c| {
        c.algorithm = Some(if r == 0 { AllReduceAlgorithm::OneShot } else { AllReduceAlgorithm::TwoShot })
    });
    assert!(algo
        .iter()
        .all(|(k, m)| *k == ErrorKind::Mismatch && m.contains("algorithm is one_shot on rank 0 but two_shot")));
}

#[test]
fn a_bad_argument_on_one_rank_fails_every_rank() {
    type Bad = Box<dyn Fn(&mut AllReduce) + Sync>;
    let cases: Vec<(&str, Bad)> = vec![
        ("output.shape is [8, 4]; expected [8, 8]", Box::new(|c| c.output.shape = vec![8, 4])),
        ("output.dtype is f32; expected bf16", Box::new(|c| c.output.dtype = DType::F32)),
        (
            "input.dtype is fp8_e4m3; expected f32, bf16, f16, int8, uint8, int32 or int64",
            Box::new(|c| {
                c.input.dtype = DType::F8E4M3;
                c.output.dtype = DType::F8E4M3;
            }),
        ),
        ("output overlaps input", Box::new(|c| c.output.addr = c.input.addr + 2)),
        ("so its elements overlap", Box::new(|c| c.output.strides = vec![1, 1])),
    ];
    for (want, bad) in cases {
        let res = failing(|r, c| {
            if r == 1 {
                bad(c)
            }
        });
        assert_eq!(res[1].0, ErrorKind::InvalidArgument, "{want}: {}", res[1].1);
        assert!(res[1].1.contains(want), "{want}: {}", res[1].1);
        for r in [0, 2] {
            assert_eq!(res[r].0, ErrorKind::Remote, "{want}: {}", res[r].1);
            assert!(res[r].1.contains(want), "{want}: {}", res[r].1);
        }
    }
}

#[test]
fn bad_rmsnorm_arguments() {
    let norm = |c: &mut AllReduce, residual_shape: Vec<usize>, weight_len: usize, eps: f32| {
        // Unused memory: the checks fail before anything is read.
        let base = 0x1000_0000u64;
        let residual = Array::contiguous(base, DType::BF16, &residual_shape);
        c.norm = Some(Norm {
            residual_out: Array::contiguous(base + 0x10_0000, DType::BF16, &residual_shape),
            residual,
            weight: Array::contiguous(base + 0x20_0000, DType::BF16, &[weight_len]),
            eps,
        });
    };
    let res = failing(|_, c| norm(c, vec![8, 8], 4, 1e-6));
    assert!(res
        .iter()
        .all(|(k, m)| *k == ErrorKind::InvalidArgument && m.contains("weight.shape is [4]; expected [8]")));
    let res = failing(|_, c| norm(c, vec![8, 4], 8, 1e-6));
    assert!(res.iter().all(|(_, m)| m.contains("residual.shape is [8, 4]; expected [8, 8]")), "{res:?}");
    let res = failing(|_, c| norm(c, vec![8, 8], 8, f32::NAN));
    assert!(res.iter().all(|(_, m)| m.contains("eps is NaN")), "{res:?}");
    let res = failing(|r, c| norm(c, vec![8, 8], 8, if r == 0 { 1e-6 } else { 1e-5 }));
    assert!(res.iter().all(|(k, m)| *k == ErrorKind::Mismatch && m.contains("eps is")), "{res:?}");
}

/// With residual_out in place of residual, out or weight in the
/// residual's memory is refused on every rank, the residual untouched, and
/// the group still runs the call with them apart.
#[test]
fn in_place_residual_apart_from_out_and_weight() {
    let groups = host_groups(2);
    let (shape, hidden) = ([2usize, 8usize], 8usize);
    // (residual, out, weight) -> the call's (out, weight).
    type Args = fn(&Array, &Array, &Array) -> (Array, Array);
    let cases: [(&str, Args); 3] = [
        ("overlaps out", |res, _, w| (res.clone(), w.clone())),
        ("overlaps weight", |res, out, _| (out.clone(), Array::contiguous(res.addr + 16, res.dtype, &[8]))),
        ("", |_, out, w| (out.clone(), w.clone())),
    ];
    for (want, args) in cases {
        let got = on_each(&groups, |rk, g| {
            let mut inp = encode(DType::F32, &values(16, rk as u64));
            let mut res = encode(DType::F32, &values(16, 9));
            let mut w = encode(DType::F32, &values(hidden, 8));
            let mut out = encode(DType::F32, &[POISON; 16]);
            let residual = tensor(&mut res, DType::F32, &shape, None);
            let (output, weight) =
                args(&residual, &tensor(&mut out, DType::F32, &shape, None), &tensor(&mut w, DType::F32, &[8], None));
            let call = AllReduce {
                input: tensor(&mut inp, DType::F32, &shape, None),
                output,
                op: ReduceOp::Sum,
                norm: Some(Norm { residual_out: residual.clone(), residual, weight, eps: 1e-6 }),
                algorithm: None,
            };
            let r = all_reduce(g, Ok(call), Stream(0));
            (r, res == encode(DType::F32, &values(16, 9)))
        });
        for (rk, (r, untouched)) in got.into_iter().enumerate() {
            if want.is_empty() {
                assert!(r.is_ok() && !untouched, "rank {rk}: {r:?}");
                continue;
            }
            let e = r.unwrap_err();
            assert_eq!(e.kind, ErrorKind::InvalidArgument, "rank {rk}: {}", e.msg);
            assert!(e.msg.contains(&format!("residual_out (in place of residual) {want}")), "rank {rk}: {}", e.msg);
            assert!(untouched, "rank {rk}: {want}: residual written");
        }
    }
    groups.iter().for_each(|g| g.release_scratch());
}

/// Integer element `v` (any value: truncated to the type) as bytes.
pub(super) fn int_bytes(dtype: DType, v: i128) -> Vec<u8> {
    match dtype {
        DType::I8 => (v as i8).to_le_bytes().to_vec(),
        DType::U8 => (v as u8).to_le_bytes().to_vec(),
        DType::I32 => (v as i32).to_le_bytes().to_vec(),
        DType::I64 => (v as i64).to_le_bytes().to_vec(),
        _ => unreachable!(),
    }
}

pub(super) fn int_value(dtype: DType, b: &[u8]) -> i128 {
    match dtype {
        DType::I8 => b[0] as i8 as i128,
        DType::U8 => b[0] as i128,
        DType::I32 => i32::from_le_bytes(b.try_into().unwrap()) as i128,
        DType::I64 => i64::from_le_bytes(b.try_into().unwrap()) as i128,
        _ => unreachable!(),
    }
}

/// Values that lose bits in f32 (and f64, for int64): int64 near +-2^60
/// and near the limits (so sums wrap), int32 around 2^25 + 1 and its
/// limits, int8 and uint8 over their whole range.
pub(super) fn int_values(dtype: DType, n: usize, seed: u64) -> Vec<i128> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n)
        .map(|i| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let small = (x >> 44) as i128 - (1 << 19); // +-2^19
            let sign = if x & 1 == 0 { 1 } else { -1 };
            match (dtype, i % 4) {
                (DType::I64, 3) => sign * (i64::MAX as i128 - small.abs()),
                (DType::I64, _) => sign * ((1i128 << 60) + small),
                (DType::I32, 3) => sign * (i32::MAX as i128 - small.abs()),
                (DType::I32, _) => sign * ((1i128 << 25) + 1 + small),
                _ => (x >> 56) as i128,
            }
        })
        .collect()
}

/// The exact reduction: the sum wrapped to the type, divided truncating
/// toward zero for an average.
pub(super) fn int_reference(dtype: DType, inputs: &[Vec<i128>], i: usize, op: ReduceOp) -> i128 {
    let sum: i128 = inputs.iter().map(|v| v[i]).sum();
    let wrapped = int_value(dtype, &int_bytes(dtype, sum));
    match op {
        ReduceOp::Sum => wrapped,
        ReduceOp::Avg => wrapped / inputs.len() as i128,
    }
}

pub(super) const INT_POISON: u8 = 0xa5;

/// `case` with an integer dtype: every rank's output equals the exact
/// reduction, and no byte outside the output changed.
fn run_int_case(c: Case) {
    let groups = host_groups(c.world);
    let size = c.dtype.size();
    let step = if c.strided { 2 } else { 1 };
    let inputs: Vec<Vec<i128>> = (0..c.world).map(|r| int_values(c.dtype, c.n, r as u64 * 31 + c.n as u64)).collect();
    let got = on_each(&groups, |r, g| {
        let mut inp = vec![INT_POISON; c.n * step * size];
        for (i, v) in inputs[r].iter().enumerate() {
            inp[i * step * size..][..size].copy_from_slice(&int_bytes(c.dtype, *v));
        }
        let mut out = vec![INT_POISON; c.n * step * size];
        let input = tensor(&mut inp, c.dtype, &[c.n], Some(&[step]));
        let output = if c.in_place { input.clone() } else { tensor(&mut out, c.dtype, &[c.n], Some(&[step])) };
        let call = AllReduce { input, output, op: c.op, norm: None, algorithm: c.algorithm };
        all_reduce(g, Ok(call), Stream(0)).unwrap();
        let mem = if c.in_place { &inp } else { &out };
        let gaps = mem.chunks(size).enumerate().filter(|(i, _)| i % step != 0);
        assert!(gaps.flat_map(|(_, b)| b).all(|&b| b == INT_POISON), "{c:?}: a byte outside the output was written");
        mem.chunks(size).step_by(step).map(|b| int_value(c.dtype, b)).collect::<Vec<_>>()
    });
    for (r, out) in got.iter().enumerate() {
        for (i, &v) in out.iter().enumerate() {
            let want = int_reference(c.dtype, &inputs, i, c.op);
            assert_eq!(v, want, "{c:?} rank {r} element {i}");
        }
    }
    groups.iter().for_each(|g| g.release_scratch());
}

#[test]
fn integers_are_exact_at_worlds_1_to_4() {
    for world in 1..=4 {
        for dtype in [DType::I8, DType::U8, DType::I32, DType::I64] {
            for algorithm in [None, Some(AllReduceAlgorithm::OneShot), Some(AllReduceAlgorithm::TwoShot)] {
                for n in [1, 3, 1000, 4099] {
                    for op in [ReduceOp::Sum, ReduceOp::Avg] {
                        run_int_case(Case { world, dtype, n, op, algorithm, strided: false, in_place: false });
                    }
                }
            }
            for (strided, in_place) in [(false, true), (true, false), (true, true)] {
                let algorithm = Some(AllReduceAlgorithm::TwoShot);
                run_int_case(Case { world, dtype, n: 517, op: ReduceOp::Avg, algorithm, strided, in_place });
            }
        }
    }
}

#[test]
fn integer_reference_wraps_and_truncates() {
    // The reference itself, on values whose answers are known.
    let v = |a: i128, b: i128| vec![vec![a], vec![b]];
    assert_eq!(int_reference(DType::I8, &v(100, 100), 0, ReduceOp::Sum), -56);
    assert_eq!(int_reference(DType::I8, &v(-3, 0), 0, ReduceOp::Avg), -1);
    assert_eq!(int_reference(DType::U8, &v(200, 100), 0, ReduceOp::Avg), 22);
    assert_eq!(int_reference(DType::I64, &v(i64::MAX as i128, 1), 0, ReduceOp::Sum), i64::MIN as i128);
    let big = (1i128 << 60) + 1;
    assert_eq!(int_reference(DType::I64, &v(big, big + 2), 0, ReduceOp::Avg), big + 1);
}

#[test]
fn integers_are_refused_by_the_rmsnorm() {
    let res = failing(|_, c| {
        let base = 0x1000_0000u64;
        c.input.dtype = DType::I32;
        c.output.dtype = DType::I32;
        c.norm = Some(Norm {
            residual_out: Array::contiguous(base + 0x10_0000, DType::I32, &[8, 8]),
            residual: Array::contiguous(base, DType::I32, &[8, 8]),
            weight: Array::contiguous(base + 0x20_0000, DType::I32, &[8]),
            eps: 1e-6,
        });
    });
    for (kind, msg) in &res {
        assert_eq!(*kind, ErrorKind::InvalidArgument, "{msg}");
        assert!(msg.contains("input.dtype is int32; all_reduce_rmsnorm takes f32, bf16 or f16"), "{msg}");
    }
}

/// Where integers cannot take the device-side kernels and the backend has
/// no integer reduction of its own (CUDA ranks sharing a GPU), the call is
/// refused before anything moves.
#[test]
fn integers_without_kernels_or_reduction_are_unsupported() {
    let mut facts = crate::ops::testing::host_facts(2);
    facts.caps.reduce_integers = false;
    let call = |dtype| AllReduce {
        input: Array::contiguous(0x1000, dtype, &[8]),
        output: Array::contiguous(0x2000, dtype, &[8]),
        op: ReduceOp::Sum,
        norm: None,
        algorithm: None,
    };
    let e = call(DType::I64).prepare(&facts, AllReduceAlgorithm::OneShot, None).err().unwrap();
    assert_eq!(e.kind, ErrorKind::Unsupported, "{}", e.msg);
    assert!(e.msg.contains("integers only in its device-side kernels"), "{}", e.msg);
    assert!(call(DType::F32).prepare(&facts, AllReduceAlgorithm::OneShot, None).is_ok());
    facts.caps.all_reduce = true;
    facts.own_devices = true;
    assert!(call(DType::I64).prepare(&facts, AllReduceAlgorithm::OneShot, None).is_ok());
}

#[test]
fn slices_cover_the_message() {
    for (n, world) in [(1, 4), (7, 3), (8, 2), (1001, 4)] {
        let mut next = 0;
        for r in 0..world {
            let (lo, hi) = slice(n, world, r);
            assert_eq!(lo, next.min(n));
            next = hi;
        }
        assert_eq!(next, n);
    }
}

#[test]
fn layout_holds_what_it_was_sized_for() {
    for world in [1, 2, 4, 8] {
        for bytes in [2, 4096, 1 << 20, 3 << 20] {
            let size = AllReduceLayout::bytes_for(bytes, world);
            let l = AllReduceLayout::of(size, world);
            assert!(l.holds(bytes), "{world} {bytes}");
            assert!(l.two_shot + 2 * world * l.two_shot_slot <= size);
            assert!(l.one_shot + 2 * world * l.one_shot_slot <= l.two_shot);
            assert!(l.flags >= AllReduceLayout::HEADER + 8 * AllReduceLayout::MAX_NORM_BLOCKS);
        }
    }
}

#[test]
fn two_shot_chunks_fit_the_flags_and_groups() {
    for world in [1, 2, 3, 4, 8, 16] {
        for bytes in [2, 8190, 8192, 1 << 20, (16 << 20) + 6, 1 << 30] {
            let chunk = AllReduceLayout::chunk_bytes(bytes, world);
            let chunks = bytes.div_ceil(chunk);
            assert!(chunk % 16 == 0 && chunk >= AllReduceLayout::MIN_CHUNK, "{world} {bytes}");
            assert!(chunks <= AllReduceLayout::MAX_CHUNKS, "{world} {bytes}: {chunks} chunks");
            let groups = AllReduceLayout::groups_of(bytes, chunk, world);
            assert!(groups <= AllReduceLayout::GROUPS && groups * world >= chunks, "{world} {bytes}");
        }
    }
    // 16 MiB over two ranks: 128 groups of two 64 KiB chunks.
    assert_eq!(AllReduceLayout::chunk_bytes(16 << 20, 2), 64 << 10);
    assert_eq!(AllReduceLayout::groups_of(16 << 20, 64 << 10, 2), 128);
}

/// On the device kernel, ranks whose tensors differ in being strided ask
/// for the same workspace up to `PACK_ROOM_MAX_BYTES` (it grows by a
/// rendezvous every rank must join); past it they agree on which are
/// strided instead (the signature differs, so ranks that differ fail with
/// Mismatch rather than wait for each other).
#[test]
fn ranks_strided_or_not_size_the_workspace_alike() {
    let mut facts = crate::ops::testing::host_facts(2);
    (facts.caps.all_reduce, facts.own_devices) = (true, true);
    let call = |n: usize, strided: bool| {
        let shape = [n / 2, 2];
        let input = match strided {
            true => Array { addr: 0x1000, dtype: DType::F32, shape: shape.to_vec(), strides: vec![4, 1] },
            false => Array::contiguous(0x1000, DType::F32, &shape),
        };
        let output = Array::contiguous(0x1_0000_0000, DType::F32, &shape);
        AllReduce { input, output, op: ReduceOp::Sum, norm: None, algorithm: None }
    };
    let prepared = |c: AllReduce| c.prepare(&facts, AllReduceAlgorithm::TwoShot, None).unwrap().workspace_bytes();
    for n in [2, 1000, PACK_ROOM_MAX_BYTES / 4] {
        assert_eq!(prepared(call(n, false)), prepared(call(n, true)), "{n} elements");
        assert_eq!(call(n, false).signature(None), call(n, true).signature(None), "{n} elements");
    }
    let n = PACK_ROOM_MAX_BYTES / 4 + 2;
    assert!(prepared(call(n, false)) < prepared(call(n, true)));
    assert_ne!(call(n, false).signature(None), call(n, true).signature(None));
}
