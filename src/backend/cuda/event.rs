//! A CUDA event owned here: recorded on a stream, asked whether the stream
//! has passed it, destroyed when dropped (at once, or, while its stream
//! has not reached it yet, by the driver once it has).

use super::driver::check;
use crate::backend::Stream;
use crate::error::Result;
use cudarc::driver::sys;

pub(super) struct Event(sys::CUevent);

// SAFETY: a CUDA event may be recorded and queried from any thread.
unsafe impl Send for Event {}

impl Event {
    /// An event that only marks a place in its stream (cheaper to record).
    pub(super) fn new() -> Result<Event> {
        Self::with_flags(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32)
    }

    /// An event that also records when its stream passed it.
    pub(super) fn timing() -> Result<Event> {
        Self::with_flags(0)
    }

    fn with_flags(flags: u32) -> Result<Event> {
        let mut e = std::ptr::null_mut();
        // SAFETY: a valid out pointer; the caller's context is current.
        check(unsafe { sys::cuEventCreate(&mut e, flags) }, "cuEventCreate")?;
        Ok(Event(e))
    }

    pub(super) fn record(&self, stream: Stream) -> Result<()> {
        // SAFETY: a live event and a stream of the same context.
        check(unsafe { sys::cuEventRecord(self.0, stream.0 as sys::CUstream) }, "cuEventRecord")
    }

    /// Makes `waiter`'s later work wait until the stream the event was
    /// last recorded on has passed it.
    pub(super) fn make_wait(&self, waiter: Stream) -> Result<()> {
        // SAFETY: a live event and a stream of the same context.
        check(unsafe { sys::cuStreamWaitEvent(waiter.0 as sys::CUstream, self.0, 0) }, "cuStreamWaitEvent")
    }

    /// Whether the stream has passed the event.
    pub(super) fn done(&self) -> Result<bool> {
        // SAFETY: a live event.
        match unsafe { sys::cuEventQuery(self.0) } {
            sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            rc => check(rc, "cuEventQuery").map(|()| true),
        }
    }

    /// Milliseconds from `self` to `later`, both timing events, both done.
    pub(super) fn ms_to(&self, later: &Event) -> Result<f32> {
        let mut ms = 0f32;
        // SAFETY: two completed events of one context; a valid out pointer.
        check(unsafe { sys::cuEventElapsedTime_v2(&mut ms, self.0, later.0) }, "cuEventElapsedTime")?;
        Ok(ms)
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        // SAFETY: created by cuEventCreate, destroyed once.
        unsafe { sys::cuEventDestroy_v2(self.0) };
    }
}
