//! `lc_allgather` on `SYMM_TEST_WORLD` GPUs (default 2; one process, a
//! thread per rank): both paths forced and the automatic choice, every dtype, sizes from 2 bytes to
//! 5 MiB with odd byte counts and tails shorter than a line, contiguous,
//! strided (input transposed, output rows padded), symmetric and at
//! unaligned addresses, into poisoned outputs checked byte for byte; the
//! lines interleaved with all-reduces through the one buffer and call
//! count; and the lines captured into a CUDA graph and replayed. Named
//! `gpu_*`; skipped with fewer GPUs than that world.

use super::*;
use crate::array::DType;
use crate::backend::cuda::driver;
use crate::backend::cuda::gpu_testing::gpu_on;
use crate::backend::AllReduceAlgorithm;
use crate::buffer::{rendezvous, Buffer};
use crate::ops::testing::{cuda_groups, gpu_test_world, on_each};
use crate::ops::{all_reduce, AllReduce, ReduceOp};
use cudarc::driver::sys;

const POISON: u8 = 0x5a;

/// Byte `i` of rank `r`'s input in call `c`: never the poison.
fn byte(r: usize, c: usize, i: usize) -> u8 {
    match (i * 7 + (i >> 8) * 13 + r * 31 + c * 101) as u8 ^ 0xa5 {
        POISON => !POISON,
        b => b,
    }
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Place {
    Contiguous,
    /// Input transposed (column-major), output rows padded by one element.
    Strided,
    /// Input in a rendezvoused buffer.
    Symmetric,
    /// Input and output one element past an 8-byte boundary (1-byte
    /// types: odd addresses).
    Unaligned,
}

const PLACES: [Place; 4] = [Place::Contiguous, Place::Strided, Place::Symmetric, Place::Unaligned];

/// (dtype, rows, cols): every dtype; tails of 6, 5 and 63 bytes; the
/// issue's 64K, 256K and 1M bf16 elements per rank; past the crossover.
const CASES: [(DType, usize, usize); 12] = [
    (DType::BF16, 3, 1),
    (DType::I8, 5, 1),
    (DType::U8, 1001, 1),
    (DType::F8E4M3, 9, 7),
    (DType::F8E5M2, 1, 1),
    (DType::F16, 33, 3),
    (DType::F32, 4, 5),
    (DType::I64, 3, 5),
    (DType::I32, 1000, 8),
    (DType::BF16, 64, 1024),
    (DType::BF16, 1024, 1024),
    (DType::I8, (5 << 20) + 3, 1),
];

/// Every rank's gather of one case (`calls` calls, new values each), by
/// `path`; every byte of each output buffer checked.
fn run(groups: &[Arc<Group>], path: Option<GatherPath>, (dtype, rows, cols): (DType, usize, usize), place: Place) {
    let e = dtype.size();
    let what = format!("{path:?} {dtype} [{rows}, {cols}] {place:?}");
    let n = rows * cols;
    let transposed = place == Place::Strided;
    let skew = if place == Place::Unaligned { e } else { 0 };
    let ld = if transposed { cols + 1 } else { cols };
    let out_len = skew + gpu_test_world() * rows * ld * e + 16;
    on_each(groups, |r, g| {
        let gpu = gpu_on(r as i32);
        let sym = (place == Place::Symmetric).then(|| {
            let b = Buffer::create(g, n * e).unwrap();
            let h = rendezvous(&b).unwrap();
            (b, h)
        });
        let inbuf = gpu.alloc(skew + n * e);
        let outbuf = gpu.alloc(out_len);
        let in_addr = sym.as_ref().map_or(inbuf.ptr + skew as u64, |(b, _)| b.addr());
        let at = |i: usize, j: usize| if transposed { i + j * rows } else { i * cols + j };
        let strides = if transposed { vec![1, rows] } else { vec![cols, 1] };
        let input = Array { addr: in_addr, dtype, shape: vec![rows, cols], strides };
        let output = Array {
            addr: outbuf.ptr + skew as u64,
            dtype,
            shape: vec![gpu_test_world() * rows, cols],
            strides: vec![ld, 1],
        };
        for call_no in 0..2 {
            let mut host = vec![0u8; n * e];
            for (i, j) in (0..rows).flat_map(|i| (0..cols).map(move |j| (i, j))) {
                for b in 0..e {
                    host[at(i, j) * e + b] = byte(r, call_no, (i * cols + j) * e + b);
                }
            }
            gpu.write_at(in_addr, &host);
            gpu.write_at(outbuf.ptr, &vec![POISON; out_len]);
            let call = LcAllgather { input: input.clone(), output: output.clone() };
            lc_allgather_by(g, Ok(call), gpu.stream(), path).unwrap_or_else(|err| panic!("{what}: {}", err.msg));
            gpu.sync();
            g.backend().check_async_error().unwrap();
            let got = gpu.read_at(outbuf.ptr, out_len);
            let mut want = vec![POISON; out_len];
            for (row, j) in (0..gpu_test_world() * rows).flat_map(|row| (0..cols).map(move |j| (row, j))) {
                let (q, i) = (row / rows, row % rows);
                for b in 0..e {
                    want[skew + (row * ld + j) * e + b] = byte(q, call_no, (i * cols + j) * e + b);
                }
            }
            if let Some(k) = (0..out_len).find(|&k| got[k] != want[k]) {
                panic!("{what} call {call_no} rank {r}: output byte {k} is {:#x}, expected {:#x}", got[k], want[k]);
            }
        }
        drop(sym);
    });
}

#[test]
fn gpu_lc_allgather_both_paths_every_dtype_size_and_place() {
    let Some(groups) = cuda_groups(gpu_test_world()) else { return };
    for path in [None, Some(GatherPath::Lines), Some(GatherPath::CopyEngines)] {
        for case in CASES {
            for place in PLACES {
                run(&groups, path, case, place);
            }
        }
    }
    groups.iter().for_each(|g| g.release_scratch());
}

/// The sizes take the lines on two GPUs (the real group's facts),
/// and the call numbers them in the all-reduce buffer; 64 MiB per rank
/// takes the copy engines.
#[test]
fn gpu_lc_allgather_small_messages_take_the_lines() {
    let Some(groups) = cuda_groups(gpu_test_world()) else { return };
    for g in &groups {
        let facts = Facts::of(g);
        for bytes in [64 << 10, 128 << 10, 512 << 10, 2 << 20] {
            assert_eq!(decide_lc_allgather(&facts, bytes, None).unwrap().path, GatherPath::Lines, "{bytes} B");
        }
        assert_eq!(decide_lc_allgather(&facts, 64 << 20, None).unwrap().path, GatherPath::CopyEngines);
    }
    let counts = on_each(&groups, |r, g| {
        let gpu = gpu_on(r as i32);
        let n = 64 << 10;
        let (inbuf, outbuf) = (gpu.alloc(2 * n), gpu.alloc(2 * gpu_test_world() * n));
        for _ in 0..3 {
            let call = LcAllgather {
                input: Array::contiguous(inbuf.ptr, DType::BF16, &[n]),
                output: Array::contiguous(outbuf.ptr, DType::BF16, &[gpu_test_world() * n]),
            };
            lc_allgather(g, Ok(call), gpu.stream()).unwrap();
        }
        gpu.sync();
        let h = crate::ops::state::of(g)
            .scratch(crate::ops::state::Scratch::AllReduce)
            .expect("the lines' all-reduce buffer");
        u32::from_le_bytes(gpu.read_at(h.buffer().addr(), 4).try_into().unwrap())
    });
    assert_eq!(counts, vec![3; gpu_test_world()]);
    groups.iter().for_each(|g| g.release_scratch());
}

/// Gathers by the lines and all-reduces (one- and two-shot) in turn, 24
/// calls issued back to back with no synchronization between them: one
/// buffer, one call count, no barrier.
#[test]
fn gpu_lc_allgather_lines_interleaved_with_all_reduces() {
    let Some(groups) = cuda_groups(gpu_test_world()) else { return };
    let (n, rounds) = (70_001usize, 12usize);
    let value = |round: usize, q: usize, i: usize| (i as i32) * 3 + (q as i32) * 1000 + round as i32;
    let ints = |b: Vec<u8>| b.chunks(4).map(|c| i32::from_le_bytes(c.try_into().unwrap())).collect::<Vec<_>>();
    on_each(&groups, |r, g| {
        let gpu = gpu_on(r as i32);
        let bufs: Vec<_> = (0..rounds)
            .map(|round| {
                let v: Vec<u8> = (0..n).flat_map(|i| value(round, r, i).to_le_bytes()).collect();
                (gpu.upload(&v), gpu.upload(&vec![POISON; 4 * n]), gpu.upload(&vec![POISON; 4 * gpu_test_world() * n]))
            })
            .collect();
        for (round, (input, sum, gathered)) in bufs.iter().enumerate() {
            let algorithm = [Some(AllReduceAlgorithm::OneShot), Some(AllReduceAlgorithm::TwoShot), None][round % 3];
            let ar = AllReduce {
                input: Array::contiguous(input.ptr, DType::I32, &[n]),
                output: Array::contiguous(sum.ptr, DType::I32, &[n]),
                op: ReduceOp::Sum,
                norm: None,
                algorithm,
            };
            all_reduce(g, Ok(ar), gpu.stream()).unwrap();
            let ag = LcAllgather {
                input: Array::contiguous(input.ptr, DType::I32, &[n]),
                output: Array::contiguous(gathered.ptr, DType::I32, &[gpu_test_world() * n]),
            };
            lc_allgather_by(g, Ok(ag), gpu.stream(), Some(GatherPath::Lines)).unwrap();
        }
        gpu.sync();
        g.backend().check_async_error().unwrap();
        for (round, (_, sum, gathered)) in bufs.iter().enumerate() {
            let (sum, gathered) =
                (ints(gpu.read_at(sum.ptr, 4 * n)), ints(gpu.read_at(gathered.ptr, 4 * gpu_test_world() * n)));
            for (i, &x) in sum.iter().enumerate() {
                let want = (0..gpu_test_world()).map(|q| value(round, q, i)).sum::<i32>();
                assert_eq!(x, want, "round {round} rank {r} sum {i}");
            }
            for (k, &x) in gathered.iter().enumerate() {
                assert_eq!(x, value(round, k / n, k % n), "round {round} rank {r} gathered {k}");
            }
        }
    });
    groups.iter().for_each(|g| g.release_scratch());
}

/// The lines captured into a CUDA graph by the caller (after an eager call
/// sized the buffers), replayed with new inputs each time: the call count
/// is read on the device.
#[test]
fn gpu_lc_allgather_lines_captured_and_replayed() {
    let Some(groups) = cuda_groups(gpu_test_world()) else { return };
    let n = (256 << 10) + 3; // bytes per rank
    let replays = 5;
    on_each(&groups, |r, g| {
        let gpu = gpu_on(r as i32);
        let (inbuf, outbuf) = (gpu.alloc(n), gpu.alloc(gpu_test_world() * n));
        let call = || LcAllgather {
            input: Array::contiguous(inbuf.ptr, DType::U8, &[n]),
            output: Array::contiguous(outbuf.ptr, DType::U8, &[gpu_test_world() * n]),
        };
        lc_allgather_by(g, Ok(call()), gpu.stream(), Some(GatherPath::Lines)).unwrap();
        gpu.sync();
        let s = gpu.stream().0 as sys::CUstream;
        let mode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL;
        // SAFETY: our own stream; graph handles made and destroyed here.
        unsafe {
            driver::check(sys::cuStreamBeginCapture_v2(s, mode), "cuStreamBeginCapture").unwrap();
            let issued = lc_allgather_by(g, Ok(call()), gpu.stream(), Some(GatherPath::Lines));
            let mut graph = std::ptr::null_mut();
            driver::check(sys::cuStreamEndCapture(s, &mut graph), "cuStreamEndCapture").unwrap();
            issued.unwrap();
            let mut exec = std::ptr::null_mut();
            driver::check(sys::cuGraphInstantiateWithFlags(&mut exec, graph, 0), "cuGraphInstantiate").unwrap();
            for k in 0..replays {
                let v: Vec<u8> = (0..n).map(|i| byte(r, k, i)).collect();
                gpu.write_at(inbuf.ptr, &v);
                gpu.write_at(outbuf.ptr, &vec![POISON; gpu_test_world() * n]);
                driver::check(sys::cuGraphLaunch(exec, s), "cuGraphLaunch").unwrap();
                gpu.sync();
                let got = gpu.read_at(outbuf.ptr, gpu_test_world() * n);
                if let Some(i) = (0..gpu_test_world() * n).find(|&i| got[i] != byte(i / n, k, i % n)) {
                    panic!("replay {k} rank {r}: byte {i} is {:#x}", got[i]);
                }
            }
            sys::cuGraphExecDestroy(exec);
            sys::cuGraphDestroy(graph);
        }
        g.backend().check_async_error().unwrap();
    });
    groups.iter().for_each(|g| g.release_scratch());
}
