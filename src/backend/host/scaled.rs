//! Scaled (fp8) matrix products on the host, the reference the CUDA path is
//! held to: the fp8 values decoded exactly, their products summed in f32,
//! then, in cuBLASLt's order, the product times the scales plus the bias
//! (plus the output's old values when accumulating), rounded once to the
//! output type; and fp8 outputs written from such a product
//! (`Backend::quantize`).

use super::{elementwise, matmul};
use crate::array::{Array, DType};
use crate::backend::{GemmScales, Quantize};
use crate::error::{err, Result};

pub fn scaled_gemm(dst: &Array, a: &Array, b: &Array, scales: &GemmScales, accumulate: bool) -> Result<()> {
    let (m, n) = (dst.shape[0], dst.shape[1]);
    scales.check(m, n, dst.dtype)?;
    let mut acc = vec![0f32; m * n];
    let product = Array::contiguous(acc.as_mut_ptr() as u64, DType::F32, &[m, n]);
    matmul::gemm(&product, a, b, false)?;
    // The old values, in f32, to add before the one rounding into `dst`.
    let old = match accumulate {
        true => {
            let mut v = vec![0f32; m * n];
            elementwise::copy(&Array::contiguous(v.as_mut_ptr() as u64, DType::F32, &[m, n]), dst)?;
            Some(v)
        }
        false => None,
    };
    let (sa, sb) = (values(&scales.a)?, values(&scales.b)?);
    let bias = scales.bias.as_ref().map(values).transpose()?;
    for (i, row) in acc.chunks_exact_mut(n).enumerate() {
        let s = sa[if scales.row_wise { i } else { 0 }];
        for (j, v) in row.iter_mut().enumerate() {
            *v *= s * sb[if scales.row_wise { j } else { 0 }];
            if let Some(bias) = &bias {
                *v += bias[j];
            }
            if let Some(old) = &old {
                *v += old[i * n + j];
            }
        }
    }
    elementwise::copy(dst, &product)
}

/// See [`Quantize`].
pub fn quantize(q: &Quantize) -> Result<()> {
    let Quantize { dst, src, bias, bias_weight, scale } = *q;
    let fmt = dst.dtype.fp8();
    let (m, n) = (src.shape[0], src.shape[1]);
    let bias_ok = bias.is_none_or(|b| b.shape == [n] && b.dtype.is_unscaled_float() && b.dtype != DType::F32);
    let ok = dst.ndim() == 2 && dst.shape == src.shape && src.dtype == DType::F32 && src.is_contiguous();
    let (Some(fmt), true, true) = (fmt, ok, bias_ok && scale.is_none_or(|s| s.numel() == 1)) else {
        return Err(err!(Internal, "quantizing {src:?} into {dst:?} with bias {bias:?}, scale {scale:?}"));
    };
    let bias = bias.map(values).transpose()?;
    let scale = scale.map(values).transpose()?.map_or(1.0, |s| s[0]);
    // SAFETY: the operations hand over a contiguous f32 `src` of m x n in
    // memory the caller promised (checked extents).
    let src = unsafe { std::slice::from_raw_parts(src.addr as *const f32, m * n) };
    for (i, row) in src.chunks_exact(n).enumerate() {
        for (j, &v) in row.iter().enumerate() {
            let v = bias.as_ref().map_or(v, |b| v + bias_weight * b[j]);
            let at = dst.addr as usize + i * dst.strides[0] + j * dst.strides[1];
            // SAFETY: element (i, j) of `dst`, inside its checked extent.
            unsafe { (at as *mut u8).write(fmt.encode(v * scale)) };
        }
    }
    Ok(())
}

/// The elements of a vector, as f32.
fn values(v: &Array) -> Result<Vec<f32>> {
    let mut out = vec![0f32; v.numel()];
    let dst = Array::contiguous(out.as_mut_ptr() as u64, DType::F32, &v.shape);
    elementwise::copy(&dst, v)?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::bf16;

    fn f32s(v: &mut [f32], shape: &[usize]) -> Array {
        Array::contiguous(v.as_mut_ptr() as u64, DType::F32, shape)
    }

    /// Scales and bias as backends take them: 16-byte aligned.
    #[repr(align(16))]
    struct Aligned<T>(T);

    #[test]
    fn tensor_and_row_wise_scales_and_bias() {
        // A = [[1, 2], [-1, 0.5]] in e4m3 (0x38 = 1, 0x40 = 2, 0xb8 = -1, 0x30 = 0.5).
        let mut a = [0x38u8, 0x40, 0xb8, 0x30];
        // B = [[1, 2, 1], [2, 1, 0]] column-major (B^T row-major), e5m2 (0x3c = 1, 0x40 = 2).
        let mut b = [0x3cu8, 0x40, 0x40, 0x3c, 0x3c, 0x00];
        let av = Array { addr: a.as_mut_ptr() as u64, dtype: DType::F8E4M3, shape: vec![2, 2], strides: vec![2, 1] };
        let bv = Array { addr: b.as_mut_ptr() as u64, dtype: DType::F8E5M2, shape: vec![2, 3], strides: vec![1, 2] };
        // A @ B = [[5, 4, 1], [0, -1.5, -1]].
        let (mut sa, mut sb) = (Aligned([2f32]), Aligned([0.5f32]));
        let mut out = [f32::NAN; 6];
        let tensor = GemmScales { row_wise: false, a: f32s(&mut sa.0, &[1]), b: f32s(&mut sb.0, &[1]), bias: None };
        scaled_gemm(&f32s(&mut out, &[2, 3]), &av, &bv, &tensor, false).unwrap();
        assert_eq!(out, [5., 4., 1., 0., -1.5, -1.]);

        let (mut ra, mut rb) = (Aligned([1f32, 10.]), Aligned([1f32, 2., 4.]));
        let mut bias = Aligned([0.25f32, 0., -1.].map(|v| bf16::from_f32(v).to_bits()));
        let bias = Array::contiguous(bias.0.as_mut_ptr() as u64, DType::BF16, &[3]);
        let mut out = [0u16; 6];
        let outv = Array::contiguous(out.as_mut_ptr() as u64, DType::BF16, &[2, 3]);
        let rows = GemmScales { row_wise: true, a: f32s(&mut ra.0, &[2]), b: f32s(&mut rb.0, &[3]), bias: Some(bias) };
        scaled_gemm(&outv, &av, &bv, &rows, false).unwrap();
        let got: Vec<f32> = out.iter().map(|&h| bf16::from_bits(h).to_f32()).collect();
        assert_eq!(got, [5.25, 8., 3., 0.25, -30., -41.]);
        // Accumulated: the same again on top.
        scaled_gemm(&outv, &av, &bv, &rows, true).unwrap();
        let got: Vec<f32> = out.iter().map(|&h| bf16::from_bits(h).to_f32()).collect();
        assert_eq!(got, [10.5, 16., 6., 0.5, -60., -82.]);

        // Scales of the wrong length are a bug in the caller.
        let short = GemmScales { row_wise: true, a: f32s(&mut ra.0, &[1]), ..rows.clone() };
        assert_eq!(scaled_gemm(&outv, &av, &bv, &short, false).unwrap_err().kind, crate::error::ErrorKind::Internal);
        // Columns 1..3 narrow B's scales and the bias; so misaligned, a
        // backend refuses them (the operations copy such vectors aligned).
        let cols = rows.columns(1, 2);
        let (b, bias) = (&cols.b, cols.bias.as_ref().unwrap());
        assert_eq!(
            (b.addr, &b.shape, bias.addr, &bias.shape),
            (rows.b.addr + 4, &vec![2], rows.bias.as_ref().unwrap().addr + 2, &vec![2])
        );
        let mut two_bf16 = [0u16; 4];
        let twov = Array::contiguous(two_bf16.as_mut_ptr() as u64, DType::BF16, &[2, 2]);
        assert_eq!(
            scaled_gemm(&twov, &av, &bv.narrow(1, 1, 2), &cols, false).unwrap_err().kind,
            crate::error::ErrorKind::Internal
        );
        assert_eq!(two_bf16, [0; 4]);
    }

    #[test]
    fn quantize_adds_weighted_bias_scales_and_saturates() {
        use half::f16;
        // src [2, 3]; dst is its transpose's storage (column-major), e4m3.
        let mut src = [1.0f32, 17.5, -600.0, f32::NAN, 0.75, 3.0];
        let srcv = f32s(&mut src, &[2, 3]);
        let mut dst = [0xaau8; 6];
        let dstv =
            Array { addr: dst.as_mut_ptr() as u64, dtype: DType::F8E4M3, shape: vec![2, 3], strides: vec![1, 2] };
        let mut bias: Vec<u16> = [0.5f32, -1.0, 0.0].iter().map(|&v| f16::from_f32(v).to_bits()).collect();
        let biasv = Array::contiguous(bias.as_mut_ptr() as u64, DType::F16, &[3]);
        let mut scale = [2f32];
        let q = Quantize {
            dst: &dstv,
            src: &srcv,
            bias: Some(&biasv),
            bias_weight: 2.0,
            scale: Some(&f32s(&mut scale, &[1])),
        };
        quantize(&q).unwrap();
        // (v + 2 * bias) * 2: 4, 31 (a tie between 30, 0x5f, and 32, 0x60:
        // to the even code), -1200 (saturates), NaN, -2.5, 6.
        let want = |r: usize, c: usize| [[0x48u8, 0x60, 0xfe], [0x7f, 0xc2, 0x4c]][r][c];
        for (r, c) in [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)] {
            assert_eq!(dst[r + 2 * c], want(r, c), "({r}, {c})");
        }
        // No bias and no scale: the values as they are, e5m2.
        let mut e5 = [0u8; 6];
        let e5v = Array::contiguous(e5.as_mut_ptr() as u64, DType::F8E5M2, &[2, 3]);
        quantize(&Quantize { dst: &e5v, src: &srcv, bias: None, bias_weight: 1.0, scale: None }).unwrap();
        let fmt = crate::fp8::Fp8::E5M2;
        let got: Vec<f32> = e5.iter().map(|&b| fmt.decode(b)).collect();
        assert_eq!((got[0], got[1], got[2], got[4], got[5]), (1.0, 16.0, -640.0, 0.75, 3.0));
        assert!(got[3].is_nan());
        // A non-fp8 destination is a bug in the caller.
        let mut f = [0f32; 6];
        let e =
            quantize(&Quantize { dst: &f32s(&mut f, &[2, 3]), src: &srcv, bias: None, bias_weight: 1.0, scale: None });
        assert_eq!(e.unwrap_err().kind, crate::error::ErrorKind::Internal);
    }
}
