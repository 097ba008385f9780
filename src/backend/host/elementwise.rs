//! Strided copies and reductions on the host, row by row.
//!
//! Arrays that share a shape are walked together: dimensions of size 1 are
//! dropped and neighbours that are contiguous in every array are merged, so
//! a contiguous copy is one `memmove` and a strided one a short loop per row.

use crate::array::{Array, DType};
use crate::backend::AddRmsNorm;
use crate::error::{err, Result};
use half::{bf16, f16};

/// The element types the host converts through f32.
#[derive(Clone, Copy)]
enum Float {
    F32,
    BF16,
    F16,
}

impl Float {
    fn of(d: DType) -> Result<Float> {
        match d {
            DType::F32 => Ok(Float::F32),
            DType::BF16 => Ok(Float::BF16),
            DType::F16 => Ok(Float::F16),
            other => Err(err!(Unsupported, "the host backend does not convert {other} values")),
        }
    }

    /// # Safety
    /// `p` points to a readable element of this type.
    unsafe fn load(self, p: *const u8) -> f32 {
        match self {
            Float::F32 => (p as *const f32).read_unaligned(),
            Float::BF16 => bf16::from_bits((p as *const u16).read_unaligned()).to_f32(),
            Float::F16 => f16::from_bits((p as *const u16).read_unaligned()).to_f32(),
        }
    }

    /// # Safety
    /// `p` points to a writable element of this type.
    unsafe fn store(self, p: *mut u8, v: f32) {
        match self {
            Float::F32 => (p as *mut f32).write_unaligned(v),
            Float::BF16 => (p as *mut u16).write_unaligned(bf16::from_f32(v).to_bits()),
            Float::F16 => (p as *mut u16).write_unaligned(f16::from_f32(v).to_bits()),
        }
    }
}

/// The integer element types, reduced exactly in their own width.
#[derive(Clone, Copy)]
enum Int {
    I8,
    U8,
    I32,
    I64,
}

impl Int {
    fn of(d: DType) -> Result<Int> {
        match d {
            DType::I8 => Ok(Int::I8),
            DType::U8 => Ok(Int::U8),
            DType::I32 => Ok(Int::I32),
            DType::I64 => Ok(Int::I64),
            other => Err(err!(Internal, "an integer reduction of {other} values")),
        }
    }

    /// The element's bits, sign- or zero-extended: sums of these wrap in
    /// u64 exactly as in the element type, once truncated back.
    ///
    /// # Safety
    /// `p` points to a readable element of this type.
    unsafe fn load(self, p: *const u8) -> u64 {
        match self {
            Int::I8 => (p as *const i8).read() as i64 as u64,
            Int::U8 => p.read() as u64,
            Int::I32 => (p as *const i32).read_unaligned() as i64 as u64,
            Int::I64 => (p as *const i64).read_unaligned() as u64,
        }
    }

    /// Stores the wrapped sum `v` divided by `divisor` (truncating toward
    /// zero, in the element type's signedness).
    ///
    /// # Safety
    /// `p` points to a writable element of this type.
    unsafe fn store_divided(self, p: *mut u8, v: u64, divisor: usize) {
        let d = divisor as i64;
        match self {
            Int::I8 => (p as *mut i8).write((v as i8 as i64 / d) as i8),
            Int::U8 => p.write((v as u8 as u64 / divisor as u64) as u8),
            Int::I32 => (p as *mut i32).write_unaligned((v as i32 as i64 / d) as i32),
            Int::I64 => (p as *mut i64).write_unaligned(v as i64 / d),
        }
    }
}

/// `shape` with size-1 dimensions dropped and mergeable neighbours merged,
/// and each array's strides for the result (at least one dimension).
fn merge_dims(shape: &[usize], strides: &[&[usize]]) -> (Vec<usize>, Vec<Vec<usize>>) {
    let mut out_shape: Vec<usize> = Vec::with_capacity(shape.len());
    let mut out_strides: Vec<Vec<usize>> = vec![Vec::with_capacity(shape.len()); strides.len()];
    for (d, &n) in shape.iter().enumerate().filter(|&(_, &n)| n != 1) {
        let mergeable =
            !out_shape.is_empty() && strides.iter().zip(&out_strides).all(|(s, o)| *o.last().unwrap() == s[d] * n);
        if mergeable {
            *out_shape.last_mut().unwrap() *= n;
            for (s, o) in strides.iter().zip(&mut out_strides) {
                *o.last_mut().unwrap() = s[d];
            }
        } else {
            out_shape.push(n);
            for (s, o) in strides.iter().zip(&mut out_strides) {
                o.push(s[d]);
            }
        }
    }
    if out_shape.is_empty() {
        out_shape.push(1);
        out_strides.iter_mut().for_each(|o| o.push(1));
    }
    (out_shape, out_strides)
}

/// Calls `f` with each array's element offset of the start of every row
/// (run along the last dimension of `shape`).
fn for_each_row(shape: &[usize], strides: &[Vec<usize>], mut f: impl FnMut(&[usize])) {
    let outer = shape.len() - 1;
    let mut idx = vec![0usize; outer];
    let mut offs = vec![0usize; strides.len()];
    loop {
        f(&offs);
        let mut d = outer;
        loop {
            if d == 0 {
                return;
            }
            d -= 1;
            idx[d] += 1;
            offs.iter_mut().zip(strides).for_each(|(o, s)| *o += s[d]);
            if idx[d] < shape[d] {
                break;
            }
            offs.iter_mut().zip(strides).for_each(|(o, s)| *o -= s[d] * shape[d]);
            idx[d] = 0;
        }
    }
}

fn same_shape(dst: &Array, src: &Array, what: &str) -> Result<()> {
    if dst.shape == src.shape {
        Ok(())
    } else {
        Err(err!(Internal, "{what}: source shape {:?} differs from destination shape {:?}", src.shape, dst.shape))
    }
}

pub fn copy(dst: &Array, src: &Array) -> Result<()> {
    same_shape(dst, src, "copy")?;
    let (shape, strides) = merge_dims(&dst.shape, &[&dst.strides, &src.strides]);
    let n = shape[shape.len() - 1];
    let (ds, ss) = (strides[0][shape.len() - 1], strides[1][shape.len() - 1]);
    let (dsz, ssz) = (dst.dtype.size(), src.dtype.size());
    let (dbase, sbase) = (dst.addr as *mut u8, src.addr as *const u8);
    if dst.dtype == src.dtype {
        for_each_row(&shape, &strides, |o| {
            // SAFETY: the operations hand the host arrays that lie in memory
            // the caller promised (checked extents); rows stay inside them.
            unsafe {
                let (d, s) = (dbase.add(o[0] * dsz), sbase.add(o[1] * ssz));
                if ds == 1 && ss == 1 {
                    std::ptr::copy(s, d, n * dsz);
                } else {
                    for i in 0..n {
                        std::ptr::copy(s.add(i * ss * ssz), d.add(i * ds * dsz), dsz);
                    }
                }
            }
        });
        return Ok(());
    }
    let (from, to) = (Float::of(src.dtype)?, Float::of(dst.dtype)?);
    for_each_row(&shape, &strides, |o| {
        for i in 0..n {
            // SAFETY: as above.
            unsafe {
                let v = from.load(sbase.add((o[1] + i * ss) * ssz));
                to.store(dbase.add((o[0] + i * ds) * dsz), v);
            }
        }
    });
    Ok(())
}

pub fn reduce(dst: &Array, srcs: &[Array], scale: f32) -> Result<()> {
    let to = Float::of(dst.dtype)?;
    let from: Vec<Float> = srcs.iter().map(|s| Float::of(s.dtype)).collect::<Result<_>>()?;
    for s in srcs {
        same_shape(dst, s, "reduce")?;
    }
    let all: Vec<&[usize]> = std::iter::once(&dst.strides[..]).chain(srcs.iter().map(|s| &s.strides[..])).collect();
    let (shape, strides) = merge_dims(&dst.shape, &all);
    let last = shape.len() - 1;
    let n = shape[last];
    let mut acc = vec![0f32; n];
    for_each_row(&shape, &strides, |o| {
        acc.fill(0.0);
        for (j, (s, f)) in srcs.iter().zip(&from).enumerate() {
            let (base, stride, size) = (s.addr as *const u8, strides[j + 1][last], s.dtype.size());
            for (i, a) in acc.iter_mut().enumerate() {
                // SAFETY: as in `copy`.
                *a += unsafe { f.load(base.add((o[j + 1] + i * stride) * size)) };
            }
        }
        let (base, stride, size) = (dst.addr as *mut u8, strides[0][last], dst.dtype.size());
        for (i, a) in acc.iter().enumerate() {
            // SAFETY: as in `copy`.
            unsafe { to.store(base.add((o[0] + i * stride) * size), a * scale) };
        }
    });
    Ok(())
}

/// `dst = (sum of srcs) / divisor` for integers (see
/// `Backend::reduce_integers`): the sum wraps modulo 2^bits, the division
/// truncates toward zero.
pub fn reduce_integers(dst: &Array, srcs: &[Array], divisor: usize) -> Result<()> {
    let int = Int::of(dst.dtype)?;
    if divisor == 0 || divisor > i64::MAX as usize {
        return Err(err!(Internal, "an integer reduction divided by {divisor}"));
    }
    for s in srcs {
        same_shape(dst, s, "reduce")?;
        if s.dtype != dst.dtype {
            return Err(err!(Internal, "an integer reduction of {} into {}", s.dtype, dst.dtype));
        }
    }
    let all: Vec<&[usize]> = std::iter::once(&dst.strides[..]).chain(srcs.iter().map(|s| &s.strides[..])).collect();
    let (shape, strides) = merge_dims(&dst.shape, &all);
    let last = shape.len() - 1;
    let (n, size) = (shape[last], dst.dtype.size());
    let mut acc = vec![0u64; n];
    for_each_row(&shape, &strides, |o| {
        acc.fill(0);
        for (j, s) in srcs.iter().enumerate() {
            let (base, stride) = (s.addr as *const u8, strides[j + 1][last]);
            for (i, a) in acc.iter_mut().enumerate() {
                // SAFETY: as in `copy`.
                *a = a.wrapping_add(unsafe { int.load(base.add((o[j + 1] + i * stride) * size)) });
            }
        }
        let (base, stride) = (dst.addr as *mut u8, strides[0][last]);
        for (i, &a) in acc.iter().enumerate() {
            // SAFETY: as in `copy`.
            unsafe { int.store_divided(base.add((o[0] + i * stride) * size), a, divisor) };
        }
    });
    Ok(())
}

/// `residual_out = x + residual` (rounded to its dtype), then `out =
/// residual_out / sqrt(mean(residual_out^2) + eps) * weight` per row, in
/// f32 (see `Backend::add_rms_norm`). Matrices of unit column stride;
/// `residual_out` may alias `x` or `residual` (each row is read first).
pub fn add_rms_norm(norm: &AddRmsNorm) -> Result<()> {
    let AddRmsNorm { out, residual_out, x, residual, weight, eps } = *norm;
    let f = Float::of(x.dtype)?;
    let (rows, hidden) = (x.shape[0], x.shape[1]);
    let mats = [out, residual_out, x, residual];
    if mats.iter().any(|m| m.shape != x.shape || m.strides[1] != 1 || m.dtype != x.dtype)
        || weight.shape != [hidden]
        || weight.dtype != x.dtype
    {
        return Err(err!(Internal, "rmsnorm of {:?} with mismatched operands", x.shape));
    }
    let size = x.dtype.size();
    let at = |m: &Array, r: usize, i: usize| m.addr as usize + (r * m.strides[0] + i) * size;
    let mut row = vec![0f32; hidden];
    for r in 0..rows {
        let mut ss = 0f32;
        for (i, v) in row.iter_mut().enumerate() {
            // SAFETY: the operations hand over arrays in memory the caller
            // promised (checked extents).
            let sum = unsafe { f.load(at(x, r, i) as *const u8) + f.load(at(residual, r, i) as *const u8) };
            // SAFETY: as above.
            unsafe { f.store(at(residual_out, r, i) as *mut u8, sum) };
            // The norm reads the rounded sum back, as an unfused pass would.
            *v = unsafe { f.load(at(residual_out, r, i) as *const u8) };
            ss += *v * *v;
        }
        let inv = 1.0 / (ss / hidden as f32 + eps).sqrt();
        for (i, v) in row.iter().enumerate() {
            let w_at = weight.addr as usize + i * weight.strides[0] * size;
            // SAFETY: as above.
            unsafe { f.store(at(out, r, i) as *mut u8, v * inv * f.load(w_at as *const u8)) };
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn view<T>(v: &mut [T], dtype: DType, shape: &[usize], strides: &[usize]) -> Array {
        Array { addr: v.as_mut_ptr() as u64, dtype, shape: shape.to_vec(), strides: strides.to_vec() }
    }

    #[test]
    fn merges_contiguous_dims_only() {
        let (shape, strides) = merge_dims(&[2, 1, 3, 4], &[&[12, 12, 4, 1], &[1, 9, 2, 6]]);
        assert_eq!(shape, vec![2, 3, 4]);
        assert_eq!(strides, vec![vec![12, 4, 1], vec![1, 2, 6]]);
        let (shape, strides) = merge_dims(&[2, 3, 4], &[&[12, 4, 1], &[24, 4, 1]]);
        assert_eq!(shape, vec![2, 12]);
        assert_eq!(strides, vec![vec![12, 1], vec![24, 1]]);
        assert_eq!(merge_dims(&[1, 1], &[&[5, 3]]).0, vec![1]);
    }

    #[test]
    fn transposing_copy_and_conversion() {
        let mut src: Vec<f32> = (0..6).map(|i| i as f32 + 0.5).collect();
        let mut dst = vec![0u16; 6];
        // dst[j][i] = src[i][j], converting to bf16.
        copy(&view(&mut dst, DType::BF16, &[2, 3], &[1, 2]), &view(&mut src, DType::F32, &[2, 3], &[3, 1])).unwrap();
        let got: Vec<f32> = dst.iter().map(|&b| bf16::from_bits(b).to_f32()).collect();
        assert_eq!(got, vec![0.5, 3.5, 1.5, 4.5, 2.5, 5.5]);
        // Same type, strided destination: untouched gaps stay.
        let mut out = vec![-1f32; 12];
        copy(&view(&mut out, DType::F32, &[2, 3], &[6, 2]), &view(&mut src, DType::F32, &[2, 3], &[3, 1])).unwrap();
        assert_eq!(out, vec![0.5, -1., 1.5, -1., 2.5, -1., 3.5, -1., 4.5, -1., 5.5, -1.]);
    }

    #[test]
    fn reduce_sums_and_scales() {
        let mut a = vec![1f32, 2., 3., 4.];
        let mut b: Vec<u16> = [10f32, 20., 30., 40.].iter().map(|&v| f16::from_f32(v).to_bits()).collect();
        let mut out = vec![0f32; 4];
        let srcs = [view(&mut a, DType::F32, &[2, 2], &[2, 1]), view(&mut b, DType::F16, &[2, 2], &[1, 2])];
        reduce(&view(&mut out, DType::F32, &[2, 2], &[2, 1]), &srcs, 0.5).unwrap();
        assert_eq!(out, vec![5.5, 16., 11.5, 22.]);
        let mut fp8 = vec![0u8; 4];
        let e = reduce(&view(&mut fp8, DType::F8E4M3, &[4], &[1]), &[], 1.0).unwrap_err();
        assert_eq!(e.kind, crate::error::ErrorKind::Unsupported);
    }

    #[test]
    fn integer_reductions_are_exact_and_wrap() {
        // Near 2^60, where f32 (and f64 for the sum of four) would lose bits.
        let big = (1i64 << 60) + 1;
        let mut a = vec![big, -7, i64::MAX, 5];
        let mut b = vec![big + 2, -8, 1, 6];
        let mut out = vec![0x5a5a_5a5a_5a5a_5a5ai64; 4];
        let srcs = [view(&mut a, DType::I64, &[4], &[1]), view(&mut b, DType::I64, &[4], &[1])];
        reduce_integers(&view(&mut out, DType::I64, &[4], &[1]), &srcs, 1).unwrap();
        assert_eq!(out, vec![2 * big + 2, -15, i64::MIN, 11]);
        reduce_integers(&view(&mut out, DType::I64, &[4], &[1]), &srcs, 2).unwrap();
        // AVG: the wrapped sum divided, truncating toward zero.
        assert_eq!(out, vec![big + 1, -7, i64::MIN / 2, 5]);
        // int8 wraps; int8 and uint8 divide in their own signedness.
        let mut x = vec![100i8, -100, -3, 127];
        let mut y = vec![100i8, -100, 0, 1];
        let mut o8 = vec![0x55i8; 4];
        let srcs = [view(&mut x, DType::I8, &[4], &[1]), view(&mut y, DType::I8, &[4], &[1])];
        reduce_integers(&view(&mut o8, DType::I8, &[4], &[1]), &srcs, 1).unwrap();
        assert_eq!(o8, vec![-56, 56, -3, -128]);
        reduce_integers(&view(&mut o8, DType::I8, &[4], &[1]), &srcs, 2).unwrap();
        assert_eq!(o8, vec![-28, 28, -1, -64]);
        let mut u = vec![200u8, 255, 3, 0];
        let mut v = vec![100u8, 1, 0, 0];
        let mut ou = vec![0x55u8; 4];
        let srcs = [view(&mut u, DType::U8, &[4], &[1]), view(&mut v, DType::U8, &[4], &[1])];
        reduce_integers(&view(&mut ou, DType::U8, &[4], &[1]), &srcs, 2).unwrap();
        assert_eq!(ou, vec![22, 0, 1, 0]);
        // int32 beyond f32's 24 bits, strided source.
        let mut p = vec![(1i32 << 25) + 1, 0, 3, 0];
        let mut q = vec![1i32, i32::MAX];
        let mut o32 = vec![-1i32; 2];
        let srcs = [view(&mut p, DType::I32, &[2], &[2]), view(&mut q, DType::I32, &[2], &[1])];
        reduce_integers(&view(&mut o32, DType::I32, &[2], &[1]), &srcs, 1).unwrap();
        assert_eq!(o32, vec![(1 << 25) + 2, i32::MIN + 2]);
    }
}
