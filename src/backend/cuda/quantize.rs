//! fp8 outputs on CUDA (kernels/quantize.cu): an f32 product with its bias
//! and result scale rounded once into an fp8 matrix (`Backend::quantize`).

use super::module::{arg, Kernels};
use crate::array::DType;
use crate::backend::{Quantize, Stream};
use crate::error::{err, Result};
use crate::fp8::Fp8;
use std::ffi::c_void;

/// Threads per block (`SYMM_QUANTIZE_THREADS`).
const THREADS: u32 = 256;
/// Resident blocks per SM the grid aims for (grid-stride loops do the rest).
const BLOCKS_PER_SM: u32 = 8;

/// Enqueues `q` on `stream` (a stream of `kernels`' device).
pub fn quantize(kernels: &Kernels, q: &Quantize, stream: Stream) -> Result<()> {
    let Quantize { dst, src, bias, bias_weight, scale } = *q;
    let (rows, cols) = (src.shape[0], src.shape[1]);
    let bias_dtype = match bias.map(|b| b.dtype) {
        None => 0,
        Some(DType::BF16) => 1, // SYMM_DT_BF16
        Some(DType::F16) => 2,  // SYMM_DT_F16
        Some(other) => return Err(err!(Internal, "an fp8 output's bias of {other}")),
    };
    let shapes_ok = dst.ndim() == 2 && dst.shape == src.shape && src.is_contiguous() && src.dtype == DType::F32;
    let vectors_ok = bias.is_none_or(|b| b.shape == [cols]) && scale.is_none_or(|s| s.numel() == 1);
    let f = match dst.dtype.fp8() {
        Some(Fp8::E4M3) if shapes_ok && vectors_ok => &kernels.quantize[0],
        Some(Fp8::E5M2) if shapes_ok && vectors_ok => &kernels.quantize[1],
        _ => return Err(err!(Internal, "quantizing {src:?} into {dst:?} with bias {bias:?}, scale {scale:?}")),
    };
    let n = (rows * cols) as u64;
    if n == 0 {
        return Ok(());
    }
    let resident = kernels.sm_count.max(1) as u64 * BLOCKS_PER_SM as u64;
    let grid = n.div_ceil(THREADS as u64).min(resident).max(1) as u32;
    let mut out = dst.addr;
    let (mut row, mut col) = (dst.strides[0] as i64, dst.strides[1] as i64);
    let mut input = src.addr;
    let (mut m, mut nc) = (rows as u64, cols as u64);
    let mut bias_ptr = bias.map_or(0, |b| b.addr);
    let mut bias_dtype: i32 = bias_dtype;
    let mut weight = bias_weight;
    let mut scale_ptr = scale.map_or(0, |s| s.addr);
    let mut params: [*mut c_void; 10] = [
        arg(&mut out),
        arg(&mut row),
        arg(&mut col),
        arg(&mut input),
        arg(&mut m),
        arg(&mut nc),
        arg(&mut bias_ptr),
        arg(&mut bias_dtype),
        arg(&mut weight),
        arg(&mut scale_ptr),
    ];
    // SAFETY: the parameters match symm_quantize_*'s signature
    // (kernels/quantize.cu) and live until the launch returns; the
    // operations hand over arrays in this device's memory whose extents
    // they checked.
    unsafe { kernels.launch(f, grid, (THREADS, 1, 1), stream, &mut params, "the fp8 output kernel") }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::array::Array;
    use crate::backend::cuda::gpu_testing::gpu;
    use half::bf16;

    /// The kernel gives `Fp8::encode`'s bits (the host backend's) for every
    /// fp8 midpoint and its neighbours, a sweep of f32s, saturation, NaN and
    /// infinities; with a bias, weight and scale; into a transposed,
    /// poisoned destination whose gaps stay untouched.
    #[test]
    fn gpu_quantize_matches_the_host_encoder() {
        let Some(g) = gpu() else { return };
        for fmt in [Fp8::E4M3, Fp8::E5M2] {
            let mut v: Vec<f32> = Vec::new();
            let finite: Vec<f32> = (0..0x80u8).map(|b| fmt.decode(b)).filter(|x| x.is_finite()).collect();
            for w in finite.windows(2) {
                let mid = (w[0] + w[1]) / 2.0;
                v.extend([mid, -mid, f32::from_bits(mid.to_bits() + 1), f32::from_bits(mid.to_bits() - 1)]);
            }
            v.extend([f32::NAN, f32::INFINITY, -f32::INFINITY, 1e30, -1e30, 0.0, -0.0, 1e-40]);
            let mut x = 0x9e37_79b9u32;
            while v.len() % 64 != 0 || v.len() < 4096 {
                x ^= x << 13;
                x ^= x >> 17;
                x ^= x << 5;
                v.push(f32::from_bits((x & 0x8000_0000) | ((107 + (x >> 8) % 38) << 23) | (x & 0x7f_ffff)));
            }
            let (rows, cols) = (v.len() / 64, 64);
            let bias: Vec<bf16> = (0..cols).map(|j| bf16::from_f32(j as f32 / 8.0 - 4.0)).collect();
            let (weight, scale) = (3.0f32, 0.75f32);
            // dst column-major with a gap row: strides [1, rows + 1].
            let ld = rows + 1;
            let poison = vec![0xa5u8; ld * cols];
            let (src, bias_d, scale_d, dst) = (g.upload(&v), g.upload(&bias), g.upload(&[scale]), g.upload(&poison));
            let dst_a = Array {
                addr: dst.ptr,
                dtype: if fmt == Fp8::E4M3 { DType::F8E4M3 } else { DType::F8E5M2 },
                shape: vec![rows, cols],
                strides: vec![1, ld],
            };
            let src_a = Array::contiguous(src.ptr, DType::F32, &[rows, cols]);
            let bias_a = Array::contiguous(bias_d.ptr, DType::BF16, &[cols]);
            let scale_a = Array::contiguous(scale_d.ptr, DType::F32, &[1]);
            let q =
                Quantize { dst: &dst_a, src: &src_a, bias: Some(&bias_a), bias_weight: weight, scale: Some(&scale_a) };
            quantize(&g.kernels, &q, g.stream()).unwrap();
            g.sync();
            let got = dst.read::<u8>(ld * cols);
            for i in 0..rows {
                for j in 0..cols {
                    let want = fmt.encode((v[i * cols + j] + weight * bias[j].to_f32()) * scale);
                    assert_eq!(got[i + j * ld], want, "{fmt:?} ({i}, {j}): {}", v[i * cols + j]);
                }
                assert!((0..cols).all(|j| j * ld + rows >= got.len() || got[j * ld + rows] == 0xa5));
            }
        }
    }
}
