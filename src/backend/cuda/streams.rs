//! Side streams and the events that fork them from, and join them back to,
//! the caller's stream. Made on first use (outside graph capture) and kept:
//! a captured graph refers to them.
//!
//! Side streams run at the context's greatest priority. They carry the
//! operations' small kernels (barriers, signals, waits, staging copies)
//! beside the caller's matmuls; a matmul's pending blocks otherwise take
//! every multiprocessor that frees up first, and a signal kernel queued
//! behind them waited for the whole matmul (29 us on two H200s,
//! bench/results/), and the peer with it. The block scheduler dispatches a
//! higher-priority stream's blocks first.

use super::driver::check;
use super::event::Event;
use crate::backend::Stream;
use crate::error::{err, Result};
use crate::sync::{self, lock};
use cudarc::driver::sys;
use std::collections::hash_map::{Entry, HashMap};
use std::sync::Mutex;

/// Up to this many side streams (one per concurrent copy engine is plenty).
const MAX_SIDE: usize = 8;

#[derive(Default)]
pub struct SideStreams {
    streams: Mutex<Vec<usize>>,
    /// One event per stream that others wait on: a wait refers to the
    /// event's latest record at the time of the wait, so record-then-wait
    /// back to back needs no more.
    events: Mutex<HashMap<usize, Event>>,
}

impl SideStreams {
    pub fn stream(&self, i: usize) -> Result<Stream> {
        if i >= MAX_SIDE {
            return Err(err!(Internal, "side stream {i} requested; at most {MAX_SIDE}"));
        }
        let mut v = lock(&self.streams);
        while v.len() <= i {
            let (mut least, mut greatest) = (0, 0);
            // SAFETY: out-pointers valid; the backend made its context current.
            check(
                unsafe { sys::cuCtxGetStreamPriorityRange(&mut least, &mut greatest) },
                "cuCtxGetStreamPriorityRange",
            )?;
            let mut s = std::ptr::null_mut();
            let flags = sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32;
            // SAFETY: as above.
            check(unsafe { sys::cuStreamCreateWithPriority(&mut s, flags, greatest) }, "cuStreamCreateWithPriority")?;
            v.push(s as usize);
        }
        Ok(Stream(v[i]))
    }

    /// Waits for the work issued to every side stream so far.
    pub fn synchronize(&self) -> Result<()> {
        let v = lock(&self.streams);
        for &s in v.iter() {
            // SAFETY: created in stream(), of the current context.
            check(unsafe { sys::cuStreamSynchronize(s as sys::CUstream) }, "cuStreamSynchronize")?;
        }
        Ok(())
    }

    pub fn wait(&self, waiter: Stream, on: Stream) -> Result<()> {
        if waiter == on {
            return Ok(());
        }
        let mut events = lock(&self.events);
        let ev = match events.entry(on.0) {
            Entry::Occupied(e) => e.into_mut(),
            Entry::Vacant(v) => v.insert(Event::new()?),
        };
        ev.record(on)?;
        ev.make_wait(waiter)
    }
}

impl Drop for SideStreams {
    fn drop(&mut self) {
        sync::get_mut(&mut self.events).clear();
        for &s in sync::get_mut(&mut self.streams).iter() {
            // SAFETY: created in stream().
            unsafe { sys::cuStreamDestroy_v2(s as sys::CUstream) };
        }
    }
}
