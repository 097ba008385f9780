//! Tests of the sm90 matmul: the host-side checks, and on a Hopper GPU
//! (passing vacuously elsewhere) its results against float64 references
//! and cuBLASLt, and its fused modes (its speed: bench/sm90_matmul.rs).
use super::launch::*;
use super::matmul::*;
use super::tiling::*;
use crate::backend::cuda::gemm::{Fp8, Fp8Params, GemmDtype};
use crate::backend::{FusedMatmul, FusedScatter};

#[test]
fn smem_fits_hopper() {
    for t in [TileN::N128, TileN::N256] {
        assert!(t.smem_bytes() <= 227 * 1024, "{t:?}: {}", t.smem_bytes());
    }
}

#[test]
fn tile_choice_avoids_wave_tails() {
    // 16384 x 8192: 4096 N256 tiles = 32 waves, 8192 N128 tiles = 63 x 0.56.
    assert_eq!(choose_tile(16384, 8192, 1, 132), TileN::N256);
    // 512 x 14336 (one chunk): N256 224 tiles = 2 waves, N128 448 = 4 x 0.56.
    assert_eq!(choose_tile(512, 14336, 1, 132), TileN::N256);
    // 128 x 3584 in 4 chunks: N256 56 tiles = 1 wave, N128 112 = 1 x 0.56.
    assert_eq!(choose_tile(128, 3584, 4, 132), TileN::N128);
}

impl Sm90Matmul {
    /// Tiles of the whole launch on at most `ctas` CTAs.
    fn total_tiles(&self, ctas: u32) -> usize {
        self.tiles_with(self.column_cut(ctas))
    }
}

#[test]
fn column_cut_fills_the_last_wave() {
    // The widths of a cut's tiles, which must cover n in widths the
    // kernels have k-loops for.
    let widths = |cut: NarrowPeers, n: usize| -> Vec<usize> {
        let extra = cut.wider(n).expect("the cut covers n");
        (0..cut.tiles).map(|i| cut.width + if i < extra { 8 } else { 0 }).collect()
    };
    // The benchmark's plain matmuls (row tiles, n) on 132 SMs: 16384 x 8192
    // and 8192 x 8192 (31.03 and 15.52 waves of 256-wide tiles), 8192 x
    // 14336 (27.15), 2048 x 14336 (6.79).
    for (rows, n) in [(128, 8192), (64, 8192), (64, 14336), (16, 14336)] {
        let cut = column_cut(rows, n, 132).unwrap_or_else(|| panic!("{rows} x {n}: no cut"));
        let w = widths(cut, n);
        assert_eq!(w.iter().sum::<usize>(), n, "{rows} x {n}: {cut:?}");
        assert!(w.iter().all(|&c| (232..=256).contains(&c)), "{rows} x {n}: {cut:?}");
        let uncut = busiest_cta_cols(rows, n / 256, 132, |_| 256);
        let busiest = busiest_cta_cols(rows, cut.tiles, 132, |i| w[i]);
        // At least 1% fewer columns, and never below a perfect balance.
        assert!(100 * busiest <= 99 * uncut, "{rows} x {n}: {busiest} of {uncut}");
        assert!(busiest * 132 >= rows * n, "{rows} x {n}: {busiest}");
    }
    // 16384 x 8192 (the kernel's header): 34 tiles of 240, the first 4 of 248.
    assert_eq!(column_cut(128, 8192, 132), Some(NarrowPeers { tiles: 34, width: 240, narrower: 0 }));
    assert_eq!(busiest_cta_cols(128, 34, 132, |i| if i < 4 { 248 } else { 240 }), 7952);
    assert_eq!(busiest_cta_cols(128, 32, 132, |_| 256), 8192);
    // One wave that the cut cannot shorten (the widest tile takes as long),
    // a grid that 256-wide tiles fill, and tiles too few to cut.
    assert_eq!(column_cut(4, 8192, 132), None);
    assert_eq!(column_cut(33, 1024, 132), None);
    assert_eq!(column_cut(2, 512, 132), None);
    // The deal follows the kernel's walk: with 2 row tiles of 3 tiles on
    // 4 CTAs, CTA 0 takes tiles 0 and 4 (row 0's first, row 1's third).
    assert_eq!(busiest_cta_cols(2, 3, 4, |i| [10, 20, 30][i]), 40);
    assert_eq!(busiest_cta_cols(2, 3, 8, |i| [10, 20, 30][i]), 30);

    // Only a plain or gathered 16-bit matmul of 256-wide tiles whose C TMA
    // stores, and the launch's tiles and grid follow the cut.
    let op = |ptr, rows, ld| Operand { ptr, rows, ld };
    let plain = Sm90Matmul::plain(op(0, 16384, 64), op(0, 8192, 64), op(0, 16384, 8192), 64, GemmDtype::BF16, 0);
    let cut = plain.column_cut(132).expect("a cut at 16384 x 8192");
    assert_eq!(plain.total_tiles(132), 128 * cut.tiles);
    assert_eq!(plain.grid(132), 132);
    assert_eq!(plain.grid(8), 8);
    for off in [
        Sm90Matmul { column_cut: false, ..plain.clone() },
        Sm90Matmul { tile: TileN::N128, ..plain.clone() },
        Sm90Matmul { tma_epilogue: false, ..plain.clone() },
        Sm90Matmul { out_dtype: GemmDtype::F32, ..plain.clone() },
    ] {
        assert_eq!(off.column_cut(132), None);
        assert_eq!(off.total_tiles(132), 128 * 8192 / off.tile.cols());
    }
    let scatter = FusedScatter { rank: 0, inbox: vec![0; 2], state: vec![0; 2], out: None };
    assert_eq!(Sm90Matmul { scatter: Some(scatter), ..plain }.column_cut(132), None);
}

#[test]
fn narrow_peer_tiles_fill_the_idle_sms() {
    let narrow = |tiles, width, narrower| Some(NarrowPeers { tiles, width, narrower });
    // mm_rs 512 x 14336 x 8192, world 2: the own chunk's 64 tiles leave 68
    // SMs, two row tiles of 34 cover n: staggered, 12 of 248 columns, 14 of
    // 240, 8 of 232; else 4 of 248 and 30 of 240.
    assert_eq!(narrow_peers(256, 8192, 2, 132, None), narrow(34, 240, 8));
    assert_eq!(NarrowPeers { tiles: 34, width: 240, narrower: 8 }.wider(8192), Some(12));
    assert_eq!(narrow_peers(256, 8192, 2, 132, Some(0)), narrow(34, 240, 0));
    assert_eq!(NarrowPeers { tiles: 34, width: 240, narrower: 0 }.wider(8192), Some(4));
    // M = 256: one row tile per chunk; a base width of 240 columns.
    assert_eq!(narrow_peers(128, 8192, 2, 132, None), narrow(34, 240, 8));
    // More than one wave of 256-wide tiles (M = 2048), or no idle SM to take.
    for narrower in [None, Some(0), Some(4)] {
        assert_eq!(narrow_peers(1024, 8192, 2, 132, narrower), None);
        assert_eq!(narrow_peers(256, 8448, 2, 132, narrower), None);
        // World 4 at M = 512: 33 tiles would need 256-wide ones among them.
        assert_eq!(narrow_peers(128, 8192, 4, 132, narrower), None);
    }
    // Another count of narrower tiles; one that cannot cover n falls back
    // to one width.
    assert_eq!(narrow_peers(256, 8192, 2, 132, Some(4)), narrow(34, 240, 4));
    assert_eq!(narrow_peers(256, 8192, 2, 132, Some(20)), narrow(34, 240, 0));
    // The kernel's check takes only covering cuts of the widths it has.
    let op = |ptr, rows, ld| Operand { ptr, rows, ld };
    let mut mm = Sm90Matmul::plain(op(0, 512, 64), op(0, 8192, 64), op(0, 256, 8192), 64, GemmDtype::BF16, 0);
    (mm.chunk_rows, mm.order) = (256, vec![1, 0]);
    mm.scatter = Some(FusedScatter { rank: 0, inbox: vec![0; 2], state: vec![0; 2], out: None });
    for (tiles, width, narrower, ok) in [
        (34, 240, 0, true),
        (34, 240, 8, true),
        (34, 240, 15, true),
        // 16 narrower need 20 wider: 36 tiles.
        (34, 240, 16, false),
        (33, 248, 0, false),
        (35, 232, 0, true),
        // 224 is not a width the kernels have.
        (35, 232, 4, false),
        (36, 224, 0, false),
        (33, 240, 0, false),
        (32, 256, 0, false),
    ] {
        mm.rs_narrow = narrow(tiles, width, narrower);
        assert_eq!(mm.check().is_ok(), ok, "{tiles} x {width}, {narrower} narrower: {:?}", mm.check());
    }
    mm.rs_narrow = narrow(34, 240, 8);
    assert_eq!((mm.tiles_per_chunk(), mm.grid(132)), (2 * 34, 64 + 68));
    // Chosen over the pipelined path only where measured: 16-bit inputs,
    // a nearly full wave (mm_rs 512 x 8192 at world 2), not half of one.
    assert!(fused_scatter_preferred(256, 8192, 2, 2));
    assert!(!fused_scatter_preferred(256, 8192, 2, 1));
    assert!(!fused_scatter_preferred(128, 8192, 2, 2));
    assert!(!fused_scatter_preferred(256, 4096, 2, 2));
    assert!(!fused_scatter_preferred(1024, 8192, 2, 2));
}

#[test]
fn c_goes_through_tma_only_where_tma_cannot_spill() {
    let op = |ptr, rows, ld| Operand { ptr, rows, ld };
    let plain =
        Sm90Matmul::plain(op(0x1000, 256, 64), op(0x2000, 256, 64), op(0x3000, 256, 256), 64, GemmDtype::BF16, 0);
    assert!(plain.c_through_tma());
    let mut mm = plain.clone();
    (mm.n, mm.c.ld) = (257, 264); // a row of n elements is not whole 16-byte units
    assert!(!mm.c_through_tma());
    let mut mm = plain.clone();
    mm.out_dtype = GemmDtype::F32;
    assert!(!mm.c_through_tma());
    let mut mm = plain.clone();
    (mm.chunk_rows, mm.order) = (100, vec![0, 1, 2]); // tiles straddle chunks
    assert!(!mm.c_through_tma());
    let mut mm = plain.clone();
    mm.scatter = Some(FusedScatter { rank: 0, inbox: vec![0], state: vec![0], out: None });
    assert!(!mm.c_through_tma());
    let mut mm = plain.clone();
    mm.tma_epilogue = false;
    assert!(!mm.c_through_tma());
}

#[test]
fn check_rejects_what_the_kernel_cannot_run() {
    let op = |ptr, rows, ld| Operand { ptr, rows, ld };
    let good =
        Sm90Matmul::plain(op(0x1000, 256, 64), op(0x2000, 256, 64), op(0x3000, 256, 256), 64, GemmDtype::BF16, 0);
    good.check().unwrap();
    let mut bad = good.clone();
    bad.a.ld = 60; // not 16-byte rows, and < k
    assert!(bad.check().is_err());
    let mut bad = good.clone();
    bad.a.ptr += 2;
    assert!(bad.check().is_err());
    let mut bad = good.clone();
    bad.dtype = GemmDtype::F32;
    assert!(bad.check().is_err());
    let mut bad = good.clone();
    bad.order = vec![0, 0];
    bad.chunk_rows = 128;
    assert!(bad.check().unwrap_err().msg.contains("permutation"));
    let mut bad = good.clone();
    bad.out_dtype = GemmDtype::F16;
    assert!(bad.check().is_err());
    // fp8: any output; k a multiple of 16 (16-byte rows); not e5m2 twice; scales set.
    let f = Fp8Params {
        a_type: Fp8::E4M3,
        b_type: Fp8::E5M2,
        row_wise: true,
        a_scale: 0x10,
        b_scale: 0x20,
        bias: 0,
        fast_accum: false,
    };
    let mut fp8 = good.clone();
    fp8.set_fp8(f);
    fp8.out_dtype = GemmDtype::F16;
    fp8.check().unwrap();
    let mut bad = fp8.clone();
    bad.tile = TileN::N256; // exact accumulation needs the 128-wide tile's registers
    assert!(bad.check().unwrap_err().msg.contains("128-wide tile"));
    bad.fp8 = Some(Fp8Params { fast_accum: true, ..f });
    bad.check().unwrap();
    let mut bad = fp8.clone();
    (bad.k, bad.a.ld, bad.b.ld) = (40, 40, 40);
    assert!(bad.check().unwrap_err().msg.contains("k a multiple of 16"));
    let mut bad = fp8.clone();
    bad.fp8 = Some(Fp8Params { a_type: Fp8::E5M2, b_type: Fp8::E5M2, ..f });
    assert!(bad.check().unwrap_err().msg.contains("both be e5m2"));
    let mut bad = fp8.clone();
    bad.fp8 = Some(Fp8Params { a_scale: 0, ..f });
    assert!(bad.check().is_err());
}

// ---- on a GPU (pass vacuously without one, or on a non-Hopper GPU) ----

use crate::backend::cuda::async_error::AsyncError;
use crate::backend::cuda::driver::check;
use crate::backend::cuda::gpu_testing::{
    decode, encode as enc, fp8_bytes, gpu, rel_err, round_robin_ms, values, DevBuf, Gpu, ROUNDS,
};
use crate::backend::cuda::streams::SideStreams;
use cudarc::driver::sys;
use std::ffi::c_void;

fn hopper(g: &Gpu) -> Option<&Sm90Kernels> {
    let k = g.kernels.gemm_sm90.as_ref();
    if k.is_none() {
        eprintln!("no sm_90a kernels on this device: sm90 matmul tests skipped");
    }
    k
}

struct Problem {
    n: usize,
    k: usize,
    /// A's and B's values, and A as stored (`a_bytes`, `el` bytes each).
    a: Vec<f32>,
    b: Vec<f32>,
    a_bytes: Vec<u8>,
    el: usize,
    bufs: Vec<DevBuf>,
}

/// Random A [m, k] and B [n, k] (rounded to `dt`), on the device.
fn problem(g: &Gpu, m: usize, n: usize, k: usize, dt: GemmDtype, seed: u64) -> Problem {
    let q = |v: Vec<f32>| decode(dt, &enc(dt, &v));
    let a = q(values(m * k, seed));
    let b = q(values(n * k, seed + 1));
    let a_bytes = enc(dt, &a);
    let bufs = vec![g.upload(&a_bytes), g.upload(&enc(dt, &b))];
    Problem { n, k, a, b, a_bytes, el: dt.size(), bufs }
}

/// Random fp8 A [m, k] of `at` and B [n, k] of `bt`, on the device.
fn fp8_problem(g: &Gpu, m: usize, n: usize, k: usize, (at, bt): (Fp8, Fp8), seed: u64) -> Problem {
    let (a_bytes, b) = (fp8_bytes(m * k, seed, at), fp8_bytes(n * k, seed + 1, bt));
    let bufs = vec![g.upload(&a_bytes), g.upload(&b)];
    let a = a_bytes.iter().map(|&x| at.decode(x)).collect();
    Problem { n, k, a, b: b.iter().map(|&x| bt.decode(x)).collect(), a_bytes, el: 1, bufs }
}

impl Problem {
    fn reference(&self, rows: std::ops::Range<usize>) -> Vec<f64> {
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
fn dense(a: u64, b: u64, c: u64, (m, n, k): (usize, usize, usize), dt: GemmDtype, err: u64) -> Sm90Matmul {
    let op = |ptr, rows, ld| Operand { ptr, rows, ld };
    Sm90Matmul::plain(op(a, m, k), op(b, n, k), op(c, m, n), k, dt, err)
}

fn poisoned(g: &Gpu, elems: usize, dt: GemmDtype) -> DevBuf {
    g.upload(&enc(dt, &vec![f32::NAN; elems]))
}

/// Rows `rows` of a row-major matrix with rows of `row_bytes`, as slice
/// `s` of the fused all-gather's slice-major layout: the bytes of columns
/// `[s * slice_bytes, (s + 1) * slice_bytes)` of each row, one row after another.
fn slice_of(matrix: &[u8], rows: std::ops::Range<usize>, row_bytes: usize, slice_bytes: usize, s: usize) -> Vec<u8> {
    rows.flat_map(|i| &matrix[i * row_bytes + s * slice_bytes..i * row_bytes + (s + 1) * slice_bytes])
        .copied()
        .collect()
}

#[test]
fn gpu_sm90_matmul_matches_reference_on_any_shape() {
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
fn gpu_sm90_matmul_column_cut() {
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
fn gpu_sm90_matmul_padded_output() {
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
fn shape_selected(m: usize, n: usize, k: usize) -> bool {
    std::env::var("SYMM_SM90_SHAPE").map_or(true, |s| s == format!("{m}x{k}x{n}"))
}

/// One timing in bench/results' format (collect.py).
fn print_record((m, k, n): (usize, usize, usize), dtype: &str, imp: &str, ms: f32) {
    let tflops = 2.0 * (m * n * k) as f64 / (ms as f64 * 1e-3) / 1e12;
    println!(
        "{{\"op\": \"matmul\", \"shape\": [{m}, {k}, {n}], \"dtype\": \"{dtype}\", \"impl\": \"{imp}\", \
         \"ms\": {ms:.4}, \"tflops\": {tflops:.1}, \"iters\": {}}}",
        5 * ROUNDS
    );
}

/// Scales (one, or one per row of A / column of B) and a bias for an
/// fp8 test problem, on the host and the device.
struct Scales {
    sa: Vec<f32>,
    sb: Vec<f32>,
    bias: Option<Vec<f32>>,
    bufs: Vec<DevBuf>,
}

impl Scales {
    fn new(g: &Gpu, m: usize, n: usize, row_wise: bool, bias: Option<GemmDtype>) -> Self {
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

    fn params(&self, a_type: Fp8, b_type: Fp8) -> Fp8Params {
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
    fn apply(&self, i: usize, j: usize, dot: f64) -> f64 {
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
fn gpu_sm90_fp8_matches_reference() {
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
fn gpu_sm90_matmul_waits_for_gathered_chunks() {
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
fn gpu_sm90_gather_beside_a_copy_engine() {
    let Some(g) = gpu() else { return };
    let Some(kern) = hopper(&g) else { return };
    for (m, k, n) in [(512usize, 8192usize, 14336usize), (2048, 8192, 14336), (8192, 8192, 14336)] {
        if shape_selected(m, n, k) {
            gather_beside_a_copy_engine(&g, kern, (m, k, n), GemmDtype::BF16);
        }
    }
}

/// Rank 0 of 2: chunk 0 local, chunk 1 delivered.
fn gather_beside_a_copy_engine(g: &Gpu, kern: &Sm90Kernels, (m, k, n): (usize, usize, usize), dt: GemmDtype) {
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

/// Reduce-scatter mode: `world` ranks simulated on one GPU, each kernel
/// on half the SMs / its own stream so they run concurrently; bf16, and
/// fp8 with row-wise scales and a bias (in every rank's product).
#[test]
fn gpu_sm90_matmul_reduce_scatter_epilogue() {
    let Some(g) = gpu() else { return };
    let Some(kern) = hopper(&g) else { return };
    // Peers' tiles by TMA stores and own rows summed from partials loaded
    // into the ring (320-column rows: the last box of a tile past n; 192
    // rows: a tile's second warpgroup past its chunk; world 3: two peers'
    // partials added in turn; an f32 C: twice the boxes) and, for
    // comparison, all from registers. A share of the SMs per rank gives
    // each CTA about one tile; one CTA per rank walks them all, handing
    // tile after tile to its flagging warp; as many CTAs as a chunk has
    // tiles make each CTA's last pushed tile the one its peer's first own
    // tile waits for (v8, which took those flags before the tile's
    // mainloop but set its own last one after it, waited there until the
    // timeout). The sums go to C from the ring where they were added,
    // and in two cases through the staging area.
    use Ctas::*;
    let (bf16, f32) = (GemmDtype::BF16, GemmDtype::F32);
    let case = |world, fp8, out, push, ctas| RsCase { world, fp8, out, push, ctas, ..RsCase::default() };
    for c in [
        case(2, false, bf16, true, Share),
        case(2, true, bf16, true, Share),
        case(3, false, bf16, true, Share),
        case(2, false, f32, true, Share),
        case(2, false, bf16, true, One),
        case(3, false, bf16, true, One),
        case(2, false, bf16, true, ChunkTiles),
        case(3, false, f32, true, ChunkTiles),
        case(2, false, bf16, false, Share),
        case(2, true, bf16, false, Share),
        case(2, false, f32, false, ChunkTiles),
        // This rank's C where TMA cannot store it (the sums from registers).
        RsCase { misaligned_c: true, ..case(2, false, bf16, true, Share) },
        // Three peers' partials added in turn. (With an f32 C the sums
        // span several stages of the ring, each held until their stores
        // have read it.)
        case(4, false, f32, true, One),
    ] {
        reduce_scatter_case(&g, kern, c);
    }
    // A peer that never sends its partials: rank 0 alone gives up on them
    // and says who, with either way of sending.
    for push in [true, false] {
        reduce_scatter_case(&g, kern, RsCase { peer_missing: true, ..case(2, false, bf16, push, Share) });
    }
}

/// Narrow peer tiles (`NarrowPeers`): the peers' chunks in tiles of 248
/// and 240 columns (n = 728: three of them, the first 248 wide) under own
/// tiles of 256 (the last one 216), so that each own tile sums the partials
/// of two narrow tiles, pushed by TMA boxes (each tile's last one shifted
/// back to overlap the one before); bf16 and
/// f32 C (whose boxes are half as wide), world 2 and 3, one CTA walking
/// every tile, misaligned C, and a missing peer; staggered widths (n = 720:
/// 248, 240 and 232); and with every rank's C passed as symmetric
/// (`FusedScatter::out`), where at world 2 the peer stores its partials into C
/// and the own tiles add theirs.
#[test]
fn gpu_sm90_reduce_scatter_narrow_peer_tiles() {
    let Some(g) = gpu() else { return };
    let Some(kern) = hopper(&g) else { return };
    use Ctas::*;
    let (bf16, f32) = (GemmDtype::BF16, GemmDtype::F32);
    let case = |world, out, ctas| RsCase { world, out, ctas, narrow: true, ..RsCase::default() };
    for c in [
        case(2, bf16, Share),
        case(2, f32, Share),
        case(3, bf16, ChunkTiles),
        case(3, f32, One),
        case(2, bf16, One),
        RsCase { misaligned_c: true, ..case(2, bf16, Share) },
        RsCase { misaligned_c: true, ..case(3, f32, ChunkTiles) },
        RsCase { staggered: true, ..case(2, bf16, Share) },
        RsCase { staggered: true, ..case(3, f32, One) },
        RsCase { adds: true, ..case(2, bf16, Share) },
        RsCase { adds: true, ..case(2, f32, Share) },
        RsCase { adds: true, ..case(2, bf16, One) },
        RsCase { adds: true, staggered: true, ..case(2, bf16, Share) },
        RsCase { adds: true, staggered: true, ..case(2, f32, One) },
        // Not at world 3, nor with a misaligned C: those push into inboxes.
        RsCase { adds: true, ..case(3, bf16, ChunkTiles) },
        RsCase { adds: true, misaligned_c: true, ..case(2, bf16, Share) },
    ] {
        reduce_scatter_case(&g, kern, c);
    }
    reduce_scatter_case(&g, kern, RsCase { peer_missing: true, ..case(2, bf16, Share) });
    reduce_scatter_case(&g, kern, RsCase { peer_missing: true, adds: true, ..case(2, bf16, Share) });
}

/// One reduce-scatter case of [`reduce_scatter_case`].
#[derive(Clone, Copy, Debug)]
struct RsCase {
    world: usize,
    fp8: bool,
    out: GemmDtype,
    /// rs_push (TMA), else from registers.
    push: bool,
    ctas: Ctas,
    /// Narrow peer tiles (n 728, see gpu_sm90_reduce_scatter_narrow_peer_tiles).
    narrow: bool,
    /// With narrow tiles: of three widths (n 720).
    staggered: bool,
    /// Each rank's C one element past a 16-byte boundary.
    misaligned_c: bool,
    /// Only rank 0 runs (see reduce_scatter_case).
    peer_missing: bool,
    /// Every rank's C given as symmetric (`FusedScatter::out`): the partials go
    /// through it where `Sm90Matmul::rs_adds` allows.
    adds: bool,
}

impl Default for RsCase {
    fn default() -> Self {
        RsCase {
            world: 2,
            fp8: false,
            out: GemmDtype::BF16,
            push: true,
            ctas: Ctas::Share,
            narrow: false,
            staggered: false,
            misaligned_c: false,
            peer_missing: false,
            adds: false,
        }
    }
}

/// CTAs per rank in a reduce-scatter case.
#[derive(Clone, Copy, Debug)]
enum Ctas {
    /// The SMs split evenly between the ranks.
    Share,
    One,
    /// As many as a chunk has tiles.
    ChunkTiles,
}

/// Each rank runs `CALLS` calls back to back on its own stream, each into
/// its own poisoned output, with nothing between them: the kernels' count
/// of calls (the state's epoch) alone keeps a call's pushes out of an inbox
/// the previous call still reads. With `peer_missing`, only rank 0 runs,
/// once (200 ms timeout): a timeout error naming rank 1 is expected
/// instead of the sums.
fn reduce_scatter_case(g: &Gpu, kern: &Sm90Kernels, case: RsCase) {
    let RsCase { world, fp8, out, push, ctas, narrow, staggered, misaligned_c, peer_missing, adds } = case;
    let dt = GemmDtype::BF16;
    let n = match (narrow, staggered) {
        (false, _) => 320,
        (true, false) => 728,
        (true, true) => 720,
    };
    let (rows, k) = (192usize, 128usize);
    // The first of the narrow tiles 248 columns wide, the other two 240;
    // staggered, 248, 240 and 232.
    let narrow_tiles = NarrowPeers { tiles: 3, width: 240, narrower: usize::from(staggered) };
    let m = world * rows;
    let ps: Vec<Problem> = (0..world)
        .map(|r| {
            let seed = 40 + 2 * r as u64;
            if fp8 {
                fp8_problem(g, m, n, k, (Fp8::E5M2, Fp8::E4M3), seed)
            } else {
                problem(g, m, n, k, dt, seed)
            }
        })
        .collect();
    let scales: Vec<Scales> = (0..world).map(|_| Scales::new(g, m, n, true, Some(dt))).collect();
    let errors = AsyncError::new().unwrap();
    let template = |r: usize, c: u64| {
        let mut mm = Sm90Matmul::plain(
            Operand { ptr: ps[r].bufs[0].ptr, rows: m, ld: k },
            Operand { ptr: ps[r].bufs[1].ptr, rows: n, ld: k },
            Operand { ptr: c, rows, ld: n },
            k,
            dt,
            errors.device_ptr(),
        );
        mm.chunk_rows = rows;
        mm.order = (1..=world).map(|i| (r + i) % world).collect();
        mm.out_dtype = out;
        mm.alpha = 0.5;
        mm.max_ctas = Some(match ctas {
            Ctas::Share => g.kernels.sm_count / world as u32,
            Ctas::One => 1,
            Ctas::ChunkTiles => mm.tiles_per_chunk() as u32,
        });
        mm.timeout_ns = if peer_missing { 200_000_000 } else { 5_000_000_000 };
        mm.rs_push = push;
        if fp8 {
            mm.set_fp8(scales[r].params(Fp8::E5M2, Fp8::E4M3));
        }
        if narrow {
            (mm.tile, mm.rs_narrow) = (TileN::N256, Some(narrow_tiles));
        }
        mm
    };
    const CALLS: usize = 3;
    // With a (placeholder) scatter, so that it counts the narrow tiles' flags.
    let (skew, out_elem) = (usize::from(misaligned_c), out.size());
    let probe = Sm90Matmul {
        scatter: Some(FusedScatter { rank: 0, inbox: vec![0; world], state: vec![0; world], out: None }),
        ..template(0, 0)
    };
    assert_eq!(probe.narrow().is_some(), narrow && push, "{case:?}");
    // Whether the partials go through C: world 2, narrow tiles, an aligned C.
    let c_at = (skew * out_elem) as u64;
    let mut with_outs = probe.clone();
    with_outs.c.ptr = c_at;
    with_outs.scatter.as_mut().unwrap().out = adds.then(|| vec![c_at; world]);
    let adding = with_outs.rs_adds();
    assert_eq!(adding, adds && world == 2 && narrow && push && !misaligned_c, "{case:?}");
    let inboxes: Vec<DevBuf> = (0..world).map(|_| poisoned(g, probe.inbox_bytes() / out.size(), out)).collect();
    let states: Vec<DevBuf> = (0..world).map(|_| g.upload(&vec![0u8; probe.state_bytes()])).collect();
    let calls = if peer_missing { 1 } else { CALLS };
    let outs: Vec<Vec<DevBuf>> =
        (0..calls).map(|_| (0..world).map(|_| poisoned(g, rows * n + skew, out)).collect()).collect();
    let sides = SideStreams::default();
    let launched = if peer_missing { 1 } else { world };
    for call_outs in &outs {
        for (r, out) in call_outs.iter().enumerate().take(launched) {
            let mut mm = template(r, out.ptr + c_at);
            mm.scatter = Some(FusedScatter {
                rank: r,
                inbox: inboxes.iter().map(|b| b.ptr).collect(),
                state: states.iter().map(|b| b.ptr).collect(),
                out: adds.then(|| call_outs.iter().map(|o| o.ptr + c_at).collect()),
            });
            assert_eq!(mm.rs_adds(), adding);
            mm.launch(kern, g.kernels.sm_count, sides.stream(r).unwrap()).unwrap();
        }
    }
    for r in 0..launched {
        sides.wait(g.stream(), sides.stream(r).unwrap()).unwrap();
    }
    g.sync();
    if peer_missing {
        let e = errors.check().unwrap_err();
        assert!(e.msg.contains("fused matmul waiting for rank 1"), "{case:?}: {}", e.msg);
        return;
    }
    errors.check().unwrap();
    let out_dtype = out;
    for (call, (r, out)) in outs.iter().enumerate().flat_map(|(c, o)| o.iter().enumerate().map(move |x| (c, x))) {
        let rows_r = r * rows..(r + 1) * rows;
        let want: Vec<f64> = {
            let parts: Vec<Vec<f64>> = ps.iter().map(|p| p.reference(rows_r.clone())).collect();
            let term = |q: usize, e: usize| {
                let (i, j) = (r * rows + e / n, e % n);
                if fp8 {
                    scales[q].apply(i, j, parts[q][e])
                } else {
                    parts[q][e]
                }
            };
            (0..rows * n).map(|e| 0.5 * (0..world).map(|q| term(q, e)).sum::<f64>()).collect()
        };
        let got = decode(out_dtype, &out.read_bytes());
        let e = rel_err(&got[skew..skew + rows * n], &want);
        assert!(e < 1e-2, "{case:?}, rank {r}, call {call}: relative error {e}");
    }
    // Each rank counted every call (and, through C, started every one), and
    // each peer's flag of each of its tiles holds the epoch of the last one
    // (a rank never flags itself).
    for (r, state) in states.iter().enumerate() {
        let words = state.read::<u32>(probe.state_bytes() / 4);
        let header = FusedMatmul::STATE_HEADER_BYTES / 4;
        assert_eq!(words[0], CALLS as u32, "rank {r}'s epoch");
        assert_eq!(words[2], if adding { CALLS as u32 } else { 0 }, "rank {r}'s calls started");
        assert_eq!(words[1], 0, "rank {r}'s count of finished CTAs is reset");
        for (i, &f) in words[header..].iter().enumerate() {
            let src = i / probe.tiles_per_chunk();
            assert_eq!(f, if src == r { 0 } else { CALLS as u32 }, "rank {r}, flag {i} (from rank {src})");
        }
    }
}

/// The reduce-scatter epilogue's two ways, timed on one GPU: two ranks in
/// one context, each kernel on half the SMs and its own stream, their
/// "peer" inboxes local memory. NVLink is absent, so this shows what the
/// consumers spend on the reduce-scatter itself (stores, fence, flag and
/// adds per tile from registers, against TMA stores, a flagging warp and
/// partials loaded into the ring), not the link; the two-GPU benchmark
/// times the real thing. The same two
/// matmuls without the reduce-scatter (each rank's whole product into its
/// own buffer) are the floor: what the epilogue costs beyond a plain one.
#[test]
fn gpu_sm90_reduce_scatter_push_against_registers() {
    let Some(g) = gpu() else { return };
    let Some(kern) = hopper(&g) else { return };
    // The benchmark's mm_rs 16384x4096x8192 and 512x14336x8192, halved
    // (each rank has half the SMs); SYMM_SM90_SHAPE picks one.
    for (rows, n, k) in [(4096usize, 8192usize, 4096usize), (256, 8192, 14336)] {
        if shape_selected(2 * rows, n, k) {
            rs_push_against_registers(&g, kern, rows, n, k);
        }
    }
}

fn rs_push_against_registers(g: &Gpu, kern: &Sm90Kernels, rows: usize, n: usize, k: usize) {
    let dt = GemmDtype::BF16;
    let world = 2usize;
    let m = world * rows;
    let p = g.upload(&enc(dt, &values(m * k, 5)));
    let w = g.upload(&enc(dt, &values(n * k, 6)));
    let errors = AsyncError::new().unwrap();
    let outs: Vec<DevBuf> = (0..world).map(|_| g.alloc(rows * n * 2)).collect();
    let mut mms = Vec::new();
    for (r, out) in outs.iter().enumerate() {
        let mut mm = Sm90Matmul::plain(
            Operand { ptr: p.ptr, rows: m, ld: k },
            Operand { ptr: w.ptr, rows: n, ld: k },
            Operand { ptr: out.ptr, rows, ld: n },
            k,
            dt,
            errors.device_ptr(),
        );
        mm.chunk_rows = rows;
        mm.order = (1..=world).map(|i| (r + i) % world).collect();
        mm.max_ctas = Some(g.kernels.sm_count / world as u32);
        mm.timeout_ns = 5_000_000_000;
        mms.push(mm);
    }
    let inboxes: Vec<DevBuf> = (0..world).map(|_| g.alloc(mms[0].inbox_bytes())).collect();
    let states: Vec<DevBuf> = (0..world).map(|_| g.upload(&vec![0u8; mms[0].state_bytes()])).collect();
    for (r, mm) in mms.iter_mut().enumerate() {
        mm.scatter = Some(FusedScatter {
            rank: r,
            inbox: inboxes.iter().map(|b| b.ptr).collect(),
            state: states.iter().map(|b| b.ptr).collect(),
            out: None,
        });
    }
    let sides = SideStreams::default();
    let (main, side) = (g.stream(), sides.stream(0).unwrap());
    // The floor: no scatter, each rank's m x n product into its own buffer.
    let products: Vec<DevBuf> = (0..world).map(|_| g.alloc(m * n * 2)).collect();
    let plain: Vec<Sm90Matmul> = mms
        .iter()
        .zip(&products)
        .map(|(mm, out)| Sm90Matmul {
            c: Operand { ptr: out.ptr, rows: m, ld: n },
            chunk_rows: m,
            order: vec![0],
            scatter: None,
            ..mm.clone()
        })
        .collect();
    // Candidate c: 0 = from registers, 1 = pushed, 2 = no scatter; both ranks at once.
    let med = round_robin_ms(g, 3, |c| {
        let mut pair = if c == 2 { plain.clone() } else { mms.clone() };
        for mm in &mut pair {
            mm.rs_push = c == 1;
        }
        sides.wait(side, main).unwrap();
        pair[0].launch(kern, g.kernels.sm_count, main).unwrap();
        pair[1].launch(kern, g.kernels.sm_count, side).unwrap();
        sides.wait(main, side).unwrap();
    });
    g.sync();
    errors.check().unwrap();
    // The pushed results at full size, where each CTA hands many tiles to
    // its flagging warp: both ranks multiply the same matrices, so rank r's
    // rows are twice its rows of the floor's product (poisoned first).
    let checked: Vec<DevBuf> = (0..world).map(|_| poisoned(g, rows * n, dt)).collect();
    let mut pair: Vec<Sm90Matmul> = mms.clone();
    for (mm, out) in pair.iter_mut().zip(&checked) {
        mm.rs_push = true;
        mm.c.ptr = out.ptr;
    }
    sides.wait(side, main).unwrap();
    pair[0].launch(kern, g.kernels.sm_count, main).unwrap();
    pair[1].launch(kern, g.kernels.sm_count, side).unwrap();
    sides.wait(main, side).unwrap();
    g.sync();
    errors.check().unwrap();
    let product = decode(dt, &products[0].read_bytes());
    for (r, out) in checked.iter().enumerate() {
        let want: Vec<f64> = product[r * rows * n..(r + 1) * rows * n].iter().map(|&x| 2.0 * x as f64).collect();
        let e = rel_err(&decode(dt, &out.read_bytes()), &want);
        assert!(e < 1e-2, "pushed reduce-scatter at full size, rank {r}: relative error {e}");
    }
    for (imp, ms) in ["symm_sm90_rs_registers", "symm_sm90_rs_push", "symm_sm90_no_scatter"].iter().zip(&med) {
        print_record((m, k, n), "bf16_rs_world2_one_gpu", imp, *ms);
    }
    println!(
        "sm90 reduce-scatter on one GPU, {m}x{k}x{n}, world 2: pushed / from registers {:.3}, from registers / \
         no scatter {:.3}, pushed / no scatter {:.3}",
        med[1] / med[0],
        med[0] / med[2],
        med[1] / med[2]
    );
    // Both ranks counted the same calls (both ways alike), and every peer
    // tile's flag holds the last one's epoch.
    let words: Vec<Vec<u32>> = states.iter().map(|s| s.read::<u32>(mms[0].state_bytes() / 4)).collect();
    let epoch = words[0][0];
    assert!(epoch > 1 && words[1][0] == epoch, "epochs {} and {}", words[0][0], words[1][0]);
    let header = FusedMatmul::STATE_HEADER_BYTES / 4;
    for (r, w) in words.iter().enumerate() {
        for (i, &f) in w[header..].iter().enumerate() {
            let src = i / mms[0].tiles_per_chunk();
            assert_eq!(f, if src == r { 0 } else { epoch }, "rank {r}, flag {i}");
        }
    }
}
