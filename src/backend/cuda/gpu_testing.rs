//! Test helpers for the CUDA kernels and cuBLASLt wrappers: a device, its
//! kernels, a private stream and device buffers.
//!
//! Tests that need a GPU are named `gpu_*`, call [`gpu`] and return early on
//! machines without one, so the same suite runs in CI and checks the real
//! thing on a GPU machine (`cargo test --release --lib backend::cuda`).
//! Rust's test harness has no "skipped" state, so such a test still counts
//! as passed; to keep that visible, [`gpu`] writes
//! `SKIPPED (too few CUDA devices, or no NCCL): <test name>` to stderr (past the harness's
//! output capture) and the process prints how many were skipped when it
//! exits, after the harness's summary.

use super::driver::{self, check};
use super::gemm::{Fp8, GemmDtype};
use super::module::{self, Kernels};
use crate::backend::Stream;
use cudarc::driver::{sys, CudaContext};
use half::{bf16, f16};
use std::io::Write;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Once};

pub struct Gpu {
    pub ctx: Arc<CudaContext>,
    pub kernels: Arc<Kernels>,
    stream: sys::CUstream,
}

/// Device 0 with its kernels, or `None` when this machine has no GPU: the
/// caller then returns at once, and is reported skipped (see the module
/// documentation).
pub fn gpu() -> Option<Gpu> {
    if driver::device_count() == 0 {
        report_skipped();
        return None;
    }
    Some(gpu_on(0))
}

/// Tests that found no GPU in this process.
static SKIPPED: AtomicUsize = AtomicUsize::new(0);

/// Says on stderr that the calling test is skipped, and counts it. The
/// harness names each test's thread after the test.
pub fn report_skipped() {
    let thread = std::thread::current();
    let name = thread.name().unwrap_or("<unnamed test>");
    // Not eprintln!: the harness captures that for passing tests. One
    // write, so the line is not split by the harness's own output.
    let _ = std::io::stderr().write_all(format!("SKIPPED (too few CUDA devices, or no NCCL): {name}\n").as_bytes());
    SKIPPED.fetch_add(1, Ordering::Relaxed);
    static AT_EXIT: Once = Once::new();
    AT_EXIT.call_once(|| {
        // SAFETY: registers a function with no preconditions; if it cannot
        // be registered the summary line is merely missing.
        unsafe { libc::atexit(print_skipped) };
    });
}

extern "C" fn print_skipped() {
    let n = SKIPPED.load(Ordering::Relaxed);
    let s = if n == 1 { "" } else { "s" };
    let line = format!("SKIPPED (too few CUDA devices, or no NCCL): {n} GPU test{s} passed without running\n");
    let _ = std::io::stderr().write_all(line.as_bytes());
}

/// Device `ordinal` (which must exist) with its kernels.
pub fn gpu_on(ordinal: i32) -> Gpu {
    let ctx = driver::context(ordinal).unwrap_or_else(|e| panic!("context of device {ordinal}: {}", e.msg));
    let kernels = module::kernels(&ctx).expect("loading symm's kernels");
    let mut stream = std::ptr::null_mut();
    let flags = sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32;
    // SAFETY: out-pointer valid; the context is current.
    check(unsafe { sys::cuStreamCreate(&mut stream, flags) }, "cuStreamCreate").unwrap();
    Gpu { ctx, kernels, stream }
}

impl Gpu {
    pub fn stream(&self) -> Stream {
        Stream(self.stream as usize)
    }

    pub fn sync(&self) {
        self.ctx.bind_to_thread().unwrap();
        // SAFETY: our own stream.
        check(unsafe { sys::cuStreamSynchronize(self.stream) }, "cuStreamSynchronize").unwrap();
    }

    pub fn alloc(&self, bytes: usize) -> DevBuf {
        self.ctx.bind_to_thread().unwrap();
        let mut ptr = 0;
        // SAFETY: out-pointer valid.
        check(unsafe { sys::cuMemAlloc_v2(&mut ptr, bytes.max(1)) }, "cuMemAlloc").unwrap();
        DevBuf { ptr, bytes }
    }

    /// A buffer holding `data`.
    pub fn upload<T: Copy>(&self, data: &[T]) -> DevBuf {
        let b = self.alloc(std::mem::size_of_val(data));
        b.write(data);
        b
    }

    /// Writes `bytes` at `addr`, device memory of this GPU's (any
    /// allocation: symmetric buffers too), and waits for them to land.
    pub fn write_at(&self, addr: u64, bytes: &[u8]) {
        self.ctx.bind_to_thread().unwrap();
        // SAFETY: the caller's device memory of at least `bytes.len()`.
        check(unsafe { sys::cuMemcpyHtoD_v2(addr, bytes.as_ptr().cast(), bytes.len()) }, "cuMemcpyHtoD").unwrap();
        // SAFETY: no arguments.
        check(unsafe { sys::cuCtxSynchronize() }, "cuCtxSynchronize").unwrap();
    }

    /// The `len` bytes at `addr` (as `write_at`).
    pub fn read_at(&self, addr: u64, len: usize) -> Vec<u8> {
        self.ctx.bind_to_thread().unwrap();
        let mut v = vec![0u8; len];
        // SAFETY: as write_at, the other way.
        check(unsafe { sys::cuMemcpyDtoH_v2(v.as_mut_ptr().cast(), addr, len) }, "cuMemcpyDtoH").unwrap();
        v
    }
}

impl Drop for Gpu {
    fn drop(&mut self) {
        // SAFETY: created in gpu().
        unsafe { sys::cuStreamDestroy_v2(self.stream) };
    }
}

/// `cuMemAlloc` memory, freed on drop. Copies are synchronous.
pub struct DevBuf {
    pub ptr: u64,
    pub bytes: usize,
}

impl DevBuf {
    pub fn write<T: Copy>(&self, data: &[T]) {
        let bytes = std::mem::size_of_val(data);
        assert!(bytes <= self.bytes);
        // SAFETY: the buffer holds `bytes`; the source is valid host memory.
        check(unsafe { sys::cuMemcpyHtoD_v2(self.ptr, data.as_ptr().cast(), bytes) }, "cuMemcpyHtoD").unwrap();
        // cuMemcpyHtoD from pageable memory may return before the DMA has
        // landed, and kernels on non-blocking streams do not wait for it.
        // SAFETY: no arguments.
        check(unsafe { sys::cuCtxSynchronize() }, "cuCtxSynchronize").unwrap();
    }

    /// The first `n` elements of type `T`.
    pub fn read<T: Copy + Default>(&self, n: usize) -> Vec<T> {
        let mut v = vec![T::default(); n];
        let bytes = std::mem::size_of_val(v.as_slice());
        assert!(bytes <= self.bytes);
        // SAFETY: as write, in the other direction.
        check(unsafe { sys::cuMemcpyDtoH_v2(v.as_mut_ptr().cast(), self.ptr, bytes) }, "cuMemcpyDtoH").unwrap();
        v
    }

    pub fn read_bytes(&self) -> Vec<u8> {
        self.read(self.bytes)
    }
}

impl Drop for DevBuf {
    fn drop(&mut self) {
        // SAFETY: allocated by Gpu::alloc.
        unsafe { sys::cuMemFree_v2(self.ptr) };
    }
}

/// Milliseconds per iteration of `f` enqueued `iters` times on `g`'s stream
/// (after `warmup` untimed ones), measured with CUDA events.
pub fn time_ms(g: &Gpu, warmup: usize, iters: usize, mut f: impl FnMut()) -> f32 {
    for _ in 0..warmup {
        f();
    }
    let mut ev = [std::ptr::null_mut(); 2];
    for e in &mut ev {
        // SAFETY: out-pointer valid.
        check(unsafe { sys::cuEventCreate(e, 0) }, "cuEventCreate").unwrap();
    }
    // SAFETY: events and stream are ours.
    check(unsafe { sys::cuEventRecord(ev[0], g.stream) }, "cuEventRecord").unwrap();
    for _ in 0..iters {
        f();
    }
    check(unsafe { sys::cuEventRecord(ev[1], g.stream) }, "cuEventRecord").unwrap();
    g.sync();
    let mut ms = 0.0f32;
    check(unsafe { sys::cuEventElapsedTime_v2(&mut ms, ev[0], ev[1]) }, "cuEventElapsedTime").unwrap();
    for e in ev {
        unsafe { sys::cuEventDestroy_v2(e) };
    }
    ms / iters as f32
}

/// Captures what `f` enqueues on `g`'s stream into a graph, then launches
/// the graph `replays` times and waits. Returns `f`'s result from capture.
pub fn capture_and_replay<R>(g: &Gpu, replays: usize, f: impl FnOnce() -> R) -> R {
    let mode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL;
    // SAFETY: our own stream; graph handles are created and destroyed here.
    unsafe {
        check(sys::cuStreamBeginCapture_v2(g.stream, mode), "cuStreamBeginCapture").unwrap();
        let r = f();
        let mut graph = std::ptr::null_mut();
        check(sys::cuStreamEndCapture(g.stream, &mut graph), "cuStreamEndCapture").unwrap();
        let mut exec = std::ptr::null_mut();
        check(sys::cuGraphInstantiateWithFlags(&mut exec, graph, 0), "cuGraphInstantiate").unwrap();
        for _ in 0..replays {
            check(sys::cuGraphLaunch(exec, g.stream), "cuGraphLaunch").unwrap();
        }
        g.sync();
        sys::cuGraphExecDestroy(exec);
        sys::cuGraphDestroy(graph);
        r
    }
}

/// Rounds of `round_robin_ms`.
pub const ROUNDS: usize = 9;

/// Median ms of 5 launches of `run(c)`, for each of `count` candidates,
/// timed round-robin over ROUNDS rounds: the GPU's clock drifts as it
/// heats over a test, which favoured whatever ran first.
pub fn round_robin_ms(g: &Gpu, count: usize, mut run: impl FnMut(usize)) -> Vec<f32> {
    let mut samples = vec![Vec::new(); count];
    for round in 0..ROUNDS {
        for i in 0..count {
            let c = (i + round) % count;
            samples[c].push(time_ms(g, 1, 5, || run(c)));
        }
    }
    samples
        .iter_mut()
        .map(|v| {
            v.sort_by(f32::total_cmp);
            v[v.len() / 2]
        })
        .collect()
}

/// ‖got − want‖ / ‖want‖, and every element written (no NaN poison left).
pub fn rel_err(got: &[f32], want: &[f64]) -> f64 {
    assert_eq!(got.len(), want.len());
    let (mut num, mut den) = (0f64, 0f64);
    for (g, w) in got.iter().zip(want) {
        assert!(g.is_finite(), "an output element was not written (or is not finite): {g}");
        num += (*g as f64 - w).powi(2);
        den += w * w;
    }
    (num / den).sqrt()
}

/// Deterministic pseudo-random values in [-1, 1).
pub fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

/// Deterministic pseudo-random finite fp8 bytes of moderate magnitude
/// (|v| in [1/2, 4): exponent field 6..8 of E4M3 or 14..16 of E5M2).
pub fn fp8_bytes(len: usize, seed: u64, f: Fp8) -> Vec<u8> {
    let (shift, base) = if f == Fp8::E4M3 { (3, 6u64) } else { (2, 14u64) };
    (0..len as u64)
        .map(|i| {
            let h = (i * 0x9e37_79b9 + seed * 7919).wrapping_mul(0x2545_f491_4f6c_dd1d) >> 32;
            ((h & 0x80) | ((base + h % 3) << shift) | ((h >> 8) & ((1 << shift) - 1))) as u8
        })
        .collect()
}

/// `v` as little-endian bytes of `dtype`.
pub fn encode(dtype: GemmDtype, v: &[f32]) -> Vec<u8> {
    match dtype {
        GemmDtype::F32 => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        GemmDtype::BF16 => v.iter().flat_map(|x| bf16::from_f32(*x).to_le_bytes()).collect(),
        GemmDtype::F16 => v.iter().flat_map(|x| f16::from_f32(*x).to_le_bytes()).collect(),
    }
}

/// Little-endian bytes of `dtype` as f32 values.
pub fn decode(dtype: GemmDtype, b: &[u8]) -> Vec<f32> {
    match dtype {
        GemmDtype::F32 => b.chunks(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect(),
        GemmDtype::BF16 => b.chunks(2).map(|c| bf16::from_le_bytes(c.try_into().unwrap()).to_f32()).collect(),
        GemmDtype::F16 => b.chunks(2).map(|c| f16::from_le_bytes(c.try_into().unwrap()).to_f32()).collect(),
    }
}
