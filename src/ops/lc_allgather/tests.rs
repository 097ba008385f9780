use super::*;
use crate::array::DType;
use crate::buffer::{rendezvous, Buffer};
use crate::error::ErrorKind;
use crate::ops::testing::{host_groups, lines_calls, on_each};

#[test]
fn output_must_hold_every_rank() {
    let call = |out: &[usize]| LcAllgather {
        input: Array::contiguous(0x100_0000, DType::F8E5M2, &[2, 3]),
        output: Array::contiguous(0x200_0000, DType::F8E5M2, out),
    };
    let e = call(&[4, 3]).prepare(3, None, GatherPath::CopyEngines).err().unwrap();
    assert_eq!(e.msg, "output.shape is [4, 3]; expected [6, 3]");
    let e = call(&[4, 3]).prepare(3, None, GatherPath::Lines).err().unwrap();
    assert_eq!(e.msg, "output.shape is [4, 3]; expected [6, 3]");
    assert_eq!(call(&[6, 3]).prepare(3, None, GatherPath::CopyEngines).ok().unwrap().workspace, 6);
    // The lines: room to pack the input (6 bytes) and output (18).
    let p = call(&[6, 3]).prepare(3, None, GatherPath::Lines).ok().unwrap();
    assert_eq!((p.workspace >= 24, p.all_reduce_bytes()), (true, AllReduceLayout::bytes_for(6, 3)));
}

/// 3 MiB per rank gathered by the copy engines from symmetric memory
/// needs no more than the smallest workspace; from ordinary memory it is
/// staged in a larger one.
/// (The u32 values travel as f32 elements: same-type copies move bits.)
#[test]
fn symmetric_inputs_are_read_in_place() {
    let groups = host_groups(2);
    let n = 3 << 18; // u32 elements: 3 MiB per rank
    let sizes = on_each(&groups, |r, g| {
        let value = |q: usize, i: usize| (q * n + i) as u32 ^ 0x5a5a_5a5a;
        let mut out = vec![0u32; 2 * n];
        let output = Array::contiguous(out.as_mut_ptr() as u64, DType::F32, &[2 * n]);
        let check = |out: &[u32]| assert!((0..2 * n).all(|i| out[i] == value(i / n, i % n)));

        let buf = Buffer::create(g, 4 * n).unwrap();
        let h = rendezvous(&buf).unwrap();
        // SAFETY: the buffer holds n u32s.
        let mine = unsafe { std::slice::from_raw_parts_mut(buf.addr() as *mut u32, n) };
        mine.iter_mut().enumerate().for_each(|(i, v)| *v = value(r, i));
        let input = Array::contiguous(buf.addr(), DType::F32, &[n]);
        let copies = Some(GatherPath::CopyEngines);
        lc_allgather_by(g, Ok(LcAllgather { input, output: output.clone() }), Stream(0), copies).unwrap();
        check(&out);
        let in_place = crate::ops::state::of(g).scratch(crate::ops::state::Scratch::Workspace).unwrap().buffer().size();

        out.fill(0);
        let mut ordinary: Vec<u32> = (0..n).map(|i| value(r, i)).collect();
        let input = Array::contiguous(ordinary.as_mut_ptr() as u64, DType::F32, &[n]);
        lc_allgather_by(g, Ok(LcAllgather { input, output }), Stream(0), copies).unwrap();
        check(&out);
        drop(h);
        (in_place, crate::ops::state::of(g).scratch(crate::ops::state::Scratch::Workspace).unwrap().buffer().size())
    });
    for (in_place, staged) in sizes {
        assert!(in_place < 4 * n, "the in-place gather staged its input ({in_place} bytes of workspace)");
        assert!(staged >= 4 * n);
    }
    groups.iter().for_each(|g| g.release_scratch());
}

/// Integers gather bit-exactly at worlds 1 to 4: int64 near 2^60 and
/// int8 (one byte per element, odd sizes), from transposed inputs, into
/// poisoned outputs.
#[test]
fn integers_gather_exactly_at_worlds_1_to_4() {
    for world in 1..=4 {
        let groups = host_groups(world);
        let outs = on_each(&groups, |r, g| {
            // Logical [3, 5] stored column-major (strides [1, 3]).
            let v64 = |q: usize, i: usize| (1i64 << 60) + (q * 15 + i) as i64 * 0x1_0000_0001 - 7;
            let mut in64 = vec![0i64; 15];
            let mut in8 = vec![0i8; 15];
            for (i, j) in (0..3).flat_map(|i| (0..5).map(move |j| (i, j))) {
                in64[i + 3 * j] = -v64(r, i * 5 + j);
                in8[i + 3 * j] = ((r * 15 + i * 5 + j) as u8).wrapping_sub(100) as i8;
            }
            let mut out64 = vec![0x5a5a_5a5a_5a5a_5a5ai64; 15 * world];
            let mut out8 = vec![0x5ai8; 15 * world + 1];
            let strided = |addr: u64, dtype| Array { addr, dtype, shape: vec![3, 5], strides: vec![1, 3] };
            let call = LcAllgather {
                input: strided(in64.as_mut_ptr() as u64, DType::I64),
                output: Array::contiguous(out64.as_mut_ptr() as u64, DType::I64, &[3 * world, 5]),
            };
            lc_allgather(g, Ok(call), Stream(0)).unwrap();
            let call = LcAllgather {
                input: strided(in8.as_mut_ptr() as u64, DType::I8),
                output: Array::contiguous(out8.as_mut_ptr() as u64, DType::I8, &[3 * world, 5]),
            };
            lc_allgather(g, Ok(call), Stream(0)).unwrap();
            assert_eq!(out8[15 * world], 0x5a, "a byte past the output was written");
            for q in 0..world {
                for i in 0..15 {
                    assert_eq!(out64[q * 15 + i], -v64(q, i), "world {world} rank {r} part {q} int64 {i}");
                    assert_eq!(
                        out8[q * 15 + i],
                        ((q * 15 + i) as u8).wrapping_sub(100) as i8,
                        "world {world} part {q} int8 {i}"
                    );
                }
            }
        });
        assert_eq!(outs.len(), world);
        groups.iter().for_each(|g| g.release_scratch());
    }
}

/// Byte `i` of rank `r`'s input in call `c`: never the poison.
fn byte(r: usize, c: usize, i: usize) -> u8 {
    match (i * 7 + (i >> 8) * 13 + r * 31 + c * 101) as u8 ^ 0xa5 {
        POISON => !POISON,
        b => b,
    }
}

const POISON: u8 = 0x5a;

/// Where a case's input and output lie.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Place {
    Contiguous,
    /// Input transposed (column-major), output rows padded by one
    /// element (a poisoned gap).
    Strided,
    /// Input in a rendezvoused buffer (read in place by the copy engines).
    Symmetric,
}

/// One rank's gather of a `[rows, cols]` `dtype` input placed as
/// `place`, by `path`, into a poisoned output: every byte of the output
/// buffer checked (the gathered ones, and the poison of the gaps and
/// past the end). Collective.
fn gather_case(
    g: &Arc<Group>,
    path: GatherPath,
    (dtype, rows, cols): (DType, usize, usize),
    place: Place,
    call_no: usize,
) {
    let (r, world, e) = (g.rank(), g.world(), dtype.size());
    let what = format!("world {world} rank {r} {path:?} {dtype} [{rows}, {cols}] {place:?} call {call_no}");
    let n = rows * cols;
    let transposed = place == Place::Strided;
    let at = |i: usize, j: usize| if transposed { i + j * rows } else { i * cols + j };
    let sym = (place == Place::Symmetric).then(|| {
        let b = Buffer::create(g, n * e).unwrap();
        let h = rendezvous(&b).unwrap();
        (b, h)
    });
    let mut ordinary = vec![0u8; n * e];
    let base = sym.as_ref().map_or(ordinary.as_mut_ptr() as u64, |(b, _)| b.addr());
    // SAFETY: either buffer holds n * e bytes.
    let mem = unsafe { std::slice::from_raw_parts_mut(base as *mut u8, n * e) };
    for (i, j) in (0..rows).flat_map(|i| (0..cols).map(move |j| (i, j))) {
        for b in 0..e {
            mem[at(i, j) * e + b] = byte(r, call_no, (i * cols + j) * e + b);
        }
    }
    let strides = if transposed { vec![1, rows] } else { vec![cols, 1] };
    let input = Array { addr: base, dtype, shape: vec![rows, cols], strides };
    let ld = if transposed { cols + 1 } else { cols };
    let mut out = vec![POISON; world * rows * ld * e + 16];
    let output = Array { addr: out.as_mut_ptr() as u64, dtype, shape: vec![world * rows, cols], strides: vec![ld, 1] };
    lc_allgather_by(g, Ok(LcAllgather { input, output }), Stream(0), Some(path))
        .unwrap_or_else(|err| panic!("{what}: {}", err.msg));
    let mut want = vec![POISON; out.len()];
    for (row, j) in (0..world * rows).flat_map(|row| (0..cols).map(move |j| (row, j))) {
        let (q, i) = (row / rows, row % rows);
        for b in 0..e {
            want[(row * ld + j) * e + b] = byte(q, call_no, (i * cols + j) * e + b);
        }
    }
    if let Some(k) = (0..out.len()).find(|&k| out[k] != want[k]) {
        panic!("{what}: byte {k} of the output is {:#x}, expected {:#x}", out[k], want[k]);
    }
    drop(sym);
}

/// Both paths, forced, at worlds 1 to 4: every dtype, sizes from 2
/// bytes to 125 KiB with odd byte counts and tails shorter than a line
/// (3 bf16, 5 int8, 63 fp8), contiguous, strided and symmetric, each
/// twice (new values; the lines' call parity) into poisoned outputs.
/// The lines number every call in the all-reduce buffer (its count),
/// the copy engines make no such buffer.
#[test]
fn both_paths_gather_every_dtype_and_size_at_worlds_1_to_4() {
    // The largest first: the all-reduce buffer is sized once, so its
    // count is every lines call's.
    let cases = [
        (DType::BF16, 64, 1000),
        (DType::BF16, 3, 1),
        (DType::I8, 5, 1),
        (DType::U8, 1001, 1),
        (DType::F16, 1, 1),
        (DType::F32, 4, 5),
        (DType::I32, 7, 3),
        (DType::I64, 3, 5),
        (DType::F8E4M3, 9, 7),
        (DType::F8E5M2, 2, 3),
    ];
    let places = [Place::Contiguous, Place::Strided, Place::Symmetric];
    for world in 1..=4 {
        let groups = host_groups(world);
        on_each(&groups, |_, g| {
            for path in [GatherPath::CopyEngines, GatherPath::Lines] {
                for case in cases {
                    for place in places {
                        (0..2).for_each(|call_no| gather_case(g, path, case, place, call_no));
                    }
                }
                let calls = lines_calls(g);
                match path {
                    GatherPath::CopyEngines => assert_eq!(calls, None, "world {world}"),
                    GatherPath::Lines => {
                        assert_eq!(calls, Some((cases.len() * places.len() * 2) as u32), "world {world}")
                    }
                }
            }
        });
        groups.iter().for_each(|g| g.release_scratch());
    }
}

/// Unforced, the host's ranks (threads of their own, so free to wait
/// for each other) take the lines for a small message; ranks forcing
/// different paths fail
/// together (Mismatch) instead of waiting for each other (the call was
/// agreed before: checked on every call here).
#[test]
fn host_ranks_take_the_lines_when_small_and_paths_must_agree() {
    let groups = Group::new_local(&[0, 0], &crate::ops::testing::host_config(true)).unwrap();
    let errs = on_each(&groups, |r, g| {
        let mut input = vec![7u8; 8];
        let mut out = vec![0u8; 16];
        let (input, out) = (input.as_mut_ptr() as u64, out.as_mut_ptr() as u64);
        let call = || LcAllgather {
            input: Array::contiguous(input, DType::U8, &[8]),
            output: Array::contiguous(out, DType::U8, &[16]),
        };
        lc_allgather(g, Ok(call()), Stream(0)).unwrap();
        assert_eq!(lines_calls(g), Some(1));
        let path = if r == 0 { GatherPath::Lines } else { GatherPath::CopyEngines };
        lc_allgather_by(g, Ok(call()), Stream(0), Some(path)).unwrap_err()
    });
    for e in errs {
        assert_eq!(e.kind, crate::error::ErrorKind::Mismatch, "{}", e.msg);
        assert!(e.msg.contains("path"), "{}", e.msg);
    }
    groups.iter().for_each(|g| g.release_scratch());
}

/// Inputs at the same offset of one symmetric buffer, with strides that
/// differ per rank (the header allows it): agreed, not a mismatch; the
/// contiguous rank is read in place, the strided one is staged.
#[test]
fn symmetric_inputs_agree_on_being_read_in_place() {
    let groups = host_groups(2);
    let outs = on_each(&groups, |r, g| {
        let buf = Buffer::create(g, 4 * 6).unwrap();
        let h = rendezvous(&buf).unwrap();
        // SAFETY: the buffer holds 6 f32.
        let mem = unsafe { std::slice::from_raw_parts_mut(buf.addr() as *mut f32, 6) };
        let mut out = vec![-1f32; 12];
        let output = Array::contiguous(out.as_mut_ptr() as u64, DType::F32, &[4, 3]);
        let mut got = Vec::new();
        // Logical [2, 3] of value 10 * rank + (row * 3 + col), row-major
        // or column-major (strides [1, 2]): row-major on rank 0 only,
        // twice: a mismatch on both ranks each time, nothing written;
        // then column-major on every rank, row-major on every rank,
        // column-major again (each read where it lies or staged, as
        // agreed, the last call's agreement kept from the first).
        for (call, column_major) in [(0, [false, true]), (1, [true, true]), (2, [false, false]), (3, [true, true])] {
            let strides = if column_major[r] { vec![1, 2] } else { vec![3, 1] };
            for (i, j) in (0..2).flat_map(|i| (0..3).map(move |j| (i, j))) {
                mem[i * strides[0] + j * strides[1]] = (10 * r + i * 3 + j) as f32;
            }
            let input = Array { addr: buf.addr(), dtype: DType::F32, shape: vec![2, 3], strides };
            for _ in 0..1 + usize::from(call == 0) {
                out.fill(-1.0);
                let res = lc_allgather(g, Ok(LcAllgather { input: input.clone(), output: output.clone() }), Stream(0));
                got.push((res.map_err(|e| e.kind), out.clone()));
            }
        }
        drop(h);
        got
    });
    let want: Vec<f32> = (0..12).map(|i| (10 * (i / 6) + i % 6) as f32).collect();
    for got in outs {
        let (results, values): (Vec<_>, Vec<_>) = got.into_iter().unzip();
        assert_eq!(results, [Err(ErrorKind::Mismatch), Err(ErrorKind::Mismatch), Ok(()), Ok(()), Ok(())]);
        assert_eq!(values, [vec![-1.0; 12], vec![-1.0; 12], want.clone(), want.clone(), want.clone()]);
    }
    groups.iter().for_each(|g| g.release_scratch());
}
