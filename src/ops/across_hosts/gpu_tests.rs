use super::super::lc_allgather as lc_allgather_op;
use super::*;
use crate::array::DType;
use crate::backend::cuda::gpu_testing::{gpu_on, report_skipped};
use crate::backend::cuda::{driver, nccl};
use crate::backend::BackendChoice;
use crate::bootstrap::local::local_bootstraps;
use crate::error::ErrorKind;
use crate::group::GroupConfig;
use std::sync::Arc;
use std::time::{Duration, Instant};

fn groups(timeout: Duration) -> Vec<Arc<Group>> {
    groups_on(&["a", "b"], timeout)
}

/// A CUDA group whose rank r is on GPU r and pretend host `hosts[r]`.
fn groups_on(hosts: &[&str], timeout: Duration) -> Vec<Arc<Group>> {
    std::thread::scope(|s| {
        let hs: Vec<_> = local_bootstraps(hosts.len())
            .into_iter()
            .zip(hosts)
            .enumerate()
            .map(|(r, (b, h))| {
                let cfg = GroupConfig {
                    backend: Some(BackendChoice::Cuda),
                    timeout: Some(timeout),
                    host_id: Some(h.to_string()),
                    ..Default::default()
                };
                s.spawn(move || Group::new(Box::new(b), r as i32, &cfg).expect("a CUDA group on pretend hosts"))
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// Both ranks make a call (agreed, then kept), then rank 0 alone makes
/// it again: `stop(group)` runs on rank 0 while it waits. Returns how
/// long rank 0's stream took to get past the lone call, and rank 0's
/// group.
fn lone_kept_call(timeout: Duration, stop: impl Fn(&Group) + Sync) -> (Duration, Arc<Group>) {
    let gs = groups(timeout);
    let n = 1 << 16;
    let waited = std::thread::scope(|s| {
        let hs: Vec<_> = gs
            .iter()
            .map(|g| {
                let stop = &stop;
                s.spawn(move || {
                    let gpu = gpu_on(g.device());
                    let input = gpu.upload(&vec![g.rank() as f32 + 0.5; n]);
                    let output = gpu.upload(&vec![f32::NAN; 2 * n]);
                    let call = || LcAllgather {
                        input: Array::contiguous(input.ptr, DType::F32, &[n]),
                        output: Array::contiguous(output.ptr, DType::F32, &[2 * n]),
                    };
                    for _ in 0..2 {
                        lc_allgather_op(g, Ok(call()), gpu.stream()).unwrap();
                    }
                    gpu.sync();
                    let got = output.read::<f32>(2 * n);
                    assert!(got[..n].iter().all(|&v| v == 0.5) && got[n..].iter().all(|&v| v == 1.5));
                    if g.rank() != 0 {
                        return None;
                    }
                    let t = Instant::now();
                    lc_allgather_op(g, Ok(call()), gpu.stream()).expect("a kept call is enqueued");
                    std::thread::sleep(Duration::from_millis(200));
                    stop(g);
                    gpu.sync();
                    Some(t.elapsed())
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).find_map(|w| w).unwrap()
    });
    gs[1].abort();
    (waited, gs[0].clone())
}

#[test]
fn gpu_a_kept_call_without_its_peer_times_out_or_aborts() {
    if driver::device_count() < 2 || nccl::load().is_err() {
        report_skipped();
        return;
    }
    let (waited, g) = lone_kept_call(Duration::from_secs(2), |_| {});
    assert!(waited >= Duration::from_secs(2) && waited < Duration::from_secs(20), "{waited:?}");
    let e = g.failure().expect("the group failed");
    assert_eq!(e.kind, ErrorKind::Timeout, "{}", e.msg);
    assert!(e.msg.contains("symm_lc_allgather across hosts did not finish"), "{}", e.msg);
    let (n, gpu) = (4, gpu_on(g.device()));
    let (input, output) = (gpu.upload(&[1f32; 4]), gpu.upload(&[f32::NAN; 8]));
    let call = LcAllgather {
        input: Array::contiguous(input.ptr, DType::F32, &[n]),
        output: Array::contiguous(output.ptr, DType::F32, &[2 * n]),
    };
    assert_eq!(lc_allgather_op(&g, Ok(call), gpu.stream()).unwrap_err().kind, ErrorKind::Aborted);
    // An abort ends the wait long before a minute's timeout.
    let (waited, g) = lone_kept_call(Duration::from_secs(60), |g| g.abort());
    assert!(waited < Duration::from_secs(10), "{waited:?}");
    assert_eq!(g.failure().expect("aborted").kind, ErrorKind::Aborted);
}

/// Two pretend hosts of two GPUs each: the level inside each host on
/// the LL lines (both steps of a small all-reduce, the gather of a
/// middling one; `decide::inside_on_lines`) and through NCCL (a large
/// one), and gathers on the lines, against exact sums (small integers)
/// and every rank's rows; outputs poisoned. Skipped without four GPUs.
#[test]
fn gpu_the_level_inside_a_host_on_symmetric_memory() {
    if driver::device_count() < 4 || nccl::load().is_err() {
        report_skipped();
        return;
    }
    for hosts in [["a", "a", "b", "b"], ["a", "b", "b", "a"]] {
        let gs = groups_on(&hosts, Duration::from_secs(30));
        let value = |r: usize, i: usize| ((r * 5 + i) % 11) as f32 - 5.0;
        std::thread::scope(|s| {
            for g in &gs {
                s.spawn(move || {
                    let (r, gpu) = (g.rank(), gpu_on(g.device()));
                    for n in [1024, 1 << 17, 1 << 21] {
                        let input = gpu.upload(&(0..n).map(|i| value(r, i)).collect::<Vec<_>>());
                        let output = gpu.upload(&vec![f32::NAN; n]);
                        let call = AllReduce {
                            input: Array::contiguous(input.ptr, DType::F32, &[n]),
                            output: Array::contiguous(output.ptr, DType::F32, &[n]),
                            op: ReduceOp::Sum,
                            norm: None,
                            algorithm: None,
                        };
                        for _ in 0..2 {
                            super::super::all_reduce(g, Ok(call.clone()), gpu.stream()).unwrap();
                        }
                        gpu.sync();
                        let got = output.read::<f32>(n);
                        let bad = (0..n).filter(|&i| got[i] != (0..4).map(|q| value(q, i)).sum::<f32>()).count();
                        assert_eq!(bad, 0, "{hosts:?} all-reduce of {n}: {bad} wrong on rank {r}");
                        let rows = n / 1024;
                        let gathered = gpu.upload(&vec![f32::NAN; 4 * n]);
                        let call = LcAllgather {
                            input: Array::contiguous(input.ptr, DType::F32, &[rows, 1024]),
                            output: Array::contiguous(gathered.ptr, DType::F32, &[4 * rows, 1024]),
                        };
                        lc_allgather_op(g, Ok(call), gpu.stream()).unwrap();
                        gpu.sync();
                        let got = gathered.read::<f32>(4 * n);
                        let bad = (0..4 * n).filter(|&i| got[i] != value(i / n, i % n)).count();
                        assert_eq!(bad, 0, "{hosts:?} gather of {n}: {bad} wrong on rank {r}");
                    }
                });
            }
        });
        assert!(gs.iter().all(|g| g.check_healthy().is_ok()));
    }
}

/// Calls across hosts captured into a CUDA graph (after an eager call
/// of each made their buffers) and replayed with new inputs: an
/// all-reduce and a gather, on two pretend hosts of one GPU each, and
/// of two where four GPUs exist (the level inside on the lines). Exact
/// sums of small integers; outputs poisoned before each replay.
#[test]
fn gpu_calls_across_hosts_replay_as_graphs() {
    use crate::backend::cuda::driver::check;
    use cudarc::driver::sys;
    if driver::device_count() < 2 || nccl::load().is_err() {
        report_skipped();
        return;
    }
    let placements: &[&[&str]] =
        if driver::device_count() >= 4 { &[&["a", "b"], &["a", "a", "b", "b"]] } else { &[&["a", "b"]] };
    for hosts in placements {
        let gs = groups_on(hosts, Duration::from_secs(30));
        let world = hosts.len();
        let value = |r: usize, i: usize, k: usize| ((r * 5 + i + 3 * k) % 11) as f32 - 5.0;
        let n = 4096;
        std::thread::scope(|s| {
            for g in &gs {
                s.spawn(move || {
                    let (r, gpu) = (g.rank(), gpu_on(g.device()));
                    let input = gpu.upload(&vec![0f32; n]);
                    let (summed, gathered) = (gpu.upload(&vec![0f32; n]), gpu.upload(&vec![0f32; world * n]));
                    let enqueue = || -> Result<()> {
                        let reduce = AllReduce {
                            input: Array::contiguous(input.ptr, DType::F32, &[n]),
                            output: Array::contiguous(summed.ptr, DType::F32, &[n]),
                            op: ReduceOp::Sum,
                            norm: None,
                            algorithm: None,
                        };
                        super::super::all_reduce(g, Ok(reduce), gpu.stream())?;
                        let gather = LcAllgather {
                            input: Array::contiguous(input.ptr, DType::F32, &[n / 256, 256]),
                            output: Array::contiguous(gathered.ptr, DType::F32, &[world * n / 256, 256]),
                        };
                        lc_allgather_op(g, Ok(gather), gpu.stream())
                    };
                    enqueue().unwrap();
                    gpu.sync();
                    let st = gpu.stream().0 as sys::CUstream;
                    let mode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL;
                    // SAFETY: our own stream; graph handles made and destroyed here.
                    unsafe {
                        check(sys::cuStreamBeginCapture_v2(st, mode), "cuStreamBeginCapture").unwrap();
                        let issued = enqueue();
                        let mut graph = std::ptr::null_mut();
                        check(sys::cuStreamEndCapture(st, &mut graph), "cuStreamEndCapture").unwrap();
                        issued.unwrap();
                        let mut exec = std::ptr::null_mut();
                        check(sys::cuGraphInstantiateWithFlags(&mut exec, graph, 0), "cuGraphInstantiate").unwrap();
                        for k in 0..3 {
                            input.write(&(0..n).map(|i| value(r, i, k)).collect::<Vec<_>>());
                            summed.write(&vec![f32::NAN; n]);
                            gathered.write(&vec![f32::NAN; world * n]);
                            check(sys::cuGraphLaunch(exec, st), "cuGraphLaunch").unwrap();
                            gpu.sync();
                            let got = summed.read::<f32>(n);
                            let want = |i: usize| (0..world).map(|q| value(q, i, k)).sum::<f32>();
                            let bad = (0..n).filter(|&i| got[i] != want(i)).count();
                            assert_eq!(bad, 0, "{hosts:?} replay {k}: {bad} sums wrong on rank {r}");
                            let got = gathered.read::<f32>(world * n);
                            let bad = (0..world * n).filter(|&i| got[i] != value(i / n, i % n, k)).count();
                            assert_eq!(bad, 0, "{hosts:?} replay {k}: {bad} gathered wrong on rank {r}");
                        }
                        sys::cuGraphExecDestroy(exec);
                        sys::cuGraphDestroy(graph);
                    }
                    g.backend().check_async_error().unwrap();
                });
            }
        });
        assert!(gs.iter().all(|g| g.check_healthy().is_ok()));
    }
}
