//! The watchdog of a group's NCCL communicators (a group spanning hosts).
//!
//! NCCL's kernels wait for their peers without end. A peer that does not
//! make the same call (one that changed a call the group had agreed on and
//! kept, see `ops::agree`) or that is gone would leave this rank's stream
//! waiting forever. So each call's work across hosts is bracketed by two
//! events, and a thread polls them. Any of these aborts every communicator
//! of the group, which ends NCCL's waiting kernels:
//! - a call that has run on the GPU (its first event passed) longer than
//!   the group's timeout: the group fails with `Timeout` naming the call;
//! - an error NCCL reports asynchronously (a lost connection): the group
//!   fails with it;
//! - the group failing for any other reason (a peer on this host, an
//!   abort).
//!
//! The aborted call's outputs are left partly written; the group refuses
//! every later call. Work enqueued while the caller captures a CUDA graph
//! is not watched: the graph's replays are the caller's to launch.

use super::driver;
use super::event::Event;
use super::graphs::is_capturing;
use super::nccl::Communicator;
use crate::backend::Stream;
use crate::error::{err, Error, Result};
use crate::sync::lock;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How often the thread looks: the abort comes this much after the timeout
/// at most.
const POLL: Duration = Duration::from_millis(5);
/// Events kept for reuse (a call takes two).
const SPARE_EVENTS: usize = 64;

/// One call's work across hosts, from `start` to `end` on its stream.
struct Watched {
    what: &'static str,
    start: Event,
    end: Event,
    /// The group's timeout when the call was made.
    limit: Duration,
    /// When the thread first saw `start` passed.
    started: Option<Instant>,
}

#[derive(Default)]
struct Calls {
    pending: Vec<Watched>,
    spare: Vec<Event>,
}

struct Shared {
    comms: Vec<Arc<Communicator>>,
    calls: Mutex<Calls>,
    /// The group is gone: the thread ends.
    stop: AtomicBool,
    /// The group failed: the thread aborts the communicators and ends.
    failed: AtomicBool,
    /// Fails the group.
    fail: Box<dyn Fn(&Error) + Send + Sync>,
}

/// A group's watchdog; its thread ends when it is dropped.
pub struct Watchdog {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

impl Watchdog {
    /// Starts watching `comms` on `device`. `fail` fails the group; the
    /// group calls [`Watchdog::group_failed`] when it fails.
    pub fn start(device: i32, comms: Vec<Arc<Communicator>>, fail: Box<dyn Fn(&Error) + Send + Sync>) -> Result<Self> {
        let shared = Arc::new(Shared {
            comms,
            calls: Mutex::new(Calls::default()),
            stop: AtomicBool::new(false),
            failed: AtomicBool::new(false),
            fail,
        });
        let s = shared.clone();
        let thread = std::thread::Builder::new()
            .name("symm-nccl-watch".into())
            .spawn(move || s.run(device))
            .map_err(|e| err!(Internal, "starting the thread that watches NCCL: {e}"))?;
        Ok(Watchdog { shared, thread: Some(thread) })
    }

    /// A waker for `Health::on_failure`: prompt, takes no lock.
    pub fn group_failed(&self) -> impl Fn() + Send + Sync + 'static {
        let (shared, thread) = (Arc::downgrade(&self.shared), self.thread.as_ref().map(|t| t.thread().clone()));
        move || {
            if let Some(s) = shared.upgrade() {
                s.failed.store(true, Ordering::Release);
            }
            if let Some(t) = &thread {
                t.unpark();
            }
        }
    }

    /// Runs `enqueue` (a call's work across hosts on `stream`, named
    /// `what`) watched: if the stream is still inside it `limit` after
    /// entering it, the communicators are aborted. What `enqueue`
    /// enqueued before failing is watched too.
    pub fn watch(
        &self,
        stream: Stream,
        what: &'static str,
        limit: Duration,
        enqueue: impl FnOnce() -> Result<()>,
    ) -> Result<()> {
        if is_capturing(stream)? {
            return enqueue();
        }
        let start = self.event()?;
        start.record(stream)?;
        let enqueued = enqueue();
        let end = self.event().and_then(|end| end.record(stream).map(|()| end));
        let end = match end {
            Ok(end) => end,
            // Unwatched work may hang: the group must not go on.
            Err(e) => {
                (self.shared.fail)(&e.clone().context(format!("watching {what}")));
                return Err(e);
            }
        };
        lock(&self.shared.calls).pending.push(Watched { what, start, end, limit, started: None });
        enqueued
    }

    fn event(&self) -> Result<Event> {
        match lock(&self.shared.calls).spare.pop() {
            Some(e) => Ok(e),
            None => Event::new(),
        }
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.take() {
            t.thread().unpark();
            let _ = t.join();
        }
    }
}

impl Shared {
    fn run(&self, device: i32) {
        if let Err(e) = driver::context(device)
            .and_then(|c| c.bind_to_thread().map_err(|e| driver::cuda_err(e, "making the context current")))
        {
            (self.fail)(&e.context("the thread that watches NCCL"));
        }
        loop {
            std::thread::park_timeout(POLL);
            if self.stop.load(Ordering::Acquire) {
                return;
            }
            let failure = if self.failed.load(Ordering::Acquire) { None } else { self.look().err() };
            if failure.is_some() || self.failed.load(Ordering::Acquire) {
                if let Some(e) = failure {
                    (self.fail)(&e);
                }
                for c in &self.comms {
                    c.abort();
                }
                log::warn!("NCCL's communicators of the group were aborted");
                return;
            }
        }
    }

    /// `Err` if the communicators must be aborted.
    fn look(&self) -> Result<()> {
        for c in &self.comms {
            if let Some(e) = c.async_error() {
                return Err(e.context("NCCL, between hosts"));
            }
        }
        let mut calls = lock(&self.calls);
        let Calls { pending, spare } = &mut *calls;
        let mut i = 0;
        while i < pending.len() {
            let w = &mut pending[i];
            if w.end.done()? {
                let w = pending.swap_remove(i);
                if spare.len() + 2 <= SPARE_EVENTS {
                    spare.extend([w.start, w.end]);
                }
                continue;
            }
            if w.started.is_none() && w.start.done()? {
                w.started = Some(Instant::now());
            }
            if w.started.is_some_and(|t| t.elapsed() > w.limit) {
                return Err(err!(
                    Timeout,
                    "{} across hosts did not finish within {:?} of starting on the GPU (a peer did not make the \
                     same call, or is gone); NCCL's communicators were aborted and the call's outputs are \
                     undefined",
                    w.what,
                    w.limit
                ));
            }
            i += 1;
        }
        Ok(())
    }
}
