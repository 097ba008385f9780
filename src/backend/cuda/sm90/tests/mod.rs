//! Tests of the sm90 matmul: the host-side checks, and on a Hopper GPU
//! (passing vacuously elsewhere) its results against float64 references
//! and cuBLASLt, and its fused modes (its speed: bench/sm90_matmul.rs):
//! plain, fp8 and all-gather in `gpu`, reduce-scatter in `gpu_scatter`.
mod gpu;
mod gpu_scatter;

use super::matmul::*;
use super::tiling::*;
use crate::backend::cuda::gemm::{Fp8, Fp8Params, GemmDtype};
use crate::backend::{CallTag, FusedMatmul, FusedScatter};

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

    /// CTAs launched on a device of `sm_count` SMs: one per tile, at most
    /// one per SM (persistent) or `max_ctas`.
    fn grid(&self, sm_count: u32) -> u32 {
        self.layout(sm_count).0
    }

    /// Tiles in one chunk, the peers' narrow ones if narrower (the rs
    /// flags per source rank).
    fn tiles_per_chunk(&self) -> usize {
        let across = self.narrow().map_or(0, |w| w.tiles).max(self.n.div_ceil(self.tile.cols()));
        self.chunk_rows.div_ceil(super::BM) * across
    }

    /// Bytes of one rank's rs inbox: a slot of `chunk_rows x n` per rank.
    fn inbox_bytes(&self) -> usize {
        self.chunks() * self.chunk_rows * self.n * self.out_dtype.size()
    }

    /// Bytes of one rank's rs state: `symm_rs_state`, then the tile flags,
    /// `tiles_per_chunk` u32 per rank.
    fn state_bytes(&self) -> usize {
        FusedMatmul::STATE_HEADER_BYTES + self.chunks() * self.tiles_per_chunk() * 4
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
    let scatter = FusedScatter { rank: 0, inbox: vec![0; 2], state: vec![0; 2], out: None, tag: CallTag::of(b"test") };
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
    mm.scatter =
        Some(FusedScatter { rank: 0, inbox: vec![0; 2], state: vec![0; 2], out: None, tag: CallTag::of(b"test") });
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
    for comm_heavy in [false, true] {
        assert!(fused_scatter_preferred(256, 8192, 2, 2, comm_heavy));
    }
    assert!(!fused_scatter_preferred(256, 8192, 2, 1, false));
    assert!(!fused_scatter_preferred(128, 8192, 2, 2, false));
    assert!(!fused_scatter_preferred(256, 4096, 2, 2, false));
    assert!(!fused_scatter_preferred(1024, 8192, 2, 2, false));
    // Comm-heavy: where the rows of its tiles fill two waves or more (mm_rs 2048x1536x8192
    // and 3000x1024x8192, fp8 too), not under one (62x2048x4096, 340x4096x8192).
    assert!(fused_scatter_preferred(1024, 8192, 2, 2, true));
    assert!(fused_scatter_preferred(1500, 8192, 2, 2, true));
    assert!(fused_scatter_preferred(2048, 8192, 2, 1, true));
    assert!(!fused_scatter_preferred(31, 4096, 2, 2, true));
    assert!(!fused_scatter_preferred(170, 8192, 2, 2, true));
    // Two waves of tiles, but 1.5 of rows (528x2816x6144 f16, measured slower).
    assert!(!fused_scatter_preferred(264, 6144, 2, 2, true));
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
    mm.scatter = Some(FusedScatter { rank: 0, inbox: vec![0], state: vec![0], out: None, tag: CallTag::of(b"test") });
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
