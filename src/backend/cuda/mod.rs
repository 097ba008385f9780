//! The CUDA backend: VMM symmetric memory exported and imported as POSIX
//! fds, peers mapped into this rank's address space, and signal kernels.
//! The driver is loaded at run time (no link-time dependency); a machine
//! without one gets `SYMM_ERROR_NO_DEVICE`, never a crash.

pub mod all_reduce;
mod async_error;
mod compute;
pub mod device_bytes;
pub mod driver;
mod event;
pub mod gemm;
// Test helpers, also used by the timing runs of `crate::bench_support`.
#[allow(dead_code)]
pub(crate) mod gpu_testing;
pub(crate) mod graphs;
pub mod kernels;
mod module;
pub mod nccl;
pub mod nccl_watch;
pub mod pack;
mod quantize;
pub mod reduce;
mod signals;
pub mod sm90;
mod streams;
mod vmm;

use super::{
    AddRmsNorm, AllGatherCall, AllReduceCall, Allocation, Backend, BackendKind, Capabilities, FusedMatmul, GemmScales,
    Mapping, PadSet, Quantize, ReduceScatterCall, ReplayKey, Signals, Stream, TagCheck,
};
use crate::array::Array;
use crate::backend::CallTag;
use crate::error::{err, Result};
use crate::health::Health;
use async_error::AsyncError;
use cudarc::driver::{sys, CudaContext};
use std::os::fd::OwnedFd;
use std::sync::Arc;

pub struct CudaBackend {
    ctx: Arc<CudaContext>,
    device: i32,
    granularity: usize,
    /// Private stream for setup work (zeroing new buffers), never the caller's.
    setup: SetupStream,
    errors: Arc<AsyncError>,
    /// cuBLASLt, made on the first matmul (outside graph capture).
    gemm: once_cell::sync::OnceCell<gemm::Gemm>,
    tables: compute::SourceTables,
    side: streams::SideStreams,
    graphs: graphs::GraphCache,
}

impl CudaBackend {
    /// Whether this device runs symm's sm_90a matmul.
    fn has_fused_matmul(&self) -> bool {
        module::kernels(&self.ctx).is_ok_and(|k| k.gemm_sm90.is_some())
    }

    /// The backend for CUDA device `device` (its primary context), whose
    /// queued waits stop when the group fails (see `Health`).
    pub fn new(device: i32, health: &Arc<Health>) -> Result<Self> {
        let ctx = driver::context(device)?;
        let vmm = driver::attribute(
            device,
            sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_VIRTUAL_ADDRESS_MANAGEMENT_SUPPORTED,
        )?;
        let fds = driver::attribute(
            device,
            sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED,
        )?;
        if vmm == 0 || fds == 0 {
            return Err(crate::error::err!(
                Unsupported,
                "CUDA device {device} does not support virtual memory management with POSIX fd handles"
            ));
        }
        let errors = Arc::new(AsyncError::new()?);
        let record = errors.clone();
        health.on_failure(move || record.stop());
        Ok(CudaBackend {
            granularity: vmm::granularity(device)?,
            setup: SetupStream::new()?,
            errors,
            gemm: once_cell::sync::OnceCell::new(),
            tables: compute::SourceTables::default(),
            side: streams::SideStreams::default(),
            graphs: graphs::GraphCache::default(),
            ctx,
            device,
        })
    }

    fn bind(&self) -> Result<()> {
        self.ctx.bind_to_thread().map_err(|e| driver::cuda_err(e, "making the context current"))
    }

    /// A reduction's table of source addresses in new device memory
    /// (kept by `tables`, which frees it).
    fn upload_table(&self, bytes: &[u8]) -> Result<u64> {
        let mut dev = 0;
        // SAFETY: the context is current; out-pointer valid.
        driver::check(unsafe { sys::cuMemAlloc_v2(&mut dev, bytes.len()) }, "cuMemAlloc")?;
        self.setup.upload(dev, bytes).inspect_err(|_| {
            // SAFETY: allocated just above.
            unsafe { sys::cuMemFree_v2(dev) };
        })?;
        Ok(dev)
    }
}

/// Whether CUDA device `device` exists (for `SYMM_BACKEND=auto`).
pub fn available(device: i32) -> bool {
    device >= 0 && (device as usize) < driver::device_count()
}

impl Backend for CudaBackend {
    fn kind(&self) -> BackendKind {
        BackendKind::Cuda
    }
    fn device(&self) -> i32 {
        self.device
    }
    fn granularity(&self) -> usize {
        self.granularity
    }
    fn allocate(&self, bytes: usize) -> Result<Box<dyn Allocation>> {
        self.bind()?;
        let a = vmm::VmmAllocation::new(self.device, bytes)?;
        // Fresh VMM memory holds garbage; symmetric buffers (and their
        // signal pads) promise zeros.
        self.setup.zero(a.addr(), bytes)?;
        Ok(Box::new(a))
    }
    fn import(&self, fd: OwnedFd, bytes: usize) -> Result<Box<dyn Mapping>> {
        self.bind()?;
        Ok(Box::new(vmm::VmmMapping::import(fd, bytes, self.device)?))
    }
    fn signals(&self, pads: PadSet) -> Result<Box<dyn Signals>> {
        self.bind()?;
        let kernels = module::kernels(&self.ctx)?;
        let table: Vec<u8> = pads.pads.iter().flat_map(|a| a.to_le_bytes()).collect();
        let sig = signals::CudaSignals::new(self.ctx.clone(), kernels, self.errors.clone(), pads)?;
        self.setup.upload(sig.pads_table(), &table)?;
        Ok(Box::new(sig))
    }
    fn check_async_error(&self) -> Result<()> {
        self.errors.check()
    }
    fn copy(&self, dst: &Array, src: &Array, stream: Stream) -> Result<()> {
        self.bind()?;
        compute::copy(&*module::kernels(&self.ctx)?, dst, src, stream)
    }
    fn reduce(&self, dst: &Array, srcs: &[Array], scale: f32, stream: Stream) -> Result<()> {
        self.bind()?;
        let upload = |bytes: &[u8]| self.upload_table(bytes);
        compute::reduce(&*module::kernels(&self.ctx)?, &self.tables, upload, dst, srcs, scale, stream)
    }
    fn reduce_integers(&self, dst: &Array, srcs: &[Array], divisor: usize, stream: Stream) -> Result<()> {
        self.bind()?;
        let upload = |bytes: &[u8]| self.upload_table(bytes);
        compute::reduce_integers(&*module::kernels(&self.ctx)?, &self.tables, upload, dst, srcs, divisor, stream)
    }
    fn side_stream(&self, i: usize) -> Result<Stream> {
        self.bind()?;
        self.side.stream(i)
    }
    fn stream_wait(&self, waiter: Stream, on: Stream) -> Result<()> {
        self.bind()?;
        self.side.wait(waiter, on)
    }
    fn gemm(&self, dst: &Array, a: &Array, b: &Array, accumulate: bool, stream: Stream) -> Result<()> {
        self.bind()?;
        let g = self.gemm.get_or_try_init(|| gemm::Gemm::new(&self.ctx))?;
        compute::gemm(g, dst, a, b, accumulate, stream)
    }
    fn run_repeatable(
        &self,
        key: &dyn Fn() -> ReplayKey,
        stream: Stream,
        issue: &mut dyn FnMut(Stream) -> Result<()>,
    ) -> Result<bool> {
        self.bind()?;
        self.graphs.run(key, stream, || self.errors.check(), issue)
    }
    fn is_capturing(&self, stream: Stream) -> Result<bool> {
        self.bind()?;
        graphs::is_capturing(stream)
    }
    fn write_tag(&self, addr: u64, tag: CallTag, stream: Stream) -> Result<()> {
        self.bind()?;
        // Default flags: after the stream's earlier work. `addr` is
        // cuMemAlloc memory, which stream memory operations take.
        // SAFETY: the transport passes a slot of its tag buffer.
        driver::check(
            unsafe { sys::cuStreamWriteValue32_v2(stream.0 as sys::CUstream, addr, tag.get(), 0) },
            "cuStreamWriteValue32",
        )
    }
    fn check_tags(&self, c: &TagCheck, stream: Stream) -> Result<()> {
        self.bind()?;
        let k = module::kernels(&self.ctx)?;
        let (mut tags, mut ranks, mut count, mut tag) = (c.tags, c.ranks, c.count as i32, c.tag.get());
        let (mut rank, mut e) = (c.rank as i32, self.errors.device_ptr());
        let mut params = [
            module::arg(&mut tags),
            module::arg(&mut ranks),
            module::arg(&mut count),
            module::arg(&mut tag),
            module::arg(&mut rank),
            module::arg(&mut e),
        ];
        // SAFETY: the parameters match symm_check_tags (kernels/signal.cu)
        // and live until the launch returns.
        unsafe { k.launch(&k.check_tags, 1, (1, 1, 1), stream, &mut params, "the check of call tags") }
    }
    fn quiesce(&self, stream: Option<Stream>) -> Result<()> {
        self.bind()?;
        let Some(stream) = stream else {
            // SAFETY: the context is current.
            return driver::check(unsafe { sys::cuCtxSynchronize() }, "cuCtxSynchronize");
        };
        if graphs::is_capturing(stream)? {
            return Err(err!(
                Unsupported,
                "memory that earlier calls used must be replaced (a scratch buffer grows), which cannot happen \
                 while the stream is being captured into a graph: make the largest call once before capturing, \
                 or reserve the workspace (symm_group_reserve_workspace)"
            ));
        }
        // SAFETY: the caller's stream, of this context.
        driver::check(unsafe { sys::cuStreamSynchronize(stream.0 as sys::CUstream) }, "cuStreamSynchronize")?;
        self.side.synchronize()
    }
    fn zero(&self, addr: u64, bytes: usize, stream: Stream) -> Result<()> {
        self.bind()?;
        // SAFETY: the caller's device memory of at least `bytes`.
        driver::check(unsafe { sys::cuMemsetD8Async(addr, 0, bytes, stream.0 as sys::CUstream) }, "cuMemsetD8Async")
    }
    fn capabilities(&self) -> Capabilities {
        Capabilities {
            fused_matmul: self.has_fused_matmul(),
            max_fused_world: sm90::MAX_CHUNKS,
            gather_slice_align: sm90::Sm90Matmul::SLICE_ALIGN,
            fused_scatter_preferred: sm90::fused_scatter_preferred,
            all_reduce: true,
            // One host's integer all-reduces keep to the kernels (the
            // generic path of ranks sharing a GPU is not checked on GPUs);
            // `reduce_integers` serves the average across hosts.
            reduce_integers: false,
            all_gather: true,
        }
    }
    fn all_reduce(&self, call: &AllReduceCall, stream: Stream) -> Result<()> {
        self.bind()?;
        all_reduce::all_reduce(&*module::kernels(&self.ctx)?, call, self.errors.device_ptr(), stream)
    }
    fn all_gather(&self, call: &AllGatherCall, stream: Stream) -> Result<()> {
        self.bind()?;
        all_reduce::all_gather(&*module::kernels(&self.ctx)?, call, self.errors.device_ptr(), stream)
    }
    fn reduce_scatter(&self, call: &ReduceScatterCall, stream: Stream) -> Result<()> {
        self.bind()?;
        all_reduce::reduce_scatter(&*module::kernels(&self.ctx)?, call, self.errors.device_ptr(), stream)
    }
    fn add_rms_norm(&self, norm: &AddRmsNorm, stream: Stream) -> Result<()> {
        self.bind()?;
        let k = module::kernels(&self.ctx)?;
        if norm.weight.is_contiguous() {
            return all_reduce::add_rms_norm(&k, norm, stream);
        }
        Err(err!(Internal, "rmsnorm weight with strides {:?}", norm.weight.strides))
    }
    fn quantize(&self, q: &Quantize, stream: Stream) -> Result<()> {
        self.bind()?;
        quantize::quantize(&*module::kernels(&self.ctx)?, q, stream)
    }
    fn fused_matmul_supports(&self, call: &FusedMatmul) -> Result<()> {
        if !self.has_fused_matmul() {
            return Err(err!(Unsupported, "this device does not run symm's sm_90a matmul"));
        }
        sm90::Sm90Matmul::from_fused(call, 0)?.check()
    }
    fn fused_matmul(&self, call: &FusedMatmul, stream: Stream) -> Result<()> {
        self.bind()?;
        let k = module::kernels(&self.ctx)?;
        let Some(sm90) = k.gemm_sm90.as_ref() else {
            return Err(err!(Unsupported, "this device does not run symm's sm_90a matmul"));
        };
        let mut mm = sm90::Sm90Matmul::from_fused(call, self.errors.device_ptr())?;
        mm.max_ctas = Some(k.sm_count.saturating_sub(call.spare_sms).max(1));
        mm.launch(sm90, k.sm_count, stream)
    }
    fn scaled_gemm(
        &self,
        dst: &Array,
        a: &Array,
        b: &Array,
        scales: &GemmScales,
        accumulate: bool,
        stream: Stream,
    ) -> Result<()> {
        self.bind()?;
        let g = self.gemm.get_or_try_init(|| gemm::Gemm::new(&self.ctx))?;
        compute::scaled_gemm(g, dst, a, b, scales, accumulate, stream)
    }
    /// fp8 tensor cores arrived with compute capability 8.9; cuBLASLt's
    /// outer-vector (row-wise) scales with 12.9 on 9.0 and newer.
    fn check_scaled_gemm(&self, row_wise: bool) -> Result<()> {
        let version = gemm::ensure_cublaslt()?;
        let cc = |a| driver::attribute(self.device, a);
        let major = cc(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?;
        let minor = cc(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?;
        if (major, minor) < (8, 9) {
            return Err(crate::error::err!(
                Unsupported,
                "fp8 matmuls need compute capability 8.9 or newer; CUDA device {} is {major}.{minor}",
                self.device
            ));
        }
        if row_wise && (major < 9 || version < gemm::MIN_ROW_WISE_VERSION) {
            return Err(crate::error::err!(
                Unsupported,
                "row-wise fp8 scales need cuBLASLt 12.9 or newer on compute capability 9.0 or newer (here cuBLASLt \
                 {}.{} on {major}.{minor}); use tensor-wise scales",
                version / 10000,
                version / 100 % 100
            ));
        }
        Ok(())
    }
}

/// A non-blocking stream of our own for synchronous setup steps.
struct SetupStream(sys::CUstream);

// SAFETY: a CUstream may be used from any thread.
unsafe impl Send for SetupStream {}
unsafe impl Sync for SetupStream {}

impl SetupStream {
    fn new() -> Result<Self> {
        let mut s = std::ptr::null_mut();
        let flags = sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32;
        // SAFETY: out-pointer valid; the context is current.
        driver::check(unsafe { sys::cuStreamCreate(&mut s, flags) }, "cuStreamCreate")?;
        Ok(SetupStream(s))
    }

    /// Copies `src` to device memory at `dst` and waits for it to land. A
    /// plain cuMemcpyHtoD may return before its DMA completes, and kernels
    /// on the caller's non-blocking streams would not wait for it.
    fn upload(&self, dst: u64, src: &[u8]) -> Result<()> {
        // SAFETY: dst holds src.len() bytes; src outlives the synchronize.
        driver::check(
            unsafe { sys::cuMemcpyHtoDAsync_v2(dst, src.as_ptr().cast(), src.len(), self.0) },
            "cuMemcpyHtoDAsync",
        )?;
        // SAFETY: our own stream.
        driver::check(unsafe { sys::cuStreamSynchronize(self.0) }, "cuStreamSynchronize")
    }

    fn zero(&self, addr: u64, bytes: usize) -> Result<()> {
        // SAFETY: addr..addr+bytes is a mapping of this device.
        driver::check(unsafe { sys::cuMemsetD8Async(addr, 0, bytes, self.0) }, "cuMemsetD8Async")?;
        // SAFETY: our own stream.
        driver::check(unsafe { sys::cuStreamSynchronize(self.0) }, "cuStreamSynchronize")
    }
}

impl Drop for SetupStream {
    fn drop(&mut self) {
        // SAFETY: created in new().
        unsafe { sys::cuStreamDestroy_v2(self.0) };
    }
}
