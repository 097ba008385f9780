//! The data-moving primitives the operations are written over
//! (`Backend::{copy, reduce, gemm}`), on CUDA: the driver's copies for
//! dense and pitched layouts (copy engines between GPUs; within one GPU
//! the driver runs them on the SMs), the pack kernels for other strides,
//! the reduction kernel, and cuBLASLt (fp8 too).

use super::driver::check;
use super::gemm::{Fp8Params, Gemm, MatmulParams};
use super::module::Kernels;
use super::sm90::gemm_dtype;
use super::{pack, reduce};
use crate::array::Array;
use crate::backend::{GemmScales, Stream};
use crate::error::{err, Result};
use cudarc::driver::sys;
use std::collections::HashMap;
use std::sync::Mutex;

fn i64s(v: &[usize]) -> Vec<i64> {
    v.iter().map(|&x| x as i64).collect()
}

/// Copies between arrays of one dtype and shape.
pub fn copy(kernels: &Kernels, dst: &Array, src: &Array, stream: Stream) -> Result<()> {
    if dst.dtype != src.dtype {
        return Err(err!(Unsupported, "the CUDA backend copies without converting ({} to {})", src.dtype, dst.dtype));
    }
    if dst.shape != src.shape {
        return Err(err!(Internal, "copy between shapes {:?} and {:?}", src.shape, dst.shape));
    }
    let size = src.dtype.size();
    if src.numel() == 0 {
        return Ok(());
    }
    let s = stream.0 as sys::CUstream;
    if src.is_contiguous() && dst.is_contiguous() {
        // SAFETY: both ranges were checked by the operation; UVA addresses.
        return check(unsafe { sys::cuMemcpyAsync(dst.addr, src.addr, src.numel() * size, s) }, "cuMemcpyAsync");
    }
    if let (Some(d), Some(sm)) = (dst.as_matrix(), src.as_matrix()) {
        if d.strides[1] == 1 && sm.strides[1] == 1 {
            return copy_2d(&d, &sm, size, s);
        }
    }
    crate::backend::check_copy(dst, src)?;
    if dst.is_contiguous() {
        return pack::pack(kernels, src.addr, &i64s(&src.shape), &i64s(&src.strides), size, dst.addr, None, stream);
    }
    // check_copy: src is contiguous.
    pack::unpack(kernels, src.addr, dst.addr, &i64s(&dst.shape), &i64s(&dst.strides), size, None, stream)
}

/// A pitched copy of rows (by a copy engine between GPUs).
fn copy_2d(dst: &Array, src: &Array, size: usize, s: sys::CUstream) -> Result<()> {
    // Every field spelled out: the memory-type enums have no zero value, so
    // `mem::zeroed` here is undefined behaviour (Rust aborts on it).
    let d = sys::CUDA_MEMCPY2D {
        srcXInBytes: 0,
        srcY: 0,
        srcMemoryType: sys::CUmemorytype::CU_MEMORYTYPE_DEVICE,
        srcHost: std::ptr::null(),
        srcDevice: src.addr,
        srcArray: std::ptr::null_mut(),
        srcPitch: src.strides[0] * size,
        dstXInBytes: 0,
        dstY: 0,
        dstMemoryType: sys::CUmemorytype::CU_MEMORYTYPE_DEVICE,
        dstHost: std::ptr::null_mut(),
        dstDevice: dst.addr,
        dstArray: std::ptr::null_mut(),
        dstPitch: dst.strides[0] * size,
        WidthInBytes: src.shape[1] * size,
        Height: src.shape[0],
    };
    // SAFETY: the descriptor describes ranges the operation checked.
    check(unsafe { sys::cuMemcpy2DAsync_v2(&d, s) }, "cuMemcpy2DAsync")
}

/// Device tables of source addresses for the reduction kernel, made once per
/// distinct list (operations reuse their workspace, so lists repeat) and kept
/// for the backend's lifetime, so graphs captured with them stay valid.
#[derive(Default)]
pub struct SourceTables {
    tables: Mutex<HashMap<Vec<u64>, u64>>,
}

impl SourceTables {
    fn get(&self, addrs: Vec<u64>, upload: impl FnOnce(&[u8]) -> Result<u64>) -> Result<u64> {
        let mut t = crate::sync::lock(&self.tables);
        if let Some(&dev) = t.get(&addrs) {
            return Ok(dev);
        }
        let bytes: Vec<u8> = addrs.iter().flat_map(|a| a.to_le_bytes()).collect();
        let dev = upload(&bytes)?;
        t.insert(addrs, dev);
        Ok(dev)
    }
}

impl Drop for SourceTables {
    fn drop(&mut self) {
        for &dev in crate::sync::get_mut(&mut self.tables).values() {
            // SAFETY: allocated by the upload closure with cuMemAlloc.
            unsafe { sys::cuMemFree_v2(dev) };
        }
    }
}

/// `dst = scale * sum(srcs)` for contiguous arrays of one dtype.
pub fn reduce(
    kernels: &Kernels,
    tables: &SourceTables,
    upload: impl FnOnce(&[u8]) -> Result<u64>,
    dst: &Array,
    srcs: &[Array],
    scale: f32,
    stream: Stream,
) -> Result<()> {
    let dtype = gemm_dtype(dst.dtype)?;
    if !dst.is_contiguous() || srcs.iter().any(|s| !s.is_contiguous() || s.dtype != dst.dtype || s.shape != dst.shape) {
        return Err(err!(Internal, "the CUDA reduction takes contiguous sources and output of one dtype and shape"));
    }
    let table = tables.get(srcs.iter().map(|s| s.addr).collect(), upload)?;
    reduce::reduce(kernels, table, srcs.len(), dst.addr, dst.numel(), dtype, scale, None, stream)
}

/// `dst = sum(srcs) / divisor` for contiguous integer arrays of one dtype
/// (`Backend::reduce_integers`).
pub fn reduce_integers(
    kernels: &Kernels,
    tables: &SourceTables,
    upload: impl FnOnce(&[u8]) -> Result<u64>,
    dst: &Array,
    srcs: &[Array],
    divisor: usize,
    stream: Stream,
) -> Result<()> {
    let Some(kernel) = super::all_reduce::int_index(dst.dtype) else {
        return Err(err!(Unsupported, "the CUDA backend does not reduce {} values as integers", dst.dtype));
    };
    if !dst.is_contiguous() || srcs.iter().any(|s| !s.is_contiguous() || s.dtype != dst.dtype || s.shape != dst.shape) {
        return Err(err!(Internal, "the CUDA reduction takes contiguous sources and output of one dtype and shape"));
    }
    let table = tables.get(srcs.iter().map(|s| s.addr).collect(), upload)?;
    reduce::reduce_integers(kernels, kernel, table, srcs.len(), dst.addr, dst.numel(), divisor, stream)
}

/// One row-major matrix, its leading dimension and whether it is stored transposed.
fn operand(m: &Array) -> Result<(u64, usize, bool)> {
    // The leading dimension of a single row (or column) is never used; cuBLASLt still wants it at least the width.
    let ([rows, cols], [row_stride, col_stride]) = ([m.shape[0], m.shape[1]], [m.strides[0], m.strides[1]]);
    match (row_stride, col_stride) {
        (ld, 1) if ld >= cols || rows == 1 => Ok((m.addr, ld.max(cols), false)),
        (1, ld) if ld >= rows || cols == 1 => Ok((m.addr, ld.max(rows), true)),
        _ => Err(err!(Internal, "matmul operand with strides {:?} is neither row- nor column-major", m.strides)),
    }
}

/// The matrix part of `t` (its last two dimensions) and its batch stride
/// (0 for a plain matrix).
fn batch_part(t: &Array) -> (Array, usize) {
    match t.ndim() {
        3 => (Array { shape: t.shape[1..].to_vec(), strides: t.strides[1..].to_vec(), ..t.clone() }, t.strides[0]),
        _ => (t.clone(), 0),
    }
}

/// `dst (+)= a @ b` through cuBLASLt: matrices, or batches of them
/// (3-D arrays, see `Backend::gemm`) as one strided-batched matmul.
pub fn gemm(g: &Gemm, dst: &Array, a: &Array, b: &Array, accumulate: bool, stream: Stream) -> Result<()> {
    let batch = match (dst.ndim(), a.ndim(), b.ndim()) {
        (2, 2, 2) => 1,
        (3, 3, 3) if a.shape[0] == dst.shape[0] && b.shape[0] == dst.shape[0] => dst.shape[0],
        _ => return Err(err!(Internal, "matmul of {:?} @ {:?} into {:?}", a.shape, b.shape, dst.shape)),
    };
    let ((dst, stride_c), (a, stride_a), (b, stride_b)) = (batch_part(dst), batch_part(a), batch_part(b));
    let (m, k, n) = (a.shape[0], a.shape[1], b.shape[1]);
    let (a_addr, lda, a_trans) = operand(&a)?;
    let (b_addr, ldb, b_trans) = operand(&b)?;
    if dst.strides[1] != 1 {
        return Err(err!(Internal, "matmul output must have unit column stride"));
    }
    let mut p = MatmulParams::new(m, n, k, a_addr, b_addr, dst.addr, gemm_dtype(a.dtype)?);
    p.lda = lda;
    p.a_trans = a_trans;
    p.ldb = ldb;
    p.b_trans = b_trans;
    p.ldc = dst.strides[0].max(n);
    p.out_dtype = gemm_dtype(dst.dtype)?;
    p.accumulate = accumulate;
    (p.batch, p.stride_a, p.stride_b, p.stride_c) = (batch, stride_a, stride_b, stride_c);
    g.matmul(&p, stream)
}

/// `dst (+)= scaled a @ b` for fp8 operands through cuBLASLt (the
/// operations hand over a row-major `a`, a column-major `b` and contiguous
/// scales).
pub fn scaled_gemm(
    g: &Gemm,
    dst: &Array,
    a: &Array,
    b: &Array,
    scales: &GemmScales,
    accumulate: bool,
    stream: Stream,
) -> Result<()> {
    let (Some(a_type), Some(b_type)) = (a.dtype.fp8(), b.dtype.fp8()) else {
        return Err(err!(Internal, "scaled matmul of {} @ {}", a.dtype, b.dtype));
    };
    let (m, k, n) = (a.shape[0], a.shape[1], b.shape[1]);
    scales.check(m, n, dst.dtype)?;
    let (a_addr, lda, a_trans) = operand(a)?;
    let (b_addr, ldb, b_trans) = operand(b)?;
    if dst.strides[1] != 1 {
        return Err(err!(Internal, "matmul output must have unit column stride"));
    }
    let out_dtype = gemm_dtype(dst.dtype)?;
    let mut p = MatmulParams::new(m, n, k, a_addr, b_addr, dst.addr, out_dtype);
    (p.lda, p.a_trans, p.ldb, p.b_trans) = (lda, a_trans, ldb, b_trans);
    p.ldc = dst.strides[0].max(n);
    p.accumulate = accumulate;
    p.fp8 = Some(Fp8Params {
        a_type,
        b_type,
        row_wise: scales.row_wise,
        a_scale: scales.a.addr,
        b_scale: scales.b.addr,
        bias: scales.bias.as_ref().map_or(0, |v| v.addr),
        fast_accum: false,
    });
    g.matmul(&p, stream)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::array::DType;
    use crate::backend::cuda::gpu_testing::{encode, gpu};

    /// The batched matmuls the operations issue for `[batch, seq, hidden]`
    /// sliced along the sequence (rank r's slice of a gathered output
    /// from its shard, B shared; a strided chunk of `a` into a contiguous
    /// chunk), through `gemm`'s 3-D arrays, against the host backend's
    /// matmul on the same data, poisoned (NaN) outputs included: small
    /// integers, so both are exact and compared bit for bit.
    #[test]
    fn gpu_batched_gemm_matches_host_backend() {
        use crate::backend::cuda::gemm::Gemm;
        use crate::backend::host::matmul;
        let Some(g) = gpu() else { return };
        let lt = Gemm::new(&g.ctx).unwrap();
        let int =
            |n: usize, seed: usize| (0..n).map(|i| ((i * 7 + seed * 13 + i / 5) % 9) as f32 - 4.0).collect::<Vec<_>>();
        for dtype in [DType::BF16, DType::F16, DType::F32] {
            let gd = crate::backend::cuda::sm90::gemm_dtype(dtype).unwrap();
            for (batch, seq, hidden, n, world) in
                [(2usize, 3usize, 16usize, 8usize, 2usize), (4, 11, 24, 40, 3), (3, 128, 64, 96, 2)]
            {
                let total = seq * world;
                let (a_len, b_len, out_len) = (batch * seq * hidden, hidden * n, batch * total * n);
                let a_host = encode(gd, &int(a_len, 1));
                let b_host = encode(gd, &int(b_len, 2));
                let poison = encode(gd, &vec![f32::NAN; out_len]);
                let (a, b, out) = (g.upload(&a_host), g.upload(&b_host), g.upload(&poison));
                let (mut a_h, mut b_h, mut out_h) = (a_host.clone(), b_host.clone(), poison.clone());
                let arr = |addr: u64, shape: &[usize], strides: &[usize]| Array {
                    addr,
                    dtype,
                    shape: shape.to_vec(),
                    strides: strides.to_vec(),
                };
                let r = world - 1;
                let operands = |a: u64, b: u64, out: u64| {
                    let dst = arr(out, &[batch, total, n], &[total * n, n, 1]).narrow(1, r * seq, seq);
                    let dst = dst.as_batched(1).unwrap();
                    (
                        dst,
                        arr(a, &[batch, seq, hidden], &[seq * hidden, hidden, 1]),
                        arr(b, &[batch, hidden, n], &[0, n, 1]),
                    )
                };
                let (d, l, rhs) = operands(a.ptr, b.ptr, out.ptr);
                gemm(&lt, &d, &l, &rhs, false, g.stream()).unwrap();
                g.sync();
                let (d, l, rhs) = operands(a_h.as_mut_ptr() as u64, b_h.as_mut_ptr() as u64, out_h.as_mut_ptr() as u64);
                matmul::gemm(&d, &l, &rhs, false).unwrap();
                assert_eq!(out.read_bytes(), out_h, "{dtype} gathered slice {batch}x{seq}x{hidden} @ {n}");
                // mm_rs: chunk r of a [batch, total, hidden] read in place.
                let a_host = encode(gd, &int(batch * total * hidden, 3));
                let chunk_poison = encode(gd, &vec![f32::NAN; batch * seq * n]);
                let (a, c) = (g.upload(&a_host), g.upload(&chunk_poison));
                let (mut a_h, mut c_h) = (a_host.clone(), chunk_poison.clone());
                let operands = |a: u64, c: u64| {
                    let part = arr(a, &[batch, total, hidden], &[total * hidden, hidden, 1]).narrow(1, r * seq, seq);
                    (arr(c, &[batch, seq, n], &[seq * n, n, 1]), part.as_batched(1).unwrap())
                };
                let (d, l) = operands(a.ptr, c.ptr);
                gemm(&lt, &d, &l, &operands_b(&rhs, b.ptr), false, g.stream()).unwrap();
                g.sync();
                let (d, l) = operands(a_h.as_mut_ptr() as u64, c_h.as_mut_ptr() as u64);
                matmul::gemm(&d, &l, &operands_b(&rhs, b_h.as_mut_ptr() as u64), false).unwrap();
                assert_eq!(c.read_bytes(), c_h, "{dtype} scattered chunk {batch}x{seq}x{hidden} @ {n}");
            }
        }
    }

    /// `b` (a shared B) at `addr`.
    fn operands_b(b: &Array, addr: u64) -> Array {
        Array { addr, ..b.clone() }
    }

    /// Each path of `copy` (dense, pitched by the copy engine, pack, unpack)
    /// against the same copy done on the host, into a poisoned destination.
    #[test]
    fn gpu_copy_every_layout_matches_host() {
        let Some(g) = gpu() else { return };
        // (shape, source strides, destination strides), in elements of 2 bytes.
        let cases: &[(&[usize], &[usize], &[usize])] = &[
            (&[6, 10], &[10, 1], &[10, 1]),
            (&[6, 10], &[24, 1], &[16, 1]),
            (&[6, 10], &[10, 1], &[1, 6]),
            (&[6, 10], &[1, 6], &[10, 1]),
            (&[3, 4, 5], &[40, 5, 1], &[20, 5, 1]),
        ];
        for (shape, ss, ds) in cases {
            let extent = |st: &[usize]| 1 + shape.iter().zip(st).map(|(n, s)| (n - 1) * s).sum::<usize>();
            let src_host: Vec<u16> = (0..extent(ss)).map(|i| (i * 7 + 3) as u16).collect();
            let poison = vec![0xdeadu16; extent(ds)];
            let (src, dst) = (g.upload(&src_host), g.upload(&poison));
            let arr =
                |addr, st: &[usize]| Array { addr, dtype: DType::BF16, shape: shape.to_vec(), strides: st.to_vec() };
            copy(&g.kernels, &arr(dst.ptr, ds), &arr(src.ptr, ss), g.stream()).unwrap();
            g.sync();
            let mut want = poison.clone();
            let n: usize = shape.iter().product();
            for flat in 0..n {
                let (mut rem, mut so, mut d_o) = (flat, 0, 0);
                for dim in (0..shape.len()).rev() {
                    let i = rem % shape[dim];
                    rem /= shape[dim];
                    so += i * ss[dim];
                    d_o += i * ds[dim];
                }
                want[d_o] = src_host[so];
            }
            assert_eq!(dst.read::<u16>(want.len()), want, "copy {shape:?} {ss:?} -> {ds:?}");
        }
    }
}
