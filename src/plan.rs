//! The cost model: for a fused operation on a given group and shape, the
//! predicted matmul time, communication time and exposed (not hidden)
//! communication of each algorithm, and the choice among them.
//!
//! Times come from a roofline of the device (matmul rate, copy-engine link
//! bandwidth, HBM bandwidth, launch and barrier latencies) plus the cost of
//! splitting a matmul into pieces. The split cost is calibrated on our own
//! runs on 2 x H200 (`bench/results/2026-11-22-h200-x2-*`): with per-rank
//! pieces in rank-staggered order, the pipelined path beat one whole matmul
//! after the pulls on every benchmark shape but one, where the two were
//! within noise (ag_mm 16384x8192x8192: 3.37 vs 3.61 ms; 2048x8192x14336:
//! 0.81 vs 0.80 ms), so splitting costs about 1% here, not the 24% a naive
//! PyTorch pipeline showed in `../shared/anchors/`.

/// What the device can do, in the units the model uses.
#[derive(Clone, Copy, Debug)]
pub struct DeviceModel {
    /// Dense bf16/f16 matmul rate on large problems, TFLOP/s.
    pub matmul_tflops: f64,
    /// The same for fp8 (1-byte) operands.
    pub fp8_matmul_tflops: f64,
    /// Copy-engine pull bandwidth from one peer, GB/s.
    pub link_gbps: f64,
    /// Device memory bandwidth, GB/s (reads + writes).
    pub hbm_gbps: f64,
    /// Fixed cost of one kernel or copy launch in a pipeline, microseconds.
    pub launch_us: f64,
    /// One barrier or signal round trip between ranks, microseconds.
    pub barrier_us: f64,
    /// Relative matmul slowdown for each extra piece a matmul is split into.
    pub split_penalty: f64,
    /// Time of symm's own fused matmul relative to cuBLAS on the whole
    /// problem (kernels/gemm_sm90.cu; bf16 0.96-1.02 x on an H200 and an
    /// H100 since c7e5710; fp8 with exact accumulation 1.20-1.36 x, see
    /// bench/KERNELS.md). The fused algorithm is chosen by measurement, not
    /// by this estimate (see [`best`]).
    pub fused_slowdown: f64,
}

impl DeviceModel {
    /// Hopper (H100/H200 SXM) with NVLink, measured on 2 x H200.
    pub const HOPPER: DeviceModel = DeviceModel {
        matmul_tflops: 790.0,
        // cuBLASLt, e4m3, 16384 x 8192 x 8192 in 1.653 ms on one H200
        // (bench/results/2026-11-23-h200-x1-2582f43-fp8-lib-tests.txt).
        fp8_matmul_tflops: 1330.0,
        link_gbps: 358.0,
        hbm_gbps: 4300.0,
        launch_us: 6.0,
        barrier_us: 4.0,
        split_penalty: 0.01,
        fused_slowdown: 1.04,
    };
}

/// How an operation is carried out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Algorithm {
    /// Communicate everything, then one matmul (or matmul, then reduce).
    Sequential,
    /// One matmul piece per rank's chunk, the communication of the next
    /// chunk overlapping the matmul of the current one.
    Pipelined,
    /// One persistent matmul kernel over the whole problem whose tiles wait
    /// for their rows (all-gather) or push their results (reduce-scatter).
    Fused,
}

impl Algorithm {
    pub fn name(self) -> &'static str {
        match self {
            Algorithm::Sequential => "sequential",
            Algorithm::Pipelined => "pipelined",
            Algorithm::Fused => "fused",
        }
    }
}

/// The prediction for one algorithm.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Estimate {
    pub algorithm: Algorithm,
    /// Matmul time, including what splitting costs (ms).
    pub compute_ms: f64,
    /// Communication time if it ran alone (ms).
    pub comm_ms: f64,
    /// Communication not hidden behind the matmul (ms).
    pub exposed_ms: f64,
    /// Predicted time of the whole operation (ms).
    pub total_ms: f64,
}

/// Shape of a fused operation as the model sees it.
#[derive(Clone, Copy, Debug)]
pub struct Problem {
    /// Rows of the whole matmul (all ranks' rows for all-gather + matmul;
    /// this rank's rows of A for matmul + reduce-scatter).
    pub m: usize,
    pub k: usize,
    /// Sum of the N of every B.
    pub n: usize,
    pub world: usize,
    /// Bytes per element of A and of the output.
    pub elem_bytes: usize,
    /// Whether the fused kernel can run this problem on every rank.
    pub fused: bool,
}

fn matmul_ms(p: &Problem, rows: usize, d: &DeviceModel) -> f64 {
    let flops = 2.0 * rows as f64 * p.k as f64 * p.n as f64;
    let bytes = ((rows * p.k + p.k * p.n + rows * p.n) * p.elem_bytes) as f64;
    let tflops = if p.elem_bytes == 1 { d.fp8_matmul_tflops } else { d.matmul_tflops };
    (flops / (tflops * 1e9)).max(bytes / (d.hbm_gbps * 1e6)) + d.launch_us / 1e3
}

/// The whole matmul split into one piece per rank: (all pieces, one piece).
fn split_ms(whole: f64, world: usize, d: &DeviceModel) -> (f64, f64) {
    let extra = world as f64 - 1.0;
    let split = whole * (1.0 + d.split_penalty * extra) + extra * d.launch_us / 1e3;
    (split, split / world as f64)
}

fn transfer_ms(bytes: f64, d: &DeviceModel) -> f64 {
    bytes / (d.link_gbps * 1e6)
}

/// Both algorithms of an operation whose communication is `pulls`
/// transfers of `bytes` each (one after another) around a matmul taking
/// `whole` ms; `local_ms` is work the pipelined form adds after the last
/// piece (a local reduction).
fn estimates(whole: f64, bytes: f64, world: usize, local_ms: f64, fused: bool, d: &DeviceModel) -> Vec<Estimate> {
    let pulls = world.saturating_sub(1) as f64;
    let barriers = 2.0 * d.barrier_us / 1e3;
    let comm = pulls * transfer_ms(bytes, d) + barriers;
    let mut out = vec![Estimate {
        algorithm: Algorithm::Sequential,
        compute_ms: whole,
        comm_ms: comm,
        exposed_ms: comm,
        total_ms: whole + comm,
    }];
    if world > 1 {
        // Each pull hides behind a matmul piece; only the barriers (and the
        // local work) stay exposed, unless a pull is slower than a piece.
        let (split, piece) = split_ms(whole, world, d);
        let exposed = barriers + local_ms + pulls * (transfer_ms(bytes, d) - piece).max(0.0);
        out.push(Estimate {
            algorithm: Algorithm::Pipelined,
            compute_ms: split,
            comm_ms: comm,
            exposed_ms: exposed,
            total_ms: split + exposed,
        });
    }
    if fused && world > 1 {
        // One kernel over the whole problem: no split or launch costs; each
        // chunk's transfer hides behind the tiles of the chunks before it,
        // and one barrier stays exposed.
        let compute = whole * d.fused_slowdown;
        let piece = compute / world as f64;
        let exposed = d.barrier_us / 1e3 + local_ms + pulls * (transfer_ms(bytes, d) - piece).max(0.0);
        out.push(Estimate {
            algorithm: Algorithm::Fused,
            compute_ms: compute,
            comm_ms: comm,
            exposed_ms: exposed,
            total_ms: compute + exposed,
        });
    }
    out
}

/// All-gather of A (`m` rows in all) then matmul: each rank pulls every
/// peer's shard; pipelined, its own shard's piece runs first.
pub fn ag_mm(p: &Problem, d: &DeviceModel) -> Vec<Estimate> {
    let shard_bytes = (p.m / p.world * p.k * p.elem_bytes) as f64;
    estimates(matmul_ms(p, p.m, d), shard_bytes, p.world, 0.0, p.fused, d)
}

/// Matmul of this rank's `m` rows, then reduce-scatter of the result: each
/// rank pulls the chunk every peer computed for it; pipelined, the peers'
/// chunks come first and the final reduction is local (HBM speed). Fused,
/// the reduction happens in the epilogue of this rank's own tiles, which
/// read the peers' partials from local memory.
pub fn mm_rs(p: &Problem, d: &DeviceModel) -> Vec<Estimate> {
    let chunk_bytes = (p.m / p.world * p.n * p.elem_bytes) as f64;
    let local_reduce = (p.world as f64 + 1.0) * chunk_bytes / (d.hbm_gbps * 1e6);
    let whole = matmul_ms(p, p.m, d);
    let mut out = estimates(whole, chunk_bytes, p.world, local_reduce, p.fused, d);
    if let Some(f) = out.iter_mut().find(|e| e.algorithm == Algorithm::Fused) {
        let reads = (p.world as f64 - 1.0) * chunk_bytes / (d.hbm_gbps * 1e6);
        f.exposed_ms += reads - local_reduce;
        f.total_ms = f.compute_ms + f.exposed_ms;
    }
    out
}

/// The fused all-gather pulls each shard in slices of k (columns), each
/// flagged on its own, so that a tile of a peer's rows starts once the
/// first slice has landed instead of the whole shard. At small M that lets
/// those tiles run in the first wave beside the local ones, reading B
/// together (at 512x8192x14336 the kernel otherwise read B once per shard:
/// 1.07-1.09 x the whole matmul with the shard already there, one H100 and
/// one H200, bench/KERNELS.md). Slices stay large enough that a copy engine
/// streams them at speed, and few enough that their flags cost nothing.
const MIN_SLICE_BYTES: usize = 512 << 10;
const MAX_SLICES: usize = 8;

/// The width (in elements of k) of the fused all-gather's slices of a
/// shard of `shard_bytes` with `k` columns: `k` itself (one slice), or a
/// multiple of `align` that divides `k` into at most [`MAX_SLICES`] slices
/// of at least [`MIN_SLICE_BYTES`] (the most such slices).
pub fn gather_slice_k(shard_bytes: usize, k: usize, align: usize) -> usize {
    let most = (shard_bytes / MIN_SLICE_BYTES).clamp(1, MAX_SLICES);
    (2..=most).rev().find(|&s| k % (s * align) == 0).map_or(k, |s| k / s)
}

/// The algorithm to run: `SYMM_ALGO` (`sequential`, `pipelined` or
/// `fused`) when set, for benchmarking and tuning, else the best estimate
/// (with `fused_preferred`, see [`best`]).
/// `fused` is an error (Unsupported) where the fused kernel cannot run the
/// call, so that a benchmark or test never measures a silent fallback.
pub fn choose(estimates: &[Estimate], fused_preferred: bool) -> crate::Result<Algorithm> {
    match std::env::var("SYMM_ALGO").as_deref() {
        Ok("sequential") => Ok(Algorithm::Sequential),
        Ok("pipelined") => Ok(Algorithm::Pipelined),
        Ok("fused") if estimates.iter().any(|e| e.algorithm == Algorithm::Fused) => Ok(Algorithm::Fused),
        Ok("fused") => Err(crate::error::err!(
            Unsupported,
            "SYMM_ALGO=fused, but the fused kernel cannot run this call: it needs every rank on a GPU of its own \
             that runs symm's sm_90a kernels, bf16 or f16 operands with k a multiple of 8, gather/scatter \
             dimension 0 of matrices, B K-major (a Linear weight's transpose) and 16-byte aligned rows"
        )),
        Ok(other) => {
            Err(crate::error::err!(InvalidArgument, "SYMM_ALGO={other:?}: expected sequential, pipelined or fused"))
        }
        Err(_) => Ok(best(estimates, fused_preferred).algorithm),
    }
}

/// The automatic choice: the estimate with the smallest predicted total
/// among the sequential and pipelined paths, unless the fused one is
/// `fused_preferred` (last paragraph). Otherwise the fused kernel runs only
/// when asked for (`SYMM_ALGO=fused`): on 2 x H200 it was slower than the
/// pipelined path on 7 of the 8 benchmark shapes (ag_mm 0.99-1.10 x, and
/// 5 x at M = 512; mm_rs 1.05-1.39 x; bench/results/2026-11-23-h200-x2-*),
/// and on 2 x H100 on all 8, eager and bound (ag_mm 1.02-1.17 x, mm_rs
/// 1.03-1.11 x; bench/results/2026-11-25-h100-x2-*), for reasons the model
/// does not capture yet, so its estimate is reported but never preferred.
/// Since the fused reduce-scatter lost its opening barrier (2 x H200,
/// bench/results/2026-11-26-h200-x2-*, bench/KERNELS.md v12-v13) it ties
/// the pipelined path bound at mm_rs 512 (0.194-0.213 against 0.194-0.205
/// ms, a noisy run aside) but is 2-5% slower replayed from graphs and
/// 2-5% slower bound at 2048: still no shape where choosing it would pay.
/// With v18 (bench/KERNELS.md) it was 2-3% faster bound at mm_rs 512 in the
/// benchmark's quick runs (slower in its complete run, 0.203 against 0.196)
/// and 9-26% slower than the pipelined path at five of six small-M shapes,
/// 512 included (twice), when each call starts alone (`eager_gap_probe.py`,
/// bench/results/2026-11-26-h200-x2-3df52bb-mm-rs-small-m-probe.txt),
/// probably because its own tiles need the peer's pushes within ~10 us of
/// their mainloop's end, where the pipelined path's pull has a whole second
/// matmul to arrive in, so ranks that start apart cost it more.
/// With v19 (narrow peer tiles on the SMs a one-wave kernel leaves idle,
/// bench/KERNELS.md) the fused reduce-scatter beat the pipelined path at
/// mm_rs 512 bound, replayed and one call at a time, so where the backend
/// says its kernel is at that advantage (`fused_preferred`, from the shape
/// alone) and it can run, it is chosen.
pub fn best(estimates: &[Estimate], fused_preferred: bool) -> Estimate {
    if let Some(f) = estimates.iter().find(|e| e.algorithm == Algorithm::Fused && fused_preferred) {
        return *f;
    }
    *estimates
        .iter()
        .filter(|e| e.algorithm != Algorithm::Fused)
        .min_by(|a, b| a.total_ms.total_cmp(&b.total_ms))
        .expect("at least the sequential estimate")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn prob(m: usize, k: usize, n: usize) -> Problem {
        Problem { m, k, n, world: 2, elem_bytes: 2, fused: false }
    }

    #[test]
    fn large_ag_mm_matmul_time_is_near_measured_cublas() {
        // 16384x8192x8192 bf16 ran in 2.65-2.71 ms through cuBLAS on an H200.
        let e = ag_mm(&prob(16384, 8192, 8192), &DeviceModel::HOPPER);
        assert!((2.6..2.9).contains(&e[0].compute_ms), "{:?}", e[0]);
    }

    #[test]
    fn fp8_matmul_time_is_near_measured_cublaslt() {
        // 16384x8192x8192 e4m3 ran in 1.65 ms through cuBLASLt on an H200.
        let e = ag_mm(&Problem { elem_bytes: 1, ..prob(16384, 8192, 8192) }, &DeviceModel::HOPPER);
        assert!((1.55..1.8).contains(&e[0].compute_ms), "{:?}", e[0]);
    }

    #[test]
    fn world_one_has_only_the_sequential_plan_and_no_comm_cost_beyond_barriers() {
        let p = Problem { world: 1, ..prob(1024, 1024, 1024) };
        let e = ag_mm(&p, &DeviceModel::HOPPER);
        assert_eq!(e.len(), 1);
        assert!(e[0].comm_ms < 0.01);
    }

    #[test]
    fn benchmark_shapes_take_the_measured_faster_path() {
        // Measured on 2 x H200: pipelined won (or tied) on every shape but
        // mm_rs 512, where the fused kernel (its backend says) leads.
        for &(m, k, n) in &[(16384, 8192, 8192), (8192, 8192, 14336), (2048, 8192, 14336), (512, 8192, 14336)] {
            let p = Problem { fused: true, ..prob(m, k, n) };
            assert_eq!(best(&ag_mm(&p, &DeviceModel::HOPPER), false).algorithm, Algorithm::Pipelined);
        }
        for &(m, k, n) in &[(16384, 4096, 8192), (8192, 14336, 8192), (2048, 14336, 8192), (512, 14336, 8192)] {
            let p = Problem { fused: true, ..prob(m, k, n) };
            let want = if m == 512 { Algorithm::Fused } else { Algorithm::Pipelined };
            assert_eq!(best(&mm_rs(&p, &DeviceModel::HOPPER), m == 512).algorithm, want);
        }
        // Preferred but unable to run: the best of the others.
        assert_eq!(best(&mm_rs(&prob(512, 14336, 8192), &DeviceModel::HOPPER), true).algorithm, Algorithm::Pipelined);
    }

    #[test]
    fn negligible_communication_takes_the_sequential_path() {
        // A few KB to pull cannot pay for splitting a large matmul.
        let e = ag_mm(&prob(16, 65536, 65536), &DeviceModel::HOPPER);
        assert_eq!(best(&e, false).algorithm, Algorithm::Sequential, "{e:?}");
    }

    #[test]
    fn the_fused_kernel_hides_more_communication_and_is_offered_only_where_it_runs() {
        // One barrier and no pieces: never more exposed communication than
        // the pipelined path.
        for &(m, k, n) in &[(16384, 8192, 8192), (8192, 8192, 14336), (2048, 8192, 14336), (512, 8192, 14336)] {
            let p = Problem { fused: true, ..prob(m, k, n) };
            for est in [ag_mm(&p, &DeviceModel::HOPPER), mm_rs(&p, &DeviceModel::HOPPER)] {
                let of = |a| est.iter().find(|e| e.algorithm == a).copied().unwrap();
                assert!(of(Algorithm::Fused).exposed_ms <= of(Algorithm::Pipelined).exposed_ms, "{est:?}");
            }
        }
        // Reported, but not the automatic choice unless its backend prefers
        // it (measured faster), even where its prediction is the smallest.
        let p = Problem { fused: true, ..prob(16384, 8192, 8192) };
        let d = DeviceModel { fused_slowdown: 1.0, ..DeviceModel::HOPPER };
        let est = ag_mm(&p, &d);
        let fused = est.iter().find(|e| e.algorithm == Algorithm::Fused).unwrap();
        assert!(est.iter().all(|e| fused.total_ms <= e.total_ms), "{est:?}");
        assert_eq!(best(&est, false).algorithm, Algorithm::Pipelined);
        // Never offered at world 1 or without the kernel.
        let p = Problem { fused: true, world: 1, ..prob(1024, 1024, 1024) };
        assert!(ag_mm(&p, &DeviceModel::HOPPER).iter().all(|e| e.algorithm != Algorithm::Fused));
        assert!(mm_rs(&prob(1024, 1024, 1024), &DeviceModel::HOPPER).iter().all(|e| e.algorithm != Algorithm::Fused));
    }

    #[test]
    fn gather_slices_are_aligned_few_and_large() {
        // 512x8192x14336 at world 2: a 4 MiB shard in 8 slices of 1024 columns.
        assert_eq!(gather_slice_k(256 * 8192 * 2, 8192, 128), 1024);
        // A 1 MiB shard: two slices; a small one: one slice, the whole k.
        assert_eq!(gather_slice_k(64 * 8192 * 2, 8192, 128), 4096);
        assert_eq!(gather_slice_k(8 * 96 * 2, 96, 128), 96);
        // Slices divide k in multiples of the alignment: fewer where 8 do not.
        assert_eq!(gather_slice_k(4096 * 14336 * 2, 14336, 128), 1792); // 8 slices
        assert_eq!(gather_slice_k(4096 * 1280 * 2, 1280, 128), 256); // 5
        assert_eq!(gather_slice_k(4096 * 1000 * 2, 1000, 128), 1000); // none divides
        for k in (128..20000).step_by(64) {
            let w = gather_slice_k(4096 * k * 2, k, 128);
            assert!(w == k || (k % w == 0 && w % 128 == 0 && k / w <= MAX_SLICES), "k {k}: {w}");
        }
    }

    #[test]
    fn exposed_comm_never_exceeds_comm_plus_local_work() {
        for &(m, k, n) in &[(16384, 4096, 8192), (8192, 14336, 8192), (2048, 14336, 8192), (512, 14336, 8192)] {
            for e in mm_rs(&prob(m, k, n), &DeviceModel::HOPPER) {
                assert!(e.exposed_ms <= e.comm_ms + 0.1, "{e:?}");
                assert!(e.total_ms >= e.compute_ms, "{e:?}");
            }
        }
    }
}
