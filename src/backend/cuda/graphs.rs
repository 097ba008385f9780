//! Replays of repeated calls. An operation issues a dozen or more driver
//! calls (copies, event forks and joins, signal kernels, matmuls); at small
//! sizes the GPU finishes them sooner than the host issues them, so issuing
//! is the operation's time. A call made again with exactly the same
//! arguments (addresses included: the key says so) is captured into a CUDA
//! graph on its second occurrence, and from then on launched as that graph:
//! one driver call. Inference loops repeat their calls with the same
//! buffers, which is what this serves; a call whose addresses change runs
//! eagerly, as before.
//!
//! Safe because the operations keep no per-call state on the host (signal
//! kernels are epoch-free, flags are zeroed by the work itself, the fused
//! reduce-scatter counts its calls in device memory), so a replay does
//! exactly what an eager run would, and ranks may mix the two.
//! Not used while the caller's stream is itself being captured (the caller
//! builds its own graph then) or with `SYMM_GRAPHS=0`.
//!
//! Every captured call is replayed by cuGraphLaunch, one-kernel calls (the
//! fused operations) included: on two H200s a graph of one launch of a
//! kernel with the fused matmul's 2152 bytes of arguments cost the host
//! 1.2 us against 4.0 us for cuLaunchKernel of the same kernel, and an
//! idle GPU ended it 4.1 us after the host began against 6.5
//! (`bench/probes/launch_probe.cu`).

use super::driver::check;
use crate::backend::{ReplayKey, Stream};
use crate::error::Result;
use cudarc::driver::sys;
use std::collections::{HashMap, HashSet};
use std::sync::Mutex;

/// A call is captured when it is seen this many times.
const CAPTURE_AT: u32 = 2;
/// Most graphs kept per backend; later keys run eagerly.
const MAX_GRAPHS: usize = 256;
/// Keys counted before the counts start over (calls that never repeat
/// would otherwise grow the map without bound).
const MAX_SEEN: usize = 4096;

#[derive(Default)]
pub struct GraphCache {
    inner: Mutex<Inner>,
}

#[derive(Default)]
struct Inner {
    /// Captured calls by key: their instantiated graphs (CUgraphExec).
    execs: HashMap<ReplayKey, usize>,
    seen: HashMap<ReplayKey, u32>,
    /// Keys whose capture failed: they run eagerly.
    refused: HashSet<ReplayKey>,
    /// Our stream to capture on (made at the first capture).
    capture: Option<usize>,
}

/// Whether replays are on (`SYMM_GRAPHS=0` turns them off).
fn enabled() -> bool {
    crate::config::graphs()
}

pub(super) fn is_capturing(stream: Stream) -> Result<bool> {
    let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
    // SAFETY: out-pointer valid; the stream belongs to the current context.
    check(unsafe { sys::cuStreamIsCapturing(stream.0 as sys::CUstream, &mut status) }, "cuStreamIsCapturing")?;
    Ok(status != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)
}

fn launch(exec: usize, stream: Stream) -> Result<()> {
    #[cfg(test)]
    let started = std::time::Instant::now();
    // SAFETY: an instantiated graph of this context; the stream too.
    let r = check(unsafe { sys::cuGraphLaunch(exec as sys::CUgraphExec, stream.0 as sys::CUstream) }, "cuGraphLaunch");
    #[cfg(test)]
    launches::add(started.elapsed());
    r
}

/// Tests' count of this thread's graph launches and the host time they took.
#[cfg(test)]
pub mod launches {
    use std::cell::Cell;
    use std::time::Duration;

    thread_local! {
        static SPENT: Cell<(u64, Duration)> = const { Cell::new((0, Duration::ZERO)) };
    }

    pub(super) fn add(t: Duration) {
        SPENT.with(|s| {
            let (n, total) = s.get();
            s.set((n + 1, total + t));
        });
    }

    /// (launches, host time in them) on this thread since the last call.
    pub fn take() -> (u64, Duration) {
        SPENT.with(|s| s.replace((0, Duration::ZERO)))
    }
}

impl GraphCache {
    /// Runs `issue` (which issues one call's work on the stream it is
    /// given) on `stream`, or launches the graph of an earlier run of the
    /// call that `key()` describes (made only when replays apply).
    /// `check_errors` runs before a replay, as before any eager launch: a
    /// failure already recorded is reported instead of queueing more work.
    /// `Ok(true)`: `stream` was being captured (by the caller), so the work
    /// went into the caller's graph.
    pub fn run(
        &self,
        key: &dyn Fn() -> ReplayKey,
        stream: Stream,
        check_errors: impl Fn() -> Result<()>,
        issue: &mut dyn FnMut(Stream) -> Result<()>,
    ) -> Result<bool> {
        if is_capturing(stream)? {
            return issue(stream).map(|()| true);
        }
        if !enabled() {
            return issue(stream).map(|()| false);
        }
        let key = &key();
        let mut inner = crate::sync::lock(&self.inner);
        if let Some(&exec) = inner.execs.get(key) {
            drop(inner);
            check_errors()?;
            return launch(exec, stream).map(|()| false);
        }
        if !inner.due_for_capture(key) {
            drop(inner);
            return issue(stream).map(|()| false);
        }
        let ran = match capture(&mut inner, issue) {
            Ok((exec, nodes)) => {
                // A replay's host time grows with its nodes.
                log::debug!("captured as a graph of {nodes} nodes: {}", key.text());
                inner.execs.insert(key.clone(), exec);
                drop(inner);
                launch(exec, stream)
            }
            // Nothing ran: the capture only recorded. Run it eagerly, and
            // from now on always (a capture that failed once fails again).
            Err(e) => {
                log::info!("graph capture refused ({}); this call runs eagerly from now on: {}", e.msg, key.text());
                inner.refused.insert(key.clone());
                drop(inner);
                issue(stream)
            }
        };
        ran.map(|()| false)
    }
}

impl Inner {
    /// Counts a call that has no graph; true when it is to be captured now.
    fn due_for_capture(&mut self, key: &ReplayKey) -> bool {
        if self.refused.contains(key) || self.execs.len() >= MAX_GRAPHS {
            return false;
        }
        if self.seen.len() >= MAX_SEEN {
            self.seen.clear();
        }
        let count = self.seen.entry(key.clone()).or_insert(0);
        *count += 1;
        if *count < CAPTURE_AT {
            return false;
        }
        self.seen.remove(key);
        true
    }
}

/// Captures `issue` on our capture stream into an instantiated graph:
/// (the graph, its nodes).
fn capture(inner: &mut Inner, issue: &mut dyn FnMut(Stream) -> Result<()>) -> Result<(usize, usize)> {
    let cap = match inner.capture {
        Some(s) => s,
        None => {
            let mut s = std::ptr::null_mut();
            let flags = sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32;
            // SAFETY: out-pointer valid; the backend made its context current.
            check(unsafe { sys::cuStreamCreate(&mut s, flags) }, "cuStreamCreate")?;
            inner.capture = Some(s as usize);
            s as usize
        }
    };
    let s = cap as sys::CUstream;
    // Thread-local: other threads' calls (another rank's, a framework's)
    // are not affected by this capture.
    let mode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL;
    // SAFETY: our own stream, not capturing.
    check(unsafe { sys::cuStreamBeginCapture_v2(s, mode) }, "cuStreamBeginCapture")?;
    let issued = issue(Stream(cap));
    let mut graph = std::ptr::null_mut();
    // SAFETY: ends the capture begun above (also after a failed issue).
    let ended = check(unsafe { sys::cuStreamEndCapture(s, &mut graph) }, "cuStreamEndCapture");
    let result = issued.and(ended).and_then(|()| {
        let mut nodes = 0;
        // SAFETY: a complete graph; no array: the count alone.
        check(unsafe { sys::cuGraphGetNodes(graph, std::ptr::null_mut(), &mut nodes) }, "cuGraphGetNodes")?;
        let mut exec = std::ptr::null_mut();
        // SAFETY: a complete graph from the capture.
        check(unsafe { sys::cuGraphInstantiateWithFlags(&mut exec, graph, 0) }, "cuGraphInstantiate")?;
        Ok((exec as usize, nodes))
    });
    if !graph.is_null() {
        // SAFETY: the instantiated graph does not need its source graph.
        unsafe { sys::cuGraphDestroy(graph) };
    }
    result
}

impl Drop for GraphCache {
    fn drop(&mut self) {
        let inner = crate::sync::get_mut(&mut self.inner);
        for &exec in inner.execs.values() {
            // SAFETY: instantiated in capture(); the driver keeps a launched
            // graph's resources until its work completes.
            unsafe { sys::cuGraphExecDestroy(exec as sys::CUgraphExec) };
        }
        if let Some(s) = inner.capture {
            // SAFETY: created in capture().
            unsafe { sys::cuStreamDestroy_v2(s as sys::CUstream) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cuda::gpu_testing::gpu;
    use std::cell::Cell;

    /// The bookkeeping alone (no GPU): a key is captured at its second
    /// occurrence, never once refused, and not beyond the graph limit;
    /// counts of keys that never repeat start over instead of growing.
    #[test]
    fn keys_are_due_for_capture_at_their_second_occurrence() {
        let mut inner = Inner::default();
        let key = |text: &str| ReplayKey::new(text.to_owned());
        assert!(!inner.due_for_capture(&key("a")));
        assert!(!inner.due_for_capture(&key("b")));
        assert!(inner.due_for_capture(&key("a")));
        assert!(!inner.seen.contains_key(&key("a")), "a captured key is no longer counted");
        inner.refused.insert(key("b"));
        assert!(!inner.due_for_capture(&key("b")));
        assert!(!inner.due_for_capture(&key("b")));
        for i in 0..MAX_SEEN + 10 {
            inner.due_for_capture(&key(&format!("once {i}")));
        }
        assert!(inner.seen.len() <= MAX_SEEN);
        inner.execs = (0..MAX_GRAPHS).map(|i| (key(&format!("g{i}")), 0)).collect();
        assert!(!inner.due_for_capture(&key("c")), "no capture beyond MAX_GRAPHS");
        inner.execs.clear(); // nothing real to destroy
    }

    /// A "call" that fills a buffer with `value` on the stream it is given
    /// (two memsets, one on a forked side stream, as operations fork), and
    /// counts how often it was issued.
    #[test]
    fn gpu_repeated_calls_are_captured_then_replayed() {
        let Some(g) = gpu() else { return };
        let n = 1 << 16;
        let buf = g.alloc(4 * n);
        let side = {
            let mut s = std::ptr::null_mut();
            let flags = sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32;
            // SAFETY: out-pointer valid; the context is current.
            check(unsafe { sys::cuStreamCreate(&mut s, flags) }, "cuStreamCreate").unwrap();
            s
        };
        let streams = crate::backend::cuda::streams::SideStreams::default();
        let issued = Cell::new(0);
        let fill = |value: u32| {
            let issued = &issued;
            let (streams, ptr) = (&streams, buf.ptr);
            move |s: Stream| -> Result<()> {
                issued.set(issued.get() + 1);
                streams.wait(Stream(side as usize), s)?;
                let half = (n / 2) as u64 * 4;
                // SAFETY: both halves lie inside the buffer.
                check(unsafe { sys::cuMemsetD32Async(ptr, value, n / 2, s.0 as _) }, "memset")?;
                check(unsafe { sys::cuMemsetD32Async(ptr + half, value, n / 2, side) }, "memset")?;
                streams.wait(s, Stream(side as usize))
            }
        };
        let cache = GraphCache::default();
        let run = |key: &str, value: u32| {
            check(unsafe { sys::cuMemsetD32Async(buf.ptr, 0xdead, n, g.stream().0 as _) }, "poison").unwrap();
            cache.run(&|| ReplayKey::new(key.to_owned()), g.stream(), || Ok(()), &mut fill(value)).unwrap();
            g.sync();
            assert!(buf.read::<u32>(n).iter().all(|&v| v == value), "call {key} did not write {value}");
        };
        run("a", 7); // eager
        assert_eq!(issued.get(), 1);
        run("a", 7); // captured (issued into the graph), then launched
        assert_eq!(issued.get(), 2);
        assert_eq!(cache.inner.lock().unwrap().execs.len(), 1);
        for _ in 0..3 {
            run("a", 7); // replayed: not issued again, still written
        }
        assert_eq!(issued.get(), 2);
        run("b", 9); // another call runs eagerly
        assert_eq!(issued.get(), 3);

        // While the caller captures its own graph, calls are issued into it.
        let s = g.stream().0 as sys::CUstream;
        let mode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL;
        check(unsafe { sys::cuStreamBeginCapture_v2(s, mode) }, "begin").unwrap();
        cache.run(&|| ReplayKey::new("a".to_owned()), g.stream(), || Ok(()), &mut fill(7)).unwrap();
        let mut graph = std::ptr::null_mut();
        check(unsafe { sys::cuStreamEndCapture(s, &mut graph) }, "end").unwrap();
        assert_eq!(issued.get(), 4, "a call under the caller's capture was not issued into it");
        unsafe { sys::cuGraphDestroy(graph) };
        // SAFETY: created above; idle after the synchronizations.
        unsafe { sys::cuStreamDestroy_v2(side) };
    }
}
