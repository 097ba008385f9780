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

mod lt_matmul;
mod params;
#[cfg(test)]
mod tests;
mod tune;

pub use params::*;

use super::driver::{self, check};
use super::graphs;
use crate::backend::Stream;
use crate::error::{Error, ErrorKind, Result};
use cudarc::cublaslt::sys as lt;
use cudarc::driver::{sys, CudaContext};
use once_cell::sync::OnceCell;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use lt_matmul::{lt_check, set_fp8_pointers, Fp8Key, LtMatmul, MatmulKey, Operands, Pref};
use tune::Tuning;

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
    /// What the candidate timings started so far cost (ms, at most
    /// `tune::BUDGET_MS`).
    tuning_spent_ms: f64,
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
        Ok(Gemm {
            ctx: ctx.clone(),
            inner: Mutex::new(Inner { handle, matmuls: HashMap::new(), tuning_spent_ms: 0.0 }),
            workspace,
        })
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

    /// Where `p`'s cached matmul stands with timing its candidates (None:
    /// not cached).
    #[cfg(test)]
    fn tuning(&self, p: &MatmulParams) -> Option<Tuning> {
        let (key, _) = self.key(p);
        self.lock().matmuls.get(&key).map(|m| m.tuning)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        crate::sync::lock(&self.inner)
    }

    /// Enqueues `p` on `stream` (a stream of this device). Legal during
    /// graph capture; the first call for a shape queries the heuristic
    /// (host only), later calls reuse the cached matmul. A matmul of a
    /// size `tune` names times the heuristic's candidates on its first
    /// call outside capture (`SYMM_GEMM_TUNE=0` keeps the first choice).
    pub fn matmul(&self, p: &MatmulParams, stream: Stream) -> Result<()> {
        p.validate()?;
        if p.m == 0 || p.n == 0 {
            return Ok(());
        }
        self.ctx.bind_to_thread().map_err(|e| driver::cuda_err(e, "making the context current"))?;
        if p.k == 0 {
            return self.zero_output(p, stream);
        }
        let (key, operands) = self.key(p);
        let mut inner = self.lock();
        let Inner { handle, matmuls, tuning_spent_ms } = &mut *inner;
        let matmul = Self::cached_in(*handle, matmuls, &key, p)?;
        if let Tuning::Pending(tries) = matmul.tuning {
            let affordable = || *tuning_spent_ms + tune::cost_ms(p) <= tune::BUDGET_MS;
            if tune::worth_it(p) && crate::config::gemm_tune() && affordable() {
                // The cache may change while the lock is released: look again.
                let mut inner = self.tune(inner, tries, &key, p, operands, stream)?;
                let Inner { handle, matmuls, .. } = &mut *inner;
                return Self::launch(*handle, Self::cached_in(*handle, matmuls, &key, p)?, p, operands, stream);
            }
        }
        Self::launch(*handle, matmul, p, operands, stream)
    }

    /// Enqueues the cached `matmul` of `p` with its algorithm.
    fn launch(
        handle: lt::cublasLtHandle_t,
        matmul: &LtMatmul,
        p: &MatmulParams,
        operands: Operands,
        stream: Stream,
    ) -> Result<()> {
        if let Some(f) = &p.fp8 {
            set_fp8_pointers(matmul.desc, f)?;
        }
        matmul
            .run(handle, &matmul.algo, operands, p.alpha, p.accumulate, stream)
            .map_err(|e| e.context(format!("matmul m={} n={} k={}", p.m, p.n, p.k)))
    }

    /// The cached matmul of `key`, made (heuristic query) if missing.
    fn cached_in<'a>(
        handle: lt::cublasLtHandle_t,
        matmuls: &'a mut HashMap<MatmulKey, LtMatmul>,
        key: &MatmulKey,
        p: &MatmulParams,
    ) -> Result<&'a mut LtMatmul> {
        if !matmuls.contains_key(key) {
            let matmul = LtMatmul::new(handle, key, p.fp8.as_ref())
                .map_err(|e| e.context(format!("matmul m={} n={} k={}", p.m, p.n, p.k)))?;
            if matmuls.len() >= MAX_MATMULS {
                matmuls.clear();
            }
            matmuls.insert(*key, matmul);
        }
        Ok(matmuls.get_mut(key).expect("inserted above"))
    }

    /// Times the heuristic's candidates for `key` (`p`'s cached matmul,
    /// `tries` times tried before) on `stream` unless the stream is
    /// capturing, and keeps the fastest. The lock is released while the
    /// GPU runs them; a failure leaves the first choice (logged), never
    /// fails the call.
    fn tune<'a>(
        &'a self,
        mut inner: std::sync::MutexGuard<'a, Inner>,
        tries: u8,
        key: &MatmulKey,
        p: &MatmulParams,
        operands: Operands,
        stream: Stream,
    ) -> Result<std::sync::MutexGuard<'a, Inner>> {
        let Inner { handle, matmuls, tuning_spent_ms } = &mut *inner;
        let matmul = Self::cached_in(*handle, matmuls, key, p)?;
        // (A stream that cannot say is taken as capturing: the call itself
        // reports what is wrong with it.)
        if graphs::is_capturing(stream).unwrap_or(true) {
            return Ok(inner);
        }
        let what = format!("cuBLASLt's candidates for m={} n={} k={} {:?}", p.m, p.n, p.k, p.dtype);
        let trial = match tune::start(*handle, matmul, key, p, operands, stream) {
            Ok(Some(trial)) => trial,
            outcome => {
                if let Err(e) = outcome {
                    log::warn!("timing {what}: {e}");
                }
                matmul.tuning = Tuning::Done;
                return Ok(inner);
            }
        };
        matmul.tuning = Tuning::Running;
        *tuning_spent_ms += tune::cost_ms(p);
        drop(inner);
        let fastest = trial.fastest();
        let mut inner = self.lock();
        // Another thread may have emptied the cache meanwhile: then the
        // next call starts over.
        let Some(matmul) = inner.matmuls.get_mut(key) else { return Ok(inner) };
        matmul.tuning = match fastest {
            Ok(Some(kept)) => {
                log::info!(
                    "{what}: keeps candidate {} of {} ({:.1}% of the first choice's time)",
                    kept.index + 1,
                    kept.of,
                    100.0 * kept.ms / kept.first_ms
                );
                matmul.algo = kept.algo;
                Tuning::Done
            }
            Ok(None) => Tuning::retry(tries),
            Err(e) => {
                log::warn!("timing {what}: {e}");
                Tuning::Done
            }
        };
        Ok(inner)
    }

    /// The matmul key of `p`, and its operands (the column-major A' and B'
    /// pointers, C, the workspace).
    fn key(&self, p: &MatmulParams) -> (MatmulKey, Operands) {
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
        (key, Operands { a: a_ptr, b: b_ptr, c: p.c, workspace: ws, workspace_bytes: ws_bytes })
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

/// Every algorithm cuBLASLt's heuristic offers (up to 16) for each
/// `(m, n, k)` of `shapes` (bf16, B K-major as a Linear weight), timed
/// round-robin against its first choice, which is what the library runs.
/// Each output is checked against the first choice's. A timing run of
/// bench/sm90_matmul.rs (through `crate::bench_support`), printing op
/// "matmul_candidate" records.
#[doc(hidden)]
pub(crate) fn bench_heuristic_candidates(shapes: &[(usize, usize, usize)]) {
    use super::gpu_testing::{decode, encode, gpu, rel_err, round_robin_ms, values};
    let Some(g) = gpu() else { return };
    let gemm = Gemm::new(&g.ctx).unwrap();
    for &(m, n, k) in shapes {
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
