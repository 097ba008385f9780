//! Matrix multiplication with cuBLASLt on ROW-MAJOR operands.
//!
//! cuBLASLt is loaded at run time like the driver: [`ensure_cublaslt`]
//! checks the library and every symbol used here before anything is called,
//! so a machine without `libcublasLt.so` gets an `Unsupported` error with a
//! message, never a panic (cudarc panics on a missing library or symbol).
//!
//! `C[m, n] = alpha * op(A)[m, k] @ op(B)[k, n] (+ C when accumulating)`, all
//! row-major with leading dimensions in elements. cuBLASLt is column-major,
//! so the product is computed as `C^T = op(B)^T op(A)^T`: a row-major matrix
//! with leading dimension `ld` is the same memory as its transpose in
//! column-major with the same `ld`, which swaps A with B and m with n and
//! needs no data movement (see [`ColMajor::from_row_major`]).
//!
//! fp8 matmuls ([`MatmulParams::fp8`]) follow `torch._scaled_mm`: both
//! operands K-major (A row-major, B column-major: cuBLASLt's fp8 kernels
//! take only the "TN" form, which is what they are after the swap), f32
//! scales by device pointer (tensor-wise, or row-wise through cuBLASLt's
//! outer-vector scale mode, cuBLASLt 12.9+ on Hopper and newer), and an
//! optional bias added by the epilogue.
//!
//! Descriptors, layouts and the heuristic's algorithm are cached per shape
//! key (which includes each pointer's alignment class and the workspace
//! size), so repeated calls and calls during CUDA graph capture do no
//! heuristic query once a shape has been seen. The workspace is plain
//! `cuMemAlloc` memory (never stream-ordered pool memory), allocated up
//! front, so matmuls are capture-safe.

use super::driver::{self, check};
use crate::backend::Stream;
use crate::error::{err, Error, ErrorKind, Result};
use cudarc::cublaslt::sys as lt;
use cudarc::driver::{sys, CudaContext};
use once_cell::sync::OnceCell;
use std::collections::HashMap;
use std::ffi::{c_void, CStr};
use std::sync::{Arc, Mutex};

/// Every cuBLASLt entry point this module calls, checked once up front.
const LT_SYMBOLS: &[&str] = &[
    "cublasLtGetVersion",
    "cublasLtGetStatusName",
    "cublasLtGetStatusString",
    "cublasLtCreate",
    "cublasLtDestroy",
    "cublasLtMatmulDescCreate",
    "cublasLtMatmulDescDestroy",
    "cublasLtMatmulDescSetAttribute",
    "cublasLtMatrixLayoutCreate",
    "cublasLtMatrixLayoutDestroy",
    "cublasLtMatrixLayoutSetAttribute",
    "cublasLtMatmulPreferenceCreate",
    "cublasLtMatmulPreferenceDestroy",
    "cublasLtMatmulPreferenceSetAttribute",
    "cublasLtMatmulAlgoGetHeuristic",
    "cublasLtMatmulAlgoConfigGetAttribute",
    "cublasLtMatmul",
];

/// Oldest cuBLASLt accepted (`cublasLtGetVersion()`: major * 10000 + minor * 100 + patch).
const MIN_VERSION: usize = 12_00_00;

/// Workspace sizes, as cuBLAS recommends: 32 MiB on Hopper and newer.
const WORKSPACE_SM90: usize = 32 << 20;
const WORKSPACE_OLDER: usize = 4 << 20;

/// More cached matmuls than this and the cache starts over (each matmul is a
/// few hundred bytes of host memory; this only bounds pathological use).
const MAX_MATMULS: usize = 4096;

/// The cuBLASLt version once the library and all its symbols are present.
pub fn ensure_cublaslt() -> Result<usize> {
    static CHECKED: OnceCell<std::result::Result<usize, String>> = OnceCell::new();
    CHECKED.get_or_init(check_cublaslt).clone().map_err(|m| Error::new(ErrorKind::Unsupported, m))
}

fn check_cublaslt() -> std::result::Result<usize, String> {
    // SAFETY: only dlopens candidate names; never panics.
    if !unsafe { lt::is_culib_present() } {
        return Err("cuBLASLt is not available: libcublasLt.so could not be loaded \
                    (install the CUDA toolkit's cuBLAS or the nvidia-cublas wheel and put it on the loader path)"
            .into());
    }
    // SAFETY: the library is present (same candidate list), so culib() does not panic.
    let lib = unsafe { lt::culib() };
    // SAFETY (in the closure): looking a symbol up has no side effects.
    let missing =
        super::driver::missing_symbols(LT_SYMBOLS, |n| unsafe { lib.get::<unsafe extern "C" fn()>(n) }.is_ok());
    if !missing.is_empty() {
        return Err(format!("the loaded cuBLASLt is too old: it lacks {}", missing.join(", ")));
    }
    // SAFETY: symbol checked above; no arguments.
    let version = unsafe { lt::cublasLtGetVersion() };
    if version < MIN_VERSION {
        return Err(format!(
            "the loaded cuBLASLt is version {}.{}.{}; symm needs 12.0 or newer",
            version / 10000,
            version / 100 % 100,
            version % 100
        ));
    }
    Ok(version)
}

/// Element types of the matmul (and of the reduction kernels, which index
/// their entry points by `as usize`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum GemmDtype {
    F32 = 0,
    BF16 = 1,
    F16 = 2,
}

impl GemmDtype {
    /// Bytes per element.
    pub const fn size(self) -> usize {
        match self {
            GemmDtype::F32 => 4,
            GemmDtype::BF16 | GemmDtype::F16 => 2,
        }
    }

    fn cuda(self) -> lt::cudaDataType {
        match self {
            GemmDtype::F32 => lt::cudaDataType::CUDA_R_32F,
            GemmDtype::BF16 => lt::cudaDataType::CUDA_R_16BF,
            GemmDtype::F16 => lt::cudaDataType::CUDA_R_16F,
        }
    }
}

pub use crate::fp8::Fp8;

impl Fp8 {
    fn cuda(self) -> lt::cudaDataType {
        match self {
            Fp8::E4M3 => lt::cudaDataType::CUDA_R_8F_E4M3,
            Fp8::E5M2 => lt::cudaDataType::CUDA_R_8F_E5M2,
        }
    }
}

/// What makes a matmul an fp8 one: `C = sa * sb * (A @ B) (+ bias)`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Fp8Params {
    pub a_type: Fp8,
    pub b_type: Fp8,
    /// Row-wise: `a_scale` holds m f32 (one per row of A) and `b_scale` n
    /// (one per column of B); else each holds one f32.
    pub row_wise: bool,
    /// Device addresses of the f32 scales, read when the matmul runs.
    pub a_scale: u64,
    pub b_scale: u64,
    /// 0, or the device address of n elements of `out_dtype` (bf16 or
    /// f16) added to every row.
    pub bias: u64,
    /// Accumulate in the tensor cores only (torch's `use_fast_accum`):
    /// faster, but about 14 mantissa bits per partial sum, where cuBLASLt
    /// otherwise promotes into f32 registers every few k-blocks. symm's
    /// sm90 kernel always accumulates this way.
    pub fast_accum: bool,
}

/// Oldest cuBLASLt with outer-vector (row-wise) fp8 scales.
pub const MIN_ROW_WISE_VERSION: usize = 12_09_00;

/// One row-major matmul: `C[m, n] = alpha * op(A) @ op(B)`, plus the old C
/// when `accumulate` (beta = 1; else beta = 0 and C is not read).
///
/// All leading dimensions are in elements and describe the matrix as
/// stored, row-major:
/// * A: `a_trans == false`: stored `[m, k]`, `lda >= k`, element (i, p) at
///   `a + (i * lda + p) * size`; `a_trans == true`: stored `[k, m]` (A^T
///   row-major, i.e. A column-major), `lda >= m`.
/// * B: `b_trans == false`: stored `[k, n]`, `ldb >= n`; `b_trans == true`:
///   stored `[n, k]` (e.g. a `torch.nn.Linear` weight), `ldb >= k`.
/// * C: stored `[m, n]`, `ldc >= n`, of `out_dtype`.
///
/// With `batch` > 1, `batch` such products (a strided-batched matmul):
/// product i reads A at `a + i * stride_a` elements, B at `b + i *
/// stride_b` and writes C at `c + i * stride_c`; a stride of 0 on A or B
/// shares that operand (one B for every product). Not for fp8.
///
/// Pointers are device addresses (UVA: peers' mappings too), aligned at
/// least to their element size; 16-byte alignment (of pointers and of
/// `ld * size`) lets cuBLASLt pick its fastest kernels.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MatmulParams {
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub a: u64,
    pub lda: usize,
    pub a_trans: bool,
    pub b: u64,
    pub ldb: usize,
    pub b_trans: bool,
    pub c: u64,
    pub ldc: usize,
    /// Type of A and B (unless `fp8` is set).
    pub dtype: GemmDtype,
    /// Type of C: `dtype`, or F32 (f32 output from bf16/f16 inputs).
    pub out_dtype: GemmDtype,
    pub alpha: f32,
    /// beta = 1 (C += A @ B) when true, else beta = 0.
    pub accumulate: bool,
    /// `CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET`: run on (about) this many SMs,
    /// leaving the rest to concurrent communication kernels.
    pub sm_count_target: Option<u32>,
    /// (device address, bytes) of a workspace to use instead of the
    /// [`Gemm`]'s own: needed when matmuls of one `Gemm` may run
    /// concurrently on several streams (tests make one with
    /// `Gemm::alloc_workspace`).
    /// Must be `cuMemAlloc`/VMM memory that outlives the work (and any graph
    /// captured with it).
    pub workspace: Option<(u64, usize)>,
    /// Set for fp8 A and B (of the types given there, `dtype` then being
    /// unused): needs `a_trans == false`, `b_trans == true`, no
    /// `accumulate`, `batch` 1, and `out_dtype` of any type.
    pub fp8: Option<Fp8Params>,
    /// Products in the batch (1: one matmul), and the elements between
    /// consecutive matrices of A, B and C (unused for one).
    pub batch: usize,
    pub stride_a: usize,
    pub stride_b: usize,
    pub stride_c: usize,
}

impl MatmulParams {
    /// Dense row-major `C[m, n] = A[m, k] @ B[k, n]`, all of `dtype`.
    pub fn new(m: usize, n: usize, k: usize, a: u64, b: u64, c: u64, dtype: GemmDtype) -> Self {
        MatmulParams {
            m,
            n,
            k,
            a,
            lda: k,
            a_trans: false,
            b,
            ldb: n,
            b_trans: false,
            c,
            ldc: n,
            dtype,
            out_dtype: dtype,
            alpha: 1.0,
            accumulate: false,
            sm_count_target: None,
            workspace: None,
            fp8: None,
            batch: 1,
            stride_a: 0,
            stride_b: 0,
            stride_c: 0,
        }
    }

    /// Bytes per element of A and B.
    fn operand_size(&self) -> u64 {
        if self.fp8.is_some() {
            1
        } else {
            self.dtype.size() as u64
        }
    }

    /// Checks shapes, leading dimensions, types and pointers.
    pub fn validate(&self) -> Result<()> {
        use GemmDtype::*;
        match (self.fp8, self.dtype, self.out_dtype) {
            (Some(f), ..) => self.validate_fp8(&f)?,
            (None, F32, F32) | (None, BF16, BF16) | (None, BF16, F32) | (None, F16, F16) | (None, F16, F32) => {}
            (None, i, o) => return Err(err!(Unsupported, "matmul of {i:?} inputs into {o:?} output is not supported")),
        }
        let limit = i64::MAX as usize;
        for (name, v) in [("m", self.m), ("n", self.n), ("k", self.k), ("lda", self.lda), ("ldb", self.ldb)] {
            if v > limit {
                return Err(err!(InvalidArgument, "matmul {name} = {v} is too large"));
            }
        }
        if self.ldc > limit {
            return Err(err!(InvalidArgument, "matmul ldc = {} is too large", self.ldc));
        }
        self.validate_batch()?;
        if self.m == 0 || self.n == 0 {
            return Ok(());
        }
        let (a_row, b_row) = (if self.a_trans { self.m } else { self.k }, if self.b_trans { self.k } else { self.n });
        let mut checks = vec![("ldc", self.ldc, self.n)];
        if self.k > 0 {
            checks.extend([("lda", self.lda, a_row), ("ldb", self.ldb, b_row)]);
        }
        for (name, ld, min) in checks {
            if ld < min {
                return Err(err!(InvalidArgument, "matmul {name} = {ld} is smaller than its row length {min}"));
            }
        }
        let (s, so) = (self.operand_size(), self.out_dtype.size() as u64);
        let mut ptrs = vec![("C", self.c, so)];
        if self.k > 0 {
            ptrs.extend([("A", self.a, s), ("B", self.b, s)]);
        }
        for (name, p, size) in ptrs {
            if p == 0 {
                return Err(err!(InvalidArgument, "matmul {name} is NULL"));
            }
            if p % size != 0 {
                return Err(err!(InvalidArgument, "matmul {name} = {p:#x} is not aligned to its element size {size}"));
            }
        }
        if let Some((ws, bytes)) = self.workspace {
            if ws == 0 || ws % 256 != 0 || bytes == 0 {
                return Err(err!(
                    InvalidArgument,
                    "matmul workspace ({ws:#x}, {bytes} bytes) must be non-empty and 256-byte aligned"
                ));
            }
        }
        if self.sm_count_target == Some(0) {
            return Err(err!(InvalidArgument, "matmul sm_count_target must be at least 1"));
        }
        Ok(())
    }

    /// A batch: a count cuBLASLt takes (int32), strides it takes (int64),
    /// none for fp8, and C's products apart (each at least its rows past
    /// the previous one: the products must not overlap, and cuBLASLt's
    /// layouts take no other order).
    fn validate_batch(&self) -> Result<()> {
        if self.batch == 1 {
            return Ok(());
        }
        if self.batch == 0 || self.batch > i32::MAX as usize {
            return Err(err!(InvalidArgument, "matmul batch = {} is not between 1 and {}", self.batch, i32::MAX));
        }
        if self.fp8.is_some() {
            return Err(err!(Unsupported, "fp8 matmuls are not batched"));
        }
        for (name, v) in [("stride_a", self.stride_a), ("stride_b", self.stride_b), ("stride_c", self.stride_c)] {
            if v > i64::MAX as usize {
                return Err(err!(InvalidArgument, "matmul {name} = {v} is too large"));
            }
        }
        if self.m > 0 && self.n > 0 && self.stride_c < self.m * self.ldc {
            return Err(err!(
                InvalidArgument,
                "matmul stride_c = {} is smaller than one C ({} rows of {})",
                self.stride_c,
                self.m,
                self.ldc
            ));
        }
        Ok(())
    }

    fn validate_fp8(&self, f: &Fp8Params) -> Result<()> {
        if f.a_type == Fp8::E5M2 && f.b_type == Fp8::E5M2 {
            return Err(err!(Unsupported, "cuBLASLt has no fp8 matmul of two E5M2 operands"));
        }
        if self.a_trans || !self.b_trans {
            return Err(err!(
                Unsupported,
                "fp8 matmuls need A row-major and B column-major (K-major operands); got a_trans {}, b_trans {}",
                self.a_trans,
                self.b_trans
            ));
        }
        if self.accumulate {
            return Err(err!(Unsupported, "fp8 matmuls do not accumulate into C"));
        }
        if f.bias != 0 && self.out_dtype == GemmDtype::F32 {
            return Err(err!(Unsupported, "fp8 matmuls add a bias to bf16 or f16 outputs only"));
        }
        let bias = (f.bias != 0).then_some(("bias", f.bias, self.out_dtype.size() as u64));
        for (name, p, size) in [("a_scale", f.a_scale, 4), ("b_scale", f.b_scale, 4)].into_iter().chain(bias) {
            if p == 0 || p % size != 0 {
                return Err(err!(InvalidArgument, "matmul {name} = {p:#x} is NULL or not aligned to {size} bytes"));
            }
        }
        Ok(())
    }
}

/// One operand of the column-major problem cuBLASLt sees: the stored
/// matrix is `rows x cols` column-major with leading dimension `ld`, and
/// `trans` applies `op = T`; in a batch, the next one `stride` elements on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ColOperand {
    pub rows: u64,
    pub cols: u64,
    pub ld: i64,
    pub trans: bool,
    pub stride: i64,
}

/// The column-major problem `D = op(A') op(B')` equivalent to a row-major
/// [`MatmulParams`]: A' is the caller's B, B' the caller's A, m' = n, n' = m.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ColMajor {
    pub m: u64,
    pub n: u64,
    pub k: u64,
    pub a: ColOperand,
    pub b: ColOperand,
    pub c: ColOperand,
    /// Products in the batch (1: one).
    pub batch: u64,
}

impl ColMajor {
    /// Maps a row-major problem (already validated) onto cuBLASLt's
    /// column-major one, and returns it with the (A', B') pointers.
    pub fn from_row_major(p: &MatmulParams) -> (ColMajor, u64, u64) {
        let (m, n, k) = (p.m as u64, p.n as u64, p.k as u64);
        // Caller's B row-major [k, n] == column-major [n, k]: op N gives
        // B^T (n x k). Stored transposed ([n, k] row-major == [k, n]
        // column-major), op T gives the same n x k.
        // Strides only in a batch, so that one matmul has one key.
        let stride = |s: usize| if p.batch > 1 { s as i64 } else { 0 };
        let (sa, sb) = (stride(p.stride_b), stride(p.stride_a));
        let a = if p.b_trans {
            ColOperand { rows: k, cols: n, ld: p.ldb as i64, trans: true, stride: sa }
        } else {
            ColOperand { rows: n, cols: k, ld: p.ldb as i64, trans: false, stride: sa }
        };
        // Caller's A row-major [m, k] == column-major [k, m] = A^T (k x m).
        let b = if p.a_trans {
            ColOperand { rows: m, cols: k, ld: p.lda as i64, trans: true, stride: sb }
        } else {
            ColOperand { rows: k, cols: m, ld: p.lda as i64, trans: false, stride: sb }
        };
        // C row-major [m, n] == column-major [n, m] = C^T.
        let c = ColOperand { rows: n, cols: m, ld: p.ldc as i64, trans: false, stride: stride(p.stride_c) };
        (ColMajor { m: n, n: m, k, a, b, c, batch: p.batch as u64 }, p.b, p.a)
    }
}

/// Largest power of two dividing `addr`, capped at 256 (cuBLASLt's
/// default and largest alignment requirement).
pub fn alignment_class(addr: u64) -> u32 {
    if addr == 0 {
        256
    } else {
        1u32 << addr.trailing_zeros().min(8)
    }
}

/// The alignment every matrix of a batch has: that of the first, and of
/// the step between two (`stride` elements of `size` bytes; 0 for one
/// matrix or a shared one).
fn batch_alignment(addr: u64, stride: i64, size: u64) -> u32 {
    alignment_class(addr).min(alignment_class(stride as u64 * size))
}

/// The fp8 part of a matmul's key: what shapes its descriptor and algorithm.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct Fp8Key {
    a_type: Fp8,
    b_type: Fp8,
    row_wise: bool,
    bias: bool,
    fast_accum: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct MatmulKey {
    shape: ColMajor,
    dtype: GemmDtype,
    out_dtype: GemmDtype,
    sm_count_target: u32,
    fp8: Option<Fp8Key>,
    /// Alignment classes of A', B', C.
    align: [u32; 3],
    workspace: usize,
}

/// What cuBLASLt needs for one shape: created once, reused for every call.
struct LtMatmul {
    desc: lt::cublasLtMatmulDesc_t,
    layouts: [lt::cublasLtMatrixLayout_t; 3],
    algo: lt::cublasLtMatmulAlgo_t,
}

// SAFETY: cuBLASLt descriptors are plain host objects; we only touch them
// under the Gemm's mutex.
unsafe impl Send for LtMatmul {}

impl Drop for LtMatmul {
    fn drop(&mut self) {
        // SAFETY: created by LtMatmul::new and destroyed only here; errors are
        // not actionable in a destructor.
        unsafe {
            for l in self.layouts {
                if !l.is_null() {
                    lt::cublasLtMatrixLayoutDestroy(l);
                }
            }
            if !self.desc.is_null() {
                lt::cublasLtMatmulDescDestroy(self.desc);
            }
        }
    }
}

/// Converts a cuBLASLt status into our error, naming the call.
fn lt_check(s: lt::cublasStatus_t, what: &str) -> Result<()> {
    if s == lt::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
        return Ok(());
    }
    let kind = match s {
        lt::cublasStatus_t::CUBLAS_STATUS_NOT_SUPPORTED | lt::cublasStatus_t::CUBLAS_STATUS_ARCH_MISMATCH => {
            ErrorKind::Unsupported
        }
        lt::cublasStatus_t::CUBLAS_STATUS_ALLOC_FAILED => ErrorKind::OutOfMemory,
        _ => ErrorKind::Cuda,
    };
    // SAFETY: symbols checked by ensure_cublaslt; they return static strings.
    let text = |p: *const std::ffi::c_char| {
        if p.is_null() {
            format!("{s:?}")
        } else {
            // SAFETY: non-null static C string from cuBLASLt.
            unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
        }
    };
    let (name, desc) = unsafe { (text(lt::cublasLtGetStatusName(s)), text(lt::cublasLtGetStatusString(s))) };
    Err(Error::new(kind, format!("{what} failed: {name} ({desc})")))
}

fn set_desc<T>(desc: lt::cublasLtMatmulDesc_t, attr: lt::cublasLtMatmulDescAttributes_t, v: &T) -> Result<()> {
    // SAFETY: `v` is the attribute's documented type and outlives the call.
    let s = unsafe { lt::cublasLtMatmulDescSetAttribute(desc, attr, (v as *const T).cast(), std::mem::size_of::<T>()) };
    lt_check(s, "cublasLtMatmulDescSetAttribute")
}

/// A strided batch on a layout: `count` matrices (int32 in cuBLASLt),
/// `stride` elements apart (int64; 0 repeats one matrix).
fn set_batch(layout: lt::cublasLtMatrixLayout_t, count: u64, stride: i64) -> Result<()> {
    use lt::cublasLtMatrixLayoutAttribute_t as L;
    let count = i32::try_from(count).map_err(|_| err!(InvalidArgument, "matmul batch = {count} is too large"))?;
    let set = |attr, v: *const c_void, bytes| {
        // SAFETY: `v` points to a value of the attribute's documented type,
        // `bytes` long, alive for the call.
        lt_check(
            unsafe { lt::cublasLtMatrixLayoutSetAttribute(layout, attr, v, bytes) },
            "cublasLtMatrixLayoutSetAttribute",
        )
    };
    set(L::CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, (&count as *const i32).cast(), 4)?;
    set(L::CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, (&stride as *const i64).cast(), 8)
}

fn set_pref<T>(
    pref: lt::cublasLtMatmulPreference_t,
    attr: lt::cublasLtMatmulPreferenceAttributes_t,
    v: &T,
) -> Result<()> {
    // SAFETY: as set_desc.
    let s = unsafe {
        lt::cublasLtMatmulPreferenceSetAttribute(pref, attr, (v as *const T).cast(), std::mem::size_of::<T>())
    };
    lt_check(s, "cublasLtMatmulPreferenceSetAttribute")
}

/// A matmul preference, destroyed on drop.
struct Pref(lt::cublasLtMatmulPreference_t);

impl Pref {
    /// The heuristic's constraints for `key`: its workspace and alignments.
    fn new(key: &MatmulKey) -> Result<Pref> {
        use lt::cublasLtMatmulPreferenceAttributes_t as P;
        let mut pref = Pref(std::ptr::null_mut());
        // SAFETY: out-pointer valid.
        lt_check(unsafe { lt::cublasLtMatmulPreferenceCreate(&mut pref.0) }, "cublasLtMatmulPreferenceCreate")?;
        set_pref(pref.0, P::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &(key.workspace as u64))?;
        let [aa, ab, ac] = key.align;
        set_pref(pref.0, P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &aa)?;
        set_pref(pref.0, P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &ab)?;
        set_pref(pref.0, P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &ac)?;
        set_pref(pref.0, P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &ac)?;
        Ok(pref)
    }
}

impl Drop for Pref {
    fn drop(&mut self) {
        // SAFETY: created in Pref::new.
        unsafe { lt::cublasLtMatmulPreferenceDestroy(self.0) };
    }
}

impl LtMatmul {
    /// Builds descriptors and asks the heuristic for the best algorithm
    /// (for an fp8 matmul with its first call's scale and bias pointers
    /// set, so the heuristic sees a complete descriptor; later calls set
    /// their own).
    fn new(handle: lt::cublasLtHandle_t, key: &MatmulKey, fp8: Option<&Fp8Params>) -> Result<LtMatmul> {
        use lt::cublasLtMatmulDescAttributes_t as D;
        let mut matmul = LtMatmul {
            desc: std::ptr::null_mut(),
            layouts: [std::ptr::null_mut(); 3],
            // SAFETY: plain old data; overwritten by the heuristic's result.
            algo: unsafe { std::mem::zeroed() },
        };
        // SAFETY: out-pointer valid.
        lt_check(
            unsafe {
                lt::cublasLtMatmulDescCreate(
                    &mut matmul.desc,
                    lt::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                    lt::cudaDataType::CUDA_R_32F,
                )
            },
            "cublasLtMatmulDescCreate",
        )?;
        let op = |t: bool| if t { 1i32 } else { 0i32 }; // CUBLAS_OP_T / CUBLAS_OP_N
        set_desc(matmul.desc, D::CUBLASLT_MATMUL_DESC_TRANSA, &op(key.shape.a.trans))?;
        set_desc(matmul.desc, D::CUBLASLT_MATMUL_DESC_TRANSB, &op(key.shape.b.trans))?;
        if key.sm_count_target > 0 {
            let sms = i32::try_from(key.sm_count_target).unwrap_or(i32::MAX);
            set_desc(matmul.desc, D::CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET, &sms)?;
        }
        // A' is the caller's B and B' the caller's A (see ColMajor).
        let types = match key.fp8 {
            Some(Fp8Key { a_type: a, b_type: b, row_wise, bias, fast_accum }) => {
                set_fp8_modes(matmul.desc, row_wise, bias.then_some(key.out_dtype), fast_accum)?;
                if let Some(f) = fp8 {
                    set_fp8_pointers(matmul.desc, f)?;
                }
                [b.cuda(), a.cuda(), key.out_dtype.cuda()]
            }
            None => [key.dtype.cuda(), key.dtype.cuda(), key.out_dtype.cuda()],
        };
        let operands = [key.shape.a, key.shape.b, key.shape.c];
        for (i, (ty, o)) in types.into_iter().zip(operands).enumerate() {
            // SAFETY: out-pointer valid.
            lt_check(
                unsafe { lt::cublasLtMatrixLayoutCreate(&mut matmul.layouts[i], ty, o.rows, o.cols, o.ld) },
                "cublasLtMatrixLayoutCreate",
            )?;
            if key.shape.batch > 1 {
                set_batch(matmul.layouts[i], key.shape.batch, o.stride)?;
            }
        }

        let Some(first) = matmul.heuristic_results(handle, &Pref::new(key)?, 1)?.into_iter().next() else {
            return Err(err!(
                Unsupported,
                "cuBLASLt has no algorithm for this matmul ({key:?}); \
                 16-byte aligned pointers and leading dimensions widen the choice"
            ));
        };
        // The caller's m and n (ColMajor swaps them).
        let (m, n, k, dtype, id, ws) =
            (key.shape.n, key.shape.m, key.shape.k, key.dtype, algo_id(&first.algo), first.workspaceSize);
        log::info!("cuBLASLt's pick for m={m} n={n} k={k} {dtype:?}: algorithm id {id}, workspace {ws} bytes");
        matmul.algo = first.algo;
        Ok(matmul)
    }

    /// The heuristic's first `count` algorithms for this matmul's
    /// descriptors, best first (those it reports as usable).
    fn heuristic(
        &self,
        handle: lt::cublasLtHandle_t,
        pref: &Pref,
        count: usize,
    ) -> Result<Vec<lt::cublasLtMatmulAlgo_t>> {
        Ok(self.heuristic_results(handle, pref, count)?.into_iter().map(|r| r.algo).collect())
    }

    /// As [`Self::heuristic`], with each algorithm's workspace size.
    fn heuristic_results(
        &self,
        handle: lt::cublasLtHandle_t,
        pref: &Pref,
        count: usize,
    ) -> Result<Vec<lt::cublasLtMatmulHeuristicResult_t>> {
        // SAFETY: plain old data (state 0 = success), overwritten below.
        let mut results: Vec<lt::cublasLtMatmulHeuristicResult_t> = vec![unsafe { std::mem::zeroed() }; count];
        let mut returned = 0;
        let [la, lb, lc] = self.layouts;
        // SAFETY: the descriptors belong to this handle; `count` result slots.
        lt_check(
            unsafe {
                lt::cublasLtMatmulAlgoGetHeuristic(
                    handle,
                    self.desc,
                    la,
                    lb,
                    lc,
                    lc,
                    pref.0,
                    i32::try_from(count).unwrap_or(i32::MAX),
                    results.as_mut_ptr(),
                    &mut returned,
                )
            },
            "cublasLtMatmulAlgoGetHeuristic",
        )?;
        results.truncate(usize::try_from(returned).unwrap_or(0));
        Ok(results.into_iter().filter(|r| r.state == lt::cublasStatus_t::CUBLAS_STATUS_SUCCESS).collect())
    }
}

/// cuBLASLt's id of an algorithm (`CUBLASLT_ALGO_CONFIG_ID`), for logs; -1
/// if it cannot say.
fn algo_id(algo: &lt::cublasLtMatmulAlgo_t) -> i32 {
    let (mut id, mut written) = (-1i32, 0usize);
    // SAFETY: the attribute is an int32; buffer and size match.
    let s = unsafe {
        lt::cublasLtMatmulAlgoConfigGetAttribute(
            algo,
            lt::cublasLtMatmulAlgoConfigAttributes_t::CUBLASLT_ALGO_CONFIG_ID,
            (&mut id as *mut i32).cast(),
            std::mem::size_of::<i32>(),
            &mut written,
        )
    };
    if s == lt::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
        id
    } else {
        -1
    }
}

/// The parts of an fp8 matmul's descriptor that shape its algorithm: the
/// outer-vector scale mode for row-wise scales, the bias epilogue, and
/// whether partial sums stay in the tensor cores.
fn set_fp8_modes(
    desc: lt::cublasLtMatmulDesc_t,
    row_wise: bool,
    bias: Option<GemmDtype>,
    fast_accum: bool,
) -> Result<()> {
    use lt::cublasLtMatmulDescAttributes_t as D;
    if fast_accum {
        set_desc(desc, D::CUBLASLT_MATMUL_DESC_FAST_ACCUM, &1i8)?;
    }
    if row_wise {
        let mode = lt::cublasLtMatmulMatrixScale_t::CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F;
        set_desc(desc, D::CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &mode)?;
        set_desc(desc, D::CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &mode)?;
    }
    if let Some(ty) = bias {
        set_desc(desc, D::CUBLASLT_MATMUL_DESC_EPILOGUE, &lt::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_BIAS)?;
        set_desc(desc, D::CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &ty.cuda())?;
    }
    Ok(())
}

/// The per-call pointers of an fp8 matmul, set on its cached descriptor
/// just before the call (under the `Gemm`'s lock). cuBLASLt scales its A'
/// and B', which are the caller's B and A: the scales swap too, so A''s
/// outer vector (length m' = n) is the caller's `b_scale`.
fn set_fp8_pointers(desc: lt::cublasLtMatmulDesc_t, f: &Fp8Params) -> Result<()> {
    use lt::cublasLtMatmulDescAttributes_t as D;
    let ptr = |p: u64| p as *const c_void;
    set_desc(desc, D::CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &ptr(f.b_scale))?;
    set_desc(desc, D::CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &ptr(f.a_scale))?;
    if f.bias != 0 {
        set_desc(desc, D::CUBLASLT_MATMUL_DESC_BIAS_POINTER, &ptr(f.bias))?;
    }
    Ok(())
}

/// Device memory from `cuMemAlloc` (never pool memory), freed on drop.
pub struct GemmWorkspace {
    ctx: Arc<CudaContext>,
    ptr: u64,
    bytes: usize,
}

impl GemmWorkspace {
    fn alloc(ctx: &Arc<CudaContext>, bytes: usize) -> Result<Self> {
        ctx.bind_to_thread().map_err(|e| driver::cuda_err(e, "making the context current"))?;
        let mut ptr = 0;
        // SAFETY: out-pointer valid; the device's context is current.
        check(unsafe { sys::cuMemAlloc_v2(&mut ptr, bytes) }, "cuMemAlloc (cuBLASLt workspace)")
            .map_err(|e| e.context("allocating a matmul workspace (not possible during graph capture)"))?;
        Ok(GemmWorkspace { ctx: ctx.clone(), ptr, bytes })
    }

    /// For [`MatmulParams::workspace`].
    #[cfg(test)]
    pub fn as_param(&self) -> Option<(u64, usize)> {
        Some((self.ptr, self.bytes))
    }
}

impl Drop for GemmWorkspace {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        // SAFETY: allocated in alloc(); the owner guarantees no pending work uses it.
        unsafe { sys::cuMemFree_v2(self.ptr) };
    }
}

struct Inner {
    handle: lt::cublasLtHandle_t,
    matmuls: HashMap<MatmulKey, LtMatmul>,
}

// SAFETY: the handle and matmuls are only used under the Gemm's mutex.
unsafe impl Send for Inner {}

impl Drop for Inner {
    fn drop(&mut self) {
        self.matmuls.clear();
        // SAFETY: created in Gemm::new, destroyed once.
        unsafe { lt::cublasLtDestroy(self.handle) };
    }
}

/// cuBLASLt matmuls on one device: a handle, a workspace and a matmul cache.
/// `Send + Sync`; calls are serialized on an internal mutex (enqueueing
/// only: the GPU work itself runs on the caller's stream).
///
/// Every call uses the same built-in workspace unless it passes its own:
/// matmuls of one `Gemm` that may run concurrently (on different streams
/// without ordering between them) must use distinct workspaces. Drop a
/// `Gemm` (and its workspaces) only once the work it enqueued, and every
/// graph captured with it, is finished with.
pub struct Gemm {
    ctx: Arc<CudaContext>,
    inner: Mutex<Inner>,
    workspace: GemmWorkspace,
}

impl Gemm {
    /// A handle and a workspace for `ctx`'s device (not during graph capture:
    /// it allocates).
    pub fn new(ctx: &Arc<CudaContext>) -> Result<Self> {
        driver::ensure_driver()?;
        ensure_cublaslt()?;
        ctx.bind_to_thread().map_err(|e| driver::cuda_err(e, "making the context current"))?;
        let major = driver::attribute(
            ctx.ordinal() as i32,
            sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR,
        )?;
        let bytes = if major >= 9 { WORKSPACE_SM90 } else { WORKSPACE_OLDER };
        let workspace = GemmWorkspace::alloc(ctx, bytes)?;
        let mut handle = std::ptr::null_mut();
        // SAFETY: symbols checked; out-pointer valid; the device's context is current.
        lt_check(unsafe { lt::cublasLtCreate(&mut handle) }, "cublasLtCreate")?;
        Ok(Gemm { ctx: ctx.clone(), inner: Mutex::new(Inner { handle, matmuls: HashMap::new() }), workspace })
    }

    /// Another workspace the size of the built-in one, for matmuls running
    /// concurrently with others of this `Gemm`. Not during graph capture.
    #[cfg(test)]
    pub fn alloc_workspace(&self) -> Result<GemmWorkspace> {
        GemmWorkspace::alloc(&self.ctx, self.workspace.bytes)
    }

    /// Number of cached matmuls (shapes seen).
    #[cfg(test)]
    pub fn cached_matmuls(&self) -> usize {
        self.lock().matmuls.len()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        crate::sync::lock(&self.inner)
    }

    /// Enqueues `p` on `stream` (a stream of this device). Legal during
    /// graph capture; the first call for a shape queries the heuristic
    /// (host only), later calls reuse the cached matmul.
    pub fn matmul(&self, p: &MatmulParams, stream: Stream) -> Result<()> {
        p.validate()?;
        if p.m == 0 || p.n == 0 {
            return Ok(());
        }
        self.ctx.bind_to_thread().map_err(|e| driver::cuda_err(e, "making the context current"))?;
        if p.k == 0 {
            return self.zero_output(p, stream);
        }
        let (key, a_ptr, b_ptr, ws) = self.key(p);
        let ws_bytes = key.workspace;
        let mut inner = self.lock();
        if !inner.matmuls.contains_key(&key) {
            let matmul = LtMatmul::new(inner.handle, &key, p.fp8.as_ref())
                .map_err(|e| e.context(format!("matmul m={} n={} k={}", p.m, p.n, p.k)))?;
            if inner.matmuls.len() >= MAX_MATMULS {
                inner.matmuls.clear();
            }
            inner.matmuls.insert(key, matmul);
        }
        let matmul = &inner.matmuls[&key];
        if let Some(f) = &p.fp8 {
            set_fp8_pointers(matmul.desc, f)?;
        }
        let alpha = p.alpha;
        let beta: f32 = if p.accumulate { 1.0 } else { 0.0 };
        let [la, lb, lc] = matmul.layouts;
        let c = p.c as *mut c_void;
        // SAFETY: descriptors belong to this handle; pointers were validated
        // by the caller's contract (device memory of the described shapes);
        // alpha/beta are host f32 (default pointer mode) read during the call.
        let s = unsafe {
            lt::cublasLtMatmul(
                inner.handle,
                matmul.desc,
                (&alpha as *const f32).cast(),
                a_ptr as *const c_void,
                la,
                b_ptr as *const c_void,
                lb,
                (&beta as *const f32).cast(),
                c,
                lc,
                c,
                lc,
                &matmul.algo,
                ws as *mut c_void,
                ws_bytes,
                stream.0 as lt::cudaStream_t,
            )
        };
        lt_check(s, "cublasLtMatmul").map_err(|e| e.context(format!("matmul m={} n={} k={}", p.m, p.n, p.k)))
    }

    /// The matmul key of `p`, with the column-major A' and B' pointers and
    /// the workspace's address.
    fn key(&self, p: &MatmulParams) -> (MatmulKey, u64, u64, u64) {
        let (shape, a_ptr, b_ptr) = ColMajor::from_row_major(p);
        let (ws, ws_bytes) = p.workspace.unwrap_or((self.workspace.ptr, self.workspace.bytes));
        let key = MatmulKey {
            shape,
            dtype: p.dtype,
            out_dtype: p.out_dtype,
            sm_count_target: p.sm_count_target.unwrap_or(0),
            fp8: p.fp8.map(|f| Fp8Key {
                a_type: f.a_type,
                b_type: f.b_type,
                row_wise: f.row_wise,
                bias: f.bias != 0,
                fast_accum: f.fast_accum,
            }),
            align: [
                batch_alignment(a_ptr, shape.a.stride, p.operand_size()),
                batch_alignment(b_ptr, shape.b.stride, p.operand_size()),
                batch_alignment(p.c, shape.c.stride, p.out_dtype.size() as u64),
            ],
            workspace: ws_bytes,
        };
        (key, a_ptr, b_ptr, ws)
    }

    /// k == 0: the product is empty, so C = beta * C: nothing to do when
    /// accumulating, zeros otherwise.
    fn zero_output(&self, p: &MatmulParams, stream: Stream) -> Result<()> {
        if p.accumulate {
            return Ok(());
        }
        let size = p.out_dtype.size();
        let s = stream.0 as sys::CUstream;
        for i in 0..p.batch {
            let c = p.c + (i * p.stride_c * size) as u64;
            if p.ldc == p.n {
                // SAFETY: each C holds m * n elements (validated contract).
                check(unsafe { sys::cuMemsetD8Async(c, 0, p.m * p.n * size, s) }, "cuMemsetD8Async")?;
            } else {
                // SAFETY: each C holds m rows of pitch ldc, n used elements each.
                check(unsafe { sys::cuMemsetD2D8Async(c, p.ldc * size, 0, p.n * size, p.m, s) }, "cuMemsetD2D8Async")?;
            }
        }
        Ok(())
    }
}

// SAFETY: the context is process-wide; the handle and matmuls are behind the
// mutex; the workspace is a device address.
unsafe impl Send for Gemm {}
unsafe impl Sync for Gemm {}

impl Drop for Gemm {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
    }
}

/// Every algorithm cuBLASLt's heuristic offers (up to 16) for the
/// pipelined paths' matmuls at M = 512 (each rank's half of the rows,
/// and all of them), timed round-robin against its first choice, which
/// is what the library runs. Each output is checked against the first
/// choice's. A timing run of bench/sm90_matmul.rs (through
/// `crate::bench_support`), printing op "matmul_candidate" records.
#[doc(hidden)]
pub(crate) fn bench_heuristic_candidates() {
    use super::gpu_testing::{decode, encode, gpu, rel_err, round_robin_ms, values};
    let Some(g) = gpu() else { return };
    let gemm = Gemm::new(&g.ctx).unwrap();
    // (m, n, k): mm_rs 512x14336x8192's chunks and whole; ag_mm 512x8192x14336's.
    for (m, n, k) in [(256usize, 8192usize, 14336usize), (512, 8192, 14336), (256, 14336, 8192), (512, 14336, 8192)] {
        let a = g.upload(&encode(GemmDtype::BF16, &values(m * k, 1)));
        let b = g.upload(&encode(GemmDtype::BF16, &values(n * k, 2)));
        let (c, reference) = (g.alloc(m * n * 2), g.alloc(m * n * 2));
        // B K-major (a Linear weight's transpose), as the operations get it.
        let mut p = MatmulParams::new(m, n, k, a.ptr, b.ptr, reference.ptr, GemmDtype::BF16);
        (p.b_trans, p.ldb) = (true, k);
        gemm.matmul(&p, g.stream()).unwrap();
        g.sync();
        let want: Vec<f64> = decode(GemmDtype::BF16, &reference.read_bytes()).iter().map(|&v| v as f64).collect();
        p.c = c.ptr;
        gemm.matmul(&p, g.stream()).unwrap(); // the matmul of this key
        let (key, ..) = gemm.key(&p);
        let candidates = {
            let inner = gemm.lock();
            inner.matmuls[&key].heuristic(inner.handle, &Pref::new(&key).unwrap(), 16).unwrap()
        };
        let set = |algo: lt::cublasLtMatmulAlgo_t| gemm.lock().matmuls.get_mut(&key).unwrap().algo = algo;
        let med = round_robin_ms(&g, candidates.len(), |c| {
            set(candidates[c]);
            gemm.matmul(&p, g.stream()).unwrap();
        });
        for (i, algo) in candidates.iter().enumerate() {
            set(*algo);
            gemm.matmul(&p, g.stream()).unwrap();
            g.sync();
            let e = rel_err(&decode(GemmDtype::BF16, &c.read_bytes()), &want);
            println!(
                "{{\"op\": \"matmul_candidate\", \"shape\": [{m}, {k}, {n}], \"candidate\": {i}, \
                 \"ms\": {:.4}, \"ratio_to_first\": {:.3}, \"relerr_to_first\": {e:.1e}}}",
                med[i],
                med[i] / med[0]
            );
            assert!(e < 1e-2, "{m}x{k}x{n} candidate {i}: relative error {e} to the first choice");
        }
        set(candidates[0]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Naive column-major `D = op(A) op(B)` as cuBLASLt defines it.
    fn colmajor_ref(cm: &ColMajor, a: &[f64], b: &[f64], d: &mut [f64]) {
        let at = |i: u64, p: u64| {
            let (r, c) = if cm.a.trans { (p, i) } else { (i, p) };
            a[(c as i64 * cm.a.ld + r as i64) as usize]
        };
        let bt = |p: u64, j: u64| {
            let (r, c) = if cm.b.trans { (j, p) } else { (p, j) };
            b[(c as i64 * cm.b.ld + r as i64) as usize]
        };
        for i in 0..cm.m {
            for j in 0..cm.n {
                let s: f64 = (0..cm.k).map(|p| at(i, p) * bt(p, j)).sum();
                d[(j as i64 * cm.c.ld + i as i64) as usize] = s;
            }
        }
    }

    fn value(seed: usize) -> f64 {
        ((seed * 7919 + 13) % 97) as f64 - 48.0
    }

    /// Row-major reference and the col-major mapping agree for every
    /// transpose combination and padded leading dimensions.
    #[test]
    fn row_major_maps_onto_column_major() {
        let (m, n, k) = (5usize, 3usize, 4usize);
        for (a_trans, b_trans) in [(false, false), (true, false), (false, true), (true, true)] {
            let lda = if a_trans { m + 2 } else { k + 1 };
            let ldb = if b_trans { k + 3 } else { n + 1 };
            let ldc = n + 2;
            let a_rows = if a_trans { k } else { m };
            let b_rows = if b_trans { n } else { k };
            let a: Vec<f64> = (0..a_rows * lda).map(value).collect();
            let b: Vec<f64> = (0..b_rows * ldb).map(|i| value(i + 1000)).collect();
            let a_el = |i: usize, p: usize| if a_trans { a[p * lda + i] } else { a[i * lda + p] };
            let b_el = |p: usize, j: usize| if b_trans { b[j * ldb + p] } else { b[p * ldb + j] };
            let mut p = MatmulParams::new(m, n, k, 0x1000, 0x2000, 0x3000, GemmDtype::BF16);
            (p.lda, p.ldb, p.ldc, p.a_trans, p.b_trans) = (lda, ldb, ldc, a_trans, b_trans);
            p.validate().unwrap();
            let (cm, pa, pb) = ColMajor::from_row_major(&p);
            assert_eq!((pa, pb), (0x2000, 0x1000), "A' is the caller's B");
            assert_eq!((cm.m, cm.n, cm.k), (n as u64, m as u64, k as u64));
            // Stored shapes fit their leading dimensions.
            for o in [cm.a, cm.b, cm.c] {
                assert!(o.ld as u64 >= o.rows, "{o:?}");
            }
            let mut d = vec![f64::NAN; m * ldc];
            colmajor_ref(&cm, &b, &a, &mut d);
            for i in 0..m {
                for j in 0..n {
                    let want: f64 = (0..k).map(|q| a_el(i, q) * b_el(q, j)).sum();
                    assert_eq!(d[i * ldc + j], want, "C[{i},{j}] trans=({a_trans},{b_trans})");
                }
            }
        }
    }

    #[test]
    fn validation() {
        let ok = MatmulParams::new(64, 32, 16, 0x1000, 0x2000, 0x3000, GemmDtype::F16);
        ok.validate().unwrap();
        let mut p = ok;
        p.lda = 15;
        assert_eq!(p.validate().unwrap_err().kind, ErrorKind::InvalidArgument);
        p = ok;
        p.a_trans = true;
        assert!(p.validate().is_err(), "transposed A needs lda >= m");
        p.lda = 64;
        p.validate().unwrap();
        p = ok;
        p.b_trans = true;
        p.ldb = 16;
        p.validate().unwrap();
        p = ok;
        p.ldc = 31;
        assert!(p.validate().is_err());
        p = ok;
        p.out_dtype = GemmDtype::F32;
        p.validate().unwrap();
        p.dtype = GemmDtype::F32;
        p.validate().unwrap();
        p.out_dtype = GemmDtype::BF16;
        assert_eq!(p.validate().unwrap_err().kind, ErrorKind::Unsupported);
        p = ok;
        p.dtype = GemmDtype::BF16;
        assert_eq!(p.validate().unwrap_err().kind, ErrorKind::Unsupported, "bf16 into f16");
        p = ok;
        p.b = 0;
        assert!(p.validate().is_err());
        p = ok;
        p.c = 0x3001;
        assert!(p.validate().is_err(), "misaligned C");
        p = ok;
        p.sm_count_target = Some(0);
        assert!(p.validate().is_err());
        p = ok;
        p.workspace = Some((0x1000, 0));
        assert!(p.validate().is_err());
        // Empty problems are valid (and no-ops), even with NULL pointers.
        p = MatmulParams::new(0, 32, 16, 0, 0, 0, GemmDtype::F32);
        p.validate().unwrap();
        // k == 0 needs only C.
        p = MatmulParams::new(4, 4, 0, 0, 0, 0x100, GemmDtype::F32);
        p.validate().unwrap();
        p.ldc = 3;
        assert!(p.validate().is_err());
    }

    #[test]
    fn batch_validation_and_keys() {
        let mut p = MatmulParams::new(4, 8, 16, 0x1000, 0x2000, 0x3000, GemmDtype::BF16);
        (p.batch, p.stride_a, p.stride_b, p.stride_c) = (3, 64, 0, 40);
        p.validate().unwrap();
        let (cm, ..) = ColMajor::from_row_major(&p);
        // A' is the caller's B (shared: stride 0), B' the caller's A.
        assert_eq!((cm.batch, cm.a.stride, cm.b.stride, cm.c.stride), (3, 0, 64, 40));
        let mut q = p;
        q.stride_c = 31;
        assert_eq!(q.validate().unwrap_err().kind, ErrorKind::InvalidArgument, "C's products overlap");
        q = p;
        q.batch = 0;
        assert_eq!(q.validate().unwrap_err().kind, ErrorKind::InvalidArgument);
        q = p;
        q.fp8 = Some(Fp8Params {
            a_type: Fp8::E4M3,
            b_type: Fp8::E4M3,
            row_wise: false,
            a_scale: 0x100,
            b_scale: 0x200,
            bias: 0,
            fast_accum: false,
        });
        (q.b_trans, q.ldb) = (true, 16);
        assert_eq!(q.validate().unwrap_err().kind, ErrorKind::Unsupported, "fp8 is not batched");
        // One product: strides are not part of its key.
        let one = MatmulParams { batch: 1, ..p };
        let (cm, ..) = ColMajor::from_row_major(&one);
        assert_eq!((cm.batch, cm.a.stride, cm.b.stride, cm.c.stride), (1, 0, 0, 0));
        // The alignment of every matrix in the batch: 40 bf16 = 80 bytes apart is 16-byte aligned.
        assert_eq!(batch_alignment(0x3000, 40, 2), 16);
        assert_eq!(batch_alignment(0x3000, 0, 2), 256);
        assert_eq!(batch_alignment(0x3000, 3, 2), 2);
    }

    #[test]
    fn fp8_validation() {
        let f = Fp8Params {
            a_type: Fp8::E4M3,
            b_type: Fp8::E5M2,
            row_wise: true,
            a_scale: 0x100,
            b_scale: 0x200,
            bias: 0,
            fast_accum: false,
        };
        let mut ok = MatmulParams::new(64, 32, 16, 0x1000, 0x2000, 0x3000, GemmDtype::BF16);
        (ok.b_trans, ok.ldb, ok.fp8) = (true, 16, Some(f));
        ok.validate().unwrap();
        let mut p = ok;
        p.b_trans = false;
        p.ldb = 32;
        assert_eq!(p.validate().unwrap_err().kind, ErrorKind::Unsupported, "B must be K-major");
        p = ok;
        p.fp8 = Some(Fp8Params { a_type: Fp8::E5M2, ..f });
        assert_eq!(p.validate().unwrap_err().kind, ErrorKind::Unsupported, "E5M2 x E5M2");
        p = ok;
        p.fp8 = Some(Fp8Params { a_scale: 0, ..f });
        assert_eq!(p.validate().unwrap_err().kind, ErrorKind::InvalidArgument);
        p = ok;
        p.out_dtype = GemmDtype::F32;
        p.validate().unwrap();
        p.fp8 = Some(Fp8Params { bias: 0x400, ..f });
        assert_eq!(p.validate().unwrap_err().kind, ErrorKind::Unsupported, "no bias into f32");
        // fp8 operands are one byte: an odd address is aligned.
        p = ok;
        p.a = 0x1001;
        p.validate().unwrap();
    }

    #[test]
    fn alignment_classes() {
        assert_eq!(alignment_class(0x1000), 256);
        assert_eq!(alignment_class(0x1010), 16);
        assert_eq!(alignment_class(0x1002), 2);
        assert_eq!(alignment_class(0x1080), 128);
        assert_eq!(alignment_class(0), 256);
    }

    #[test]
    fn dtype_sizes_and_indices() {
        assert_eq!(GemmDtype::F32.size(), 4);
        assert_eq!(GemmDtype::BF16.size(), 2);
        assert_eq!(GemmDtype::F16.size(), 2);
        // The reduction kernels are indexed by these values (kernels/reduce.cu SYMM_DT_*).
        assert_eq!(GemmDtype::F32 as usize, 0);
        assert_eq!(GemmDtype::BF16 as usize, 1);
        assert_eq!(GemmDtype::F16 as usize, 2);
    }

    // ---- on a GPU (pass vacuously without one) ----

    use crate::backend::cuda::gpu_testing::{
        capture_and_replay, decode, encode, fp8_bytes, gpu, time_ms, values, DevBuf, Gpu,
    };

    /// Device buffers and the host reference for one problem.
    struct Case {
        p: MatmulParams,
        bufs: [DevBuf; 3],
        c: Vec<f32>,
        expect: Vec<f64>,
    }

    /// Builds `p`'s operands (random, as stored, with padding), C's initial
    /// contents and the expected result. `shift` moves every pointer by
    /// that many elements (to exercise weaker alignment).
    fn setup(g: &Gpu, mut p: MatmulParams, shift: usize) -> Case {
        let (s, so) = (p.dtype.size(), p.out_dtype.size());
        let a_rows = if p.a_trans { p.k } else { p.m };
        let b_rows = if p.b_trans { p.n } else { p.k };
        let q = |v: Vec<f32>, t| decode(t, &encode(t, &v));
        let a = q(values(a_rows * p.lda + shift, 1), p.dtype);
        let b = q(values(b_rows * p.ldb + shift, 2), p.dtype);
        let c = q(values(p.m * p.ldc + shift, 3), p.out_dtype);
        let bufs = [g.upload(&encode(p.dtype, &a)), g.upload(&encode(p.dtype, &b)), g.upload(&encode(p.out_dtype, &c))];
        p.a = bufs[0].ptr + (shift * s) as u64;
        p.b = bufs[1].ptr + (shift * s) as u64;
        p.c = bufs[2].ptr + (shift * so) as u64;
        let a_el = |i: usize, t: usize| if p.a_trans { a[shift + t * p.lda + i] } else { a[shift + i * p.lda + t] };
        let b_el = |t: usize, j: usize| if p.b_trans { b[shift + j * p.ldb + t] } else { b[shift + t * p.ldb + j] };
        let mut expect = vec![0f64; p.m * p.n];
        for i in 0..p.m {
            for j in 0..p.n {
                let dot: f64 = (0..p.k).map(|t| a_el(i, t) as f64 * b_el(t, j) as f64).sum();
                let old = if p.accumulate { c[shift + i * p.ldc + j] as f64 } else { 0.0 };
                expect[i * p.n + j] = p.alpha as f64 * dot + old;
            }
        }
        Case { p, bufs, c, expect }
    }

    fn verify(case: &Case, what: &str) {
        let p = &case.p;
        let so = p.out_dtype.size();
        let shift = (p.c - case.bufs[2].ptr) as usize / so;
        let got = decode(p.out_dtype, &case.bufs[2].read_bytes());
        let tol = match (p.dtype, p.out_dtype) {
            (_, GemmDtype::BF16) => 1.0 / 64.0,
            (_, GemmDtype::F16) => 1.0 / 512.0,
            (GemmDtype::F32, _) => 1e-5,
            _ => 1e-4,
        };
        for i in 0..p.m {
            for j in 0..p.ldc {
                let idx = shift + i * p.ldc + j;
                if j >= p.n {
                    assert_eq!(got[idx].to_bits(), case.c[idx].to_bits(), "{what}: padding C[{i},{j}] was written");
                    continue;
                }
                let want = case.expect[i * p.n + j];
                let err = (got[idx] as f64 - want).abs();
                assert!(
                    err <= tol * (want.abs() + (p.k as f64).sqrt()),
                    "{what}: C[{i},{j}] = {} want {want}",
                    got[idx]
                );
            }
        }
    }

    #[test]
    fn gpu_matmul_matches_host() {
        let Some(g) = gpu() else { return };
        let gemm = Gemm::new(&g.ctx).unwrap();
        use GemmDtype::*;
        let shapes = [(64usize, 48usize, 40usize), (129, 67, 33), (1, 256, 512), (300, 1, 70), (256, 256, 1024)];
        let types = [(BF16, BF16), (BF16, F32), (F16, F16), (F16, F32), (F32, F32)];
        for (m, n, k) in shapes {
            for (dt, ot) in types {
                for (a_trans, b_trans) in [(false, false), (true, false), (false, true), (true, true)] {
                    for (pad, shift, accumulate) in [(0, 0, false), (8, 0, true), (3, 1, false)] {
                        let mut p = MatmulParams::new(m, n, k, 0, 0, 0, dt);
                        p.out_dtype = ot;
                        (p.a_trans, p.b_trans, p.accumulate) = (a_trans, b_trans, accumulate);
                        p.lda = if a_trans { m } else { k } + pad;
                        p.ldb = if b_trans { k } else { n } + pad;
                        p.ldc = n + pad;
                        p.alpha = if accumulate { 0.5 } else { 1.0 };
                        let case = setup(&g, p, shift);
                        let what = format!("{:?}", case.p);
                        gemm.matmul(&case.p, g.stream()).unwrap_or_else(|e| panic!("{what}: {e}"));
                        g.sync();
                        verify(&case, &what);
                    }
                }
            }
        }
        // An SM count target, a workspace of our own, k == 0.
        let mut p = MatmulParams::new(512, 384, 256, 0, 0, 0, BF16);
        p.sm_count_target = Some(16);
        let ws = gemm.alloc_workspace().unwrap();
        p.workspace = ws.as_param();
        let case = setup(&g, p, 0);
        gemm.matmul(&case.p, g.stream()).unwrap();
        g.sync();
        verify(&case, "sm_count_target 16, own workspace");
        for accumulate in [false, true] {
            let mut p = MatmulParams::new(33, 20, 0, 0, 0, 0, BF16);
            (p.ldc, p.accumulate) = (24, accumulate);
            let case = setup(&g, p, 0);
            gemm.matmul(&case.p, g.stream()).unwrap();
            g.sync();
            verify(&case, &format!("k == 0, accumulate {accumulate}"));
        }
        assert!(gemm.cached_matmuls() > 100);
    }

    /// Strided-batched matmuls against a float64 reference: A and C with
    /// gaps between their matrices (C's rows padded too), everything of C
    /// outside the products poisoned (NaN) and checked untouched; B shared
    /// (batch stride 0) or one per batch, row- or column-major; every
    /// input type; sequence slices of 3 and 11 rows; accumulating too.
    #[test]
    fn gpu_batched_matmul_matches_host() {
        let Some(g) = gpu() else { return };
        let gemm = Gemm::new(&g.ctx).unwrap();
        use GemmDtype::*;
        let shapes = [(2usize, 3usize, 8usize, 16usize), (4, 11, 40, 24), (3, 64, 48, 40), (2, 128, 256, 64)];
        let types = [(BF16, BF16), (BF16, F32), (F16, F16), (F16, F32), (F32, F32)];
        let modes = [(true, false, false), (true, true, false), (false, false, true), (false, true, false)];
        for (batch, m, n, k) in shapes {
            for (dt, ot) in types {
                for (shared_b, b_trans, accumulate) in modes {
                    let (lda, ldb, ldc) = (k, if b_trans { k } else { n }, n + 3);
                    let stride_a = m * lda + 8;
                    let stride_b = if shared_b { 0 } else { k * n + 8 };
                    let stride_c = m * ldc + 5;
                    let q = |v: Vec<f32>, t| decode(t, &encode(t, &v));
                    let a = q(values(batch * stride_a, 1), dt);
                    let b = q(values(if shared_b { k * n } else { batch * stride_b }, 2), dt);
                    let mut c = q(values(batch * stride_c, 3), ot);
                    let mut held = vec![false; c.len()];
                    for t in 0..batch {
                        for i in 0..m {
                            (0..n).for_each(|j| held[t * stride_c + i * ldc + j] = true);
                        }
                    }
                    c.iter_mut().zip(&held).filter(|(_, &h)| !h).for_each(|(v, _)| *v = f32::NAN);
                    let c = q(c, ot);
                    let bufs = [g.upload(&encode(dt, &a)), g.upload(&encode(dt, &b)), g.upload(&encode(ot, &c))];
                    let mut p = MatmulParams::new(m, n, k, bufs[0].ptr, bufs[1].ptr, bufs[2].ptr, dt);
                    (p.out_dtype, p.ldb, p.b_trans, p.ldc, p.accumulate) = (ot, ldb, b_trans, ldc, accumulate);
                    (p.batch, p.stride_a, p.stride_b, p.stride_c) = (batch, stride_a, stride_b, stride_c);
                    let what = format!("{p:?}");
                    gemm.matmul(&p, g.stream()).unwrap_or_else(|e| panic!("{what}: {e}"));
                    g.sync();
                    let got = decode(ot, &bufs[2].read_bytes());
                    let tol = match (dt, ot) {
                        (_, BF16) => 1.0 / 64.0,
                        (_, F16) => 1.0 / 512.0,
                        (F32, _) => 1e-5,
                        _ => 1e-4,
                    };
                    let b_el = |t: usize, x: usize, j: usize| {
                        let base = t * stride_b;
                        if b_trans {
                            b[base + j * ldb + x]
                        } else {
                            b[base + x * ldb + j]
                        }
                    };
                    for (idx, _) in held.iter().enumerate().filter(|(_, &h)| !h) {
                        assert_eq!(got[idx].to_bits(), c[idx].to_bits(), "{what}: the gap at {idx} was written");
                    }
                    for t in 0..batch {
                        for i in 0..m {
                            for j in 0..n {
                                let dot: f64 =
                                    (0..k).map(|x| a[t * stride_a + i * lda + x] as f64 * b_el(t, x, j) as f64).sum();
                                let idx = t * stride_c + i * ldc + j;
                                let want = dot + if accumulate { c[idx] as f64 } else { 0.0 };
                                let err = (got[idx] as f64 - want).abs();
                                assert!(
                                    err <= tol * (want.abs() + (k as f64).sqrt()),
                                    "{what}: C[{t}][{i},{j}] = {} want {want}",
                                    got[idx]
                                );
                            }
                        }
                    }
                }
            }
        }
        // Products of C must not overlap.
        let mut p = MatmulParams::new(8, 8, 8, 0x1000, 0x2000, 0x3000, BF16);
        (p.batch, p.stride_c) = (2, 32);
        assert_eq!(p.validate().unwrap_err().kind, ErrorKind::InvalidArgument, "overlapping C");
    }

    /// cuBLASLt fp8 against a float64 reference of `torch._scaled_mm`:
    /// both operand-type mixes, tensor-wise and row-wise scales (the scale
    /// pointers swap with the operands), bias, padded leading dimensions.
    #[test]
    fn gpu_fp8_matmul_matches_host() {
        let Some(g) = gpu() else { return };
        let gemm = Gemm::new(&g.ctx).unwrap();
        let (m, n, k) = (96usize, 80usize, 64usize);
        for (at, bt) in [(Fp8::E4M3, Fp8::E4M3), (Fp8::E4M3, Fp8::E5M2), (Fp8::E5M2, Fp8::E4M3)] {
            for row_wise in [false, true] {
                for (out, bias) in [(GemmDtype::BF16, true), (GemmDtype::F16, false), (GemmDtype::F32, false)] {
                    let (lda, ldb, ldc) = (k + 16, k, n + 8);
                    let a = fp8_bytes(m * lda, 1, at); // row-major [m, k], padded rows
                    let b = fp8_bytes(n * ldb, 2, bt); // column-major [k, n]: B^T row-major [n, k]
                    let sa: Vec<f32> = (0..if row_wise { m } else { 1 }).map(|i| 0.25 + (i % 7) as f32 / 4.0).collect();
                    let sb: Vec<f32> = (0..if row_wise { n } else { 1 }).map(|j| 1.5 - (j % 5) as f32 / 8.0).collect();
                    let bias_v: Vec<f32> =
                        (0..n).map(|j| decode(out, &encode(out, &[j as f32 / 16.0 - 2.0]))[0]).collect();
                    let bufs = [g.upload(&a), g.upload(&b), g.alloc(m * ldc * out.size())];
                    let (dsa, dsb, dbias) = (g.upload(&sa), g.upload(&sb), g.upload(&encode(out, &bias_v)));
                    let mut p = MatmulParams::new(m, n, k, bufs[0].ptr, bufs[1].ptr, bufs[2].ptr, out);
                    (p.lda, p.ldb, p.ldc, p.b_trans) = (lda, ldb, ldc, true);
                    let bias_ptr = if bias { dbias.ptr } else { 0 };
                    p.fp8 = Some(Fp8Params {
                        a_type: at,
                        b_type: bt,
                        row_wise,
                        a_scale: dsa.ptr,
                        b_scale: dsb.ptr,
                        bias: bias_ptr,
                        fast_accum: false,
                    });
                    let what = format!("{at:?} x {bt:?} row_wise {row_wise} into {out:?} bias {bias}");
                    gemm.matmul(&p, g.stream()).unwrap_or_else(|e| panic!("{what}: {e}"));
                    g.sync();
                    let got = decode(out, &bufs[2].read_bytes());
                    let tol = match out {
                        GemmDtype::BF16 => 1.0 / 128.0,
                        GemmDtype::F16 => 1.0 / 1024.0,
                        _ => 1e-5,
                    };
                    for i in 0..m {
                        for j in 0..n {
                            let terms =
                                (0..k).map(|t| at.decode(a[i * lda + t]) as f64 * bt.decode(b[j * ldb + t]) as f64);
                            let (dot, magnitude) = terms.fold((0.0, 0.0), |(s, m), x| (s + x, m + x.abs()));
                            let scale =
                                sa[if row_wise { i } else { 0 }] as f64 * sb[if row_wise { j } else { 0 }] as f64;
                            let want = dot * scale + if bias { bias_v[j] as f64 } else { 0.0 };
                            let err = (got[i * ldc + j] as f64 - want).abs();
                            // Hopper's fp8 tensor cores accumulate with about
                            // 14 mantissa bits between cuBLASLt's promotions to
                            // f32 (measured: 5e-5 relative on an H200), so the
                            // bound grows with the sum of |terms|, not the result.
                            let accumulation = magnitude * scale / 4096.0;
                            assert!(
                                err <= tol * (want.abs() + 1.0) + accumulation,
                                "{what}: C[{i},{j}] = {} want {want}",
                                got[i * ldc + j]
                            );
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn gpu_matmul_in_graph_capture() {
        let Some(g) = gpu() else { return };
        let gemm = Gemm::new(&g.ctx).unwrap();
        // A shape seen before capture (cached matmul) ...
        let mut p = MatmulParams::new(256, 192, 128, 0, 0, 0, GemmDtype::BF16);
        p.accumulate = true;
        let warm = setup(&g, p, 0);
        gemm.matmul(&warm.p, g.stream()).unwrap();
        g.sync();
        let case = setup(&g, p, 0);
        // ... and one first seen during capture (heuristic query in capture).
        let fresh = setup(&g, MatmulParams::new(96, 80, 72, 0, 0, 0, GemmDtype::F16), 0);
        let before = gemm.cached_matmuls();
        capture_and_replay(&g, 1, || {
            gemm.matmul(&case.p, g.stream()).unwrap();
            gemm.matmul(&fresh.p, g.stream()).unwrap();
        });
        assert_eq!(gemm.cached_matmuls(), before + 1);
        verify(&case, "captured, cached matmul, accumulate, replayed once");
        verify(&fresh, "captured, matmul made during capture");
    }

    /// TFLOP/s of large bf16 matmuls, with and without an SM target (run
    /// with --ignored on a GPU machine).
    #[test]
    #[ignore]
    fn gpu_matmul_throughput() {
        let Some(g) = gpu() else { return };
        let gemm = Gemm::new(&g.ctx).unwrap();
        for (m, n, k) in [(8192usize, 8192usize, 8192usize), (16384, 8192, 8192), (4096, 4096, 4096)] {
            let a = g.alloc(m * k * 2);
            let b = g.alloc(k * n * 2);
            let c = g.alloc(m * n * 2);
            for target in [None, Some(120), Some(100)] {
                let mut p = MatmulParams::new(m, n, k, a.ptr, b.ptr, c.ptr, GemmDtype::BF16);
                p.sm_count_target = target;
                let ms = time_ms(&g, 3, 10, || gemm.matmul(&p, g.stream()).unwrap());
                let tflops = 2.0 * (m * n * k) as f64 / (ms as f64 / 1e3) / 1e12;
                eprintln!("matmul bf16 {m}x{n}x{k} sm_target={target:?}: {ms:.3} ms, {tflops:.0} TFLOP/s");
            }
        }
    }

    #[test]
    fn missing_cublaslt_is_an_error_not_a_panic() {
        // Without the library this is Unsupported with a message; with it,
        // the version is at least 12.0.
        match ensure_cublaslt() {
            Ok(v) => assert!(v >= MIN_VERSION),
            Err(e) => {
                assert_eq!(e.kind, ErrorKind::Unsupported);
                assert!(e.msg.contains("cuBLASLt"), "{}", e.msg);
            }
        }
    }
}
