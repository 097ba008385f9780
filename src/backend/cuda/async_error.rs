//! The asynchronous error record: where a kernel whose signal wait timed out
//! (or found a peer in another call) says so (layout: `struct symm_async_error` in kernels/common.cuh). It is
//! pinned host memory mapped into the device, so the host reads it without
//! synchronizing any stream.

use super::driver::check;
use crate::backend::CallTag;
use crate::error::{err, Result};
use cudarc::driver::sys;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Mutex;

/// Records of dropped `AsyncError`s (host addresses), reused by later ones
/// and never freed: freeing pinned portable memory synchronizes every
/// device of the process, so a group destroyed while another group's kernel
/// waits for this thread's next call would wait for that kernel, which
/// waits for this thread, until the kernel's timeout.
static FREED: Mutex<Vec<usize>> = Mutex::new(Vec::new());

/// Mirror of `struct symm_async_error`.
#[repr(C)]
struct Record {
    status: u32,
    published: u32,
    rank: i32,
    peer: i32,
    channel: i32,
    kind: u32,
    waited_ns: u64,
}

const TIMEOUT: u32 = 1;
const INVALID_ARG: u32 = 2;
/// Written by the host (`stop`), never by a kernel: the group failed.
const STOPPED: u32 = 3;
/// A wait found a peer's signal or lines from another call (its tag).
const MISMATCH: u32 = 4;
/// `SYMM_GEMM_CHANNEL`: the waits of the sm90 matmul (kernels/sm90_wait.cuh).
const GEMM_CHANNEL: i32 = -2;
/// `SYMM_AR_CHANNEL`: the waits of kernels/allreduce.cu.
const ALL_REDUCE_CHANNEL: i32 = -3;
/// `symm_check_tags` (kernels/signal.cu): an NCCL step across hosts.
const ACROSS_CHANNEL: i32 = -4;

pub struct AsyncError {
    host: *mut Record,
    device: u64,
    /// Whether the failure was logged (it is reported on every later call).
    logged: AtomicBool,
}

// SAFETY: the record is plain pinned memory; the host only reads it (and
// zeroes it at creation) and the device writes it atomically.
unsafe impl Send for AsyncError {}
unsafe impl Sync for AsyncError {}

impl AsyncError {
    /// A zeroed record (a freed one's, else a new one). The current context
    /// must be the device's.
    pub fn new() -> Result<Self> {
        let mut p = crate::sync::lock(&FREED).pop().unwrap_or(0) as *mut std::ffi::c_void;
        if p.is_null() {
            let flags = sys::CU_MEMHOSTALLOC_DEVICEMAP | sys::CU_MEMHOSTALLOC_PORTABLE;
            // SAFETY: out-pointer valid; flags are driver constants.
            check(unsafe { sys::cuMemHostAlloc(&mut p, std::mem::size_of::<Record>(), flags) }, "cuMemHostAlloc")?;
        }
        let host = p as *mut Record;
        // SAFETY: freshly allocated, large enough, not yet shared.
        unsafe { host.write(std::mem::zeroed()) };
        let mut device = 0;
        // SAFETY: p is mapped host memory.
        if let Err(e) =
            check(unsafe { sys::cuMemHostGetDevicePointer_v2(&mut device, p, 0) }, "cuMemHostGetDevicePointer")
        {
            crate::sync::lock(&FREED).push(p as usize);
            return Err(e);
        }
        Ok(AsyncError { host, device, logged: AtomicBool::new(false) })
    }

    /// The device pointer kernels receive as `err`.
    pub fn device_ptr(&self) -> u64 {
        self.device
    }

    /// Makes every kernel of the group that waits stop (their waits poll the
    /// status word), unless a failure is recorded already. Takes no lock
    /// and does not touch the driver, so it is safe from any thread while
    /// another is blocked in a CUDA call.
    pub fn stop(&self) {
        // SAFETY: as in `check`; the device CASes the same word, so whoever
        // writes first wins and the other leaves the record alone.
        let status = unsafe { &*(std::ptr::addr_of!((*self.host).status) as *const AtomicU32) };
        if status.compare_exchange(0, STOPPED, Ordering::AcqRel, Ordering::Acquire).is_ok() {
            // SAFETY: the status is ours now; no kernel writes the fields.
            unsafe { &*(std::ptr::addr_of!((*self.host).published) as *const AtomicU32) }.store(1, Ordering::Release);
        }
    }

    /// The failure a kernel recorded, naming the peer (`Timeout`, or
    /// `Mismatch` where a peer was in another call). The record stays set:
    /// the pads are in an unknown state after either, so the group must be
    /// rebuilt.
    pub fn check(&self) -> Result<()> {
        // SAFETY: the record is valid for our lifetime; the device writes the
        // status word atomically, so read it atomically.
        let status = unsafe { &*(std::ptr::addr_of!((*self.host).status) as *const AtomicU32) }.load(Ordering::Acquire);
        if status == 0 {
            return Ok(());
        }
        if status == STOPPED {
            return Err(err!(Aborted, "the group failed, and the work it had queued on the device was stopped"));
        }
        let published =
            unsafe { &*(std::ptr::addr_of!((*self.host).published) as *const AtomicU32) }.load(Ordering::Acquire);
        if published == 0 {
            return Err(match status {
                MISMATCH => {
                    err!(Mismatch, "a wait on the device found a peer in another call (details still being written)")
                }
                _ => err!(Timeout, "a signal wait on the device failed (details still being written)"),
            });
        }
        // SAFETY: published == 1 (acquire) orders the reads of the fields.
        let r = unsafe { std::ptr::read_volatile(self.host) };
        let what = match r.kind {
            _ if r.channel == GEMM_CHANNEL => format!("the fused matmul waiting for rank {}", r.peer),
            _ if r.channel == ALL_REDUCE_CHANNEL => format!("the all-reduce waiting for rank {}", r.peer),
            _ if r.channel == ACROSS_CHANNEL => "an exchange across hosts".to_string(),
            1 => {
                format!("put_signal to rank {} on channel {}: the previous signal was not consumed", r.peer, r.channel)
            }
            2 => format!("wait_signal for rank {} on channel {}", r.peer, r.channel),
            3 => format!("wait_value for a flag of rank {}", r.peer),
            _ => format!("barrier on channel {}", r.channel),
        };
        let e = match r.status {
            TIMEOUT => err!(
                Timeout,
                "rank {}: {what} timed out on the device after {} ms; the group's signal pads are now undefined, destroy the group",
                r.rank,
                r.waited_ns / 1_000_000
            ),
            MISMATCH => CallTag::mismatch(&format!("rank {}: {what}: ", r.rank), r.peer.max(0) as usize, None),
            INVALID_ARG => err!(Internal, "rank {}: a signal kernel got invalid arguments ({what})", r.rank),
            other => err!(Internal, "rank {}: unknown device error {other} ({what})", r.rank),
        };
        if !self.logged.swap(true, Ordering::Relaxed) {
            log::warn!("{}", e.msg);
        }
        Err(e)
    }
}

impl Drop for AsyncError {
    /// Keeps the record for the next `AsyncError` (see [`FREED`]).
    fn drop(&mut self) {
        crate::sync::lock(&FREED).push(self.host as usize);
    }
}
