//! A profiling aid for the fused kernel's inside, where Nsight cannot look
//! (its kernel replay breaks the ranks' flag protocol). With
//! `SYMM_TRACE_SM90=<prefix>`, each launch of the sm90 matmul for a fused
//! operation, outside graph capture, has every CTA record the GPU's
//! %globaltimer at fixed points of its last tile (`SYMM_TRACE_*` in
//! `kernels/gemm_sm90.cu`); the launch is then waited for and one line per
//! CTA appended to `<prefix>.<pid>.txt`. The wait makes it a tool for
//! timelines, not for throughput. Replayed calls skip it: set
//! `SYMM_GRAPHS=0` as well.

use super::driver::check;
use super::sm90_gemm::{Sm90Kernels, Sm90Matmul};
use crate::backend::Stream;
use crate::error::{err, Result};
use cudarc::driver::sys;
use std::io::Write;
use std::sync::atomic::{AtomicU64, Ordering};

/// u64 per CTA (`SYMM_GEMM_TRACE_SLOTS`), in this order.
const SLOTS: &[&str] = &["start", "mainloop", "epilogue", "pushed", "flagged", "partials", "chunk", "end"];

/// The prefix of the trace files, when tracing is on.
pub fn prefix() -> Option<&'static str> {
    static PREFIX: once_cell::sync::Lazy<Option<String>> =
        once_cell::sync::Lazy::new(|| std::env::var("SYMM_TRACE_SM90").ok().filter(|s| !s.is_empty()));
    PREFIX.as_deref()
}

/// Launches `mm` with a trace buffer, waits for it and appends its trace.
pub fn launch(mm: &mut Sm90Matmul, kernels: &Sm90Kernels, sm_count: u32, stream: Stream, prefix: &str) -> Result<()> {
    static LAUNCHES: AtomicU64 = AtomicU64::new(0);
    let ctas = mm.grid(sm_count) as usize;
    let bytes = ctas * SLOTS.len() * 8;
    let buf = Buffer::alloc(bytes)?;
    let s = stream.0 as sys::CUstream;
    // SAFETY: `bytes` of device memory just allocated.
    check(unsafe { sys::cuMemsetD8Async(buf.0, 0, bytes, s) }, "cuMemsetD8Async (trace)")?;
    mm.trace = buf.0;
    let launched = mm.launch(kernels, sm_count, stream);
    mm.trace = 0;
    launched?;
    let mut host = vec![0u64; ctas * SLOTS.len()];
    // SAFETY: the destination holds `bytes`; unified addressing tells the
    // driver it is (pageable) host memory.
    check(unsafe { sys::cuMemcpyAsync(host.as_mut_ptr() as u64, buf.0, bytes, s) }, "cuMemcpyAsync (trace)")?;
    // SAFETY: a stream of the current context.
    check(unsafe { sys::cuStreamSynchronize(s) }, "cuStreamSynchronize (trace)")?;
    let launch = LAUNCHES.fetch_add(1, Ordering::Relaxed);
    let rank = mm.scatter.as_ref().map(|s| s.rank).or(mm.gather.as_ref().map(|g| g.local_chunk)).unwrap_or(0);
    let mut text = String::new();
    if launch == 0 {
        text += &format!("# launch rank m n k tile cta {}\n", SLOTS.join(" "));
    }
    for (cta, slots) in host.chunks(SLOTS.len()).enumerate() {
        let times: Vec<String> = slots.iter().map(u64::to_string).collect();
        text += &format!("{launch} {rank} {} {} {} {} {cta} {}\n", mm.m, mm.n, mm.k, mm.tile.cols(), times.join(" "));
    }
    let path = format!("{prefix}.{}.txt", std::process::id());
    std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&path)
        .and_then(|mut f| f.write_all(text.as_bytes()))
        .map_err(|e| err!(Internal, "writing the sm90 trace to {path}: {e}"))
}

/// Device memory for one traced launch.
struct Buffer(u64);

impl Buffer {
    fn alloc(bytes: usize) -> Result<Self> {
        let mut ptr = 0;
        // SAFETY: out-pointer valid; the caller made the device's context current.
        check(unsafe { sys::cuMemAlloc_v2(&mut ptr, bytes) }, "cuMemAlloc (trace)")?;
        Ok(Buffer(ptr))
    }
}

impl Drop for Buffer {
    fn drop(&mut self) {
        // SAFETY: allocated in alloc(); the launch that wrote it was waited
        // for (or never queued).
        unsafe { sys::cuMemFree_v2(self.0) };
    }
}
