//! Tile choices of the sm90 matmul, from the shape alone where every rank
//! must agree (tile width, narrow peer tiles) and from the grid where only
//! this rank's launch depends on it (the column cut). `busiest_cta_cols`
//! mirrors the kernel's tile order (kernels/sm90_scheduler.cuh).

use super::{BK_BYTES, BM, EPI_BYTES, GROUP_M, SHAPE_SMS};

/// Tile widths the kernels come in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TileN {
    N128,
    N256,
}

impl TileN {
    pub const fn cols(self) -> usize {
        match self {
            TileN::N128 => 128,
            TileN::N256 => 256,
        }
    }

    pub(super) const fn stages(self) -> usize {
        match self {
            TileN::N128 => 6,
            TileN::N256 => 4,
        }
    }

    /// Dynamic shared memory of the kernel (`symm_gemm_cfg::SMEM_BYTES`):
    /// the ring, the epilogue's staging (`SYMM_GEMM_EPI_BYTES`), barriers
    /// (the ring's two per stage, the two of the reduce-scatter's flag
    /// handoff), the reduce-scatter's epoch (8 bytes) and its peers-ready
    /// barrier.
    pub(super) const fn smem_bytes(self) -> usize {
        let stage = (BM + self.cols()) * BK_BYTES;
        self.stages() * stage + EPI_BYTES + (2 * self.stages() + 4) * 8 + 1024
    }
}

/// The peers' chunks of a one-wave reduce-scatter cut into `tiles` tiles
/// per 128-row tile, `width` columns wide (the first few 8 wider, to cover
/// n, and as many more as the last `narrower`, which are 8 narrower), so
/// that they finish before this rank's own 256-wide tiles and their pushes
/// cross NVLink while those still multiply ("Narrow peer tiles" in the
/// kernel's header).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NarrowPeers {
    pub tiles: usize,
    pub width: usize,
    pub narrower: usize,
}

impl NarrowPeers {
    /// Widths the kernels have a k-loop for.
    pub(super) const WIDTHS: [usize; 3] = [232, 240, 248];

    /// Tiles of `width + 8` columns (the first ones) to cover `n`.
    pub(super) fn wider(self, n: usize) -> Option<usize> {
        (n.div_ceil(8) + self.narrower)
            .checked_sub(self.tiles * (self.width / 8))
            .filter(|&e| e + self.narrower <= self.tiles && e < self.tiles)
    }

    /// Whether these tiles cover `n` columns in widths the kernels have.
    pub(super) fn covers(self, n: usize) -> bool {
        let has = |w: usize| Self::WIDTHS.contains(&w);
        self.wider(n).is_some_and(|e| {
            has(self.width) && (e == 0 || has(self.width + 8)) && (self.narrower == 0 || has(self.width - 8))
        })
    }
}

/// The tile width for an `m x n` problem split into `chunks` row chunks on
/// `sms` multiprocessors: the one with fewer predicted tile-waves, where a
/// 128-wide tile costs a little more than half a 256-wide one.
pub fn choose_tile(m_chunk: usize, n: usize, chunks: usize, sms: usize) -> TileN {
    let cost = |t: TileN, rel: f64| {
        let tiles = m_chunk.div_ceil(BM) * n.div_ceil(t.cols()) * chunks;
        tiles.div_ceil(sms.max(1)) as f64 * rel
    };
    // Relative time of one tile: N128 does half the work, but loads more
    // per flop. Measured with the TMA-store epilogue,
    // 16384x8192x8192: N128 0.958-0.978 of cuBLASLt on an H200 against
    // N256 0.964-0.999, but 1.145 against 0.975 on an H100 (less memory
    // bandwidth), so N128 must win on waves by a margin.
    if cost(TileN::N128, 0.56) < cost(TileN::N256, 1.0) {
        TileN::N128
    } else {
        TileN::N256
    }
}

/// The cut of each of `rows` row tiles' `n` columns into tiles of 232 to
/// 256 columns (the kernels' narrow k-loops; the first ones 8 wider, to
/// cover n) that gives the busiest of `ctas` CTAs at least 1% fewer
/// columns than 256-wide tiles do, the fewest tiles of the best, or None.
/// A persistent grid takes its busiest CTA's time, and a k-loop's time
/// goes with its tile's width, so at 16384 x 8192
/// on 132 SMs 34 tiles per row tile (240 columns, the first 4 of 248)
/// leave the busiest CTA 7952 columns, where 32 of 256 (31.03 tiles per
/// CTA, so 32 tiles' time) leave it 8192. (A cut is a `NarrowPeers` with
/// no narrower tiles: the same widths, the same kernel arithmetic.)
pub fn column_cut(rows: usize, n: usize, ctas: usize) -> Option<NarrowPeers> {
    let wide = n.div_ceil(256);
    let cols8 = n.div_ceil(8);
    let wide_width = |i: usize| if i + 1 < wide { 256 } else { n - 256 * (wide - 1) };
    let uncut = busiest_cta_cols(rows, wide, ctas, wide_width);
    (wide + 1..=cols8 / 29)
        .filter_map(|tiles| {
            let cut = NarrowPeers { tiles, width: 8 * (cols8 / tiles), narrower: 0 };
            let extra = cut.wider(n).filter(|_| NarrowPeers::WIDTHS.contains(&cut.width))?;
            let width = |i: usize| cut.width + if i < extra { 8 } else { 0 };
            Some((busiest_cta_cols(rows, tiles, ctas, width), cut))
        })
        .filter(|&(cols, _)| 100 * cols <= 99 * uncut)
        .min_by_key(|&(cols, cut)| (cols, cut.tiles))
        .map(|(_, cut)| cut)
}

/// The most columns one CTA computes when `rows` row tiles of `tiles`
/// tiles each (tile i `width(i)` wide) are dealt to `ctas` CTAs in the
/// kernel's order (`symm_tiling::at` in kernels/sm90_scheduler.cuh: groups of `GROUP_M` row tiles walked
/// column by column, tile t to CTA t mod the grid). Each column of a group
/// is a run of consecutive t, added to the CTAs it spans through a cyclic
/// difference array: a launch evaluates a few cuts, so this costs one step
/// per run, not per tile.
pub(super) fn busiest_cta_cols(rows: usize, tiles: usize, ctas: usize, width: impl Fn(usize) -> usize) -> usize {
    let grid = ctas.min(rows * tiles).max(1);
    let (mut every, mut diff) = (0, vec![0isize; grid + 1]);
    for first_m in (0..rows).step_by(GROUP_M) {
        let group_m = (rows - first_m).min(GROUP_M);
        for tn in 0..tiles {
            let w = width(tn);
            // Tiles first_m * tiles + tn * group_m, and the next group_m - 1.
            let (start, len) = ((first_m * tiles + tn * group_m) % grid, group_m % grid);
            every += group_m / grid * w;
            let w = w as isize;
            diff[start] += w;
            if start + len <= grid {
                diff[start + len] -= w;
            } else {
                diff[grid] -= w;
                diff[0] += w;
                diff[start + len - grid] -= w;
            }
        }
    }
    let mut run = 0;
    let most = diff[..grid].iter().map(|d| {
        run += d;
        run
    });
    every + most.max().unwrap_or(0) as usize
}

/// Narrow peer tiles for a reduce-scatter of `chunks` chunks of `m_chunk`
/// rows by `n` columns in 256-wide tiles on `sms` multiprocessors, where
/// they pay: the 256-wide tiles are one wave that leaves SMs idle, and the
/// peers' chunks then fill them with more tiles of 232 to 248 columns (the
/// widths the kernels have): at mm_rs M = 512 world 2, n = 8192, 68 tiles
/// on the 68 SMs the own chunk's 64 leave, per row tile 12 of 248 columns,
/// 14 of 240 and 8 of 232 (`staggered`; without, 4 of 248 and 30 of 240).
/// `None` where the tiles would not be narrower.
///
/// Staggered: a k-loop's time goes with its tile's width, so the three
/// widths end theirs ~5 us apart (0.61 us per column at this shape) and
/// the link, which takes ~11 us for the 4 MiB of partials (~380 GB/s,
/// `bench/probes/push_probe.cu`), drains the first group's pushes before the
/// next group's come. A queue model of the link put the last push ~2-3.5
/// us earlier with a quarter of the tiles 8 narrower than with one width;
/// measured on 2 x H200, pushes complete ~4 us earlier at the median but
/// the last flag only ~1 us (the push's other costs).
///
/// `narrower`: how many tiles per row tile are 8 columns narrower (None:
/// a quarter of them; 0: one width but the few to cover n).
pub fn narrow_peers(
    m_chunk: usize,
    n: usize,
    chunks: usize,
    sms: usize,
    narrower: Option<usize>,
) -> Option<NarrowPeers> {
    let tiles_m = m_chunk.div_ceil(BM);
    let wide = n.div_ceil(TileN::N256.cols());
    let own = tiles_m * wide;
    if chunks < 2 || own * chunks > sms {
        return None;
    }
    // As many as the idle SMs take, of 240 columns or more (the staggered
    // cut then narrows some to 232).
    let tiles = ((sms - own) / ((chunks - 1) * tiles_m)).min(n.div_ceil(8) / 30);
    if tiles <= wide {
        return None;
    }
    let width = 8 * (n.div_ceil(8) / tiles);
    let stagger = NarrowPeers { tiles, width, narrower: narrower.unwrap_or(tiles / 4) };
    if stagger.narrower > 0 && stagger.covers(n) {
        return Some(stagger);
    }
    let w = NarrowPeers { narrower: 0, ..stagger };
    w.covers(n).then_some(w)
}

/// The tile width of a fused call: the shape's alone (the same SM count
/// assumed on every rank), so every rank numbers the tiles alike.
pub(super) fn fused_tile(m_chunk: usize, n: usize, chunks: usize) -> TileN {
    choose_tile(m_chunk, n, chunks, SHAPE_SMS)
}

/// The narrow peer tiles a fused 16-bit reduce-scatter of this shape uses
/// (256-wide tiles only): the shape's alone, so that every rank cuts the
/// chunks alike.
pub(super) fn narrow_plan(m_chunk: usize, n: usize, chunks: usize) -> Option<NarrowPeers> {
    let wide = fused_tile(m_chunk, n, chunks) == TileN::N256;
    wide.then(|| narrow_peers(m_chunk, n, chunks, SHAPE_SMS, None)).flatten()
}

/// Whether the fused reduce-scatter should be chosen over the other paths
/// (pure: the shape alone, and the cost model's verdict that the call is
/// `comm_heavy`, for the backend's decision layer).
///
/// Measured ahead on one nearly full wave: 16-bit inputs where its peers'
/// tiles are narrow ([`narrow_peers`]) and the rows of the wave of
/// 256-wide tiles fill at least 90% of the SMs (where half of them would
/// idle, as at M = 256 or n = 4096, cuBLAS's smaller tiles fill the GPU in
/// the pipelined path, and the fused kernel was 1.09-1.26 x slower there,
/// measured before the narrow peer tiles; at chunks of 170 rows, a third
/// of its second row of tiles, 1.09 x the sequential path). At mm_rs 512x14336x8192 on 2 x
/// H200: bound 0.1879-0.1893 ms against 0.1975-0.1977 for the pipelined
/// path, 0.1986-0.1999 against 0.2005-0.2016 replayed from graphs, and 189
/// against 195 us one call at a time. Elsewhere (more waves) the pipelined
/// path stays ahead or level.
///
/// Comm-heavy, where the rows of its tiles fill at least two waves: its
/// pushes of one wave's tiles then hide behind the next
/// (`cost::FUSED_SCATTER_COMM_SHARE` has the shapes). With fewer, the last
/// wave's pushes and the peers' flags come after all of the matmul, while
/// the sequential path's matmul fills the GPU: mm_rs 62x2048x4096 at world
/// 2 took 26.3 us fused against 15.8 sequential, 340x4096x8192 64.2
/// against 57.1, 414x2816x6144 50.6 against 43.9 (graph-replayed, 2 x
/// H200, bench/results/2026-11-30-h200-x2-ef80067-drawn/); at
/// 528x2816x6144 (f16) its 288 tiles (chunks of 264 rows: a third row of
/// tiles 8 rows deep) filled 1.5 waves, and it took 70.8 us against
/// NCCL-then-cuBLAS's 60.5 (...-5fc0d1b-x2-checks/).
pub fn fused_scatter_preferred(chunk_rows: usize, n: usize, chunks: usize, in_elem: usize, comm_heavy: bool) -> bool {
    let wide_rows = chunks * chunk_rows * n.div_ceil(TileN::N256.cols());
    let one_full_wave =
        in_elem == 2 && 10 * wide_rows >= 9 * SHAPE_SMS * BM && narrow_plan(chunk_rows, n, chunks).is_some();
    let filled_rows = chunks * chunk_rows * n.div_ceil(fused_tile(chunk_rows, n, chunks).cols());
    let waves_hide = filled_rows >= 2 * SHAPE_SMS * BM;
    one_full_wave || (comm_heavy && waves_hide)
}
