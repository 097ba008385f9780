//! Strided <-> contiguous copies on CUDA (kernels/pack.cu): [`pack`]
//! gathers an N-d strided tensor (rank <= 8, shape and strides in elements,
//! strides may be negative or zero) into a contiguous row-major buffer;
//! [`unpack`] scatters a contiguous row-major buffer into a strided tensor.
//!
//! The host normalizes the layout first ([`PackRoute::new`]): size-1
//! dimensions are dropped and dimensions contiguous with each other merged.
//! A layout that turns out contiguous is one `cuMemcpyAsync`; one whose
//! innermost dimension is contiguous is copied row by row with the widest
//! access (up to 16 bytes) that every row start allows; one whose innermost
//! dimension is strided but another dimension unit-stride (a transpose) goes
//! through 32 x 32 tiles in shared memory, coalesced on both sides;
//! anything else is copied element by element.

use super::driver::{check, cuda_err};
use super::module::{arg, Kernels};
use crate::backend::Stream;
use crate::error::{err, Result};
use cudarc::driver::sys;
use std::ffi::c_void;

/// Threads per block (`SYMM_PACK_THREADS`).
pub const PACK_THREADS: u32 = 256;
/// Largest tensor rank accepted.
pub const PACK_MAX_DIMS: usize = 8;
/// Blocks per SM the grid is capped at (the kernels use few registers).
pub const PACK_BLOCKS_PER_SM: u32 = 8;
/// Units (chunks or elements) each thread of a team copies per segment.
const UNITS_PER_THREAD: u64 = 4;
const MAX_OUTER: usize = PACK_MAX_DIMS - 1;
/// Tile edge and block shape of the transpose kernels (`SYMM_TILE_DIM`, `SYMM_TILE_ROWS`).
pub const TILE_DIM: u32 = 32;
pub const TILE_ROWS: u32 = 8;
const MAX_BATCH: usize = PACK_MAX_DIMS - 2;

/// Mirror of `struct symm_pack_desc` (kernels/pack.cu).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PackDesc {
    pub rows: u64,
    pub row_units: u64,
    pub segs_per_row: u64,
    pub seg_units: u64,
    pub inner_stride: i64,
    pub outer_ndim: i32,
    pub team_log2: i32,
    pub outer_shape: [u64; MAX_OUTER],
    pub outer_stride: [i64; MAX_OUTER],
}

const _: () = assert!(std::mem::size_of::<PackDesc>() == 160);

/// Mirror of `struct symm_tile_desc` (kernels/pack.cu).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TileDesc {
    pub ni: u64,
    pub nj: u64,
    pub rs_i: i64,
    pub rs_j: i64,
    pub ws_i: i64,
    pub ws_j: i64,
    pub tiles_i: u64,
    pub tiles_j: u64,
    pub batch: u64,
    pub batch_ndim: i32,
    pub read_fast_i: i32,
    pub write_fast_i: i32,
    pub reserved: i32,
    pub batch_shape: [u64; MAX_BATCH],
    pub batch_rs: [i64; MAX_BATCH],
    pub batch_ws: [i64; MAX_BATCH],
}

const _: () = assert!(std::mem::size_of::<TileDesc>() == 232);

/// Which side is strided.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Direction {
    /// strided source -> contiguous destination.
    Pack,
    /// contiguous source -> strided destination.
    Unpack,
}

/// How a copy is carried out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PackRoute {
    /// No elements.
    Empty,
    /// Both sides contiguous: one memcpy of `bytes`.
    Copy { bytes: usize },
    /// Innermost dimension contiguous: `symm_pack_rows_v{2^width_log2}`.
    Rows { width_log2: u32, desc: PackDesc },
    /// Innermost dimension strided: `symm_pack_strided_e{2^elem_log2}`.
    Strided { elem_log2: u32, desc: PackDesc },
    /// Innermost dimension strided but another one unit-stride (a
    /// transpose): `symm_pack_tiled_e{2^elem_log2}`.
    Tiled { elem_log2: u32, desc: TileDesc },
}

/// Shape and strides (elements) with size-1 dimensions dropped and
/// mergeable neighbours merged, outermost first. `None` when a dimension
/// is empty.
pub fn collapse(shape: &[i64], strides: &[i64]) -> Option<Vec<(u64, i64)>> {
    if shape.contains(&0) {
        return None;
    }
    let mut dims: Vec<(u64, i64)> = Vec::with_capacity(shape.len());
    for (&size, &stride) in shape.iter().zip(strides) {
        if size == 1 {
            continue;
        }
        match dims.last_mut() {
            // The previous (outer) dimension steps over exactly this one.
            Some(last) if last.1 == stride.wrapping_mul(size) => {
                last.0 *= size as u64;
                last.1 = stride;
            }
            _ => dims.push((size as u64, stride)),
        }
    }
    Some(dims)
}

/// A sufficient condition for no two indices addressing the same element:
/// sorted by |stride|, each stride exceeds the span of the smaller ones.
pub fn non_overlapping(dims: &[(u64, i64)]) -> bool {
    let mut sorted: Vec<(u64, u64)> = dims.iter().map(|&(s, st)| (s, st.unsigned_abs())).collect();
    sorted.sort_by_key(|&(_, st)| st);
    let mut span: u128 = 0;
    for (size, stride) in sorted {
        if (stride as u128) <= span {
            return false;
        }
        span += stride as u128 * (size as u128 - 1);
    }
    true
}

/// log2 of the widest access (<= 16 bytes) that divides every value.
pub fn common_width_log2(values: &[u64]) -> u32 {
    values.iter().filter(|&&v| v != 0).map(|v| v.trailing_zeros()).min().unwrap_or(4).min(4)
}

/// Team size and segmentation for rows of `row_units` units.
fn segment(desc: &mut PackDesc) {
    let team = desc.row_units.next_power_of_two().clamp(1, PACK_THREADS as u64);
    desc.team_log2 = team.trailing_zeros() as i32;
    desc.seg_units = (team * UNITS_PER_THREAD).min(desc.row_units).max(1);
    desc.segs_per_row = desc.row_units.div_ceil(desc.seg_units);
}

impl PackRoute {
    /// Routes a copy between a strided tensor at `strided` (address of
    /// element [0, ..., 0]) and a contiguous row-major one at `contiguous`.
    pub fn new(
        shape: &[i64],
        strides: &[i64],
        elem_size: usize,
        strided: u64,
        contiguous: u64,
        dir: Direction,
    ) -> Result<PackRoute> {
        if shape.len() != strides.len() || shape.len() > PACK_MAX_DIMS {
            return Err(err!(
                InvalidArgument,
                "pack: rank {} with {} strides (at most {PACK_MAX_DIMS} dimensions)",
                shape.len(),
                strides.len()
            ));
        }
        if let Some(s) = shape.iter().find(|&&s| s < 0) {
            return Err(err!(InvalidArgument, "pack: negative dimension {s}"));
        }
        if !matches!(elem_size, 1 | 2 | 4 | 8) {
            return Err(err!(Unsupported, "pack: element size {elem_size} (1, 2, 4 or 8 bytes)"));
        }
        let Some(dims) = collapse(shape, strides) else {
            return Ok(PackRoute::Empty);
        };
        let es = elem_size as u64;
        let total = dims.iter().try_fold(es, |acc, &(s, _)| acc.checked_mul(s));
        let Some(total) = total.filter(|&t| t <= isize::MAX as u64) else {
            return Err(err!(InvalidArgument, "pack: tensor of shape {shape:?} is too large"));
        };
        if strided == 0 || contiguous == 0 {
            return Err(err!(InvalidArgument, "pack: NULL pointer"));
        }
        if strided % es != 0 || contiguous % es != 0 {
            return Err(err!(InvalidArgument, "pack: pointers must be aligned to the element size {elem_size}"));
        }
        let span_limit = i64::MAX as i128;
        if dims.iter().any(|&(s, st)| (st as i128 * es as i128 * s as i128).abs() > span_limit) {
            return Err(err!(InvalidArgument, "pack: strides {strides:?} are too large"));
        }
        if dir == Direction::Unpack && !non_overlapping(&dims) {
            return Err(err!(
                InvalidArgument,
                "unpack: the strided output (shape {shape:?}, strides {strides:?}) has overlapping elements"
            ));
        }
        match dims.as_slice() {
            [] | [(_, 1)] => return Ok(PackRoute::Copy { bytes: total as usize }),
            _ => {}
        }
        let (inner_len, inner_stride) = *dims.last().expect("non-empty");
        let outer = &dims[..dims.len() - 1];
        let mut desc = PackDesc {
            rows: outer.iter().map(|&(s, _)| s).product(),
            outer_ndim: outer.len() as i32,
            ..PackDesc::default()
        };
        for (i, &(s, st)) in outer.iter().enumerate() {
            desc.outer_shape[i] = s;
            desc.outer_stride[i] = st * es as i64;
        }
        if inner_stride == 1 {
            let row_bytes = inner_len * es;
            let mut vals = vec![row_bytes, strided, contiguous];
            vals.extend(outer.iter().map(|&(_, st)| (st * es as i64).unsigned_abs()));
            let width_log2 = common_width_log2(&vals);
            desc.row_units = row_bytes >> width_log2;
            segment(&mut desc);
            Ok(PackRoute::Rows { width_log2, desc })
        } else if let Some(d) = outer.iter().position(|&(_, st)| st.unsigned_abs() == 1) {
            Ok(PackRoute::Tiled { elem_log2: es.trailing_zeros(), desc: tile_desc(&dims, d, es as i64, dir) })
        } else {
            desc.row_units = inner_len;
            desc.inner_stride = inner_stride * es as i64;
            segment(&mut desc);
            Ok(PackRoute::Strided { elem_log2: es.trailing_zeros(), desc })
        }
    }
}

/// The transpose of collapsed `dims` whose outer dimension `d` has unit
/// stride on the strided side: the tile plane is (d, innermost), the other
/// outer dimensions are the batch. Strides in bytes (`es` per element).
fn tile_desc(dims: &[(u64, i64)], d: usize, es: i64, dir: Direction) -> TileDesc {
    // Row-major strides of the contiguous side.
    let mut contig = vec![0i64; dims.len()];
    let mut acc = 1i64;
    for (c, &(size, _)) in contig.iter_mut().zip(dims).rev() {
        *c = acc;
        acc *= size as i64;
    }
    let inner = dims.len() - 1;
    let strided = |k: usize| dims[k].1 * es;
    let contiguous = |k: usize| contig[k] * es;
    let (read, write): (&dyn Fn(usize) -> i64, &dyn Fn(usize) -> i64) = match dir {
        Direction::Pack => (&strided, &contiguous),
        Direction::Unpack => (&contiguous, &strided),
    };
    let (ni, nj) = (dims[d].0, dims[inner].0);
    let mut t = TileDesc {
        ni,
        nj,
        rs_i: read(d),
        rs_j: read(inner),
        ws_i: write(d),
        ws_j: write(inner),
        tiles_i: ni.div_ceil(TILE_DIM as u64),
        tiles_j: nj.div_ceil(TILE_DIM as u64),
        batch: 1,
        // The strided side is unit-stride along i, the contiguous side along j.
        read_fast_i: (dir == Direction::Pack).into(),
        write_fast_i: (dir == Direction::Unpack).into(),
        ..TileDesc::default()
    };
    for (n, k) in (0..inner).filter(|&k| k != d).enumerate() {
        t.batch_shape[n] = dims[k].0;
        t.batch_rs[n] = read(k);
        t.batch_ws[n] = write(k);
        t.batch *= dims[k].0;
        t.batch_ndim += 1;
    }
    t
}

/// Grid for `desc`: one team per segment, capped at
/// [`PACK_BLOCKS_PER_SM`] blocks per SM and at `max_blocks`, at least 1.
pub fn pack_grid(desc: &PackDesc, sm_count: u32, max_blocks: Option<u32>) -> u32 {
    let teams_per_block = (PACK_THREADS >> desc.team_log2).max(1) as u64;
    let needed = desc.rows.saturating_mul(desc.segs_per_row).div_ceil(teams_per_block);
    let resident = sm_count.max(1) as u64 * PACK_BLOCKS_PER_SM as u64;
    let cap = max_blocks.map_or(resident, |b| resident.min(b as u64));
    needed.min(cap).max(1) as u32
}

/// Grid for a transpose: one block per tile, capped like [`pack_grid`].
pub fn tile_grid(desc: &TileDesc, sm_count: u32, max_blocks: Option<u32>) -> u32 {
    let needed = desc.batch.saturating_mul(desc.tiles_i).saturating_mul(desc.tiles_j);
    let resident = sm_count.max(1) as u64 * PACK_BLOCKS_PER_SM as u64;
    let cap = max_blocks.map_or(resident, |b| resident.min(b as u64));
    needed.min(cap).max(1) as u32
}

/// Gathers the strided tensor at `src` (shape and `src_strides` in
/// elements, `src` = address of element [0, ..., 0]) into the contiguous
/// row-major buffer `dst`, on `stream`. The two must not overlap.
#[allow(clippy::too_many_arguments)]
pub fn pack(
    kernels: &Kernels,
    src: u64,
    shape: &[i64],
    src_strides: &[i64],
    elem_size: usize,
    dst: u64,
    max_blocks: Option<u32>,
    stream: Stream,
) -> Result<()> {
    let route = PackRoute::new(shape, src_strides, elem_size, src, dst, Direction::Pack)?;
    run(kernels, &route, src, dst, Direction::Pack, max_blocks, stream)
}

/// Scatters the contiguous row-major buffer `src` into the strided tensor
/// at `dst` (shape and `dst_strides` in elements), on `stream`. The strided
/// tensor must not have overlapping elements (checked conservatively), and
/// the two buffers must not overlap.
#[allow(clippy::too_many_arguments)]
pub fn unpack(
    kernels: &Kernels,
    src: u64,
    dst: u64,
    shape: &[i64],
    dst_strides: &[i64],
    elem_size: usize,
    max_blocks: Option<u32>,
    stream: Stream,
) -> Result<()> {
    let route = PackRoute::new(shape, dst_strides, elem_size, dst, src, Direction::Unpack)?;
    run(kernels, &route, src, dst, Direction::Unpack, max_blocks, stream)
}

fn run(
    kernels: &Kernels,
    route: &PackRoute,
    src: u64,
    dst: u64,
    dir: Direction,
    max_blocks: Option<u32>,
    stream: Stream,
) -> Result<()> {
    if max_blocks == Some(0) {
        return Err(err!(InvalidArgument, "pack max_blocks must be at least 1"));
    }
    let (f, desc) = match route {
        PackRoute::Empty => return Ok(()),
        PackRoute::Copy { bytes } => {
            kernels.ctx.bind_to_thread().map_err(|e| cuda_err(e, "making the context current"))?;
            // SAFETY: both buffers hold `bytes` (the caller's contract).
            return check(unsafe { sys::cuMemcpyAsync(dst, src, *bytes, stream.0 as sys::CUstream) }, "cuMemcpyAsync");
        }
        PackRoute::Rows { width_log2, desc } => (&kernels.pack_rows[*width_log2 as usize], desc),
        PackRoute::Strided { elem_log2, desc } => (&kernels.pack_strided[*elem_log2 as usize], desc),
        PackRoute::Tiled { elem_log2, desc } => {
            let f = &kernels.pack_tiled[*elem_log2 as usize];
            let grid = tile_grid(desc, kernels.sm_count, max_blocks);
            let (mut src, mut dst, mut desc) = (src, dst, *desc);
            let mut params: [*mut c_void; 3] = [arg(&mut src), arg(&mut dst), arg(&mut desc)];
            // SAFETY: the parameters match symm_pack_tiled_*'s signature
            // (TileDesc mirrors symm_tile_desc) and live until the launch returns.
            return unsafe {
                kernels.launch(f, grid, (TILE_DIM, TILE_ROWS, 1), stream, &mut params, "the transpose kernel")
            };
        }
    };
    let grid = pack_grid(desc, kernels.sm_count, max_blocks);
    let (mut src, mut dst, mut desc) = (src, dst, *desc);
    let mut scatter: i32 = (dir == Direction::Unpack).into();
    let mut params: [*mut c_void; 4] = [arg(&mut src), arg(&mut dst), arg(&mut desc), arg(&mut scatter)];
    // SAFETY: the parameters match symm_pack_*'s signature (kernels/pack.cu;
    // PackDesc mirrors symm_pack_desc) and live until the launch returns.
    unsafe { kernels.launch(f, grid, (PACK_THREADS, 1, 1), stream, &mut params, "the pack kernel") }
}

/// Throughput of the row and strided paths (bench/copy_kernels.rs).
pub(crate) fn bench_pack_bandwidth() {
    use super::gpu_testing::{gpu, time_ms};
    let Some(g) = gpu() else { return };
    let cases: &[(&str, &[i64], &[i64])] = &[
        ("rows 16B", &[8192, 8192], &[8192 + 64, 1]),
        ("rows 4B", &[8192, 8190], &[8192, 1]),
        ("blocks", &[8, 1024, 8192], &[8192, 65536, 1]),
        ("transpose", &[8192, 8192], &[1, 8192]),
        ("strided", &[8192, 4096], &[8192, 2]),
    ];
    for (name, shape, strides) in cases {
        let n: i64 = shape.iter().product();
        let span = shape.iter().zip(*strides).map(|(s, st)| (s - 1) * st.abs()).sum::<i64>() + 1;
        let src = g.alloc(span as usize * 2);
        let dst = g.alloc(n as usize * 2);
        let ms =
            time_ms(&g, 3, 20, || pack(&g.kernels, src.ptr, shape, strides, 2, dst.ptr, None, g.stream()).unwrap());
        let gb = (2 * n * 2) as f64 / 1e9;
        eprintln!("pack bf16 {name} {shape:?}: {ms:.3} ms, {:.0} GB/s (read + write)", gb / (ms as f64 / 1e3));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::ErrorKind;

    /// Host model of the kernels: executes a route on byte buffers, so the
    /// routing logic is checked end to end against a naive strided copy.
    fn execute(route: &PackRoute, strided: &mut [u8], sbase: usize, contig: &mut [u8], dir: Direction) {
        let (desc, unit, inner) = match route {
            PackRoute::Empty => return,
            PackRoute::Tiled { elem_log2, desc: t } => {
                let e = 1usize << elem_log2;
                assert_eq!(t.tiles_i, t.ni.div_ceil(32));
                assert_eq!(t.tiles_j, t.nj.div_ceil(32));
                for mut b in 0..t.batch {
                    let (mut ro, mut wo) = (0i64, 0i64);
                    for k in (0..t.batch_ndim as usize).rev() {
                        let idx = (b % t.batch_shape[k]) as i64;
                        ro += idx * t.batch_rs[k];
                        wo += idx * t.batch_ws[k];
                        b /= t.batch_shape[k];
                    }
                    // The fast dimension of each side has unit stride.
                    assert_eq!(if t.read_fast_i == 1 { t.rs_i } else { t.rs_j }.unsigned_abs(), e as u64);
                    assert_eq!(if t.write_fast_i == 1 { t.ws_i } else { t.ws_j }.unsigned_abs(), e as u64);
                    for i in 0..t.ni as i64 {
                        for j in 0..t.nj as i64 {
                            let r = ro + i * t.rs_i + j * t.rs_j;
                            let w = wo + i * t.ws_i + j * t.ws_j;
                            match dir {
                                Direction::Pack => {
                                    let s = (sbase as i64 + r) as usize;
                                    contig[w as usize..w as usize + e].copy_from_slice(&strided[s..s + e]);
                                }
                                Direction::Unpack => {
                                    let s = (sbase as i64 + w) as usize;
                                    strided[s..s + e].copy_from_slice(&contig[r as usize..r as usize + e]);
                                }
                            }
                        }
                    }
                }
                return;
            }
            PackRoute::Copy { bytes } => {
                match dir {
                    Direction::Pack => contig[..*bytes].copy_from_slice(&strided[sbase..sbase + bytes]),
                    Direction::Unpack => strided[sbase..sbase + bytes].copy_from_slice(&contig[..*bytes]),
                }
                return;
            }
            PackRoute::Rows { width_log2, desc } => (desc, 1usize << width_log2, None),
            PackRoute::Strided { elem_log2, desc } => (desc, 1usize << elem_log2, Some(desc.inner_stride)),
        };
        // Every team-sized slice of every segment, like the kernel.
        let total = desc.rows * desc.segs_per_row;
        for u in 0..total {
            let (row, seg) = (u / desc.segs_per_row, u % desc.segs_per_row);
            let mut r = row;
            let mut off = 0i64;
            for k in (0..desc.outer_ndim as usize).rev() {
                off += (r % desc.outer_shape[k]) as i64 * desc.outer_stride[k];
                r /= desc.outer_shape[k];
            }
            let first = seg * desc.seg_units;
            let end = (first + desc.seg_units).min(desc.row_units);
            for c in first..end {
                let step = inner.unwrap_or(unit as i64);
                let s = (sbase as i64 + off + c as i64 * step) as usize;
                let t = (row * desc.row_units + c) as usize * unit;
                assert_eq!(s % unit, (sbase % unit), "strided access misaligned");
                assert_eq!(t % unit, 0, "contiguous access misaligned");
                match dir {
                    Direction::Pack => contig[t..t + unit].copy_from_slice(&strided[s..s + unit]),
                    Direction::Unpack => strided[s..s + unit].copy_from_slice(&contig[t..t + unit]),
                }
            }
        }
    }

    /// Offset (elements) of each logical index, row-major enumeration.
    fn offsets(shape: &[i64], strides: &[i64]) -> Vec<i64> {
        let n: i64 = shape.iter().product();
        (0..n)
            .map(|mut lin| {
                let mut off = 0;
                for d in (0..shape.len()).rev() {
                    off += (lin % shape[d]) * strides[d];
                    lin /= shape[d];
                }
                off
            })
            .collect()
    }

    fn check_roundtrip(shape: &[i64], strides: &[i64], es: usize) -> PackRoute {
        let offs = offsets(shape, strides);
        let (lo, hi) = (offs.iter().copied().min().unwrap_or(0), offs.iter().copied().max().unwrap_or(0));
        // Base so that negative strides stay in bounds; 256-aligned.
        let base = ((-lo).max(0) as usize * es).div_ceil(256) * 256;
        let len = base + (hi.max(0) as usize + 1) * es + 64;
        let n = offs.len();
        let mut strided: Vec<u8> = (0..len).map(|i| (i * 31 + 7) as u8).collect();
        let mut contig = vec![0u8; n * es];
        // Fake device addresses with the same alignment as the host buffers' offsets.
        let route = PackRoute::new(shape, strides, es, 0x10_0000 + base as u64, 0x20_0000, Direction::Pack).unwrap();
        execute(&route, &mut strided, base, &mut contig, Direction::Pack);
        for (i, &o) in offs.iter().enumerate() {
            let s = (base as i64 + o * es as i64) as usize;
            assert_eq!(contig[i * es..(i + 1) * es], strided[s..s + es], "pack {shape:?} {strides:?} element {i}");
        }
        // Unpack the reverse into a fresh buffer (only when non-overlapping).
        let dims = collapse(shape, strides).unwrap_or_default();
        if non_overlapping(&dims) {
            let contig2: Vec<u8> = (0..n * es).map(|i| (i * 13 + 1) as u8).collect();
            let mut out = vec![0u8; len];
            let route2 =
                PackRoute::new(shape, strides, es, 0x10_0000 + base as u64, 0x20_0000, Direction::Unpack).unwrap();
            execute(&route2, &mut out, base, &mut contig2.clone(), Direction::Unpack);
            for (i, &o) in offs.iter().enumerate() {
                let s = (base as i64 + o * es as i64) as usize;
                assert_eq!(out[s..s + es], contig2[i * es..(i + 1) * es], "unpack {shape:?} {strides:?} element {i}");
            }
        }
        route
    }

    #[test]
    fn collapsing() {
        assert_eq!(collapse(&[2, 3, 4], &[12, 4, 1]), Some(vec![(24, 1)]));
        assert_eq!(collapse(&[2, 1, 4], &[4, 99, 1]), Some(vec![(8, 1)]));
        assert_eq!(collapse(&[2, 3, 4], &[24, 4, 1]), Some(vec![(2, 24), (12, 1)]));
        assert_eq!(collapse(&[3, 4], &[1, 3]), Some(vec![(3, 1), (4, 3)]));
        assert_eq!(collapse(&[2, 0, 4], &[4, 4, 1]), None);
        assert_eq!(collapse(&[1, 1], &[5, 7]), Some(vec![]));
        assert_eq!(collapse(&[4, 5], &[-5, -1]), Some(vec![(20, -1)]));
    }

    #[test]
    fn overlap() {
        assert!(non_overlapping(&[(4, 8), (8, 1)]));
        assert!(non_overlapping(&[(8, 1), (4, 8)]));
        assert!(!non_overlapping(&[(4, 0)]));
        assert!(!non_overlapping(&[(2, 1), (3, 1)]));
        assert!(!non_overlapping(&[(4, 4), (8, 1)]));
        assert!(non_overlapping(&[(4, -8), (8, 1)]));
    }

    #[test]
    fn widths() {
        assert_eq!(common_width_log2(&[64, 0x1000, 0x2000]), 4);
        assert_eq!(common_width_log2(&[24, 0x1000]), 3);
        assert_eq!(common_width_log2(&[64, 0x1004]), 2);
        assert_eq!(common_width_log2(&[6, 0x1000]), 1);
        assert_eq!(common_width_log2(&[]), 4);
    }

    #[test]
    fn routes() {
        // Contiguous: one memcpy.
        let p = PackRoute::new(&[4, 8], &[8, 1], 2, 0x1000, 0x2000, Direction::Pack).unwrap();
        assert_eq!(p, PackRoute::Copy { bytes: 64 });
        // Empty.
        assert_eq!(PackRoute::new(&[4, 0], &[8, 1], 2, 0x1000, 0x2000, Direction::Pack).unwrap(), PackRoute::Empty);
        // Scalar (rank 0) and all-ones shapes copy one element.
        assert_eq!(PackRoute::new(&[], &[], 4, 0x1000, 0x2000, Direction::Pack).unwrap(), PackRoute::Copy { bytes: 4 });
        // Padded rows of 16-byte multiples: 16-byte accesses.
        match PackRoute::new(&[4, 8], &[16, 1], 2, 0x1000, 0x2000, Direction::Pack).unwrap() {
            PackRoute::Rows { width_log2: 4, desc } => {
                assert_eq!((desc.rows, desc.row_units, desc.outer_ndim), (4, 1, 1));
                assert_eq!(desc.outer_stride[0], 32);
            }
            p => panic!("{p:?}"),
        }
        // Rows of 3 floats: 4-byte accesses.
        assert!(matches!(
            PackRoute::new(&[4, 3], &[5, 1], 4, 0x1000, 0x2000, Direction::Pack).unwrap(),
            PackRoute::Rows { width_log2: 2, .. }
        ));
        // A misaligned base lowers the width.
        assert!(matches!(
            PackRoute::new(&[4, 8], &[16, 1], 2, 0x1002, 0x2000, Direction::Pack).unwrap(),
            PackRoute::Rows { width_log2: 1, .. }
        ));
        // Transposed: tiles over (dim 0, dim 1).
        match PackRoute::new(&[3, 4], &[1, 3], 4, 0x1000, 0x2000, Direction::Pack).unwrap() {
            PackRoute::Tiled { elem_log2: 2, desc } => {
                assert_eq!((desc.ni, desc.nj, desc.batch), (3, 4, 1));
                assert_eq!((desc.rs_i, desc.rs_j, desc.ws_i, desc.ws_j), (4, 12, 16, 4));
                assert_eq!((desc.read_fast_i, desc.write_fast_i), (1, 0));
            }
            p => panic!("{p:?}"),
        }
        match PackRoute::new(&[3, 4], &[1, 3], 4, 0x1000, 0x2000, Direction::Unpack).unwrap() {
            PackRoute::Tiled { desc, .. } => {
                assert_eq!((desc.rs_i, desc.rs_j, desc.ws_i, desc.ws_j), (16, 4, 4, 12));
                assert_eq!((desc.read_fast_i, desc.write_fast_i), (0, 1));
            }
            p => panic!("{p:?}"),
        }
        // A batch of transposes: [b, k, m] stored as [b, m, k].
        match PackRoute::new(&[5, 6, 7], &[42, 1, 6], 2, 0x1000, 0x2000, Direction::Pack).unwrap() {
            PackRoute::Tiled { desc, .. } => {
                assert_eq!((desc.ni, desc.nj, desc.batch, desc.batch_ndim), (6, 7, 5, 1));
                assert_eq!((desc.batch_rs[0], desc.batch_ws[0]), (84, 84));
            }
            p => panic!("{p:?}"),
        }
        // No unit stride anywhere: strided elements (here one row of every other element).
        match PackRoute::new(&[3, 4], &[8, 2], 4, 0x1000, 0x2000, Direction::Pack).unwrap() {
            PackRoute::Strided { elem_log2: 2, desc } => {
                assert_eq!((desc.rows, desc.row_units, desc.inner_stride), (1, 12, 8));
            }
            p => panic!("{p:?}"),
        }
        // Long rows are split into segments; short rows share a block.
        match PackRoute::new(&[2, 100_000], &[100_008, 1], 2, 0x1000, 0x2000, Direction::Pack).unwrap() {
            PackRoute::Rows { width_log2: 4, desc } => {
                assert_eq!(desc.row_units, 12_500);
                assert_eq!(desc.team_log2, 8);
                assert_eq!(desc.seg_units, 256 * UNITS_PER_THREAD);
                assert_eq!(desc.segs_per_row, 12_500u64.div_ceil(1024));
            }
            p => panic!("{p:?}"),
        }
    }

    #[test]
    fn errors() {
        let e = |r: Result<PackRoute>| r.unwrap_err().kind;
        assert_eq!(e(PackRoute::new(&[2, 3], &[3], 4, 0x1000, 0x2000, Direction::Pack)), ErrorKind::InvalidArgument);
        assert_eq!(e(PackRoute::new(&[1; 9], &[1; 9], 4, 0x1000, 0x2000, Direction::Pack)), ErrorKind::InvalidArgument);
        assert_eq!(
            e(PackRoute::new(&[2, -1], &[1, 1], 4, 0x1000, 0x2000, Direction::Pack)),
            ErrorKind::InvalidArgument
        );
        assert_eq!(e(PackRoute::new(&[2, 3], &[3, 1], 3, 0x1000, 0x2000, Direction::Pack)), ErrorKind::Unsupported);
        assert_eq!(e(PackRoute::new(&[2, 3], &[3, 2], 4, 0x1002, 0x2000, Direction::Pack)), ErrorKind::InvalidArgument);
        assert_eq!(e(PackRoute::new(&[2, 3], &[3, 2], 4, 0, 0x2000, Direction::Pack)), ErrorKind::InvalidArgument);
        // Broadcast input is fine to gather, not to scatter into.
        PackRoute::new(&[4, 3], &[0, 1], 4, 0x1000, 0x2000, Direction::Pack).unwrap();
        assert_eq!(
            e(PackRoute::new(&[4, 3], &[0, 1], 4, 0x1000, 0x2000, Direction::Unpack)),
            ErrorKind::InvalidArgument
        );
    }

    #[test]
    fn roundtrips_match_a_naive_copy() {
        let cases: &[(&[i64], &[i64])] = &[
            (&[4, 8], &[8, 1]),
            (&[4, 8], &[16, 1]),
            (&[4, 3], &[5, 1]),
            (&[3, 4], &[1, 3]),
            (&[2, 3, 4], &[24, 4, 1]),
            (&[2, 3, 4], &[1, 2, 6]),
            (&[2, 3, 4, 5], &[120, 40, 5, 1]),
            (&[2, 3, 4, 5], &[60, 1, 15, 3]),
            (&[5, 7], &[-7, 1]),
            (&[5, 7], &[7, -1]),
            (&[4, 3], &[0, 1]),
            (&[2, 1, 3, 1, 2], &[12, 99, 4, 99, 1]),
            (&[3, 1000], &[1003, 1]),
            (&[2, 2, 2, 2, 2, 2, 2, 3], &[256, 128, 64, 32, 16, 8, 4, 1]),
            (&[], &[]),
            (&[3, 4], &[8, 2]),
            (&[5, 6, 7], &[42, 1, 6]),
            (&[40, 70], &[1, -40]),
            (&[2, 3, 40, 5, 70], &[42000, 1, 1050, 14000, 15]),
            (&[4, 33, 2, 65], &[1, 520, 4, 8]),
        ];
        for es in [1usize, 2, 4, 8] {
            for (shape, strides) in cases {
                check_roundtrip(shape, strides, es);
            }
        }
    }

    #[test]
    fn grids() {
        let mut d = PackDesc { rows: 1000, row_units: 1, ..PackDesc::default() };
        segment(&mut d);
        assert_eq!((d.team_log2, d.seg_units, d.segs_per_row), (0, 1, 1));
        // 256 single-unit rows per block.
        assert_eq!(pack_grid(&d, 132, None), 4);
        d = PackDesc { rows: 1, row_units: 1 << 24, ..PackDesc::default() };
        segment(&mut d);
        assert_eq!(pack_grid(&d, 132, None), 132 * PACK_BLOCKS_PER_SM);
        assert_eq!(pack_grid(&d, 132, Some(8)), 8);
        d = PackDesc { rows: 0, row_units: 0, ..PackDesc::default() };
        segment(&mut d);
        assert_eq!(pack_grid(&d, 132, None), 1);
    }

    // ---- on a GPU (pass vacuously without one) ----

    use crate::backend::cuda::gpu_testing::{gpu, Gpu};

    /// pack and unpack on the GPU against a naive host copy. `shift` bytes
    /// (a multiple of the element size) move the strided base off 256-byte
    /// alignment.
    fn check_gpu(g: &Gpu, shape: &[i64], strides: &[i64], es: usize, shift: usize, max_blocks: Option<u32>) {
        let offs = offsets(shape, strides);
        let (lo, hi) = (offs.iter().copied().min().unwrap_or(0), offs.iter().copied().max().unwrap_or(0));
        let base = ((-lo).max(0) as usize * es).div_ceil(256) * 256 + shift;
        let len = base + (hi.max(0) as usize + 1) * es + 64;
        let n = offs.len();
        let what = format!("shape {shape:?} strides {strides:?} es {es} shift {shift} blocks {max_blocks:?}");
        let init: Vec<u8> = (0..len).map(|i| (i * 31 + 7) as u8).collect();
        let strided = g.upload(&init);
        let contig = g.alloc(n * es + 16);
        pack(&g.kernels, strided.ptr + base as u64, shape, strides, es, contig.ptr, max_blocks, g.stream()).unwrap();
        g.sync();
        let got = contig.read_bytes();
        for (i, &o) in offs.iter().enumerate() {
            let s = (base as i64 + o * es as i64) as usize;
            assert_eq!(got[i * es..(i + 1) * es], init[s..s + es], "pack {what}: element {i}");
        }
        if non_overlapping(&collapse(shape, strides).unwrap_or_default()) {
            let data: Vec<u8> = (0..n * es).map(|i| (i * 13 + 1) as u8).collect();
            contig.write(&data);
            unpack(&g.kernels, contig.ptr, strided.ptr + base as u64, shape, strides, es, max_blocks, g.stream())
                .unwrap();
            g.sync();
            let mut want = init.clone();
            for (i, &o) in offs.iter().enumerate() {
                let s = (base as i64 + o * es as i64) as usize;
                want[s..s + es].copy_from_slice(&data[i * es..(i + 1) * es]);
            }
            assert!(strided.read_bytes() == want, "unpack {what}");
        }
    }

    #[test]
    fn gpu_pack_matches_host() {
        let Some(g) = gpu() else { return };
        let cases: &[(&[i64], &[i64])] = &[
            (&[4, 8], &[8, 1]),
            (&[4, 8], &[16, 1]),
            (&[4, 3], &[5, 1]),
            (&[3, 4], &[1, 3]),
            (&[2, 3, 4], &[1, 2, 6]),
            (&[2, 3, 4, 5], &[60, 1, 15, 3]),
            (&[5, 7], &[-7, 1]),
            (&[5, 7], &[7, -1]),
            (&[4, 3], &[0, 1]),
            (&[2, 1, 3, 1, 2], &[12, 99, 4, 99, 1]),
            (&[2, 2, 2, 2, 2, 2, 2, 3], &[256, 128, 64, 32, 16, 8, 4, 1]),
            (&[], &[]),
            // Larger: padded rows (vector path), long rows (segments),
            // a transpose (strided path), a gathered block layout.
            (&[64, 1000], &[1024, 1]),
            (&[3, 100_000], &[100_008, 1]),
            (&[300, 257], &[1, 300]),
            (&[4, 96, 130], &[130, 520, 1]),
            (&[100_000, 3], &[4, 1]),
            (&[3, 4], &[8, 2]),
            (&[5, 6, 7], &[42, 1, 6]),
            (&[40, 70], &[1, -40]),
            (&[2, 3, 40, 5, 70], &[42000, 1, 1050, 14000, 15]),
            (&[4, 33, 2, 65], &[1, 520, 4, 8]),
            (&[3, 1000, 3], &[3000, 1, 1000]),
        ];
        for es in [1usize, 2, 4, 8] {
            for (shape, strides) in cases {
                check_gpu(&g, shape, strides, es, 0, None);
                check_gpu(&g, shape, strides, es, es, None);
            }
            check_gpu(&g, &[3, 100_000], &[100_008, 1], es, 0, Some(1));
            check_gpu(&g, &[300, 257], &[1, 300], es, 0, Some(3));
            check_gpu(&g, &[3, 100, 200], &[20000, 1, 100], es, 0, Some(2));
        }
    }
}
