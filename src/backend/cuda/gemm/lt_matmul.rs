//! One cached cuBLASLt matmul: its descriptors, layouts and the
//! heuristic's algorithm for one shape key.

use super::params::*;
use super::tune::Tuning;
use crate::backend::Stream;
use crate::error::{err, Error, ErrorKind, Result};
use cudarc::cublaslt::sys as lt;
use std::ffi::{c_void, CStr};

/// The fp8 part of a matmul's key: what shapes its descriptor and algorithm.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(super) struct Fp8Key {
    pub(super) a_type: Fp8,
    pub(super) b_type: Fp8,
    pub(super) row_wise: bool,
    pub(super) bias: bool,
    pub(super) fast_accum: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(super) struct MatmulKey {
    pub(super) shape: ColMajor,
    pub(super) dtype: GemmDtype,
    pub(super) out_dtype: GemmDtype,
    pub(super) sm_count_target: u32,
    pub(super) fp8: Option<Fp8Key>,
    /// Alignment classes of A', B', C.
    pub(super) align: [u32; 3],
    pub(super) workspace: usize,
}

/// What cuBLASLt needs for one shape: created once, reused for every call.
pub(super) struct LtMatmul {
    pub(super) desc: lt::cublasLtMatmulDesc_t,
    pub(super) layouts: [lt::cublasLtMatrixLayout_t; 3],
    pub(super) algo: lt::cublasLtMatmulAlgo_t,
    pub(super) tuning: Tuning,
}

/// One launch's operands: A', B' (the caller's B and A, see `ColMajor`),
/// C, and the workspace.
#[derive(Clone, Copy, Debug)]
pub(super) struct Operands {
    pub(super) a: u64,
    pub(super) b: u64,
    pub(super) c: u64,
    pub(super) workspace: u64,
    pub(super) workspace_bytes: usize,
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
pub(super) fn lt_check(s: lt::cublasStatus_t, what: &str) -> Result<()> {
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

pub(super) fn set_desc<T>(
    desc: lt::cublasLtMatmulDesc_t,
    attr: lt::cublasLtMatmulDescAttributes_t,
    v: &T,
) -> Result<()> {
    // SAFETY: `v` is the attribute's documented type and outlives the call.
    let s = unsafe { lt::cublasLtMatmulDescSetAttribute(desc, attr, (v as *const T).cast(), std::mem::size_of::<T>()) };
    lt_check(s, "cublasLtMatmulDescSetAttribute")
}

/// A strided batch on a layout: `count` matrices (int32 in cuBLASLt),
/// `stride` elements apart (int64; 0 repeats one matrix).
pub(super) fn set_batch(layout: lt::cublasLtMatrixLayout_t, count: u64, stride: i64) -> Result<()> {
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

pub(super) fn set_pref<T>(
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
pub(super) struct Pref(lt::cublasLtMatmulPreference_t);

impl Pref {
    /// The heuristic's constraints for `key`: its workspace and alignments.
    pub(super) fn new(key: &MatmulKey) -> Result<Pref> {
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
    pub(super) fn new(handle: lt::cublasLtHandle_t, key: &MatmulKey, fp8: Option<&Fp8Params>) -> Result<LtMatmul> {
        use lt::cublasLtMatmulDescAttributes_t as D;
        let mut matmul = LtMatmul {
            desc: std::ptr::null_mut(),
            layouts: [std::ptr::null_mut(); 3],
            // SAFETY: plain old data; overwritten by the heuristic's result.
            algo: unsafe { std::mem::zeroed() },
            tuning: Tuning::Pending(0),
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

    /// Enqueues this matmul with `algo` on `stream`: `C = alpha A' B' (+ C
    /// when `accumulate`)`.
    pub(super) fn run(
        &self,
        handle: lt::cublasLtHandle_t,
        algo: &lt::cublasLtMatmulAlgo_t,
        o: Operands,
        alpha: f32,
        accumulate: bool,
        stream: Stream,
    ) -> Result<()> {
        let beta: f32 = if accumulate { 1.0 } else { 0.0 };
        let [la, lb, lc] = self.layouts;
        let c = o.c as *mut c_void;
        // SAFETY: descriptors belong to this handle; pointers were validated
        // by the caller's contract (device memory of the described shapes);
        // alpha/beta are host f32 (default pointer mode) read during the call.
        let s = unsafe {
            lt::cublasLtMatmul(
                handle,
                self.desc,
                (&alpha as *const f32).cast(),
                o.a as *const c_void,
                la,
                o.b as *const c_void,
                lb,
                (&beta as *const f32).cast(),
                c,
                lc,
                c,
                lc,
                algo,
                o.workspace as *mut c_void,
                o.workspace_bytes,
                stream.0 as lt::cudaStream_t,
            )
        };
        lt_check(s, "cublasLtMatmul")
    }

    /// The heuristic's first `count` algorithms for this matmul's
    /// descriptors, best first (those it reports as usable).
    pub(super) fn heuristic(
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
pub(super) fn algo_id(algo: &lt::cublasLtMatmulAlgo_t) -> i32 {
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
pub(super) fn set_fp8_modes(
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
pub(super) fn set_fp8_pointers(desc: lt::cublasLtMatmulDesc_t, f: &Fp8Params) -> Result<()> {
    use lt::cublasLtMatmulDescAttributes_t as D;
    let ptr = |p: u64| p as *const c_void;
    set_desc(desc, D::CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &ptr(f.b_scale))?;
    set_desc(desc, D::CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &ptr(f.a_scale))?;
    if f.bias != 0 {
        set_desc(desc, D::CUBLASLT_MATMUL_DESC_BIAS_POINTER, &ptr(f.bias))?;
    }
    Ok(())
}
