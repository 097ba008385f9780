//! TMA descriptors (`CUtensorMap`) of the sm90 matmul's operands: A, B and
//! C in boxes of one k-block (128 bytes, the swizzle's width), and the
//! reduce-scatter's inboxes.

use super::{Operand, BK_BYTES, MAX_CHUNKS};
use crate::backend::cuda::driver::check;
use crate::backend::cuda::gemm::GemmDtype;
use crate::error::Result;
use cudarc::driver::sys;
use std::ffi::c_void;

/// A `CUtensorMap` (128 bytes, 64-byte aligned).
#[repr(C, align(64))]
#[derive(Clone, Copy)]
pub(super) struct TensorMap(pub(super) [u64; 16]);

/// Mirror of `struct symm_rs_maps`: the reduce-scatter's TMA maps (rs_push).
#[repr(C)]
#[derive(Clone, Copy)]
pub(super) struct RsMaps {
    /// This rank's inbox, `[world][chunk_rows][n]`, boxes of 128 rows of one slot.
    pub(super) inbox: TensorMap,
    /// `push[d]`: rank d's inbox slot for this rank, `[chunk_rows][n]`.
    pub(super) push: [TensorMap; MAX_CHUNKS],
}

/// Element type of a tensor map: C's or a 16-bit input's type, or bytes
/// (fp8: TMA only moves them).
#[derive(Clone, Copy)]
pub(super) enum MapType {
    Elem(GemmDtype),
    Byte,
}

impl MapType {
    pub(super) fn size(self) -> usize {
        match self {
            MapType::Elem(t) => t.size(),
            MapType::Byte => 1,
        }
    }
}

/// A 2-D tensor map over `o` (`o.rows` rows of `k` elements) with boxes of
/// `box_rows` rows of a k-block (128 bytes), 128-byte swizzle, zeros outside.
pub(super) fn encode(ty: MapType, o: &Operand, k: usize, box_rows: usize) -> Result<TensorMap> {
    encode_box(ty, o, k, BK_BYTES / ty.size(), box_rows)
}

/// As [`encode`], boxes of `box_rows x box_cols` elements (`box_cols`
/// times the element size must be 128 bytes for the swizzle).
pub(super) fn encode_box(ty: MapType, o: &Operand, k: usize, box_cols: usize, box_rows: usize) -> Result<TensorMap> {
    encode_tiled(
        ty,
        o.ptr,
        &[k as u64, o.rows as u64],
        &[(o.ld * ty.size()) as u64],
        &[box_cols as u32, box_rows as u32],
    )
}

/// A tensor map of `dims` (innermost first) at `base`, `strides` bytes
/// between the outer dimensions' elements, boxes of `boxes`, 128-byte
/// swizzle, zeros outside.
pub(super) fn encode_tiled(ty: MapType, base: u64, dims: &[u64], strides: &[u64], boxes: &[u32]) -> Result<TensorMap> {
    use sys::CUtensorMapDataType::*;
    let data_type = match ty {
        MapType::Elem(GemmDtype::F16) => CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
        MapType::Elem(GemmDtype::F32) => CU_TENSOR_MAP_DATA_TYPE_FLOAT32,
        MapType::Elem(_) => CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
        MapType::Byte => CU_TENSOR_MAP_DATA_TYPE_UINT8,
    };
    let elem_strides = [1u32; 3];
    assert!(
        strides.len() + 1 == dims.len() && boxes.len() == dims.len() && dims.len() <= elem_strides.len(),
        "one stride per outer dimension, at most 3 dimensions"
    );
    let mut map = TensorMap([0; 16]);
    // SAFETY: dims, boxes and elem_strides hold the rank's elements
    // (checked above; elem_strides at least), strides one fewer; the map is
    // 128 bytes, 64-byte aligned.
    check(
        unsafe {
            sys::cuTensorMapEncodeTiled(
                (&mut map as *mut TensorMap).cast(),
                data_type,
                dims.len() as u32,
                base as *mut c_void,
                dims.as_ptr(),
                strides.as_ptr(),
                boxes.as_ptr(),
                elem_strides.as_ptr(),
                sys::CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
                sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
                sys::CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                sys::CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
            )
        },
        "cuTensorMapEncodeTiled",
    )?;
    Ok(map)
}
