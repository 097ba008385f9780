//! Host side of `kernels/gemm_sm90.cu` and `gemm_sm90_rs.cu` (one kernel,
//! `kernels/sm90_kernel.cuh`, in two modes): symm's own persistent Hopper matmul,
//! whose tiles can wait for all-gathered rows or push reduce-scatter
//! partials (docs/sm90-kernel.md describes the design).
//!
//! Available only on compute capability 9.0 devices whose loaded module
//! holds the sm_90a code (checked once by launching a probe kernel), with
//! the driver's tensor-map encoder. Operands: A row-major `[m, k]`, B
//! K-major (stored `[n, k]`, a Linear weight), C row-major `[m, n]`; A and B
//! bf16 or f16 (C f32 or the input type), or fp8 with scales and an
//! optional bias as `torch._scaled_mm` (C f32, bf16 or f16); base addresses
//! and row strides 16-byte aligned (TMA's rules). [`Sm90Matmul::check`]
//! says why a problem does not qualify, and callers then use cuBLASLt.
//!
//! - `tiling`: tile width, narrow peer tiles and the column cut (pure
//!   functions of the shape and grid; the decision layer's inputs);
//! - `matmul`: one launch's description, built from a `FusedMatmul`;
//! - `tmap`: TMA descriptors;
//! - `launch`: the kernel's parameter block, entry points and launch.

#[doc(hidden)]
pub mod bench;
mod launch;
mod matmul;
mod tiling;
mod tmap;

#[cfg(test)]
mod tests;

pub use launch::Sm90Kernels;
pub(crate) use matmul::gemm_dtype;
pub use matmul::{Operand, Sm90Matmul};
pub use tiling::{fused_scatter_preferred, TileN};

/// Most row chunks (ranks) a fused call may have (`SYMM_GEMM_MAX_CHUNKS`).
pub(crate) const MAX_CHUNKS: usize = 16;
/// What a gathered slice's width must be a multiple of: whole k-blocks of
/// every input type (64 16-bit or 128 8-bit elements).
pub(crate) const SLICE_ALIGN: usize = 128;
/// Rows of a tile (`SYMM_GEMM_BM`).
pub(crate) const BM: usize = 128;
/// Row tiles walked together, column by column (`SYMM_GEMM_GROUP_M`).
const GROUP_M: usize = 8;
/// Bytes of each row of A and B in a k-block (`SYMM_GEMM_BK_BYTES`).
const BK_BYTES: usize = 128;
const THREADS: u32 = 384;
/// Shared memory staging C for TMA stores (`SYMM_GEMM_EPI_BYTES`).
const EPI_BYTES: usize = 2 * 16384;
/// The SM count that decisions made from the shape alone assume (tile
/// width, narrow peer tiles): every rank must number tiles, and their flags,
/// alike whatever its device, so none of them reads its own SM count.
const SHAPE_SMS: usize = 132;
/// Rows of C's TMA box (each consumer warpgroup stores 64 rows); its
/// columns span 128 bytes, the swizzle's width.
const C_BOX_ROWS: usize = 64;

// A gathered slice is whole k-blocks of every input type.
const _: () = assert!(SLICE_ALIGN % BK_BYTES == 0);

/// Driver entry points beyond the backend's base set.
pub(crate) const SYMBOLS: &[&str] = &["cuTensorMapEncodeTiled", "cuFuncSetAttribute"];
