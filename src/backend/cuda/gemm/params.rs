//! What a matmul is: its dtypes, row-major operands and fp8 scaling, and
//! the column-major problem cuBLASLt is asked to solve for it.

use crate::error::{err, Result};
use cudarc::cublaslt::sys as lt;

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

    pub(super) fn cuda(self) -> lt::cudaDataType {
        match self {
            GemmDtype::F32 => lt::cudaDataType::CUDA_R_32F,
            GemmDtype::BF16 => lt::cudaDataType::CUDA_R_16BF,
            GemmDtype::F16 => lt::cudaDataType::CUDA_R_16F,
        }
    }
}

pub use crate::fp8::Fp8;

impl Fp8 {
    pub(super) fn cuda(self) -> lt::cudaDataType {
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
    /// [`Gemm`](super::Gemm)'s own: needed when matmuls of one `Gemm` may run
    /// concurrently on several streams (tests make one with
    /// `Gemm::alloc_workspace`).
    /// Must be `cuMemAlloc`/VMM memory that outlives the work (and any graph
    /// captured with it).
    pub workspace: Option<(u64, usize)>,
    /// Set for fp8 A and B (of the types given there, `dtype` then being
    /// unused): needs `a_trans == false`, `b_trans == true`, `batch` 1, and
    /// `out_dtype` of any type (C, when accumulated, of the same).
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
    pub(super) fn operand_size(&self) -> u64 {
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
pub(super) fn batch_alignment(addr: u64, stride: i64, size: u64) -> u32 {
    alignment_class(addr).min(alignment_class(stride as u64 * size))
}
