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
//! A graph that holds a single launch of one of symm's own kernels (the
//! fused reduce-scatter's one kernel) is replayed as that launch, with the
//! arguments the capture recorded: on two H200s cuGraphLaunch made such a
//! bound call cost the host 11 us against 9 us issued afresh
//! (`bench/results/2026-11-26-h200-x2-7c59b68-host-overhead.txt`), and a
//! kernel launch also reaches the GPU sooner.

use super::driver::check;
use crate::backend::Stream;
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

/// How a captured call is replayed.
#[derive(Clone, Copy)]
enum Replay {
    /// cuGraphLaunch of the instantiated graph (a CUgraphExec).
    Graph(usize),
    /// The graph's one kernel launched again (`single_launch`).
    Kernel(KernelLaunch),
}

/// A graph's only node, a launch of one of symm's own kernels (which take
/// no launch attributes), with the graph that owns its arguments.
#[derive(Clone, Copy)]
struct KernelLaunch {
    params: sys::CUDA_KERNEL_NODE_PARAMS,
    graph: sys::CUgraph,
}

// SAFETY: driver handles and the graph-owned argument array, usable from
// any thread; only read after the capture.
unsafe impl Send for KernelLaunch {}

#[derive(Default)]
struct Inner {
    /// Captured calls by key.
    execs: HashMap<String, Replay>,
    seen: HashMap<String, u32>,
    /// Keys whose capture failed: they run eagerly.
    refused: HashSet<String>,
    /// Our stream to capture on (made at the first capture).
    capture: Option<usize>,
}

/// Whether replays are on (`SYMM_GRAPHS=0` turns them off).
fn enabled() -> bool {
    static ON: once_cell::sync::Lazy<bool> =
        once_cell::sync::Lazy::new(|| std::env::var("SYMM_GRAPHS").map_or(true, |v| v != "0"));
    *ON
}

pub(super) fn is_capturing(stream: Stream) -> Result<bool> {
    let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
    // SAFETY: out-pointer valid; the stream belongs to the current context.
    check(unsafe { sys::cuStreamIsCapturing(stream.0 as sys::CUstream, &mut status) }, "cuStreamIsCapturing")?;
    Ok(status != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)
}

fn launch(replay: Replay, stream: Stream) -> Result<()> {
    #[cfg(test)]
    let started = std::time::Instant::now();
    let s = stream.0 as sys::CUstream;
    let r = match replay {
        // SAFETY: an instantiated graph of this context; the stream too.
        Replay::Graph(exec) => check(unsafe { sys::cuGraphLaunch(exec as sys::CUgraphExec, s) }, "cuGraphLaunch"),
        Replay::Kernel(k) => {
            let p = &k.params;
            // SAFETY: the captured launch of a kernel of this context; its
            // argument array is owned by the graph, kept until the cache drops.
            let r = unsafe {
                sys::cuLaunchKernel(
                    p.func,
                    p.gridDimX,
                    p.gridDimY,
                    p.gridDimZ,
                    p.blockDimX,
                    p.blockDimY,
                    p.blockDimZ,
                    p.sharedMemBytes,
                    s,
                    p.kernelParams,
                    std::ptr::null_mut(),
                )
            };
            check(r, "cuLaunchKernel (a replayed call)")
        }
    };
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
    /// `ours` says whether a kernel is one of symm's own (launched with no
    /// attributes), which a graph of that kernel alone replays as a launch.
    pub fn run(
        &self,
        key: &dyn Fn() -> String,
        stream: Stream,
        check_errors: impl Fn() -> Result<()>,
        ours: &dyn Fn(sys::CUfunction) -> bool,
        issue: &mut dyn FnMut(Stream) -> Result<()>,
    ) -> Result<()> {
        if !enabled() || is_capturing(stream)? {
            return issue(stream);
        }
        let key = &key();
        let mut inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(&exec) = inner.execs.get(key) {
            drop(inner);
            check_errors()?;
            return launch(exec, stream);
        }
        if !inner.due_for_capture(key) {
            drop(inner);
            return issue(stream);
        }
        match capture(&mut inner, ours, issue) {
            Ok(exec) => {
                inner.execs.insert(key.to_owned(), exec);
                drop(inner);
                launch(exec, stream)
            }
            // Nothing ran: the capture only recorded. Run it eagerly, and
            // from now on always (a capture that failed once fails again).
            Err(_) => {
                inner.refused.insert(key.to_owned());
                drop(inner);
                issue(stream)
            }
        }
    }
}

impl Inner {
    /// Counts a call that has no graph; true when it is to be captured now.
    fn due_for_capture(&mut self, key: &str) -> bool {
        if self.refused.contains(key) || self.execs.len() >= MAX_GRAPHS {
            return false;
        }
        if self.seen.len() >= MAX_SEEN {
            self.seen.clear();
        }
        let count = self.seen.entry(key.to_owned()).or_insert(0);
        *count += 1;
        if *count < CAPTURE_AT {
            return false;
        }
        self.seen.remove(key);
        true
    }
}

/// Captures `issue` on our capture stream: its one kernel launch, or an
/// instantiated graph.
fn capture(
    inner: &mut Inner,
    ours: &dyn Fn(sys::CUfunction) -> bool,
    issue: &mut dyn FnMut(Stream) -> Result<()>,
) -> Result<Replay> {
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
        if let Some(params) = single_launch(graph, ours)? {
            return Ok(Replay::Kernel(KernelLaunch { params, graph }));
        }
        let mut exec = std::ptr::null_mut();
        // SAFETY: a complete graph from the capture.
        check(unsafe { sys::cuGraphInstantiateWithFlags(&mut exec, graph, 0) }, "cuGraphInstantiate")?;
        Ok(Replay::Graph(exec as usize))
    });
    if !graph.is_null() && !matches!(result, Ok(Replay::Kernel(_))) {
        // SAFETY: the instantiated graph does not need its source graph.
        unsafe { sys::cuGraphDestroy(graph) };
    }
    result
}

/// The parameters of `graph`'s one node when it is a launch of one of
/// symm's own kernels (`ours`) with its arguments as an array (how our
/// launches pass them), else `None`.
fn single_launch(
    graph: sys::CUgraph,
    ours: &dyn Fn(sys::CUfunction) -> bool,
) -> Result<Option<sys::CUDA_KERNEL_NODE_PARAMS>> {
    let mut count = 0usize;
    // SAFETY: a complete graph; with no array, only the count is written.
    check(unsafe { sys::cuGraphGetNodes(graph, std::ptr::null_mut(), &mut count) }, "cuGraphGetNodes")?;
    if count != 1 {
        return Ok(None);
    }
    let mut node = std::ptr::null_mut();
    // SAFETY: room for the one node.
    check(unsafe { sys::cuGraphGetNodes(graph, &mut node, &mut count) }, "cuGraphGetNodes")?;
    let mut kind = sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_EMPTY;
    // SAFETY: a node of the graph; out-pointer valid.
    check(unsafe { sys::cuGraphNodeGetType(node, &mut kind) }, "cuGraphNodeGetType")?;
    if kind != sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_KERNEL {
        return Ok(None);
    }
    // SAFETY: plain data, filled in by the driver below.
    let mut params: sys::CUDA_KERNEL_NODE_PARAMS = unsafe { std::mem::zeroed() };
    // SAFETY: a kernel node; the argument array it returns is owned by the
    // node and valid while the graph lives.
    check(unsafe { sys::cuGraphKernelNodeGetParams_v2(node, &mut params) }, "cuGraphKernelNodeGetParams")?;
    let plain = !params.func.is_null() && ours(params.func) && !params.kernelParams.is_null() && params.extra.is_null();
    Ok(plain.then_some(params))
}

impl Drop for GraphCache {
    fn drop(&mut self) {
        let inner = self.inner.get_mut().unwrap_or_else(|p| p.into_inner());
        for replay in inner.execs.values() {
            match *replay {
                // SAFETY: instantiated in capture(); the driver keeps a
                // launched graph's resources until its work completes.
                Replay::Graph(exec) => unsafe { sys::cuGraphExecDestroy(exec as sys::CUgraphExec) },
                // SAFETY: made in capture(); launches copied their arguments.
                Replay::Kernel(k) => unsafe { sys::cuGraphDestroy(k.graph) },
            };
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
    use crate::backend::cuda::gemm::GemmDtype;
    use crate::backend::cuda::gpu_testing::gpu;
    use std::cell::Cell;

    /// The bookkeeping alone (no GPU): a key is captured at its second
    /// occurrence, never once refused, and not beyond the graph limit;
    /// counts of keys that never repeat start over instead of growing.
    #[test]
    fn keys_are_due_for_capture_at_their_second_occurrence() {
        let mut inner = Inner::default();
        assert!(!inner.due_for_capture("a"));
        assert!(!inner.due_for_capture("b"));
        assert!(inner.due_for_capture("a"));
        assert!(!inner.seen.contains_key("a"), "a captured key is no longer counted");
        inner.refused.insert("b".into());
        assert!(!inner.due_for_capture("b"));
        assert!(!inner.due_for_capture("b"));
        for i in 0..MAX_SEEN + 10 {
            inner.due_for_capture(&format!("once {i}"));
        }
        assert!(inner.seen.len() <= MAX_SEEN);
        inner.execs = (0..MAX_GRAPHS).map(|i| (format!("g{i}"), Replay::Graph(0))).collect();
        assert!(!inner.due_for_capture("c"));
        assert!(!inner.due_for_capture("c"), "no capture beyond MAX_GRAPHS");
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
            cache.run(&|| key.to_owned(), g.stream(), || Ok(()), &|_| true, &mut fill(value)).unwrap();
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
        cache.run(&|| "a".to_owned(), g.stream(), || Ok(()), &|_| true, &mut fill(7)).unwrap();
        let mut graph = std::ptr::null_mut();
        check(unsafe { sys::cuStreamEndCapture(s, &mut graph) }, "end").unwrap();
        assert_eq!(issued.get(), 4, "a call under the caller's capture was not issued into it");
        unsafe { sys::cuGraphDestroy(graph) };
        // SAFETY: created above; idle after the synchronizations.
        unsafe { sys::cuStreamDestroy_v2(side) };
    }

    /// A call that is one launch of one of our kernels (a reduction) is
    /// replayed as that launch, not as a graph, and computes afresh each
    /// time (its output poisoned first); a kernel `ours` does not vouch
    /// for stays a graph.
    #[test]
    fn gpu_a_call_of_one_kernel_is_replayed_as_a_launch() {
        let Some(g) = gpu() else { return };
        let n = 1 << 12;
        let src: Vec<f32> = (0..n).map(|i| 0.25 + i as f32).collect();
        let src_buf = g.upload(&src);
        let table = g.upload(&[src_buf.ptr]);
        let out = g.alloc(4 * n);
        let issued = Cell::new(0);
        let mut reduce = |s: Stream| -> Result<()> {
            issued.set(issued.get() + 1);
            let p = super::super::reduce::ReduceParams::new(table.ptr, 1, out.ptr, n, GemmDtype::F32, 2.0);
            super::super::reduce::reduce_with(&g.kernels, &p, s)
        };
        for (key, ours) in [("ours", true), ("not ours", false)] {
            let cache = GraphCache::default();
            issued.set(0);
            for call in 0..4 {
                // SAFETY: 4n bytes of device memory.
                check(unsafe { sys::cuMemsetD32Async(out.ptr, 0x7fc0_0000, n, g.stream().0 as _) }, "poison").unwrap();
                cache.run(&|| key.to_owned(), g.stream(), || Ok(()), &|_| ours, &mut reduce).unwrap();
                g.sync();
                let got = out.read::<f32>(n);
                assert!(got.iter().zip(&src).all(|(o, s)| *o == 2.0 * s), "{key}, call {call}: wrong output");
            }
            assert_eq!(issued.get(), 2, "{key}: issued eagerly once and once into the capture");
            let inner = cache.inner.lock().unwrap();
            let direct = matches!(inner.execs.get(key), Some(Replay::Kernel(_)));
            assert_eq!(direct, ours, "{key}: replayed as a launch: {direct}");
        }
    }
}
