//! Timing runs of the sm90 matmul against cuBLASLt on the benchmark's
//! shapes, for `bench/sm90_matmul.rs` (through `crate::bench_support`).
//! Each prints one JSON record per shape and implementation in the format
//! bench/gpu/collect.py reads (op "matmul"), and panics if the results of
//! the two differ.

use super::Operand;
use super::{Sm90Kernels, Sm90Matmul, TileN};
use crate::backend::cuda::async_error::AsyncError;
use crate::backend::cuda::gemm::{Fp8, Fp8Params, Gemm, GemmDtype, MatmulParams};
use crate::backend::cuda::gpu_testing::{
    decode, encode, fp8_bytes, gpu, rel_err, round_robin_ms, values, DevBuf, Gpu, ROUNDS,
};

/// The benchmark's matmul shapes, (m, n, k).
pub const SHAPES: [(usize, usize, usize); 8] = [
    (16384, 8192, 8192),
    (8192, 14336, 8192),
    (2048, 14336, 8192),
    (512, 14336, 8192),
    (16384, 8192, 4096),
    (8192, 8192, 14336),
    (2048, 8192, 14336),
    (512, 8192, 14336),
];

/// One timing in bench/results' format (collect.py).
pub fn print_record((m, k, n): (usize, usize, usize), dtype: &str, imp: &str, ms: f32) {
    let tflops = 2.0 * (m * n * k) as f64 / (ms as f64 * 1e-3) / 1e12;
    println!(
        "{{\"op\": \"matmul\", \"shape\": [{m}, {k}, {n}], \"dtype\": \"{dtype}\", \"impl\": \"{imp}\", \
         \"ms\": {ms:.4}, \"tflops\": {tflops:.1}, \"iters\": {}}}",
        5 * ROUNDS
    );
}

/// Device 0 and its sm90 kernels, or None (said why on stderr).
fn hopper() -> Option<Gpu> {
    let g = gpu()?;
    if g.kernels.gemm_sm90.is_none() {
        eprintln!("no sm_90a kernels on this device: sm90 matmul timings skipped");
        return None;
    }
    Some(g)
}

fn kernels(g: &Gpu) -> &Sm90Kernels {
    g.kernels.gemm_sm90.as_ref().expect("checked by hopper()")
}

/// A plain matmul of dense row-major A [m, k] and B [n, k] into C [m, n].
fn dense(a: u64, b: u64, c: u64, (m, n, k): (usize, usize, usize), dt: GemmDtype, err: u64) -> Sm90Matmul {
    let op = |ptr, rows, ld| Operand { ptr, rows, ld };
    Sm90Matmul::plain(op(a, m, k), op(b, n, k), op(c, m, n), k, dt, err)
}

/// bf16: the kernel as chosen, cuBLASLt, then every tile width, C stored
/// from registers, and (where it has one) without the column cut.
/// `shapes`: (m, n, k) to time.
pub fn sm90_matmul(shapes: &[(usize, usize, usize)]) {
    let Some(g) = hopper() else { return };
    let kern = kernels(&g);
    let errors = AsyncError::new().unwrap();
    let lt = Gemm::new(&g.ctx).unwrap();
    let dt = GemmDtype::BF16;
    for &(m, n, k) in shapes {
        let a = g.upload(&encode(dt, &values(m * k, 1)));
        let b = g.upload(&encode(dt, &values(n * k, 2)));
        let (c1, c2) = (g.alloc(m * n * 2), g.alloc(m * n * 2));
        let chosen = dense(a.ptr, b.ptr, c1.ptr, (m, n, k), dt, errors.device_ptr());
        let mut lp = MatmulParams::new(m, n, k, a.ptr, b.ptr, c2.ptr, dt);
        (lp.b_trans, lp.ldb) = (true, k);
        // Candidates (None: cuBLASLt).
        let mut candidates = vec![("symm_sm90".to_string(), Some(chosen.clone())), ("cublaslt".to_string(), None)];
        for tile in [TileN::N128, TileN::N256] {
            let mm = Sm90Matmul { tile, ..chosen.clone() };
            candidates.push((format!("symm_sm90_n{}", tile.cols()), Some(mm)));
        }
        let regs = Sm90Matmul { tma_epilogue: false, ..chosen.clone() };
        candidates.push(("symm_sm90_register_epilogue".into(), Some(regs)));
        if chosen.column_cut(g.kernels.sm_count).is_some() {
            let uncut = Sm90Matmul { column_cut: false, ..chosen.clone() };
            candidates.push(("symm_sm90_uncut".into(), Some(uncut)));
        }
        let names: Vec<&String> = candidates.iter().map(|(name, _)| name).collect();
        let med = round_robin_ms(&g, candidates.len(), |c| match &candidates[c].1 {
            Some(mm) => mm.launch(kern, g.kernels.sm_count, g.stream()).unwrap(),
            None => lt.matmul(&lp, g.stream()).unwrap(),
        });
        let (ours, theirs) = (med[0], med[1]);
        // C holds the last run of some candidate; rerun the chosen one.
        chosen.launch(kern, g.kernels.sm_count, g.stream()).unwrap();
        g.sync();
        let (x, y) = (decode(dt, &c1.read_bytes()), decode(dt, &c2.read_bytes()));
        let want: Vec<f64> = y.iter().map(|v| *v as f64).collect();
        let e = rel_err(&x, &want);
        for (imp, ms) in names.iter().zip(&med) {
            print_record((m, k, n), "bf16", imp, *ms);
        }
        let others: Vec<String> =
            names.iter().zip(&med).skip(2).map(|(v, ms)| format!("{v} {:.3}", ms / theirs)).collect();
        println!(
            "matmul {m}x{k}x{n} tile {:?}: sm90 {ours:.4} ms, cuBLASLt {theirs:.4} ms, ratio {:.3}, \
             relative difference {e:.2e}; ratios of every variant: {}",
            chosen.tile,
            ours / theirs,
            others.join(", ")
        );
        assert!(e < 1e-2, "{m}x{n}x{k}: sm90 and cuBLASLt differ by {e}");
    }
    errors.check().unwrap();
}

/// fp8 scales on the device: one each (tensor-wise), or one per row of A
/// and column of B.
struct Scales {
    bufs: [DevBuf; 2],
    row_wise: bool,
}

impl Scales {
    fn new(g: &Gpu, m: usize, n: usize, row_wise: bool) -> Self {
        let sa: Vec<f32> = (0..if row_wise { m } else { 1 }).map(|i| 0.25 + (i % 7) as f32 / 4.0).collect();
        let sb: Vec<f32> = (0..if row_wise { n } else { 1 }).map(|j| 1.5 - (j % 5) as f32 / 8.0).collect();
        Scales { bufs: [g.upload(&sa), g.upload(&sb)], row_wise }
    }

    fn params(&self, a_type: Fp8, b_type: Fp8, fast_accum: bool) -> Fp8Params {
        Fp8Params {
            a_type,
            b_type,
            row_wise: self.row_wise,
            a_scale: self.bufs[0].ptr,
            b_scale: self.bufs[1].ptr,
            bias: 0,
            fast_accum,
        }
    }
}

/// fp8 (e4m3 x e4m3, bf16 out) against cuBLASLt, which by default promotes
/// its accumulators into f32 (torch's default) and with fast_accum does as
/// the kernel does; tensor-wise and row-wise scales.
pub fn sm90_fp8(shapes: &[(usize, usize, usize)]) {
    let Some(g) = hopper() else { return };
    let kern = kernels(&g);
    let errors = AsyncError::new().unwrap();
    let lt = Gemm::new(&g.ctx).unwrap();
    let (at, bt) = (Fp8::E4M3, Fp8::E4M3);
    for &(m, n, k) in shapes {
        let a = g.upload(&fp8_bytes(m * k, 1, at));
        let b = g.upload(&fp8_bytes(n * k, 2, bt));
        let (c1, c2) = (g.alloc(m * n * 2), g.alloc(m * n * 2));
        let scales = [Scales::new(&g, m, n, false), Scales::new(&g, m, n, true)];
        // Per scale mode: symm exact, symm fast_accum; cuBLASLt the same.
        let (mut ours, mut theirs) = (Vec::new(), Vec::new());
        for sc in &scales {
            let mm = dense(a.ptr, b.ptr, c1.ptr, (m, n, k), GemmDtype::BF16, errors.device_ptr());
            for fast_accum in [false, true] {
                let f = sc.params(at, bt, fast_accum);
                let mut ours_f = mm.clone();
                ours_f.set_fp8(f);
                ours.push(ours_f);
                let mut lp = MatmulParams::new(m, n, k, a.ptr, b.ptr, c2.ptr, GemmDtype::BF16);
                (lp.b_trans, lp.ldb, lp.fp8) = (true, k, Some(f));
                theirs.push(lp);
            }
        }
        // Fast accumulation on the exact kernels' 128-wide tile, tensor-wise:
        // what the tile costs apart from the promotion.
        let mut fast_n128 = ours[1].clone();
        fast_n128.tile = TileN::N128;
        // Candidate c < 8: scale mode c / 4; c % 4: symm exact, symm fast,
        // cuBLASLt exact, cuBLASLt fast. Candidate 8: fast_n128.
        let med = round_robin_ms(&g, 9, |c| {
            let i = 2 * (c / 4) + c % 2;
            if c == 8 {
                fast_n128.launch(kern, g.kernels.sm_count, g.stream()).unwrap()
            } else if c % 4 < 2 {
                ours[i].launch(kern, g.kernels.sm_count, g.stream()).unwrap()
            } else {
                lt.matmul(&theirs[i], g.stream()).unwrap()
            }
        });
        let names = ["", "_rowwise"].iter().flat_map(|mode| {
            ["symm_sm90", "symm_sm90_fast_accum", "cublaslt", "cublaslt_fast_accum"].map(|imp| format!("{imp}{mode}"))
        });
        for (imp, ms) in names.chain(["symm_sm90_fast_accum_n128".to_string()]).zip(&med) {
            print_record((m, k, n), "fp8_e4m3", &imp, *ms);
        }
        // Differences, in the order of `ours`: exact against exact, fast against fast.
        let mut diffs = Vec::new();
        for (mm, lp) in ours.iter().zip(&theirs) {
            mm.launch(kern, g.kernels.sm_count, g.stream()).unwrap();
            lt.matmul(lp, g.stream()).unwrap();
            g.sync();
            let (x, y) = (decode(GemmDtype::BF16, &c1.read_bytes()), decode(GemmDtype::BF16, &c2.read_bytes()));
            let want: Vec<f64> = y.iter().map(|v| *v as f64).collect();
            diffs.push(rel_err(&x, &want));
        }
        println!(
            "matmul fp8 {m}x{k}x{n}: ratio to cuBLASLt, exact (tile N128) / fast_accum (tile {:?}): \
             tensor-wise {:.3} / {:.3}, row-wise {:.3} / {:.3}; relative differences exact {:.2e} {:.2e}, \
             fast {:.2e} {:.2e}",
            ours[1].tile,
            med[0] / med[2],
            med[1] / med[3],
            med[4] / med[6],
            med[5] / med[7],
            diffs[0],
            diffs[2],
            diffs[1],
            diffs[3]
        );
        // Exact accumulation agrees with cuBLASLt's; fast accumulation
        // may differ by what truncation loses (printed above).
        assert!(diffs[0] < 1e-2 && diffs[2] < 1e-2, "{m}x{n}x{k}: sm90 fp8 and cuBLASLt differ: {diffs:?}");
    }
    errors.check().unwrap();
}
