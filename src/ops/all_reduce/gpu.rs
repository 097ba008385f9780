//! The device-side all-reduce on `SYMM_TEST_WORLD` GPUs (default 2; one
//! process, a thread per rank) against a float64 reference: every dtype,
//! sum and average, 1 element to tens of MB with odd sizes, in place,
//! strided, symmetric and ordinary inputs, one-shot and two-shot forced, the
//! fused RMSNorm, many calls in a row (the call count and its parity), and
//! calls captured into a CUDA graph and replayed; integers summed exactly.
//! Named `gpu_*`; skipped with fewer GPUs than that world.

use super::*;
use crate::backend::cuda::driver;
use crate::backend::cuda::gemm::GemmDtype;
use crate::backend::cuda::gpu_testing::{decode, encode, gpu_on, values, DevBuf};
use crate::buffer::{rendezvous, Buffer};
use crate::ops::testing::{cuda_groups, gpu_test_world, on_each};
use cudarc::driver::sys;

fn gd(d: DType) -> GemmDtype {
    match d {
        DType::F32 => GemmDtype::F32,
        DType::BF16 => GemmDtype::BF16,
        _ => GemmDtype::F16,
    }
}

/// Values of rank `r`'s input as the dtype holds them.
fn inputs(dtype: DType, n: usize, r: usize, seed: u64) -> Vec<f32> {
    decode(gd(dtype), &encode(gd(dtype), &values(n, seed * 1009 + r as u64 * 7 + n as u64)))
}

fn check_close(what: &str, dtype: DType, got: &[f32], want: &[f64]) {
    let tol = if dtype == DType::F32 { 1e-5 } else { 1e-2 };
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!((*g as f64 - w).abs() <= tol * (1.0 + w.abs()), "{what}: element {i}: got {g}, want {w}");
    }
}

/// Where a rank's input lives for one case.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Place {
    Ordinary,
    /// Output is the input.
    Same,
    Strided,
    Symmetric,
}

#[derive(Clone, Copy, Debug)]
struct Case {
    dtype: DType,
    n: usize,
    op: ReduceOp,
    algorithm: Option<AllReduceAlgorithm>,
    place: Place,
    calls: usize,
}

/// Runs `c` on every rank (`calls` times, new values each time) and checks
/// every output against the float64 sum, and that the ranks agree bitwise.
fn run(groups: &[Arc<Group>], c: Case) {
    let what = format!("{c:?}");
    let size = c.dtype.size();
    let outs = on_each(groups, |r, g| {
        let gpu = gpu_on(r as i32);
        let step = if c.place == Place::Strided { 2 } else { 1 };
        let sym = (c.place == Place::Symmetric).then(|| {
            let b = Buffer::create(g, c.n * size).unwrap();
            let h = rendezvous(&b).unwrap();
            (b, h)
        });
        let inbuf = gpu.alloc(c.n * step * size);
        let outbuf = gpu.alloc(c.n * step * size);
        let in_addr = sym.as_ref().map_or(inbuf.ptr, |(b, _)| b.addr());
        let mut results = Vec::new();
        for call_no in 0..c.calls {
            let v = inputs(c.dtype, c.n, r, call_no as u64);
            // Poison everything, then the input at its places.
            let mut full = vec![-1024.0f32; c.n * step];
            for i in 0..c.n {
                full[i * step] = v[i];
            }
            let bytes = encode(gd(c.dtype), &full);
            gpu.write_at(in_addr, &bytes);
            outbuf.write(&encode(gd(c.dtype), &vec![-1024.0f32; c.n * step]));
            let arr = |addr| Array { addr, dtype: c.dtype, shape: vec![c.n], strides: vec![step] };
            let input = arr(in_addr);
            let output = if c.place == Place::Same { input.clone() } else { arr(outbuf.ptr) };
            let call = AllReduce { input, output, op: c.op, norm: None, algorithm: c.algorithm };
            all_reduce(g, Ok(call), gpu.stream()).unwrap_or_else(|e| panic!("{what}: {}", e.msg));
            gpu.sync();
            g.backend().check_async_error().unwrap();
            let out_addr = if c.place == Place::Same { in_addr } else { outbuf.ptr };
            let got = decode(gd(c.dtype), &gpu.read_at(out_addr, c.n * step * size));
            if step == 2 {
                assert!(got.iter().skip(1).step_by(2).all(|&x| x == -1024.0), "{what}: a gap was written");
            }
            results.push((v, got.into_iter().step_by(step).collect::<Vec<f32>>()));
        }
        drop(sym);
        results
    });
    let scale = if c.op == ReduceOp::Avg { 1.0 / gpu_test_world() as f64 } else { 1.0 };
    for call_no in 0..c.calls {
        let want: Vec<f64> =
            (0..c.n).map(|i| outs.iter().map(|o| o[call_no].0[i] as f64).sum::<f64>() * scale).collect();
        for (r, o) in outs.iter().enumerate() {
            check_close(&format!("{what} call {call_no} rank {r}"), c.dtype, &o[call_no].1, &want);
            let same = o[call_no].1.iter().zip(&outs[0][call_no].1).all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(same, "{what} call {call_no}: rank {r}'s output differs from rank 0's");
        }
    }
}

const ALGORITHMS: [Option<AllReduceAlgorithm>; 3] =
    [None, Some(AllReduceAlgorithm::OneShot), Some(AllReduceAlgorithm::TwoShot)];

#[test]
fn gpu_all_reduce_every_dtype_op_size_and_algorithm() {
    let Some(groups) = cuda_groups(gpu_test_world()) else { return };
    for dtype in [DType::F32, DType::BF16, DType::F16] {
        for algorithm in ALGORITHMS {
            for n in [1, 2, 3, 7, 8, 9, 1000, 4097, 65_539, 1 << 20, (5 << 20) + 3] {
                let op = if n % 2 == 0 { ReduceOp::Avg } else { ReduceOp::Sum };
                run(&groups, Case { dtype, n, op, algorithm, place: Place::Ordinary, calls: 2 });
            }
        }
    }
    // Tens of MB per rank.
    for algorithm in ALGORITHMS {
        let n = (24 << 20) / 2 + 1;
        run(&groups, Case { dtype: DType::BF16, n, op: ReduceOp::Sum, algorithm, place: Place::Ordinary, calls: 1 });
    }
    groups.iter().for_each(|g| g.release_scratch());
}

#[test]
fn gpu_all_reduce_in_place_strided_and_symmetric() {
    let Some(groups) = cuda_groups(gpu_test_world()) else { return };
    for place in [Place::Same, Place::Strided, Place::Symmetric] {
        for algorithm in ALGORITHMS {
            for n in [1, 999, 70_001, 1 << 20] {
                for op in [ReduceOp::Sum, ReduceOp::Avg] {
                    run(&groups, Case { dtype: DType::BF16, n, op, algorithm, place, calls: 2 });
                }
            }
        }
    }
    groups.iter().for_each(|g| g.release_scratch());
}

/// Integers summed exactly on the device (int64 near 2^60 and its limits,
/// int32 around 2^25 + 1, int8/uint8 over their range; sums that wrap;
/// AVG truncating toward zero): every algorithm, sizes from one element to
/// MBs with odd byte counts, strided and in place, and 1-byte arrays at
/// odd addresses; outputs poisoned, bytes around them checked.
#[test]
fn gpu_all_reduce_integers_exact() {
    let Some(groups) = cuda_groups(gpu_test_world()) else { return };
    for dtype in [DType::I8, DType::U8, DType::I32, DType::I64] {
        for algorithm in ALGORITHMS {
            for n in [1, 3, 7, 8, 9, 1000, 4097, 65_539, 1 << 20, (3 << 20) + 3] {
                for op in [ReduceOp::Sum, ReduceOp::Avg] {
                    run_int(&groups, dtype, n, op, algorithm, Place::Ordinary, 0);
                }
            }
            for place in [Place::Same, Place::Strided] {
                run_int(&groups, dtype, 70_001, ReduceOp::Sum, algorithm, place, 0);
            }
            if dtype.size() == 1 {
                for n in [5, 4097, 300_001] {
                    run_int(&groups, dtype, n, ReduceOp::Avg, algorithm, Place::Ordinary, 1);
                }
            }
        }
    }
    groups.iter().for_each(|g| g.release_scratch());
}

/// One integer case, twice in a row (the call count's parity): `offset`
/// bytes added to both arrays' addresses.
fn run_int(
    groups: &[Arc<Group>],
    dtype: DType,
    n: usize,
    op: ReduceOp,
    algorithm: Option<AllReduceAlgorithm>,
    place: Place,
    offset: usize,
) {
    use super::tests::{int_bytes, int_reference, int_value, int_values, INT_POISON};
    let what = format!("{dtype} n={n} {op:?} {algorithm:?} {place:?} offset {offset}");
    let size = dtype.size();
    let step = if place == Place::Strided { 2 } else { 1 };
    let len = n * step * size + offset + 16;
    for call_no in 0..2u64 {
        let inputs: Vec<Vec<i128>> =
            (0..gpu_test_world()).map(|r| int_values(dtype, n, call_no * 101 + r as u64)).collect();
        let outs = on_each(groups, |r, g| {
            let gpu = gpu_on(r as i32);
            let mut host = vec![INT_POISON; len];
            for (i, v) in inputs[r].iter().enumerate() {
                host[offset + i * step * size..][..size].copy_from_slice(&int_bytes(dtype, *v));
            }
            let inbuf = gpu.upload(&host);
            let outbuf = gpu.upload(&vec![INT_POISON; len]);
            let arr = |base: u64| Array { addr: base + offset as u64, dtype, shape: vec![n], strides: vec![step] };
            let input = arr(inbuf.ptr);
            let output = if place == Place::Same { input.clone() } else { arr(outbuf.ptr) };
            let call = AllReduce { input, output, op, norm: None, algorithm };
            all_reduce(g, Ok(call), gpu.stream()).unwrap_or_else(|e| panic!("{what}: {}", e.msg));
            gpu.sync();
            g.backend().check_async_error().unwrap();
            let got = if place == Place::Same { inbuf.read_bytes() } else { outbuf.read_bytes() };
            let mut elems = vec![false; len];
            (0..n).for_each(|i| elems[offset + i * step * size..][..size].fill(true));
            let outside = got.iter().zip(&elems).filter(|(_, &e)| !e).all(|(&b, _)| b == INT_POISON);
            assert!(outside, "{what} call {call_no} rank {r}: a byte outside the output was written");
            (0..n).map(|i| int_value(dtype, &got[offset + i * step * size..][..size])).collect::<Vec<i128>>()
        });
        for (r, out) in outs.iter().enumerate() {
            for (i, &v) in out.iter().enumerate() {
                let want = int_reference(dtype, &inputs, i, op);
                assert_eq!(v, want, "{what} call {call_no} rank {r} element {i}");
            }
        }
    }
}

/// Many calls in a row, sizes and algorithms interleaved: the call count
/// and its parity carry from call to call (and the eager repeats replay as
/// graphs).
#[test]
fn gpu_all_reduce_many_calls_interleaved() {
    let Some(groups) = cuda_groups(gpu_test_world()) else { return };
    for round in 0..3 {
        for (n, algorithm) in [
            (4096, Some(AllReduceAlgorithm::OneShot)),
            (1 << 20, Some(AllReduceAlgorithm::TwoShot)),
            (33, None),
            (300_001, Some(AllReduceAlgorithm::OneShot)),
            (2 << 20, None),
        ] {
            let op = if round == 1 { ReduceOp::Avg } else { ReduceOp::Sum };
            run(&groups, Case { dtype: DType::BF16, n, op, algorithm, place: Place::Ordinary, calls: 5 });
        }
    }
    groups.iter().for_each(|g| g.release_scratch());
}

/// A call captured into a CUDA graph by the caller (after one eager call
/// sized the buffers), replayed with new inputs each time.
#[test]
fn gpu_all_reduce_captured_and_replayed() {
    let Some(groups) = cuda_groups(gpu_test_world()) else { return };
    for (n, algorithm) in [(4096usize, AllReduceAlgorithm::OneShot), (3 << 20, AllReduceAlgorithm::TwoShot)] {
        let dtype = DType::BF16;
        let replays = 5;
        let outs = on_each(&groups, |r, g| {
            let gpu = gpu_on(r as i32);
            let (inbuf, outbuf) = (gpu.alloc(n * 2), gpu.alloc(n * 2));
            let call = || AllReduce {
                input: Array::contiguous(inbuf.ptr, dtype, &[n]),
                output: Array::contiguous(outbuf.ptr, dtype, &[n]),
                op: ReduceOp::Sum,
                norm: None,
                algorithm: Some(algorithm),
            };
            inbuf.write(&encode(GemmDtype::BF16, &inputs(dtype, n, r, 99)));
            all_reduce(g, Ok(call()), gpu.stream()).unwrap();
            gpu.sync();
            let s = gpu.stream().0 as sys::CUstream;
            let mode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL;
            let mut got = Vec::new();
            // SAFETY: our own stream; graph handles made and destroyed here.
            unsafe {
                driver::check(sys::cuStreamBeginCapture_v2(s, mode), "cuStreamBeginCapture").unwrap();
                let issued = all_reduce(g, Ok(call()), gpu.stream());
                let mut graph = std::ptr::null_mut();
                driver::check(sys::cuStreamEndCapture(s, &mut graph), "cuStreamEndCapture").unwrap();
                issued.unwrap();
                let mut exec = std::ptr::null_mut();
                driver::check(sys::cuGraphInstantiateWithFlags(&mut exec, graph, 0), "cuGraphInstantiate").unwrap();
                for k in 0..replays {
                    let v = inputs(dtype, n, r, k as u64);
                    inbuf.write(&encode(GemmDtype::BF16, &v));
                    driver::check(sys::cuGraphLaunch(exec, s), "cuGraphLaunch").unwrap();
                    gpu.sync();
                    got.push((v, decode(GemmDtype::BF16, &outbuf.read_bytes())));
                }
                sys::cuGraphExecDestroy(exec);
                sys::cuGraphDestroy(graph);
            }
            g.backend().check_async_error().unwrap();
            got
        });
        for k in 0..replays {
            let want: Vec<f64> = (0..n).map(|i| outs.iter().map(|o| o[k].0[i] as f64).sum()).collect();
            for (r, o) in outs.iter().enumerate() {
                check_close(&format!("{algorithm:?} n={n} replay {k} rank {r}"), dtype, &o[k].1, &want);
            }
        }
    }
    groups.iter().for_each(|g| g.release_scratch());
}

/// The fused form against float64, fused in the one-shot kernel (rows of
/// whole 8-byte lines) or after the two-shot, residual_out in place or not.
#[test]
fn gpu_all_reduce_rmsnorm() {
    let Some(groups) = cuda_groups(gpu_test_world()) else { return };
    for dtype in [DType::BF16, DType::F16, DType::F32] {
        for (tokens, hidden) in [(1, 4096), (7, 8192), (64, 4096), (512, 8192), (3, 33), (5, 130)] {
            for algorithm in ALGORITHMS {
                for in_place in [false, true] {
                    rmsnorm(&groups, dtype, tokens, hidden, algorithm, in_place);
                }
            }
        }
    }
    groups.iter().for_each(|g| g.release_scratch());
}

fn rmsnorm(
    groups: &[Arc<Group>],
    dtype: DType,
    tokens: usize,
    hidden: usize,
    algorithm: Option<AllReduceAlgorithm>,
    in_place: bool,
) {
    let n = tokens * hidden;
    let what = format!("rmsnorm {dtype} {tokens}x{hidden} {algorithm:?} in place {in_place}");
    let g16 = gd(dtype);
    let residual = inputs(dtype, n, 9, 1);
    let weight = inputs(dtype, hidden, 9, 2);
    let eps = 1e-6f32;
    let outs = on_each(groups, |r, g| {
        let gpu = gpu_on(r as i32);
        let v = inputs(dtype, n, r, 5);
        let inb = gpu.upload(&encode(g16, &v));
        let resb = gpu.upload(&encode(g16, &residual));
        let wb = gpu.upload(&encode(g16, &weight));
        let outb: DevBuf = gpu.upload(&encode(g16, &vec![-1024.0; n]));
        let rob: DevBuf = gpu.upload(&encode(g16, &vec![-1024.0; n]));
        let m = |addr| Array::contiguous(addr, dtype, &[tokens, hidden]);
        let res = m(resb.ptr);
        let call = AllReduce {
            input: m(inb.ptr),
            output: m(outb.ptr),
            op: ReduceOp::Sum,
            norm: Some(Norm {
                residual: res.clone(),
                weight: Array::contiguous(wb.ptr, dtype, &[hidden]),
                eps,
                residual_out: if in_place { res } else { m(rob.ptr) },
            }),
            algorithm,
        };
        all_reduce(g, Ok(call), gpu.stream()).unwrap_or_else(|e| panic!("{what}: {}", e.msg));
        gpu.sync();
        g.backend().check_async_error().unwrap();
        let ro = if in_place { &resb } else { &rob };
        (v, decode(g16, &outb.read_bytes()), decode(g16, &ro.read_bytes()))
    });
    let q = |x: f64| decode(g16, &encode(g16, &[x as f32]))[0] as f64;
    let sum: Vec<f64> = (0..n).map(|i| q(outs.iter().map(|o| o.0[i] as f64).sum())).collect();
    let r: Vec<f64> = (0..n).map(|i| sum[i] + residual[i] as f64).collect();
    let mut want = vec![0f64; n];
    for t in 0..tokens {
        let row = &r[t * hidden..(t + 1) * hidden];
        let inv = 1.0 / (row.iter().map(|x| x * x).sum::<f64>() / hidden as f64 + eps as f64).sqrt();
        for i in 0..hidden {
            want[t * hidden + i] = row[i] * inv * weight[i] as f64;
        }
    }
    for (rk, o) in outs.iter().enumerate() {
        check_close(&format!("{what} rank {rk} residual_out"), dtype, &o.2, &r);
        check_close(&format!("{what} rank {rk} out"), dtype, &o.1, &want);
    }
}
