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
        let want: Vec<f64> = (0..world).flat_map(|r| (0..12).map(move |i| input_value(DType::BF16, r, i))).collect();
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
            let call =
                LcAllgather { input: arr(&input, DType::F32, &[n]), output: arr(&gathered, DType::F32, &[world * n]) };
            lc_allgather_op(g, Ok(call), Stream(0)).unwrap();
            assert!(gathered.iter().enumerate().all(|(i, &v)| v == value(i / n, i % n)), "{hosts:?} rank {r}: gather");
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
