//! A profiling aid for the fused kernel's inside, where Nsight cannot look
//! (its kernel replay breaks the ranks' flag protocol). With
//! `SYMM_TRACE_SM90=<prefix>`, each launch of the sm90 matmul for a fused
//! operation, outside graph capture, has every CTA record the GPU's
//! %globaltimer at fixed points of its last tile (`SYMM_TRACE_*` in
//! `kernels/gemm_sm90.cu`) into mapped host memory; a host function queued
//! behind the kernel appends one line per CTA to `<prefix>.<pid>.txt`. The
//! host never waits (an all-gather kernel waits for copies issued after
//! it), but the host function holds the stream: a tool for timelines, not
//! for throughput. Replayed calls skip it: set `SYMM_GRAPHS=0` as well.

use super::driver::check;
use super::sm90_gemm::{Sm90Kernels, Sm90Matmul};
use crate::backend::Stream;
use crate::error::Result;
use cudarc::driver::sys;
use std::io::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

/// u64 per CTA (`SYMM_GEMM_TRACE_SLOTS`), in this order.
const SLOTS: &[&str] = &[
    "start", "mainloop", "epilogue", "pushed", "flagged", "partials", "chunk", "end", "added", "drained", "ready",
    "boxes", "handed", "first_in", "last_in",
];

/// The prefix of the trace files, when tracing is on.
pub fn prefix() -> Option<&'static str> {
    static PREFIX: once_cell::sync::Lazy<Option<String>> =
        once_cell::sync::Lazy::new(|| std::env::var("SYMM_TRACE_SM90").ok().filter(|s| !s.is_empty()));
    PREFIX.as_deref()
}

/// Launches `mm` with a trace buffer and queues the writing of its trace.
pub fn launch(mm: &mut Sm90Matmul, kernels: &Sm90Kernels, sm_count: u32, stream: Stream, prefix: &str) -> Result<()> {
    static LAUNCHES: AtomicU64 = AtomicU64::new(0);
    let ctas = mm.grid(sm_count) as usize;
    let buf = written_or_new(ctas * SLOTS.len())?;
    mm.trace = buf.device;
    let launched = mm.launch(kernels, sm_count, stream);
    mm.trace = 0;
    launched?;
    let launch = LAUNCHES.fetch_add(1, Ordering::Relaxed);
    let rank = mm.scatter.as_ref().map(|s| s.rank).or(mm.gather.as_ref().map(|g| g.local_chunk)).unwrap_or(0);
    let mut head = String::new();
    if launch == 0 {
        head += &format!("# launch rank m n k tile cta {}\n", SLOTS.join(" "));
    }
    let job = Box::new(Job {
        buf,
        path: format!("{prefix}.{}.txt", std::process::id()),
        head,
        fields: format!("{launch} {rank} {} {} {} {}", mm.m, mm.n, mm.k, mm.tile.cols()),
    });
    let job = Box::into_raw(job);
    // SAFETY: `write_trace` takes back the box exactly once, when the stream
    // reaches it; on failure nothing was queued and the box is ours again.
    let queued = check(
        unsafe { sys::cuLaunchHostFunc(stream.0 as sys::CUstream, Some(write_trace), job.cast()) },
        "cuLaunchHostFunc (trace)",
    );
    if queued.is_err() {
        // SAFETY: not queued, so not taken.
        let job = unsafe { Box::from_raw(job) };
        // The kernel writes the buffer: let it finish before the buffer goes.
        // SAFETY: a stream of the current context.
        let _ = unsafe { sys::cuStreamSynchronize(stream.0 as sys::CUstream) };
        drop(job);
    }
    queued
}

/// One launch's trace, written once the kernel is done.
struct Job {
    buf: HostBuffer,
    path: String,
    head: String,
    fields: String,
}

/// Host function (no CUDA calls allowed): appends the trace, hands the
/// buffer back for reuse (`written_or_new`).
unsafe extern "C" fn write_trace(job: *mut std::ffi::c_void) {
    // SAFETY: the box made by `launch`, given to this function only.
    let Job { buf, path, head: mut text, fields } = *unsafe { Box::from_raw(job.cast::<Job>()) };
    for cta in 0..buf.len / SLOTS.len() {
        let times: Vec<String> = (0..SLOTS.len()).map(|s| buf.read(cta * SLOTS.len() + s).to_string()).collect();
        text += &format!("{fields} {cta} {}\n", times.join(" "));
    }
    let written = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&path)
        .and_then(|mut f| f.write_all(text.as_bytes()));
    if let Err(e) = written {
        eprintln!("symm: writing the sm90 trace to {path}: {e}");
    }
    WRITTEN.lock().unwrap_or_else(|p| p.into_inner()).push(buf);
}

/// Buffers whose traces were written, for the next traced launches: never
/// freed while the process traces, because cuMemFreeHost synchronizes the
/// device, which held each traced call until the GPU was idle and put two
/// ranks' kernels tens of microseconds apart however the caller lined them
/// up (`fused_trace.py --in-step`).
static WRITTEN: Mutex<Vec<HostBuffer>> = Mutex::new(Vec::new());

/// A written buffer of `len` u64, zeroed again, or a new one.
fn written_or_new(len: usize) -> Result<HostBuffer> {
    let mut written = WRITTEN.lock().unwrap_or_else(|p| p.into_inner());
    match written.iter().position(|b| b.len == len) {
        Some(i) => {
            let buf = written.swap_remove(i);
            // SAFETY: `len` u64 of ours; the kernel that wrote them is done.
            unsafe { buf.host.write_bytes(0, len) };
            Ok(buf)
        }
        None => HostBuffer::alloc(len),
    }
}

/// Zeroed mapped host memory of `len` u64 that the kernel writes.
struct HostBuffer {
    host: *mut u64,
    device: u64,
    len: usize,
}

// SAFETY: pinned host memory, usable from any thread.
unsafe impl Send for HostBuffer {}

impl HostBuffer {
    fn alloc(len: usize) -> Result<Self> {
        let mut p = std::ptr::null_mut();
        // SAFETY: out-pointer valid; the caller made the device's context current.
        check(
            unsafe { sys::cuMemHostAlloc(&mut p, len * 8, sys::CU_MEMHOSTALLOC_DEVICEMAP) },
            "cuMemHostAlloc (trace)",
        )?;
        // Owned from here (freed on drop, on error too). Filled in place:
        // `HostBuffer { device, ..buf }` would copy the fields and drop
        // (free) `buf`, which memcheck caught as writes to freed memory.
        let mut buf = HostBuffer { host: p.cast(), device: 0, len };
        // SAFETY: `len` u64 just allocated.
        unsafe { buf.host.write_bytes(0, len) };
        // SAFETY: mapped host memory.
        check(unsafe { sys::cuMemHostGetDevicePointer_v2(&mut buf.device, p, 0) }, "cuMemHostGetDevicePointer")?;
        Ok(buf)
    }

    fn read(&self, i: usize) -> u64 {
        assert!(i < self.len);
        // SAFETY: in bounds; written by the kernel, which has finished.
        unsafe { self.host.add(i).read_volatile() }
    }
}

impl Drop for HostBuffer {
    fn drop(&mut self) {
        // SAFETY: allocated in alloc(); the kernel that wrote it is done.
        unsafe { sys::cuMemFreeHost(self.host.cast()) };
    }
}
