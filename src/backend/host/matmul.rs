//! Matrix products on the host with the `gemm` crate, in f32 over all
//! cores. bf16, f16 and fp8 operands are widened to f32 first (the crate
//! has no kernel for them, and widening keeps the sums in f32 for every
//! type; fp8 values and their products are exact in f32).

use super::elementwise;
use crate::array::{Array, DType};
use crate::error::{err, Result};
use crate::fp8::Fp8;

/// An f32 view of a matrix: the caller's memory when it already is f32,
/// else a widened contiguous copy.
struct F32Matrix {
    ptr: *const f32,
    row_stride: isize,
    col_stride: isize,
    _widened: Option<Vec<f32>>,
}

impl F32Matrix {
    fn of(m: &Array) -> Result<F32Matrix> {
        if m.dtype == DType::F32 {
            return Ok(F32Matrix {
                ptr: m.addr as *const f32,
                row_stride: m.strides[0] as isize,
                col_stride: m.strides[1] as isize,
                _widened: None,
            });
        }
        let v = match m.dtype.fp8() {
            Some(format) => decode_fp8(m, format),
            None => {
                let mut v = vec![0f32; m.numel()];
                elementwise::copy(&Array::contiguous(v.as_mut_ptr() as u64, DType::F32, &m.shape), m)?;
                v
            }
        };
        Ok(F32Matrix { ptr: v.as_ptr(), row_stride: m.shape[1] as isize, col_stride: 1, _widened: Some(v) })
    }
}

/// The values of an fp8 matrix, row-major. (Copies never convert fp8, so
/// the widening lives here rather than in `elementwise`.)
fn decode_fp8(m: &Array, format: Fp8) -> Vec<f32> {
    let base = m.addr as *const u8;
    let mut v = Vec::with_capacity(m.numel());
    for i in 0..m.shape[0] {
        for j in 0..m.shape[1] {
            // SAFETY: the operations hand the host matrices inside memory the
            // caller promised (checked extents); one byte per element.
            v.push(format.decode(unsafe { *base.add(i * m.strides[0] + j * m.strides[1]) }));
        }
    }
    v
}

/// `dst (+)= a @ b` for matrices, or for batches of them (3-D arrays, see
/// `Backend::gemm`): matrix by matrix, a shared operand (batch stride 0)
/// widened once.
pub fn gemm(dst: &Array, a: &Array, b: &Array, accumulate: bool) -> Result<()> {
    let matrices = a.ndim() == 2 && b.ndim() == 2 && dst.ndim() == 2;
    let batched = a.ndim() == 3 && b.ndim() == 3 && dst.ndim() == 3 && a.shape[0] == dst.shape[0];
    let batch = if batched { dst.shape[0] } else { 1 };
    let shapes_ok = (matrices || batched && b.shape[0] == batch) && {
        let [m, k, n] = [a.shape[a.ndim() - 2], a.shape[a.ndim() - 1], b.shape[b.ndim() - 1]];
        b.shape[b.ndim() - 2] == k && dst.shape[dst.ndim() - 2..] == [m, n]
    };
    if !shapes_ok {
        return Err(err!(Internal, "gemm of {:?} @ {:?} into {:?}", a.shape, b.shape, dst.shape));
    }
    if matrices {
        return gemm_matrix(dst, &F32Matrix::of(a)?, &F32Matrix::of(b)?, a.shape[1], accumulate);
    }
    let k = a.shape[2];
    let shared = |t: &Array| if t.strides[0] == 0 { Some(F32Matrix::of(&matrix(t, 0))) } else { None };
    let (shared_a, shared_b) = (shared(a).transpose()?, shared(b).transpose()?);
    for i in 0..batch {
        let own_a = if shared_a.is_none() { Some(F32Matrix::of(&matrix(a, i))?) } else { None };
        let own_b = if shared_b.is_none() { Some(F32Matrix::of(&matrix(b, i))?) } else { None };
        let lhs = own_a.as_ref().or(shared_a.as_ref()).expect("one of the two");
        let rhs = own_b.as_ref().or(shared_b.as_ref()).expect("one of the two");
        gemm_matrix(&matrix(dst, i), lhs, rhs, k, accumulate)?;
    }
    Ok(())
}

/// Matrix `i` of a batch.
fn matrix(t: &Array, i: usize) -> Array {
    Array {
        addr: t.addr + (i * t.strides[0] * t.dtype.size()) as u64,
        dtype: t.dtype,
        shape: t.shape[1..].to_vec(),
        strides: t.strides[1..].to_vec(),
    }
}

/// `dst (+)= lhs @ rhs` for one matrix `dst` (the shapes checked).
fn gemm_matrix(dst: &Array, lhs: &F32Matrix, rhs: &F32Matrix, k: usize, accumulate: bool) -> Result<()> {
    let (m, n) = (dst.shape[0], dst.shape[1]);
    let run = |ptr: *mut f32, row_stride: isize, col_stride: isize| {
        // SAFETY: the three matrices lie in memory the operations checked,
        // with the strides given; `dst` does not overlap the operands.
        unsafe {
            gemm::gemm(
                m,
                n,
                k,
                ptr,
                col_stride,
                row_stride,
                accumulate,
                lhs.ptr,
                lhs.col_stride,
                lhs.row_stride,
                rhs.ptr,
                rhs.col_stride,
                rhs.row_stride,
                1.0f32,
                1.0f32,
                false,
                false,
                false,
                gemm::Parallelism::Rayon(0),
            )
        }
    };
    if dst.dtype == DType::F32 {
        run(dst.addr as *mut f32, dst.strides[0] as isize, dst.strides[1] as isize);
        return Ok(());
    }
    // Other outputs through f32: the old values in (when accumulating),
    // the sum rounded once on the way out.
    let mut out = vec![0f32; m * n];
    let staged = Array::contiguous(out.as_mut_ptr() as u64, DType::F32, &dst.shape);
    if accumulate {
        elementwise::copy(&staged, dst)?;
    }
    run(out.as_mut_ptr(), n as isize, 1);
    elementwise::copy(dst, &staged)
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::bf16;

    /// Batches against a float64 reference: A with gaps between its
    /// matrices, B shared (batch stride 0) or one per batch (column-major),
    /// C with padded rows and gaps, poisoned; bf16, f16 and f32 inputs,
    /// into their own type or f32, accumulating too. Small integers: every
    /// sum is exact, so the results are compared exactly.
    #[test]
    fn batches_of_strided_matrices() {
        use half::f16;
        let (batch, m, k, n) = (3usize, 5usize, 7usize, 4usize);
        let value = |i: usize| ((i * 5 + i / 3) % 7) as f64 - 3.0;
        let enc = |t: DType, v: f64| -> u32 {
            match t {
                DType::BF16 => bf16::from_f64(v).to_bits() as u32,
                DType::F16 => f16::from_f64(v).to_bits() as u32,
                _ => (v as f32).to_bits(),
            }
        };
        let dec = |t: DType, b: u32| -> f64 {
            match t {
                DType::BF16 => bf16::from_bits(b as u16).to_f64(),
                DType::F16 => f16::from_bits(b as u16).to_f64(),
                _ => f32::from_bits(b) as f64,
            }
        };
        // Elements as u32 bits, 2-byte types packed two to a word.
        let store = |t: DType, v: &[u32]| -> Vec<u32> {
            match t.size() {
                4 => v.to_vec(),
                _ => (0..v.len().div_ceil(2)).map(|i| v[2 * i] | v.get(2 * i + 1).map_or(0, |&h| h << 16)).collect(),
            }
        };
        let load = |t: DType, words: &[u32], i: usize| -> u32 {
            match t.size() {
                4 => words[i],
                _ => (words[i / 2] >> (16 * (i % 2))) & 0xffff,
            }
        };
        const POISON: u32 = 0x7fc0_7fc0;
        for (input, output) in
            [(DType::BF16, DType::BF16), (DType::F16, DType::F16), (DType::F32, DType::F32), (DType::BF16, DType::F32)]
        {
            for (shared_b, accumulate) in [(true, false), (false, false), (false, true)] {
                let a_strides = [m * k + 3, k, 1];
                let a_vals: Vec<u32> = (0..batch * a_strides[0]).map(|i| enc(input, value(i))).collect();
                let mut a_mem = store(input, &a_vals);
                // B column-major [k, n] per batch, or one row-major B.
                let b_strides = if shared_b { [0, n, 1] } else { [k * n, 1, k] };
                let b_len = if shared_b { k * n } else { batch * k * n };
                let b_vals: Vec<u32> = (0..b_len).map(|i| enc(input, value(i + 100))).collect();
                let mut b_mem = store(input, &b_vals);
                let c_strides = [m * (n + 2) + 5, n + 2, 1];
                let c_len = batch * c_strides[0];
                let c_old: Vec<u32> = (0..c_len)
                    .map(|i| {
                        if accumulate {
                            enc(output, value(i + 7))
                        } else {
                            POISON & if output.size() == 2 { 0xffff } else { u32::MAX }
                        }
                    })
                    .collect();
                let mut c_mem = store(output, &c_old);
                let arr = |addr: *mut u32, t: DType, shape: [usize; 3], strides: [usize; 3]| Array {
                    addr: addr as u64,
                    dtype: t,
                    shape: shape.to_vec(),
                    strides: strides.to_vec(),
                };
                let (av, bv, cv) = (
                    arr(a_mem.as_mut_ptr(), input, [batch, m, k], a_strides),
                    arr(b_mem.as_mut_ptr(), input, [batch, k, n], b_strides),
                    arr(c_mem.as_mut_ptr(), output, [batch, m, n], c_strides),
                );
                gemm(&cv, &av, &bv, accumulate).unwrap();
                let what = format!("{input} into {output}, shared B {shared_b}, accumulate {accumulate}");
                let mut held = vec![false; c_len];
                for t in 0..batch {
                    for i in 0..m {
                        for j in 0..n {
                            let dot: f64 = (0..k)
                                .map(|p| {
                                    let a = dec(input, a_vals[t * a_strides[0] + i * a_strides[1] + p]);
                                    let b = dec(input, b_vals[t * b_strides[0] + p * b_strides[1] + j * b_strides[2]]);
                                    a * b
                                })
                                .sum();
                            let at = t * c_strides[0] + i * c_strides[1] + j;
                            let old = if accumulate { dec(output, c_old[at]) } else { 0.0 };
                            held[at] = true;
                            assert_eq!(load(output, &c_mem, at), enc(output, dot + old), "{what}: C[{t}, {i}, {j}]");
                        }
                    }
                }
                for (at, _) in held.iter().enumerate().filter(|(_, &h)| !h) {
                    assert_eq!(load(output, &c_mem, at), c_old[at], "{what}: the gap at {at} was written");
                }
            }
        }
    }

    #[test]
    fn mixed_types_strides_and_accumulation() {
        // a = [[1, 2], [3, 4], [5, 6]] stored column-major in bf16.
        let mut a: Vec<u16> = [1f32, 3., 5., 2., 4., 6.].iter().map(|&v| bf16::from_f32(v).to_bits()).collect();
        let mut b = vec![1f32, 0., 2., 0., 1., 3.]; // [[1, 0, 2], [0, 1, 3]]
        let mut c = vec![100f32; 9];
        let av = Array { addr: a.as_mut_ptr() as u64, dtype: DType::BF16, shape: vec![3, 2], strides: vec![1, 3] };
        let bv = Array::contiguous(b.as_mut_ptr() as u64, DType::F32, &[2, 3]);
        let cv = Array::contiguous(c.as_mut_ptr() as u64, DType::F32, &[3, 3]);
        gemm(&cv, &av, &bv, false).unwrap();
        assert_eq!(c, vec![1., 2., 8., 3., 4., 18., 5., 6., 28.]);
        gemm(&cv, &av, &bv, true).unwrap();
        assert_eq!(c, vec![2., 4., 16., 6., 8., 36., 10., 12., 56.]);
        let mut h = vec![0u16; 9];
        let hv = Array::contiguous(h.as_mut_ptr() as u64, DType::BF16, &[3, 3]);
        gemm(&hv, &av, &bv, false).unwrap();
        assert_eq!(bf16::from_bits(h[8]).to_f32(), 28.0);
        // Accumulating into bf16 too (through f32).
        gemm(&hv, &av, &bv, true).unwrap();
        assert_eq!(bf16::from_bits(h[8]).to_f32(), 56.0);
    }
}
