//! Scaled (fp8) matmuls: what `torch._scaled_mm` computes, and what torch's
//! `fused_all_gather_scaled_matmul` and `fused_scaled_matmul_reduce_scatter`
//! build on it:
//!
//! `out = (A * a_scale) @ (B * b_scale) (+ bias)`, products summed in f32,
//! with A and B 8-bit floats (e4m3 or e5m2, not both e5m2) and the output
//! bf16, f16, f32 or fp8. Scales are f32 and either tensor-wise (each one
//! element) or row-wise (`a_scale` one per row of A, shaped like A with the
//! last dimension 1; `b_scale` `[1, N]`); as in torch, the call is
//! tensor-wise exactly when every scale holds one element. The bias is
//! `[N]` of the output dtype, bf16 or f16 (cuBLASLt, and so torch, has no
//! bias for f32 outputs); for an fp8 output bf16 or f16.
//!
//! An fp8 output is `fp8(result * result_scale)`, the result scale one f32
//! (absent: 1), rounded once to nearest even and saturated to the format's
//! largest finite value, NaN kept: cuBLASLt's D scale
//! (`CUBLASLT_MATMUL_DESC_D_SCALE_POINTER`, "converts results from the
//! compute type's range to the storage type's"), the meaning torch
//! documents for `_scaled_mm`'s `scale_result`. (torch 2.11's CUDA
//! `_scaled_mm` ignores it, measured on an H200, and its CPU emulation
//! divides by it.) The operations compute such a
//! product in f32 and round it with `Backend::quantize`.
//!
//! Layout, as cuBLASLt's fp8 kernels need and torch requires: B
//! column-major (`W.t()` of a row-major `[N, K]` weight) with its column
//! stride a multiple of 16 and 16-byte aligned data, and K and each
//! matmul's N multiples of 16. These hold on every backend, so that a call
//! that works on the host backend works on CUDA. A, being copied or packed
//! by the operations where needed, may have any strides.
//!
//! Each check names the argument as the C caller wrote it. None touches
//! memory.

use super::check;
use crate::array::{Array, DType};
use crate::backend::Backend;
use crate::error::{err, Result};

/// How the scales apply.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// One scale for A and one for each B.
    Tensor,
    /// One scale per row of A and per column of each B.
    Row,
}

impl Mode {
    /// Tensor-wise when every scale holds one element (torch's rule).
    pub fn of(a_scale: &Array, b_scales: &[&Array]) -> Mode {
        if a_scale.numel() == 1 && b_scales.iter().all(|s| s.numel() == 1) {
            Mode::Tensor
        } else {
            Mode::Row
        }
    }
}

/// Whether `backend` runs the fp8 matmuls of a plan with scale mode `mode`
/// (`None`: not fp8); asked while planning, so a call the backend cannot run
/// fails before any data moves.
pub fn check_backend(backend: &dyn Backend, mode: Option<Mode>) -> Result<()> {
    match mode {
        Some(m) => backend.check_scaled_gemm(m == Mode::Row),
        None => Ok(()),
    }
}

/// Granule of K and N (and of B's column stride) for fp8 matmuls.
const GRANULE: usize = 16;

/// A matmul whose A is not fp8 takes no scales (they would mean nothing)
/// and, as torch's unscaled ops, no bias. `set` names the options given.
pub fn unscaled(a: &Array, a_name: &str, scales_set: &[&str], biases_set: &[&str]) -> Result<()> {
    if let Some(name) = scales_set.first() {
        return Err(err!(
            InvalidArgument,
            "{name} is set but {a_name} is {}: scales apply to fp8 matmuls only; leave it NULL",
            a.dtype
        ));
    }
    if let Some(name) = biases_set.first() {
        return Err(err!(
            Unsupported,
            "{name} is set but {a_name} is {}: biases are supported with fp8 (scaled) matmuls only, as in \
             torch's scaled operations",
            a.dtype
        ));
    }
    Ok(())
}

/// An fp8 A needs its scales.
pub fn required(a: &Array, a_name: &str, missing: &[&str]) -> Result<()> {
    if missing.is_empty() {
        return Ok(());
    }
    Err(err!(
        InvalidArgument,
        "{a_name} is {}, and fp8 matmuls need scales: set {} (as torch._scaled_mm's scale_a and scale_b)",
        a.dtype,
        missing.join(" and ")
    ))
}

/// B of an fp8 matmul with A: fp8 too, not both e5m2, and K-major.
pub fn b_operand(b: &Array, b_name: &str, a: &Array, a_name: &str) -> Result<()> {
    if b.dtype.fp8().is_none() {
        return Err(err!(
            InvalidArgument,
            "{b_name}.dtype is {}; expected an fp8 type, as {a_name} is {}",
            b.dtype,
            a.dtype
        ));
    }
    if a.dtype == DType::F8E5M2 && b.dtype == DType::F8E5M2 {
        return Err(err!(
            Unsupported,
            "{a_name} and {b_name} are both fp8_e5m2, which cuBLASLt (and so torch._scaled_mm) cannot multiply; \
             make one of them fp8_e4m3"
        ));
    }
    check::ndim_is(b, b_name, 2)?;
    let column_major = b.strides[0] == 1 || b.shape[0] == 1;
    let ld = b.strides[1];
    if !column_major || ld % GRANULE != 0 || (b.shape[1] > 1 && ld < b.shape[0]) || b.addr % GRANULE as u64 != 0 {
        return Err(err!(
            Unsupported,
            "{b_name} has strides {:?} at {:#x}; fp8 matmuls need B column-major (strides [1, ld] with ld a \
             multiple of {GRANULE}, e.g. W.t() of a row-major [N, K] W) at a 16-byte aligned address, as \
             cuBLASLt and torch._scaled_mm do",
            b.strides,
            b.addr
        ));
    }
    Ok(())
}

/// K and N of one fp8 matmul are multiples of the granule.
pub fn sizes(k: usize, n: usize, what: &str) -> Result<()> {
    if k % GRANULE != 0 || n % GRANULE != 0 {
        return Err(err!(
            Unsupported,
            "{what} has K = {k} and N = {n}; fp8 matmuls need both to be multiples of {GRANULE} \
             (as cuBLASLt and torch._scaled_mm)"
        ));
    }
    Ok(())
}

/// The output of an fp8 matmul.
pub fn output(out: &Array, name: &str) -> Result<()> {
    if out.dtype.is_unscaled_float() || out.dtype.fp8().is_some() {
        return Ok(());
    }
    Err(err!(Unsupported, "{name}.dtype is {}; fp8 matmuls write bf16, f16, f32 or an fp8 type", out.dtype))
}

/// The result scale of output `out`: one f32, for an fp8 output only.
pub fn result_scale(t: &Array, name: &str, out: &Array, out_name: &str) -> Result<()> {
    if out.dtype.fp8().is_none() {
        return Err(err!(
            InvalidArgument,
            "{name} is set but {out_name} is {}: a result scale applies to fp8 outputs only; leave it NULL",
            out.dtype
        ));
    }
    f32_scale(t, name)?;
    if t.numel() != 1 {
        return Err(err!(InvalidArgument, "{name}.shape is {:?}; expected one element", t.shape));
    }
    Ok(())
}

fn f32_scale(t: &Array, name: &str) -> Result<()> {
    if t.dtype != DType::F32 {
        return Err(err!(InvalidArgument, "{name}.dtype is {}; scales are f32", t.dtype));
    }
    Ok(())
}

/// `a_scale` of A with shape `a_shape`: one element, or (row-wise) A's
/// shape with the last dimension 1. Any strides.
pub fn a_scale(t: &Array, name: &str, a_shape: &[usize], mode: Mode) -> Result<()> {
    f32_scale(t, name)?;
    let mut rows = a_shape.to_vec();
    *rows.last_mut().expect("A has dimensions") = 1;
    if mode == Mode::Row && t.shape != rows {
        return Err(err!(
            InvalidArgument,
            "{name}.shape is {:?}; expected {rows:?} for row-wise scales (or one element, with one-element \
             B scales, for tensor-wise)",
            t.shape
        ));
    }
    Ok(())
}

/// `b_scale` of a B with `n` columns: one element, or (row-wise) a
/// contiguous `[1, n]`.
pub fn b_scale(t: &Array, name: &str, n: usize, mode: Mode) -> Result<()> {
    f32_scale(t, name)?;
    if mode == Mode::Row && t.shape != [1, n] {
        return Err(err!(
            InvalidArgument,
            "{name}.shape is {:?}; expected [1, {n}] for row-wise scales (or one element, with a one-element \
             a_scale, for tensor-wise)",
            t.shape
        ));
    }
    if !t.is_contiguous() {
        return Err(err!(InvalidArgument, "{name} has strides {:?}; expected a contiguous vector", t.strides));
    }
    Ok(())
}

/// The bias of a matmul with output `out` of `n` columns.
pub fn bias(t: &Array, name: &str, n: usize, out: &Array, out_name: &str) -> Result<()> {
    if out.dtype == DType::F32 {
        return Err(err!(
            Unsupported,
            "{name} is set but {out_name} is f32; a bias needs a bf16, f16 or fp8 output (as torch._scaled_mm: \
             cuBLASLt adds bf16 and f16 biases only)"
        ));
    }
    if out.dtype.fp8().is_some() {
        if !matches!(t.dtype, DType::BF16 | DType::F16) {
            return Err(err!(
                InvalidArgument,
                "{name}.dtype is {}; the bias of an fp8 output is bf16 or f16 (as torch._scaled_mm)",
                t.dtype
            ));
        }
    } else {
        check::same_dtype(t, name, out.dtype, out_name)?;
    }
    check::shape_is(t, name, &[n])?;
    if !t.is_contiguous() {
        return Err(err!(InvalidArgument, "{name} has strides {:?}; expected a contiguous vector", t.strides));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::ErrorKind;

    fn t(dtype: DType, shape: &[usize]) -> Array {
        Array::contiguous(0x1000, dtype, shape)
    }

    fn col_major(dtype: DType, k: usize, n: usize) -> Array {
        Array { addr: 0x2000, dtype, shape: vec![k, n], strides: vec![1, k] }
    }

    #[test]
    fn mode_follows_torch() {
        let one = t(DType::F32, &[1]);
        let rows = t(DType::F32, &[8, 1]);
        let cols = t(DType::F32, &[1, 32]);
        assert_eq!(Mode::of(&one, &[&one, &t(DType::F32, &[1, 1])]), Mode::Tensor);
        assert_eq!(Mode::of(&rows, &[&cols]), Mode::Row);
        // A one-row A with a [1, 1] scale is row-wise when B's is a vector.
        assert_eq!(Mode::of(&t(DType::F32, &[1, 1]), &[&cols]), Mode::Row);
    }

    #[test]
    fn operands_and_layouts() {
        let a = t(DType::F8E5M2, &[4, 32]);
        assert!(b_operand(&col_major(DType::F8E4M3, 32, 16), "b", &a, "a").is_ok());
        let e = b_operand(&col_major(DType::F8E5M2, 32, 16), "b", &a, "a").unwrap_err();
        assert_eq!(e.kind, ErrorKind::Unsupported);
        assert!(e.msg.contains("both fp8_e5m2"), "{}", e.msg);
        let e = b_operand(&col_major(DType::BF16, 32, 16), "bs[1]", &a, "a_shard").unwrap_err();
        assert_eq!(e.msg, "bs[1].dtype is bf16; expected an fp8 type, as a_shard is fp8_e5m2");
        let row_major = t(DType::F8E4M3, &[32, 16]);
        let e = b_operand(&row_major, "b", &a, "a").unwrap_err();
        assert_eq!(e.kind, ErrorKind::Unsupported);
        assert!(e.msg.contains("need B column-major"), "{}", e.msg);
        let padded = Array { strides: vec![1, 40], ..col_major(DType::F8E4M3, 32, 16) };
        assert!(b_operand(&padded, "b", &a, "a").is_err(), "ld 40 is no multiple of 16");
        let misaligned = Array { addr: 0x2008, ..col_major(DType::F8E4M3, 32, 16) };
        assert!(b_operand(&misaligned, "b", &a, "a").is_err());
        assert!(sizes(32, 48, "bs[0]").is_ok());
        assert_eq!(sizes(24, 16, "bs[0]").unwrap_err().msg.split(';').next().unwrap(), "bs[0] has K = 24 and N = 16");
        assert!(output(&t(DType::F8E4M3, &[2]), "out").is_ok() && output(&t(DType::F32, &[2]), "out").is_ok());
    }

    #[test]
    fn scales_and_bias() {
        let a_shape = [2, 3, 32];
        assert!(a_scale(&t(DType::F32, &[2, 3, 1]), "s", &a_shape, Mode::Row).is_ok());
        let e = a_scale(&t(DType::F32, &[6, 1]), "opts->a_scale", &a_shape, Mode::Row).unwrap_err();
        assert!(e.msg.starts_with("opts->a_scale.shape is [6, 1]; expected [2, 3, 1]"), "{}", e.msg);
        let e = a_scale(&t(DType::BF16, &[1]), "opts->a_scale", &a_shape, Mode::Tensor).unwrap_err();
        assert_eq!(e.msg, "opts->a_scale.dtype is bf16; scales are f32");
        assert!(b_scale(&t(DType::F32, &[1, 16]), "s", 16, Mode::Row).is_ok());
        assert!(b_scale(&t(DType::F32, &[16, 1]), "s", 16, Mode::Row).is_err());
        let strided = Array { strides: vec![16, 2], ..t(DType::F32, &[1, 16]) };
        assert!(b_scale(&strided, "s", 16, Mode::Row).unwrap_err().msg.contains("contiguous"));
        let out = t(DType::BF16, &[4, 16]);
        assert!(bias(&t(DType::BF16, &[16]), "opts->bias", 16, &out, "out").is_ok());
        let e = bias(&t(DType::F16, &[16]), "opts->bias", 16, &out, "out").unwrap_err();
        assert_eq!(e.msg, "opts->bias.dtype is f16; expected bf16, the dtype of out");
        let e = bias(&t(DType::F32, &[16]), "opts->bias", 16, &t(DType::F32, &[4, 16]), "out").unwrap_err();
        assert_eq!(e.kind, ErrorKind::Unsupported);
        assert!(bias(&t(DType::BF16, &[8]), "opts->bias", 16, &out, "out").is_err());
        // An fp8 output takes a bf16 or f16 bias, and a one-element f32 result scale.
        let fp8 = t(DType::F8E5M2, &[4, 16]);
        assert!(bias(&t(DType::F16, &[16]), "b", 16, &fp8, "out").is_ok());
        assert!(bias(&t(DType::BF16, &[16]), "b", 16, &fp8, "out").is_ok());
        let e = bias(&t(DType::F32, &[16]), "opts->bias", 16, &fp8, "out").unwrap_err();
        assert_eq!(e.msg, "opts->bias.dtype is f32; the bias of an fp8 output is bf16 or f16 (as torch._scaled_mm)");
        assert!(result_scale(&t(DType::F32, &[1, 1]), "s", &fp8, "out").is_ok());
        let e = result_scale(&t(DType::F32, &[1]), "opts->result_scale", &out, "out").unwrap_err();
        assert_eq!(e.kind, ErrorKind::InvalidArgument);
        assert!(e.msg.starts_with("opts->result_scale is set but out is bf16"), "{}", e.msg);
        assert_eq!(
            result_scale(&t(DType::F32, &[2]), "s", &fp8, "out").unwrap_err().msg,
            "s.shape is [2]; expected one element"
        );
        assert_eq!(
            result_scale(&t(DType::BF16, &[1]), "s", &fp8, "out").unwrap_err().msg,
            "s.dtype is bf16; scales are f32"
        );
    }

    #[test]
    fn options_without_fp8() {
        let a = t(DType::BF16, &[4, 8]);
        assert!(unscaled(&a, "a", &[], &[]).is_ok());
        let e = unscaled(&a, "a", &["opts->a_scale"], &[]).unwrap_err();
        assert_eq!(e.kind, ErrorKind::InvalidArgument);
        assert!(e.msg.starts_with("opts->a_scale is set but a is bf16"), "{}", e.msg);
        assert_eq!(unscaled(&a, "a", &[], &["opts->bias"]).unwrap_err().kind, ErrorKind::Unsupported);
        let fp8 = t(DType::F8E4M3, &[4, 32]);
        let e = required(&fp8, "a", &["opts->a_scale", "opts->b_scale"]).unwrap_err();
        assert!(e.msg.contains("set opts->a_scale and opts->b_scale"), "{}", e.msg);
    }
}
