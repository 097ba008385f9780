//! The reduction of reduce-scatter on CUDA (kernels/reduce.cu):
//! `out[i] = scale * sum_{r < world} src_r[i]` for `i < n`, summed in f32 in
//! rank order, where the sources are given by a device table of `world`
//! addresses (peers' symmetric buffers as mapped here, or local chunks).
//!
//! The kernel picks 16-byte vector accesses by itself when every pointer
//! allows it (it peels up to 7 leading elements to reach alignment), so
//! callers need not care; 16-byte aligned chunk starts are simply faster.
//! The grid is sized by the SM count, and can be capped so the reduction
//! runs beside a GEMM on a few SMs.

use super::gemm::GemmDtype;
use super::module::{arg, Kernels};
use crate::backend::Stream;
use crate::error::{err, Result};
use std::ffi::c_void;

/// Element types of the reduction (the matmul's).
pub type ReduceDtype = GemmDtype;

/// Threads per block (`SYMM_REDUCE_THREADS`).
pub const REDUCE_THREADS: u32 = 256;
/// Resident blocks per SM the kernels are compiled for (`SYMM_REDUCE_MIN_BLOCKS`).
pub const REDUCE_BLOCKS_PER_SM: u32 = 4;
/// Largest `world` (`SYMM_REDUCE_MAX_WORLD`).
pub const REDUCE_MAX_WORLD: usize = 128;

/// Everything a reduction can do; [`reduce`] covers the common case.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ReduceParams {
    /// Device array of `world` u64 addresses (8-byte aligned), read by the
    /// kernel when it runs (so it may be filled by earlier stream work).
    pub srcs_table: u64,
    pub world: usize,
    /// Bytes added to every table entry: one table of buffer bases serves
    /// every chunk. A multiple of the element size.
    pub src_offset: u64,
    /// `n` elements of `dtype`; ignored (may be 0) when `acc_out` is set.
    pub out: u64,
    pub n: usize,
    pub dtype: ReduceDtype,
    pub scale: f32,
    /// 0, or `n` f32 partial sums added before scaling.
    pub acc_in: u64,
    /// 0, or where the f32 result goes instead of `out` (may equal `acc_in`).
    pub acc_out: u64,
    /// Cap on the grid (e.g. the SMs left free by a concurrent GEMM).
    pub max_blocks: Option<u32>,
}

impl ReduceParams {
    pub fn new(srcs_table: u64, world: usize, out: u64, n: usize, dtype: ReduceDtype, scale: f32) -> Self {
        ReduceParams { srcs_table, world, src_offset: 0, out, n, dtype, scale, acc_in: 0, acc_out: 0, max_blocks: None }
    }

    pub fn validate(&self) -> Result<()> {
        if self.world == 0 || self.world > REDUCE_MAX_WORLD {
            return Err(err!(InvalidArgument, "reduce over {} sources (1..={REDUCE_MAX_WORLD})", self.world));
        }
        if self.max_blocks == Some(0) {
            return Err(err!(InvalidArgument, "reduce max_blocks must be at least 1"));
        }
        if self.n == 0 {
            return Ok(());
        }
        let size = self.dtype.size() as u64;
        if self.srcs_table == 0 || self.srcs_table % 8 != 0 {
            return Err(err!(
                InvalidArgument,
                "reduce source table {:#x} is NULL or not 8-byte aligned",
                self.srcs_table
            ));
        }
        if self.src_offset % size != 0 {
            return Err(err!(InvalidArgument, "reduce src_offset {} is not a multiple of {size}", self.src_offset));
        }
        let mut ptrs = vec![("acc_in", self.acc_in, 4, true)];
        if self.acc_out != 0 {
            ptrs.push(("acc_out", self.acc_out, 4, false));
        } else {
            ptrs.push(("out", self.out, size, false));
        }
        for (name, p, align, optional) in ptrs {
            if p == 0 && !optional {
                return Err(err!(InvalidArgument, "reduce {name} is NULL"));
            }
            if p % align != 0 {
                return Err(err!(InvalidArgument, "reduce {name} = {p:#x} is not aligned to {align}"));
            }
        }
        Ok(())
    }
}

/// Elements per 16-byte vector.
pub fn vector_elems(dtype: ReduceDtype) -> usize {
    16 / dtype.size()
}

/// Grid size: one thread per 16-byte vector, at most
/// [`REDUCE_BLOCKS_PER_SM`] blocks per SM (grid-stride loops do the rest),
/// at most `max_blocks`, at least 1.
pub fn reduce_grid(n: usize, dtype: ReduceDtype, sm_count: u32, max_blocks: Option<u32>) -> u32 {
    let vectors = n.div_ceil(vector_elems(dtype)) as u64;
    let needed = vectors.div_ceil(REDUCE_THREADS as u64);
    let resident = sm_count.max(1) as u64 * REDUCE_BLOCKS_PER_SM as u64;
    let cap = max_blocks.map_or(resident, |b| resident.min(b as u64));
    needed.min(cap).max(1) as u32
}

/// `out[i] = scale * sum_r srcs_table[r][i]` for `i < n`, enqueued on
/// `stream` (a stream of `kernels`' device). `out` must not overlap the
/// sources; every pointer is aligned to the element size.
#[allow(clippy::too_many_arguments)]
pub fn reduce(
    kernels: &Kernels,
    srcs_table: u64,
    world: usize,
    out: u64,
    n: usize,
    dtype: ReduceDtype,
    scale: f32,
    max_blocks: Option<u32>,
    stream: Stream,
) -> Result<()> {
    let mut p = ReduceParams::new(srcs_table, world, out, n, dtype, scale);
    p.max_blocks = max_blocks;
    reduce_with(kernels, &p, stream)
}

/// The general form: source offset, f32 partial sums in and out.
pub fn reduce_with(kernels: &Kernels, p: &ReduceParams, stream: Stream) -> Result<()> {
    p.validate()?;
    if p.n == 0 {
        return Ok(());
    }
    let grid = reduce_grid(p.n, p.dtype, kernels.sm_count, p.max_blocks);
    let f = &kernels.reduce[p.dtype as usize];
    let mut srcs = p.srcs_table;
    let mut world = p.world as i32;
    let mut offset = p.src_offset;
    let mut out = p.out;
    let mut acc_in = p.acc_in;
    let mut acc_out = p.acc_out;
    let mut n = p.n as u64;
    let mut scale = p.scale;
    let mut params: [*mut c_void; 8] = [
        arg(&mut srcs),
        arg(&mut world),
        arg(&mut offset),
        arg(&mut out),
        arg(&mut acc_in),
        arg(&mut acc_out),
        arg(&mut n),
        arg(&mut scale),
    ];
    // SAFETY: the parameters match symm_reduce_*'s signature (kernels/reduce.cu)
    // and live until the launch returns; pointers were checked above and the
    // caller guarantees they address n elements on this device.
    unsafe { kernels.launch(f, grid, (REDUCE_THREADS, 1, 1), stream, &mut params, "the reduction kernel") }
}

/// Integers (kernels/reduce.cu, `symm_reduce_int_*`): `out[i] = (sum_r
/// srcs_table[r][i]) / divisor` for `i < n`, summed wrapping in the element
/// type, divided truncating toward zero; `kernel` is the element type's
/// (`Kernels::reduce_int`). `out` may be one of the sources.
#[allow(clippy::too_many_arguments)]
pub fn reduce_integers(
    kernels: &Kernels,
    kernel: usize,
    srcs_table: u64,
    world: usize,
    out: u64,
    n: usize,
    divisor: usize,
    stream: Stream,
) -> Result<()> {
    if world == 0 || world > REDUCE_MAX_WORLD || divisor == 0 || divisor > u32::MAX as usize {
        return Err(err!(InvalidArgument, "integer reduce over {world} sources divided by {divisor}"));
    }
    if n == 0 {
        return Ok(());
    }
    let resident = kernels.sm_count.max(1) as u64 * REDUCE_BLOCKS_PER_SM as u64;
    let grid = (n as u64).div_ceil(REDUCE_THREADS as u64).min(resident).max(1) as u32;
    let (mut srcs, mut world, mut out, mut n, mut divisor) = (srcs_table, world as i32, out, n as u64, divisor as u32);
    let mut params: [*mut c_void; 5] = [arg(&mut srcs), arg(&mut world), arg(&mut out), arg(&mut n), arg(&mut divisor)];
    // SAFETY: the parameters match symm_reduce_int_*'s signature
    // (kernels/reduce.cu) and live until the launch returns; the caller
    // guarantees the table and `out` address n elements on this device.
    unsafe {
        kernels.launch(
            &kernels.reduce_int[kernel],
            grid,
            (REDUCE_THREADS, 1, 1),
            stream,
            &mut params,
            "the integer reduction kernel",
        )
    }
}

/// Reduction of a local and a peer GPU's buffer (two GPUs): what
/// reduce-scatter's reduction sees (bench/copy_kernels.rs).
pub(crate) fn bench_reduce_peer_bandwidth() {
    use super::driver::{self, check};
    use super::gpu_testing::{gpu, time_ms};
    use cudarc::driver::sys;
    let Some(g) = gpu() else { return };
    if driver::device_count() < 2 {
        eprintln!("one GPU: peer bandwidth not measured");
        return;
    }
    let n = 64usize << 20;
    let ctx1 = driver::context(1).unwrap();
    let mut remote = 0;
    // SAFETY: device 1's context is current; out-pointer valid.
    check(unsafe { sys::cuMemAlloc_v2(&mut remote, n * 2) }, "cuMemAlloc on device 1").unwrap();
    g.ctx.bind_to_thread().unwrap();
    // SAFETY: both contexts are alive.
    let r = unsafe { sys::cuCtxEnablePeerAccess(ctx1.cu_ctx(), 0) };
    assert!(matches!(r, sys::CUresult::CUDA_SUCCESS | sys::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED));
    let local = g.alloc(n * 2);
    let out = g.alloc(n * 2);
    let table = g.upload(&[local.ptr, remote]);
    for cap in [None, Some(528), Some(264), Some(128), Some(64), Some(32)] {
        let ms = time_ms(&g, 3, 20, || {
            reduce(&g.kernels, table.ptr, 2, out.ptr, n, GemmDtype::BF16, 1.0, cap, g.stream()).unwrap()
        });
        let gbs = (n * 2) as f64 / 1e9 / (ms as f64 / 1e3);
        eprintln!("reduce bf16 local+peer n={n} blocks={cap:?}: {ms:.3} ms, {gbs:.0} GB/s read from the peer");
    }
    ctx1.bind_to_thread().unwrap();
    // SAFETY: allocated above; all work finished (time_ms synchronizes).
    unsafe { sys::cuMemFree_v2(remote) };
}

/// Bandwidth of the reduction (bench/copy_kernels.rs).
pub(crate) fn bench_reduce_bandwidth() {
    use super::gpu_testing::{gpu, time_ms, DevBuf};
    let Some(g) = gpu() else { return };
    let dtype = GemmDtype::BF16;
    for world in [2usize, 4, 8] {
        let n = (256usize << 20) / world; // 512 MiB of bf16 sources in all
        let srcs: Vec<DevBuf> = (0..world).map(|_| g.alloc(n * 2)).collect();
        let table = g.upload(&srcs.iter().map(|b| b.ptr).collect::<Vec<u64>>());
        let out = g.alloc(n * 2);
        for cap in [None, Some(32), Some(16)] {
            let ms = time_ms(&g, 3, 20, || {
                reduce(&g.kernels, table.ptr, world, out.ptr, n, dtype, 1.0, cap, g.stream()).unwrap()
            });
            let gb = ((world + 1) * n * 2) as f64 / 1e9;
            eprintln!("reduce bf16 world={world} n={n} blocks={cap:?}: {ms:.3} ms, {:.0} GB/s", gb / (ms as f64 / 1e3));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::ErrorKind;

    #[test]
    fn grid_sizes() {
        // One thread per vector for small inputs.
        assert_eq!(reduce_grid(1, GemmDtype::BF16, 132, None), 1);
        assert_eq!(reduce_grid(8 * 256, GemmDtype::BF16, 132, None), 1);
        assert_eq!(reduce_grid(8 * 256 + 1, GemmDtype::BF16, 132, None), 2);
        assert_eq!(reduce_grid(4 * 256 * 3, GemmDtype::F32, 132, None), 3);
        // Capped at the resident blocks, then at max_blocks.
        assert_eq!(reduce_grid(1 << 30, GemmDtype::F16, 132, None), 132 * REDUCE_BLOCKS_PER_SM);
        assert_eq!(reduce_grid(1 << 30, GemmDtype::F16, 132, Some(16)), 16);
        assert_eq!(reduce_grid(1 << 30, GemmDtype::F16, 132, Some(100_000)), 132 * REDUCE_BLOCKS_PER_SM);
        assert_eq!(reduce_grid(100, GemmDtype::F16, 132, Some(16)), 1);
        // Never zero.
        assert_eq!(reduce_grid(0, GemmDtype::F32, 0, None), 1);
    }

    #[test]
    fn vector_widths() {
        assert_eq!(vector_elems(GemmDtype::F32), 4);
        assert_eq!(vector_elems(GemmDtype::BF16), 8);
        assert_eq!(vector_elems(GemmDtype::F16), 8);
    }

    #[test]
    fn validation() {
        let ok = ReduceParams::new(0x1000, 2, 0x2000, 100, GemmDtype::BF16, 0.5);
        ok.validate().unwrap();
        let bad = |f: &dyn Fn(&mut ReduceParams)| {
            let mut p = ok;
            f(&mut p);
            assert_eq!(p.validate().unwrap_err().kind, ErrorKind::InvalidArgument, "{p:?}");
        };
        bad(&|p| p.world = 0);
        bad(&|p| p.world = REDUCE_MAX_WORLD + 1);
        bad(&|p| p.srcs_table = 0);
        bad(&|p| p.srcs_table = 0x1004);
        bad(&|p| p.out = 0);
        bad(&|p| p.out = 0x2001);
        bad(&|p| p.src_offset = 3);
        bad(&|p| p.acc_in = 0x3002);
        bad(&|p| p.max_blocks = Some(0));
        // f32 result instead of out: out may be NULL.
        let mut p = ok;
        (p.out, p.acc_out, p.acc_in) = (0, 0x4000, 0x4000);
        p.validate().unwrap();
        p.acc_out = 0x4002;
        assert!(p.validate().is_err());
        // Nothing to do: only world is checked.
        let p = ReduceParams::new(0, 4, 0, 0, GemmDtype::F32, 1.0);
        p.validate().unwrap();
    }

    // ---- on a GPU (pass vacuously without one) ----

    use crate::backend::cuda::gpu_testing::{decode, encode, gpu, values, DevBuf, Gpu};

    #[derive(Clone, Copy, Debug, PartialEq)]
    enum Mode {
        Out,
        AccIn,
        AccOutInPlace,
    }

    /// One reduction on the GPU against the host: `world` sources of
    /// `off + n` elements reduced from element `off`, output `shift`
    /// elements past a 256-aligned base. Bitwise equality: both sides sum
    /// in f32 in rank order and round once.
    fn check_reduce(g: &Gpu, dtype: GemmDtype, world: usize, n: usize, off: usize, shift: usize, mode: Mode) {
        let size = dtype.size();
        let scale = 1.0 / world as f32;
        // Values representable in dtype, so host and device start equal.
        let srcs: Vec<Vec<f32>> =
            (0..world).map(|r| decode(dtype, &encode(dtype, &values(off + n, r as u64 * 7919 + n as u64)))).collect();
        let bufs: Vec<DevBuf> = srcs.iter().map(|v| g.upload(&encode(dtype, v))).collect();
        let table: Vec<u64> = bufs.iter().map(|b| b.ptr).collect();
        let table = g.upload(&table);
        let acc0 = values(n, 99);
        let mut expect = vec![0f32; n];
        for (i, e) in expect.iter_mut().enumerate() {
            let mut s = if mode == Mode::Out { 0.0 } else { acc0[i] };
            for src in &srcs {
                s += src[off + i];
            }
            *e = s * scale;
        }
        let mut p = ReduceParams::new(table.ptr, world, 0, n, dtype, scale);
        p.src_offset = (off * size) as u64;
        let out = g.alloc((n + shift) * size.max(4));
        let acc = g.upload(&acc0);
        match mode {
            Mode::Out => p.out = out.ptr + (shift * size) as u64,
            Mode::AccIn => {
                p.out = out.ptr + (shift * size) as u64;
                p.acc_in = acc.ptr;
            }
            Mode::AccOutInPlace => (p.acc_in, p.acc_out) = (acc.ptr, acc.ptr),
        }
        reduce_with(&g.kernels, &p, g.stream()).unwrap();
        g.sync();
        let what = format!("{dtype:?} world={world} n={n} off={off} shift={shift} {mode:?}");
        if mode == Mode::AccOutInPlace {
            let got: Vec<f32> = acc.read(n);
            for i in 0..n {
                assert_eq!(got[i].to_bits(), expect[i].to_bits(), "{what}: element {i}");
            }
        } else {
            let bytes = out.read_bytes();
            let got = &bytes[shift * size..(shift + n) * size];
            let want = encode(dtype, &expect);
            if got != want.as_slice() {
                let (g, w) = (decode(dtype, got), decode(dtype, &want));
                let i = (0..n).find(|&i| g[i].to_bits() != w[i].to_bits()).unwrap();
                panic!("{what}: element {i}: got {} want {}", g[i], w[i]);
            }
        }
    }

    #[test]
    fn gpu_reduce_matches_host() {
        let Some(g) = gpu() else { return };
        for dtype in [GemmDtype::F32, GemmDtype::BF16, GemmDtype::F16] {
            for world in [1, 2, 3, 4, 5, 8] {
                // (n, source offset, output shift): aligned, tails, peeled
                // heads, and misalignments that force the scalar path.
                for (n, off, shift) in
                    [(1, 0, 0), (7, 0, 0), (8, 0, 0), (1000, 3, 3), (4099, 0, 0), (4099, 5, 0), (100_003, 1, 1)]
                {
                    check_reduce(&g, dtype, world, n, off, shift, Mode::Out);
                }
                check_reduce(&g, dtype, world, 1 << 20, 0, 0, Mode::Out);
                check_reduce(&g, dtype, world, 10_007, 2, 0, Mode::AccIn);
                check_reduce(&g, dtype, world, 10_007, 0, 0, Mode::AccOutInPlace);
                check_reduce(&g, dtype, world, 10_007, 3, 0, Mode::AccOutInPlace);
            }
        }
    }

    #[test]
    fn gpu_reduce_capped_grid_and_graph_replay() {
        let Some(g) = gpu() else { return };
        let (n, world, dtype) = (300_001usize, 4usize, GemmDtype::BF16);
        let srcs: Vec<DevBuf> = (0..world).map(|r| g.upload(&encode(dtype, &values(n, r as u64)))).collect();
        let table = g.upload(&srcs.iter().map(|b| b.ptr).collect::<Vec<u64>>());
        let out = g.alloc(n * 2);
        reduce(&g.kernels, table.ptr, world, out.ptr, n, dtype, 1.0, Some(1), g.stream()).unwrap();
        g.sync();
        let one_block = out.read_bytes();
        out.write(&vec![0u8; n * 2]);
        crate::backend::cuda::gpu_testing::capture_and_replay(&g, 3, || {
            reduce(&g.kernels, table.ptr, world, out.ptr, n, dtype, 1.0, None, g.stream()).unwrap();
        });
        assert!(out.read_bytes() == one_block, "grid size or graph replay changed the result");
    }

    /// The integer kernels against i128 arithmetic on the host: sums that
    /// wrap, negative averages truncated toward zero, in place (`out` the
    /// first source), outputs poisoned.
    #[test]
    fn gpu_reduce_integers_wrap_and_truncate() {
        let Some(g) = gpu() else { return };
        // (kernel index, bytes, signed)
        for (kernel, size, signed) in [(0usize, 1usize, true), (1, 1, false), (2, 4, true), (3, 8, true)] {
            let bits = 8 * size as u32;
            let wrap = |v: i128| -> i128 {
                let m = v.rem_euclid(1i128 << bits);
                if signed && m >= 1i128 << (bits - 1) {
                    m - (1i128 << bits)
                } else {
                    m
                }
            };
            let to_bytes =
                |v: &[i128]| -> Vec<u8> { v.iter().flat_map(|x| x.to_le_bytes()[..size].to_vec()).collect() };
            let from_bytes = |b: &[u8]| -> Vec<i128> {
                b.chunks(size)
                    .map(|c| {
                        let mut w = [0u8; 16];
                        w[..size].copy_from_slice(c);
                        wrap(i128::from_le_bytes(w))
                    })
                    .collect()
            };
            for (world, n, divisor) in [(1, 5, 1), (3, 1001, 1), (3, 1001, 3), (5, 70_001, 5)] {
                let top = 1i128 << (bits - 1);
                let srcs: Vec<Vec<i128>> = (0..world)
                    .map(|r| {
                        (0..n).map(|i| wrap(top - 3 + (i as i128 * 7919 + r as i128 * 104_729) % 11 - 5)).collect()
                    })
                    .collect();
                let want: Vec<i128> = (0..n)
                    .map(|i| {
                        let sum = wrap(srcs.iter().map(|s| s[i]).sum());
                        // Rust's division truncates toward zero, as C's.
                        sum / divisor as i128
                    })
                    .collect();
                let bufs: Vec<DevBuf> = srcs.iter().map(|v| g.upload(&to_bytes(v))).collect();
                let table = g.upload(&bufs.iter().map(|b| b.ptr).collect::<Vec<u64>>());
                let out = g.upload(&vec![0xa5u8; n * size]);
                reduce_integers(&g.kernels, kernel, table.ptr, world, out.ptr, n, divisor, g.stream()).unwrap();
                reduce_integers(&g.kernels, kernel, table.ptr, world, bufs[0].ptr, n, divisor, g.stream()).unwrap();
                g.sync();
                let what = format!("kernel {kernel} world {world} n {n} divisor {divisor}");
                assert_eq!(from_bytes(&out.read_bytes()[..n * size]), want, "{what}");
                assert_eq!(from_bytes(&bufs[0].read_bytes()[..n * size]), want, "{what}: in place");
            }
        }
    }
}
