//! The cheap path of a repeated call on CUDA: once warmed up, every call of
//! one signature is exactly one graph launch (the agreement cache, the
//! plan and the replay key hit), which is what keeps the host time of a
//! small call low. Two ranks as threads of one process, on GPUs 0 and 1
//! where there are two (mm_rs 512 then takes the fused kernel, which needs
//! a GPU per rank), else both on GPU 0.
//!
//! The host time itself is a benchmark, not a test:
//! `bench/gpu/host_overhead.py` measures it per call (wrapper, library and
//! the driver calls, cuGraphLaunch included).

use super::{fused_ag_mm, mm_rs, AgMm, AgMmScales, MmRs, MmRsScales, ReduceOp};
use crate::array::{Array, DType};
use crate::backend::cuda::driver::check;
use crate::backend::cuda::driver::device_count;
use crate::backend::cuda::gpu_testing::{gpu, gpu_on, DevBuf, Gpu};
use crate::backend::cuda::graphs::launches;
use crate::backend::BackendChoice;
use crate::group::{Group, GroupConfig};
use cudarc::driver::sys;
use std::sync::Barrier;
use std::time::Duration;

const CALLS: usize = 20;
const BATCHES: usize = 3;

/// Ones in bf16 (0x3f80): finite operands, so no NaN slows a kernel.
fn ones(g: &Gpu, bytes: usize) -> DevBuf {
    let b = g.alloc(bytes);
    // SAFETY: the buffer holds `bytes`.
    check(unsafe { sys::cuMemsetD16_v2(b.ptr, 0x3f80, bytes / 2) }, "cuMemsetD16").unwrap();
    b
}

/// (graph launches, host time per call, of it in cuGraphLaunch).
type Kept = (u64, Duration, Duration);

/// Graph launches made by `BATCHES` batches of `CALLS` calls of `call` on
/// this rank, after a warm-up, and the host time of a call and of its
/// cuGraphLaunch (averages); every rank drains its stream and meets the
/// others before each batch.
fn launches_after_warmup(call: &dyn Fn(), g: &Gpu, meet: &Barrier) -> Kept {
    for _ in 0..5 {
        call(); // eager, captured, then replayed
    }
    g.sync();
    let (mut launched, mut spent, mut in_launch) = (0, Duration::ZERO, Duration::ZERO);
    for _ in 0..BATCHES {
        g.sync();
        meet.wait();
        launches::take();
        let started = std::time::Instant::now();
        for _ in 0..CALLS {
            call();
        }
        spent += started.elapsed();
        let (n, t) = launches::take();
        launched += n;
        in_launch += t;
    }
    g.sync();
    let calls = (CALLS * BATCHES) as u32;
    (launched, spent / calls, in_launch / calls)
}

#[test]
fn gpu_repeated_calls_are_one_graph_launch_each() {
    if gpu().is_none() {
        return;
    }
    let devices: [i32; 2] = if device_count() >= 2 { [0, 1] } else { [0, 0] };
    let cfg = GroupConfig {
        backend: Some(BackendChoice::Cuda),
        timeout: Some(Duration::from_secs(60)),
        allow_shared_device: devices[0] == devices[1],
        ..Default::default()
    };
    let groups = Group::new_local(&devices, &cfg).unwrap();
    let (m, k, n) = (512usize, 8192usize, 14336usize);
    // Per rank, allocated before any rank calls (an allocation may wait for
    // a peer's kernel on the shared device): ag_mm's shard, B and output;
    // mm_rs's A, B and output.
    let bf = 2;
    let bufs: Vec<[DevBuf; 6]> = devices
        .iter()
        .map(|&d| {
            let g = gpu_on(d);
            [
                ones(&g, m / 2 * k * bf),
                ones(&g, k * n * bf),
                ones(&g, m * n * bf),
                ones(&g, m * n * bf),
                ones(&g, n * k * bf),
                ones(&g, m / 2 * k * bf),
            ]
        })
        .collect();
    let meet = Barrier::new(2);
    let results: Vec<Vec<(&str, Kept)>> = std::thread::scope(|sc| {
        let hs: Vec<_> = groups
            .iter()
            .zip(&bufs)
            .zip(devices)
            .map(|((group, b), device)| {
                let meet = &meet;
                sc.spawn(move || {
                    // Each rank its own stream (on a shared device or its own).
                    let g = gpu_on(device);
                    g.ctx.bind_to_thread().unwrap();
                    let s = g.stream();
                    let arr = |buf: &DevBuf, shape: &[usize]| Array::contiguous(buf.ptr, DType::BF16, shape);
                    let ag = || {
                        let call = AgMm {
                            a_shard: arr(&b[0], &[m / 2, k]),
                            bs: vec![arr(&b[1], &[k, n])],
                            gather_dim: 0,
                            ag_out: None,
                            outs: vec![arr(&b[2], &[m, n])],
                            scales: AgMmScales::default(),
                            algorithm: None,
                        };
                        fused_ag_mm(group, Ok(call), s).unwrap();
                    };
                    // mm_rs 512 x 14336 x 8192: A [512, 14336], B [14336, 8192].
                    let rs = || {
                        let call = MmRs {
                            a: arr(&b[3], &[m, n]),
                            b: arr(&b[4], &[n, k]),
                            scatter_dim: 0,
                            op: ReduceOp::Sum,
                            out: arr(&b[5], &[m / 2, k]),
                            scales: MmRsScales::default(),
                            algorithm: None,
                        };
                        mm_rs(group, Ok(call), s).unwrap();
                    };
                    let mut out = Vec::new();
                    for (name, call) in [("ag_mm 512x8192x14336", &ag as &dyn Fn()), ("mm_rs 512x14336x8192", &rs)] {
                        out.push((name, launches_after_warmup(call, &g, meet)));
                    }
                    out
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (rank, rows) in results.iter().enumerate() {
        for (name, (launched, per_call, in_launch)) in rows {
            assert_eq!(*launched, (CALLS * BATCHES) as u64, "{name} on rank {rank}: calls not replayed as graphs");
            // Where a kept call's host time goes (not asserted: a benchmark).
            eprintln!(
                "{name} on rank {rank}: {:.1} us of host time per call, {:.1} of it in cuGraphLaunch",
                per_call.as_secs_f64() * 1e6,
                in_launch.as_secs_f64() * 1e6
            );
        }
    }
}
