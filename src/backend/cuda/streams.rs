//! Side streams and the events that fork them from, and join them back to,
//! the caller's stream. Made on first use (outside graph capture) and kept:
//! a captured graph refers to them.

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
            let mut s = std::ptr::null_mut();
            let flags = sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32;
            // SAFETY: out-pointer valid; the backend made its context current.
            check(unsafe { sys::cuStreamCreate(&mut s, flags) }, "cuStreamCreate")?;
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
