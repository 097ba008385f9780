//! On a GPU (passing vacuously without one, or on a non-Hopper GPU): the
//! plain, fp8 and all-gather modes, and the helpers the reduce-scatter's
//! tests share.

use super::super::launch::*;
use super::super::matmul::*;
use super::super::tiling::*;
use crate::backend::cuda::gemm::{Fp8, Fp8Params, GemmDtype};

use crate::backend::cuda::async_error::AsyncError;
use crate::backend::cuda::driver::check;
use crate::backend::cuda::gpu_testing::{
    decode, encode as enc, fp8_bytes, gpu, rel_err, round_robin_ms, values, DevBuf, Gpu, ROUNDS,
};
use crate::backend::cuda::streams::SideStreams;
use cudarc::driver::sys;
use std::ffi::c_void;

pub(super) fn hopper(g: &Gpu) -> Option<&Sm90Kernels> {
    let k = g.kernels.gemm_sm90.as_ref();
    if k.is_none() {
        eprintln!("no sm_90a kernels on this device: sm90 matmul tests skipped");
    }
    k
}

pub(super) struct Problem {
    pub(super) n: usize,
    pub(super) k: usize,
    /// A's and B's values, and A as stored (`a_bytes`, `el` bytes each).
    pub(super) a: Vec<f32>,
    pub(super) b: Vec<f32>,
    pub(super) a_bytes: Vec<u8>,
    pub(super) el: usize,
    pub(super) bufs: Vec<DevBuf>,
}

/// Random A [m, k] and B [n, k] (rounded to `dt`), on the device.
pub(super) fn problem(g: &Gpu, m: usize, n: usize, k: usize, dt: GemmDtype, seed: u64) -> Problem {
    let q = |v: Vec<f32>| decode(dt, &enc(dt, &v));
    let a = q(values(m * k, seed));
    let b = q(values(n * k, seed + 1));
    let a_bytes = enc(dt, &a);
    let bufs = vec![g.upload(&a_bytes), g.upload(&enc(dt, &b))];
    Problem { n, k, a, b, a_bytes, el: dt.size(), bufs }
}

/// Random fp8 A [m, k] of `at` and B [n, k] of `bt`, on the device.
pub(super) fn fp8_problem(g: &Gpu, m: usize, n: usize, k: usize, (at, bt): (Fp8, Fp8), seed: u64) -> Problem {
    let (a_bytes, b) = (fp8_bytes(m * k, seed, at), fp8_bytes(n * k, seed + 1, bt));
    let bufs = vec![g.upload(&a_bytes), g.upload(&b)];
    let a = a_bytes.iter().map(|&x| at.decode(x)).collect();
    Problem { n, k, a, b: b.iter().map(|&x| bt.decode(x)).collect(), a_bytes, el: 1, bufs }
}

impl Problem {
    pub(super) fn reference(&self, rows: std::ops::Range<usize>) -> Vec<f64> {
        let mut out = Vec::with_capacity(rows.len() * self.n);
        for i in rows {
            for j in 0..self.n {
                let (ra, rb) = (&self.a[i * self.k..][..self.k], &self.b[j * self.k..][..self.k]);
                out.push(ra.iter().zip(rb).map(|(x, y)| *x as f64 * *y as f64).sum());
            }
        }
        out
    }
}

/// A plain matmul of dense row-major A [m, k] and B [n, k] into C [m, n].
pub(super) fn dense(a: u64, b: u64, c: u64, (m, n, k): (usize, usize, usize), dt: GemmDtype, err: u64) -> Sm90Matmul {
    let op = |ptr, rows, ld| Operand { ptr, rows, ld };
    Sm90Matmul::plain(op(a, m, k), op(b, n, k), op(c, m, n), k, dt, err)
}

pub(super) fn poisoned(g: &Gpu, elems: usize, dt: GemmDtype) -> DevBuf {
    g.upload(&enc(dt, &vec![f32::NAN; elems]))
}

/// Rows `rows` of a row-major matrix with rows of `row_bytes`, as slice
/// `s` of the fused all-gather's slice-major layout: the bytes of columns
/// `[s * slice_bytes, (s + 1) * slice_bytes)` of each row, one row after another.
pub(super) fn slice_of(
    matrix: &[u8],
    rows: std::ops::Range<usize>,
    row_bytes: usize,
    slice_bytes: usize,
    s: usize,
) -> Vec<u8> {
    rows.flat_map(|i| &matrix[i * row_bytes + s * slice_bytes..i * row_bytes + (s + 1) * slice_bytes])
        .copied()
        .collect()
}

#[test]
pub(super) fn gpu_sm90_matmul_matches_reference_on_any_shape() {
    let Some(g) = gpu() else { return };
    let Some(kern) = hopper(&g) else { return };
    let errors = AsyncError::new().unwrap();
    use GemmDtype::*;
    let shapes = [(128, 256, 64), (1, 8, 8), (300, 200, 72), (129, 257, 136), (640, 384, 1000), (77, 1000, 512)];
    for (m, n, k) in shapes {
        for (dt, ot) in [(BF16, BF16), (BF16, F32), (F16, F16), (F16, F32)] {
            for tile in [TileN::N128, TileN::N256] {
                let p = problem(&g, m, n, k, dt, (m * n + k) as u64);
                let c = poisoned(&g, m * n, ot);
                let mut mm = dense(p.bufs[0].ptr, p.bufs[1].ptr, c.ptr, (m, n, k), dt, errors.device_ptr());
                (mm.out_dtype, mm.tile) = (ot, tile);
                mm.launch(kern, g.kernels.sm_count, g.stream()).unwrap();
                g.sync();
                let e = rel_err(&decode(ot, &c.read_bytes()), &p.reference(0..m));
                let tol = if ot == F32 { 1e-5 } else { 8e-3 };
                assert!(e < tol, "{m}x{n}x{k} {dt:?}->{ot:?} {tile:?}: relative error {e}");
            }
        }
    }
    errors.check().unwrap();
}

/// A column cut (tiles of 232 and 240 columns, see `column_cut`) covers C
/// exactly: 3 row tiles (the last partial) of 2560 columns on 11 CTAs, k
/// not a whole number of k-blocks, into a poisoned C. (Its first GPU run,
/// 8df1874, stopped at the cut's assertion: the shape's own tile was N128.)
#[test]
pub(super) fn gpu_sm90_matmul_column_cut() {
    let Some(g) = gpu() else { return };
    let Some(kern) = hopper(&g) else { return };
    let errors = AsyncError::new().unwrap();
    let (m, n, k) = (300, 2560, 200);
    for dt in [GemmDtype::BF16, GemmDtype::F16] {
        let p = problem(&g, m, n, k, dt, 7);
        let c = poisoned(&g, m * n, dt);
        let mut mm = dense(p.bufs[0].ptr, p.bufs[1].ptr, c.ptr, (m, n, k), dt, errors.device_ptr());
        // 30 tiles of 256 fit one wave: choose_tile would take N128.
        (mm.max_ctas, mm.tile) = (Some(11), TileN::N256);
        let cut = mm.column_cut(11);
        assert_eq!(cut, Some(NarrowPeers { tiles: 11, width: 232, narrower: 0 }));
        assert_eq!(mm.grid(g.kernels.sm_count), 11);
        mm.launch(kern, g.kernels.sm_count, g.stream()).unwrap();
        g.sync();
        let e = rel_err(&decode(dt, &c.read_bytes()), &p.reference(0..m));
        assert!(e < 8e-3, "{dt:?} with {cut:?}: relative error {e}");
    }
    errors.check().unwrap();
}

/// A padded C (row stride a multiple of 8): n = 257, the 16-byte
/// register epilogue with a partial last group of columns; n = 264, the
/// TMA-store epilogue. The padding stays untouched.
#[test]
pub(super) fn gpu_sm90_matmul_padded_output() {
    let Some(g) = gpu() else { return };
    let Some(kern) = hopper(&g) else { return };
    let errors = AsyncError::new().unwrap();
    let dt = GemmDtype::BF16;
    for n in [257usize, 264] {
        let (m, k, ld) = (130usize, 64usize, 272usize);
        let p = problem(&g, m, n, k, dt, 99);
        let c = poisoned(&g, m * ld, dt);
        let mm = Sm90Matmul::plain(
            Operand { ptr: p.bufs[0].ptr, rows: m, ld: k },
            Operand { ptr: p.bufs[1].ptr, rows: n, ld: k },
            Operand { ptr: c.ptr, rows: m, ld },
            k,
            dt,
            errors.device_ptr(),
        );
        mm.launch(kern, g.kernels.sm_count, g.stream()).unwrap();
        g.sync();
        let got = decode(dt, &c.read_bytes());
        let inside: Vec<f32> = (0..m).flat_map(|i| got[i * ld..i * ld + n].to_vec()).collect();
        let e = rel_err(&inside, &p.reference(0..m));
        assert!(e < 8e-3, "padded C, n = {n}: relative error {e}");
        let untouched = (0..m).all(|i| got[i * ld + n..(i + 1) * ld].iter().all(|x| x.is_nan()));
        assert!(untouched, "padding was written (n = {n}, C through TMA: {})", mm.c_through_tma());
    }
}

/// `SYMM_SM90_SHAPE=MxKxN` times that shape only (for profilers).
pub(super) fn shape_selected(m: usize, n: usize, k: usize) -> bool {
    crate::config::tests_env::sm90_shape().is_none_or(|s| s == format!("{m}x{k}x{n}"))
}

/// One timing in bench/results' format (collect.py).
pub(super) fn print_record((m, k, n): (usize, usize, usize), dtype: &str, imp: &str, ms: f32) {
    let tflops = 2.0 * (m * n * k) as f64 / (ms as f64 * 1e-3) / 1e12;
    println!(
        "{{\"op\": \"matmul\", \"shape\": [{m}, {k}, {n}], \"dtype\": \"{dtype}\", \"impl\": \"{imp}\", \
         \"ms\": {ms:.4}, \"tflops\": {tflops:.1}, \"iters\": {}}}",
        5 * ROUNDS
    );
}

/// Scales (one, or one per row of A / column of B) and a bias for an
/// fp8 test problem, on the host and the device.
pub(super) struct Scales {
    pub(super) sa: Vec<f32>,
    pub(super) sb: Vec<f32>,
    pub(super) bias: Option<Vec<f32>>,
    pub(super) bufs: Vec<DevBuf>,
}

impl Scales {
    pub(super) fn new(g: &Gpu, m: usize, n: usize, row_wise: bool, bias: Option<GemmDtype>) -> Self {
        let sa: Vec<f32> = (0..if row_wise { m } else { 1 }).map(|i| 0.25 + (i % 7) as f32 / 4.0).collect();
        let sb: Vec<f32> = (0..if row_wise { n } else { 1 }).map(|j| 1.5 - (j % 5) as f32 / 8.0).collect();
        let bias = bias.map(|dt| {
            let v: Vec<f32> = (0..n).map(|j| j as f32 / 16.0 - 2.0).collect();
            (decode(dt, &enc(dt, &v)), g.upload(&enc(dt, &v)))
        });
        let mut bufs = vec![g.upload(&sa), g.upload(&sb)];
        let bias = bias.map(|(v, buf)| {
            bufs.push(buf);
            v
        });
        Scales { sa, sb, bias, bufs }
    }

    pub(super) fn params(&self, a_type: Fp8, b_type: Fp8) -> Fp8Params {
        Fp8Params {
            a_type,
            b_type,
            row_wise: self.sa.len() > 1 || self.sb.len() > 1,
            a_scale: self.bufs[0].ptr,
            b_scale: self.bufs[1].ptr,
            bias: self.bufs.get(2).map_or(0, |b| b.ptr),
            fast_accum: false,
        }
    }

    /// `sa * sb * dot + bias` of element (i, j).
    pub(super) fn apply(&self, i: usize, j: usize, dot: f64) -> f64 {
        let (sa, sb) = (self.sa[i.min(self.sa.len() - 1)], self.sb[j.min(self.sb.len() - 1)]);
        dot * sa as f64 * sb as f64 + self.bias.as_ref().map_or(0.0, |b| b[j] as f64)
    }
}

/// fp8 against a float64 reference of `torch._scaled_mm`: the three
/// type mixes, tensor-wise and row-wise scales, with and without bias,
/// every output type, exact accumulation (128-wide tile) and fast_accum
/// (both tiles), on shapes on and off the tiles (k of 1 to 8 k-blocks,
/// odd counts too). Error bounds, relative to the sum of |terms|: exact
/// 2^-9, fast 2^-9 per 32 products. The tensor cores truncate partial
/// sums to about 14 bits even within one k-block: at k = 128, where
/// promotion changes nothing, one element was off by 2^-10.5 of it (and
/// 2^-10.06 was the largest exact-mode error over all cases); with
/// fast_accum at k = 1024 one was 1.7% off its value. The bounds are
/// loose for fast_accum at large k; the tight check of both modes is
/// gpu_sm90_fp8_against_cublaslt, where cuBLASLt's output in the same
/// mode is bit-identical to this kernel's. The largest errors seen are
/// printed.
#[test]
pub(super) fn gpu_sm90_fp8_matches_reference() {
    let Some(g) = gpu() else { return };
    let Some(kern) = hopper(&g) else { return };
    let errors = AsyncError::new().unwrap();
    use GemmDtype::*;
    let shapes = [
        (128, 256, 128),
        (1, 16, 16),
        (300, 208, 96),
        (129, 272, 144),
        (640, 384, 1024),
        (77, 1008, 512),
        (200, 160, 384),
    ];
    let mixes = [(Fp8::E4M3, Fp8::E4M3), (Fp8::E4M3, Fp8::E5M2), (Fp8::E5M2, Fp8::E4M3)];
    let mut case = 0usize;
    let mut worst = [0f64; 2]; // error / (sum of |terms| * scale): exact, fast_accum
    for (m, n, k) in shapes {
        for (at, bt) in mixes {
            let p = fp8_problem(&g, m, n, k, (at, bt), case as u64);
            let (da, db) = (&p.bufs[0], &p.bufs[1]);
            // (dot, sum of |terms|) of every output element.
            let dots: Vec<(f64, f64)> = (0..m * n)
                .map(|e| {
                    let (ra, rb) = (&p.a[e / n * k..][..k], &p.b[e % n * k..][..k]);
                    ra.iter().zip(rb).fold((0.0, 0.0), |(s, mag), (x, y)| {
                        let t = *x as f64 * *y as f64;
                        (s + t, mag + t.abs())
                    })
                })
                .collect();
            for (tile, fast_accum) in [(TileN::N128, false), (TileN::N128, true), (TileN::N256, true)] {
                for row_wise in [false, true] {
                    case += 1;
                    let out = [BF16, F16, F32][case % 3];
                    let bias = (out != F32 && case % 2 == 0).then_some(out);
                    let sc = Scales::new(&g, m, n, row_wise, bias);
                    let c = poisoned(&g, m * n, out);
                    let mut mm = dense(da.ptr, db.ptr, c.ptr, (m, n, k), BF16, errors.device_ptr());
                    (mm.out_dtype, mm.tile) = (out, tile);
                    mm.set_fp8(Fp8Params { fast_accum, ..sc.params(at, bt) });
                    mm.launch(kern, g.kernels.sm_count, g.stream()).unwrap();
                    g.sync();
                    let got = decode(out, &c.read_bytes());
                    let what = format!(
                        "{m}x{n}x{k} {at:?} x {bt:?} row_wise {row_wise} bias {} -> {out:?} {tile:?} \
                         fast_accum {fast_accum}",
                        bias.is_some()
                    );
                    let tol = match out {
                        BF16 => 1.0 / 128.0,
                        F16 => 1.0 / 1024.0,
                        _ => 1e-6,
                    };
                    for (e, (&x, &(dot, mag))) in got.iter().zip(&dots).enumerate() {
                        let (i, j) = (e / n, e % n);
                        let want = sc.apply(i, j, dot);
                        let scaled_mag = (sc.apply(i, j, mag) - sc.apply(i, j, 0.0)).abs();
                        let err = (x as f64 - want).abs();
                        let accumulation =
                            if fast_accum { scaled_mag * k.div_ceil(32) as f64 / 512.0 } else { scaled_mag / 512.0 };
                        assert!(
                            err <= tol * (want.abs() + 1.0) + accumulation,
                            "{what}: C[{i},{j}] = {x}, want {want}"
                        );
                        if out == F32 && scaled_mag > 0.0 {
                            worst[fast_accum as usize] = worst[fast_accum as usize].max(err / scaled_mag);
                        }
                    }
                }
            }
        }
    }
    errors.check().unwrap();
    println!(
        "sm90 fp8: largest f32-output error / sum of |terms|: exact {:.2e}, fast_accum {:.2e} ({case} cases)",
        worst[0], worst[1]
    );
}

/// All-gather mode on one GPU: chunks arrive slice by slice (columns of
/// k, each flagged after its copy; three slices in the slice-major
/// layout, or one in the row-major one) while the kernel runs, on NaNs
/// until then, so a tile that read a slice before its flag shows; a flag
/// that never comes is a timeout error, not a hang.
#[test]
pub(super) fn gpu_sm90_matmul_waits_for_gathered_chunks() {
    let Some(g) = gpu() else { return };
    let Some(kern) = hopper(&g) else { return };
    let out = GemmDtype::BF16;
    // 200-row chunks: C from registers; 256: tiles within chunks, C
    // through TMA. fp8: row-wise scales gathered into padded slots.
    // Slices of 128 columns: 2 k-blocks of 16-bit types, 1 of fp8.
    for (rows, fp8, slice_k) in [(200usize, false, 128usize), (256, false, 384), (200, true, 384), (256, true, 128)] {
        let (world, n, k) = (4usize, 384usize, 384usize);
        let slices = k / slice_k;
        let m = world * rows;
        let p = if fp8 { fp8_problem(&g, m, n, k, (Fp8::E4M3, Fp8::E4M3), 7) } else { problem(&g, m, n, k, out, 7) };
        let rank = 2;
        let chunk_bytes = rows * k * p.el;
        let chunk = |c: usize| &p.a_bytes[c * chunk_bytes..(c + 1) * chunk_bytes];
        // The local chunk lives elsewhere (the caller's shard); the gathered
        // buffer holds NaNs there (0xff is NaN in e4m3 too), so reading it would show.
        let local = g.upload(chunk(rank));
        let gathered = g.upload(&vec![0xffu8; m * k * p.el]);
        let flags = g.upload(&vec![0u32; world * slices]);
        let c = poisoned(&g, m * n, out);
        // Row scales: chunk c's at c * slot (slots padded by 4), NaN until they arrive.
        let slot = rows + 4;
        let sa: Vec<f32> = (0..m).map(|i| 0.5 + (i % 11) as f32 / 8.0).collect();
        let sb: Vec<f32> = (0..n).map(|j| 1.25 - (j % 3) as f32 / 4.0).collect();
        let scales = g.upload(&vec![f32::NAN; world * slot]);
        let sb_buf = g.upload(&sb);
        let upload = |dst: u64, bytes: &[u8]| {
            check(unsafe { sys::cuMemcpyHtoD_v2(dst, bytes.as_ptr().cast(), bytes.len()) }, "cuMemcpyHtoD").unwrap()
        };
        let deliver_scales = |c: usize| {
            let v: Vec<u8> = sa[c * rows..(c + 1) * rows].iter().flat_map(|x| x.to_le_bytes()).collect();
            upload(scales.ptr + (4 * c * slot) as u64, &v);
        };
        let errors = AsyncError::new().unwrap();
        let mut mm = dense(gathered.ptr, p.bufs[1].ptr, c.ptr, (m, n, k), out, errors.device_ptr());
        mm.a.ld = slice_k; // [slices][m][slice_k]
        mm.chunk_rows = rows;
        mm.order = (0..world).map(|i| (rank + i) % world).collect();
        let local = Operand { ptr: local.ptr, rows, ld: k };
        mm.gather = Some(Gather { ready: flags.ptr, slice_k, local_chunk: rank, local, scale_slot: slot });
        if fp8 {
            deliver_scales(rank);
            mm.set_fp8(Fp8Params {
                a_type: Fp8::E4M3,
                b_type: Fp8::E4M3,
                row_wise: true,
                a_scale: scales.ptr,
                b_scale: sb_buf.ptr,
                bias: 0,
                fast_accum: false,
            });
        }
        mm.timeout_ns = 5_000_000_000;
        mm.launch(kern, g.kernels.sm_count, g.stream()).unwrap();
        // Deliver the other chunks after the kernel started waiting: their
        // scales, then slice by slice, each before its flag.
        for c in mm.order[1..].iter().copied() {
            if fp8 {
                deliver_scales(c);
            }
            for s in 0..slices {
                let block = slice_of(&p.a_bytes, c * rows..(c + 1) * rows, k * p.el, slice_k * p.el, s);
                upload(gathered.ptr + ((s * m + c * rows) * slice_k * p.el) as u64, &block);
                upload(flags.ptr + 4 * (c * slices + s) as u64, &1u32.to_le_bytes());
            }
        }
        g.sync();
        errors.check().unwrap();
        let mut want = p.reference(0..m);
        if fp8 {
            want.iter_mut().enumerate().for_each(|(e, w)| *w *= sa[e / n] as f64 * sb[e % n] as f64);
        }
        let e = rel_err(&decode(out, &c.read_bytes()), &want);
        assert!(e < 8e-3, "gathered matmul, chunks of {rows} rows, fp8 {fp8}, {slices} slices: relative error {e}");

        // A chunk whose last slice never arrives: the kernel gives up and says who.
        let mut all_but_last = vec![1u32; world * slices];
        all_but_last[world * slices - 1] = 0;
        flags.write(&all_but_last);
        mm.timeout_ns = 200_000_000;
        mm.launch(kern, g.kernels.sm_count, g.stream()).unwrap();
        g.sync();
        let e = errors.check().unwrap_err();
        assert!(e.msg.contains("fused matmul waiting for rank 3"), "{}", e.msg);
    }
}

/// All-gather mode against a real asynchronous delivery, on one GPU: rank
/// 0 of 2 multiplies its own chunk (read in place) while a copy engine
/// brings the other chunk from pinned host memory on a second stream, in
/// slices of k (slice-major, one contiguous copy each) each followed by
/// its flag (`cuStreamWriteValue32`), as the two-GPU path's pulls do over
/// NVLink (8 slices here, as `plan::gather_slice_k` cuts these shards).
/// Timed round-robin against the same kernel over an A already whole
/// (plain), the copy alone, the copy then the plain matmul (sequential),
/// the fused kernel with the chunk already there (no wait), and with the
/// chunk in one slice. Where the
/// waits cost nothing, fused ≈ max(plain, copy + the other chunk's tiles).
/// The host link (~52 GB/s) is 7 x slower than NVLink's copy engines, so
/// the copy shows here where it would hide on two GPUs. Fails unless the
/// fused kernel hides some of the copy (faster than sequential).
/// SYMM_SM90_SHAPE picks one of the shapes.
#[test]
pub(super) fn gpu_sm90_gather_beside_a_copy_engine() {
    let Some(g) = gpu() else { return };
    let Some(kern) = hopper(&g) else { return };
    for (m, k, n) in [(512usize, 8192usize, 14336usize), (2048, 8192, 14336), (8192, 8192, 14336)] {
        if shape_selected(m, n, k) {
            gather_beside_a_copy_engine(&g, kern, (m, k, n), GemmDtype::BF16);
        }
    }
}

/// Rank 0 of 2: chunk 0 local, chunk 1 delivered.
pub(super) fn gather_beside_a_copy_engine(
    g: &Gpu,
    kern: &Sm90Kernels,
    (m, k, n): (usize, usize, usize),
    dt: GemmDtype,
) {
    let world = 2usize;
    let rows = m / world;
    let chunk_bytes = rows * k * dt.size();
    let a_bytes = enc(dt, &values(m * k, 11));
    let a_whole = g.upload(&a_bytes);
    let b = g.upload(&enc(dt, &values(n * k, 12)));
    let local = g.upload(&a_bytes[..chunk_bytes]);
    // Chunk 1 arrives here; chunk 0 (the local one) is never read from it.
    let gathered = g.upload(&vec![0xffu8; m * k * dt.size()]);
    let (el, slice_k) = (dt.size(), k / 8);
    let slices = k / slice_k;
    let flags = g.upload(&vec![0u32; world * slices]);
    let (c_fused, c_plain) = (poisoned(g, m * n, dt), poisoned(g, m * n, dt));
    // The other chunk in pinned host memory, a copy engine's source: row-major
    // (`host`), and slice-major as the peer stages it (`host_sliced`).
    let pinned = |bytes: &[u8]| {
        let mut host: *mut c_void = std::ptr::null_mut();
        // SAFETY: out-pointer valid; filled here, freed at the end.
        check(unsafe { sys::cuMemAllocHost_v2(&mut host, bytes.len()) }, "cuMemAllocHost").unwrap();
        // SAFETY: `host` holds bytes.len() bytes.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), host.cast::<u8>(), bytes.len()) };
        host
    };
    let host = pinned(&a_bytes[chunk_bytes..]);
    let sliced: Vec<u8> = (0..slices).flat_map(|s| slice_of(&a_bytes, rows..m, k * el, slice_k * el, s)).collect();
    let host_sliced = pinned(&sliced);
    let errors = AsyncError::new().unwrap();
    let plain = dense(a_whole.ptr, b.ptr, c_plain.ptr, (m, n, k), dt, errors.device_ptr());
    // As the two-GPU path launches it (`Sm90Matmul::from_fused`, one SM spare).
    let mut fused = Sm90Matmul {
        a: Operand { ptr: gathered.ptr, rows: m, ld: slice_k }, // [slices][m][slice_k]
        c: Operand { ptr: c_fused.ptr, rows: m, ld: n },
        chunk_rows: rows,
        order: (0..world).collect(),
        tile: choose_tile(rows, n, world, 132),
        max_ctas: Some(g.kernels.sm_count - 1),
        timeout_ns: 5_000_000_000,
        ..plain.clone()
    };
    fused.gather = Some(Gather {
        ready: flags.ptr,
        slice_k,
        local_chunk: 0,
        local: Operand { ptr: local.ptr, rows, ld: k },
        scale_slot: 0,
    });
    let mut whole = fused.clone();
    whole.a.ld = k;
    whole.gather.as_mut().unwrap().slice_k = k;
    let sides = SideStreams::default();
    let (main, side) = (g.stream(), sides.stream(0).unwrap());
    let fork = || sides.wait(side, main).unwrap();
    let join = || sides.wait(main, side).unwrap();
    let (main, side) = (main.0 as sys::CUstream, side.0 as sys::CUstream);
    let dst = gathered.ptr + chunk_bytes as u64;
    // SAFETY (the closures): streams and buffers are alive until the end
    // of this function, which synchronizes first.
    let copy_on = |s: sys::CUstream| {
        check(unsafe { sys::cuMemcpyHtoDAsync_v2(dst, host, chunk_bytes, s) }, "cuMemcpyHtoDAsync").unwrap()
    };
    // Chunk 1's slices, one contiguous copy each, each followed by its flag.
    let run_fused = |mm: &Sm90Matmul| {
        let (n_slices, width) = (mm.slices(), mm.gather.as_ref().unwrap().slice_k);
        let src = if n_slices > 1 { host_sliced } else { host };
        check(unsafe { sys::cuMemsetD32Async(flags.ptr, 0, world * n_slices, main) }, "cuMemsetD32Async").unwrap();
        fork();
        mm.launch(kern, g.kernels.sm_count, g.stream()).unwrap();
        let bytes = rows * width * el;
        for s in 0..n_slices {
            let to = gathered.ptr + ((s * m + rows) * width * el) as u64;
            // SAFETY: slice s lies within the pinned buffer (n_slices * bytes).
            let from = unsafe { src.cast::<u8>().add(s * bytes) }.cast();
            check(unsafe { sys::cuMemcpyHtoDAsync_v2(to, from, bytes, side) }, "cuMemcpyHtoDAsync").unwrap();
            let flag = flags.ptr + 4 * (n_slices + s) as u64;
            check(unsafe { sys::cuStreamWriteValue32_v2(side, flag, 1, 0) }, "cuStreamWriteValue32").unwrap();
        }
        join();
    };
    // 0 fused, 1 plain, 2 copy alone, 3 copy then plain, 4 fused with
    // the chunk already there (flags preset: what gather mode costs
    // without any wait), 5 fused with the chunk in one slice.
    let med = round_robin_ms(g, 6, |c| match c {
        0 => run_fused(&fused),
        1 => plain.launch(kern, g.kernels.sm_count, g.stream()).unwrap(),
        2 => {
            fork();
            copy_on(side);
            join();
        }
        3 => {
            copy_on(main);
            plain.launch(kern, g.kernels.sm_count, g.stream()).unwrap();
        }
        4 => {
            check(unsafe { sys::cuMemsetD32Async(flags.ptr, 1, world * slices, main) }, "cuMemsetD32Async").unwrap();
            fused.launch(kern, g.kernels.sm_count, g.stream()).unwrap();
        }
        _ => run_fused(&whole),
    });
    g.sync();
    errors.check().unwrap();
    // Once more on poisoned inputs and outputs, in slices and in one: the
    // fused product is the plain one.
    let want: Vec<f64> = decode(dt, &c_plain.read_bytes()).iter().map(|&x| x as f64).collect();
    for mm in [&fused, &whole] {
        gathered.write(&vec![0xffu8; m * k * dt.size()]);
        c_fused.write(&enc(dt, &vec![f32::NAN; m * n]));
        run_fused(mm);
        g.sync();
        errors.check().unwrap();
        let e = rel_err(&decode(dt, &c_fused.read_bytes()), &want);
        assert!(e < 1e-3, "{m}x{k}x{n}, {} slices: the fused product differs from the plain one: {e}", mm.slices());
    }
    // SAFETY: run_fused joined the side stream back, and the main one is
    // idle: no copy reads the pinned buffers any more.
    for h in [host, host_sliced] {
        check(unsafe { sys::cuMemFreeHost(h) }, "cuMemFreeHost").unwrap();
    }
    let imps = [
        "symm_sm90_gather_fused",
        "symm_sm90_plain",
        "copy_engine_htod",
        "copy_then_plain",
        "symm_sm90_gather_present",
        "symm_sm90_gather_one_slice",
    ];
    for (imp, ms) in imps.iter().zip(&med) {
        print_record((m, k, n), "bf16_gather_world2_one_gpu", imp, *ms);
    }
    let floor = med[1].max(med[2]);
    println!(
        "sm90 gather beside a copy engine, {m}x{k}x{n}, world 2: fused {:.4} ms, plain {:.4}, copy {:.4} \
         ({:.1} GB/s), sequential {:.4}, chunk already there {:.4}, one slice {:.4}; fused / plain {:.3}, \
         fused / max(plain, copy) {:.3}, fused / sequential {:.3}, already there / plain {:.3}, one slice / plain {:.3}",
        med[0],
        med[1],
        med[2],
        chunk_bytes as f64 / (med[2] as f64 * 1e6),
        med[3],
        med[4],
        med[5],
        med[0] / med[1],
        med[0] / floor,
        med[0] / med[3],
        med[4] / med[1],
        med[5] / med[1]
    );
    assert!(
        med[0] < med[3],
        "{m}x{k}x{n}: the fused kernel hid none of the copy ({} ms, sequential {})",
        med[0],
        med[3]
    );
}
