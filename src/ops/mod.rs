//! The tensor-parallel operations, written once over the backend's
//! data-moving primitives (`Backend::{copy, reduce, gemm}`) and the signals
//! of the group's workspace.
//!
//! Every operation runs the same steps (`run`):
//! 1. check the call on this rank and prepare it (`Prepared`: its
//!    algorithm, chosen by `decide`, and its workspace layout); nothing is
//!    written yet;
//! 2. agree on the call with every rank (`agree`), so that a call that is
//!    invalid on any rank, or differs between ranks, fails on all of them;
//! 3. size the group's workspace from the agreed arguments (`workspace`);
//! 4. execute: stage this rank's data in its workspace region, barrier,
//!    read the peers' regions and write the outputs, barrier again so that
//!    no rank's next call overwrites a region a peer still reads.
//!
//! A matmul operation called again with identical arguments skips steps 1
//! and 2 (`run_prepared`, `memo`), and the backend may replay step 4 as
//! one captured graph (`Backend::run_repeatable`). What the operations keep
//! per group between calls is theirs (`state`), attached to the group.
//!
//! Tensors become matrices the same way in every operation: the part of a
//! tensor that belongs to one rank is a slice along the gathered (or
//! scattered) dimension, kept in its natural order, whose leading
//! dimensions collapse into matrix rows. A slice whose strides do not
//! collapse (along a middle dimension, as sequence parallelism's `[batch,
//! seq, hidden]`) is a batch of equally strided matrices, multiplied in
//! place by one strided-batched matmul (`batched_operands`); fp8 matmuls,
//! and slices that are not even that, are copied to contiguous scratch
//! first.

mod across_hosts;
mod across_matmul;
pub mod ag_mm;
mod agree;
pub mod all_reduce;
#[cfg(test)]
mod alone_tests;
#[cfg(test)]
mod batched_tests;
pub(crate) mod check;
pub(crate) mod decide;
#[cfg(test)]
mod failure_tests;
#[cfg(test)]
mod fp8_out_tests;
pub(crate) mod fused;
pub mod hierarchy;
#[cfg(test)]
mod host_cost;
mod inside_host;
pub mod lc_allgather;
mod local_scratch;
mod memo;
pub mod mm_rs;
pub mod scaled;
pub(crate) mod state;
mod symmetric;
#[cfg(test)]
pub(crate) mod testing;
mod workspace;

pub use ag_mm::{fused_ag_mm, AgMm, AgMmScales};
pub use all_reduce::{all_reduce, AllReduce, Norm};
pub use lc_allgather::{lc_allgather, LcAllgather};
pub use mm_rs::{mm_rs, MmRs, MmRsScales, ReduceOp};
pub use symmetric::{symmetric_args, PeerAccess, SYMMETRIC_ARGS};
pub use workspace::reserve as reserve_workspace;

use crate::array::Array;
use crate::backend::{AllGatherCall, CallTag, GemmScales, ReduceScatterCall, ReplayKey, Stream};
use crate::buffer::Handle;
use crate::cost::Algorithm;
use crate::error::{err, Result};
use crate::group::Group;
use crate::health::CallState;
use agree::Signature;
use state::Scratch;
use std::hash::Hash;
use std::sync::Arc;

/// A checked call, its algorithm chosen and its workspace laid out, ready
/// to run once the ranks agree on it.
trait Prepared {
    /// Workspace bytes the call needs, computed from agreed arguments only
    /// (never from local strides or addresses), so every rank sizes the
    /// workspace alike.
    fn workspace_bytes(&self) -> usize;
    /// Mailbox bytes the call needs (agreed arguments only, as above);
    /// only the fused reduce-scatter has one.
    fn mailbox_bytes(&self) -> usize {
        0
    }
    /// Bytes of the flags buffer the call needs (as above; the fused
    /// reduce-scatter's state).
    fn flags_bytes(&self) -> usize {
        0
    }
    /// Bytes of the all-reduce buffer the call needs (as above).
    fn all_reduce_bytes(&self) -> usize {
        0
    }
    fn execute(&self, ex: &Exec<'_>) -> Result<()>;
    /// Everything `execute` reads from the call (addresses included), so
    /// that two calls with the same key issue the same work: a backend
    /// may replay a repeated call (`Backend::run_repeatable`).
    fn replay_key(&self) -> String;
    /// The algorithm decided and why, for the log (operations that choose one).
    fn decided(&self) -> Option<String> {
        None
    }
}

/// `sig` with the algorithm the call runs (`Err`: the call failed here, and
/// the agreement reports that instead), so that ranks whose choices differ
/// fail with `Mismatch` instead of running different algorithms.
fn with_algorithm<E>(sig: Signature, algorithm: std::result::Result<Algorithm, E>) -> Signature {
    sig.arg("algorithm", algorithm.map_or("undecided", Algorithm::name))
}

/// Runs one collective call. `prepared` is this rank's signature and
/// prepared call, or why the call could not be read at all; either way
/// every rank takes part in the agreement, so that peers learn of a failure.
fn run<P: Prepared>(group: &Arc<Group>, stream: Stream, prepared: Result<(Signature, Result<P>)>) -> Result<()> {
    let _lock = group.lock_collective();
    group.check_healthy()?;
    let call = state::of(group).next_call();
    let (p, agreement) = agreed(group, prepared, call)?;
    launch(group, stream, &p, agreement.tag, &|_, make| ReplayKey::new(make()))
}

/// As `run`, for an operation whose preparation (`prepare`: signature and
/// prepared call) depends on nothing but its arguments and the group's
/// fixed properties: a call identical to an earlier one reuses that one's
/// preparation (see `memo`).
fn run_prepared<C, P>(
    group: &Arc<Group>,
    stream: Stream,
    call: Result<C>,
    prepare: impl FnOnce(C) -> (Signature, Result<P>),
) -> Result<()>
where
    C: Clone + Hash + Eq + Send + Sync + 'static,
    P: Prepared + Send + Sync + 'static,
{
    let _lock = group.lock_collective();
    group.check_healthy()?;
    let number = state::of(group).next_call();
    let reuse = !group.check_args_always();
    if let (true, Ok(c)) = (reuse, &call) {
        if let Some(e) = memo::find::<C, P>(group, c) {
            group.post_call(number, CallState::Going);
            return launch(group, stream, &*e.prepared, e.tag, &|ids, make| e.key(ids, make));
        }
    }
    let kept = call.as_ref().ok().filter(|_| reuse).cloned();
    let (p, agreement) = agreed(group, call.map(prepare), number)?;
    if agreement.first {
        if let Some(line) = p.decided() {
            log::info!("{line}");
        }
    }
    match kept {
        Some(c) => {
            let e = memo::keep(group, c, Arc::new(p), agreement.tag);
            launch(group, stream, &*e.prepared, e.tag, &|ids, make| e.key(ids, make))
        }
        None => launch(group, stream, &p, agreement.tag, &|_, make| ReplayKey::new(make())),
    }
}

/// The agreement (with the collective lock held) on this rank's call
/// number `call`: its prepared call once every rank agreed on it, and the
/// agreement.
fn agreed<P>(group: &Group, prepared: Result<(Signature, Result<P>)>, call: u64) -> Result<(P, agree::Agreed)> {
    let (sig, p) = match prepared {
        Ok((s, p)) => (Some(s), p),
        Err(e) => (None, Err(e)),
    };
    let agreement = agree::agree(group, sig.as_ref(), p.as_ref().map(drop).map_err(Clone::clone), call)?;
    Ok((p?, agreement))
}

/// The ids of the scratch buffers a call runs with (workspace, mailbox,
/// flags), which its replay key depends on.
type ScratchIds = (u64, Option<u64>, Option<u64>, Option<u64>);

/// Executes an agreed call (with the collective lock held), replayed where
/// the backend can; its signals and lines carry `tag`. `key(scratch ids,
/// make)` is the replay key, `make()` making it afresh.
fn launch<P: Prepared>(
    group: &Arc<Group>,
    stream: Stream,
    plan: &P,
    tag: CallTag,
    key: &dyn Fn(ScratchIds, &dyn Fn() -> String) -> ReplayKey,
) -> Result<()> {
    let ws = workspace::ensure(group, Scratch::Workspace, plan.workspace_bytes(), Some(stream))?;
    let optional = |kind, bytes| match bytes {
        0 => Ok(None),
        bytes => workspace::ensure(group, kind, bytes, Some(stream)).map(Some),
    };
    let mailbox = optional(Scratch::Mailbox, plan.mailbox_bytes())?;
    let flags = optional(Scratch::Flags, plan.flags_bytes())?;
    let reduce = optional(Scratch::AllReduce, plan.all_reduce_bytes())?;
    let id = |h: &Option<Arc<Handle>>| h.as_ref().map(|h| h.id());
    let ids = (ws.id(), id(&mailbox), id(&flags), id(&reduce));
    let make = || {
        let mailbox = ids.1.map(|id| format!(", mailbox {id:#x}")).unwrap_or_default();
        let flags = ids.2.map(|id| format!(", flags {id:#x}")).unwrap_or_default();
        let reduce = ids.3.map(|id| format!(", all-reduce {id:#x}")).unwrap_or_default();
        format!(
            "rank {} of {}, workspace {:#x}{mailbox}{flags}{reduce}: {}",
            group.rank(),
            group.world(),
            ids.0,
            plan.replay_key()
        )
    };
    let key = || key(ids, &make);
    let captured = group.backend().run_repeatable(&key, stream, &mut |s| {
        // Work issued before the failure may be waited on by the peers:
        // the group is out of step, and fails.
        plan.execute(&Exec {
            group,
            base: ws.buffer().addr(),
            ws: Some(ws.clone()),
            mailbox: mailbox.clone(),
            flags: flags.clone(),
            reduce: reduce.clone(),
            stream: s,
            tag,
        })
        .inspect_err(|e| group.fail(e))
    })?;
    if captured {
        // The caller's graph replays this call on these buffers: keep them
        // when a later call grows them.
        state::of(group).pin([Some(&ws), mailbox.as_ref(), flags.as_ref(), reduce.as_ref()].into_iter().flatten());
    }
    Ok(())
}

/// The signal channel of the workspace that operations synchronize on
/// (the workspace is private to them, so one channel serves all).
const CHANNEL: usize = 0;

/// What a prepared call executes with: the group, its workspace (and mailbox and
/// flags buffer, when it asked for them), the caller's stream.
struct Exec<'a> {
    group: &'a Group,
    /// This rank's workspace, where `local` offsets point.
    base: u64,
    /// The workspace rendezvoused with every rank; `None` in a group
    /// spanning hosts, whose workspace is this rank's memory alone.
    ws: Option<Arc<Handle>>,
    mailbox: Option<Arc<Handle>>,
    flags: Option<Arc<Handle>>,
    /// The all-reduce buffer, when the call asked for one.
    reduce: Option<Arc<Handle>>,
    stream: Stream,
    /// What this call's signals and lines carry (see `agree`).
    tag: CallTag,
}

impl Exec<'_> {
    fn rank(&self) -> usize {
        self.group.rank()
    }

    fn world(&self) -> usize {
        self.group.world()
    }

    /// The workspace rendezvoused with every rank, for the steps that reach
    /// the peers' memory or signal them.
    fn ws(&self) -> Result<&Arc<Handle>> {
        self.ws.as_ref().ok_or_else(|| err!(Internal, "no peer's workspace is mapped in a group spanning hosts"))
    }

    /// Address of `offset` in rank `r`'s workspace, as mapped here.
    fn at(&self, r: usize, offset: usize) -> Result<u64> {
        Ok(self.ws()?.peer_addr(r)? + offset as u64)
    }

    /// Address of `offset` in this rank's workspace.
    fn local(&self, offset: usize) -> u64 {
        self.base + offset as u64
    }

    /// Address of `offset` in every rank's mailbox or flags buffer (`kind`),
    /// as mapped here, by rank.
    fn on_every_rank(&self, kind: Scratch, offset: usize) -> Result<Vec<u64>> {
        let buf = match kind {
            Scratch::Workspace => self.ws.as_ref(),
            Scratch::Mailbox => self.mailbox.as_ref(),
            Scratch::Flags => self.flags.as_ref(),
            Scratch::AllReduce => self.reduce.as_ref(),
        };
        let buf = buf.ok_or_else(|| err!(Internal, "the call was given no {kind:?}"))?;
        (0..self.world()).map(|r| Ok(buf.peer_addr(r)? + offset as u64)).collect()
    }

    /// Every rank's `bytes` contiguous bytes at `input` into `output` (rank
    /// r's at `output + r * bytes`) by one launch of the device-side
    /// all-gather (`Backend::all_gather`, its kernel by size:
    /// `decide::all_gather_kernel`) through the all-reduce buffer the call
    /// asked for (`Prepared::all_reduce_bytes`).
    fn all_gather_lines(&self, input: u64, output: u64, bytes: usize) -> Result<()> {
        let reduce = self.reduce.as_ref().ok_or_else(|| err!(Internal, "the call was given no all-reduce buffer"))?;
        let call = AllGatherCall {
            algorithm: decide::all_gather_kernel(bytes, self.world()).0,
            rank: self.rank(),
            world: self.world(),
            bytes,
            input,
            output,
            scratch: self.on_every_rank(Scratch::AllReduce, 0)?,
            scratch_bytes: reduce.buffer().size(),
            timeout: self.group.timeout(),
            tag: self.tag,
        };
        self.group.backend().all_gather(&call, self.stream)
    }

    /// One device-side reduce-scatter through the all-reduce buffer (no
    /// barrier; LL lines or pieces, `decide::reduce_scatter_kernel`):
    /// `output` (contiguous, a float type) = `scale` x the sum over ranks
    /// of their chunk for this rank, every rank's `input` holding `world`
    /// chunks of `output`'s size back to back.
    fn device_reduce_scatter(&self, input: u64, output: &Array, scale: f32) -> Result<()> {
        let reduce = self.reduce.as_ref().ok_or_else(|| err!(Internal, "the call was given no all-reduce buffer"))?;
        if !output.is_contiguous() {
            return Err(err!(Internal, "a reduce-scatter on the lines into a strided output"));
        }
        let chunk = output.numel() * output.dtype.size();
        let call = ReduceScatterCall {
            algorithm: decide::reduce_scatter_kernel(chunk, self.world()).0,
            rank: self.rank(),
            world: self.world(),
            dtype: output.dtype,
            n: output.numel(),
            input,
            chunk_stride: chunk,
            output: output.addr,
            scale,
            scratch: self.on_every_rank(Scratch::AllReduce, 0)?,
            scratch_bytes: reduce.buffer().size(),
            timeout: self.group.timeout(),
            tag: self.tag,
        };
        self.group.backend().reduce_scatter(&call, self.stream)
    }

    /// Every rank once, starting with this one and going down, so that at
    /// each step the ranks read from different peers.
    fn rotation(&self) -> impl Iterator<Item = usize> {
        let (rank, world) = (self.rank(), self.world());
        (0..world).map(move |step| (rank + world - step) % world)
    }

    fn barrier(&self) -> Result<()> {
        self.barrier_on(self.stream)
    }

    /// A barrier of the ranks on the workspace, on `stream`.
    fn barrier_on(&self, stream: Stream) -> Result<()> {
        self.ws()?.barrier(CHANNEL, self.tag, stream)
    }

    /// Signals `peer` on the workspace's `channel`, on `stream`.
    fn put_signal(&self, peer: usize, channel: usize, stream: Stream) -> Result<()> {
        self.ws()?.put_signal(peer, channel, self.tag, stream)
    }

    /// Waits for `peer`'s signal on the workspace's `channel`, on `stream`.
    fn wait_signal(&self, peer: usize, channel: usize, stream: Stream) -> Result<()> {
        self.ws()?.wait_signal(peer, channel, self.tag, stream)
    }

    /// The side stream for communication that overlaps the main stream.
    fn side(&self) -> Result<Stream> {
        self.group.backend().side_stream(0)
    }

    /// A second side stream, for signals that must not hold up the main
    /// stream's next matmul (see `MmRsPrepared::pipelined`).
    fn signal_side(&self) -> Result<Stream> {
        self.group.backend().side_stream(1)
    }

    /// The side stream starts after the main stream's work so far.
    fn fork(&self, side: Stream) -> Result<()> {
        self.stream_after(side, self.stream)
    }

    /// `later` continues after `earlier`'s work so far.
    fn stream_after(&self, later: Stream, earlier: Stream) -> Result<()> {
        self.group.backend().stream_wait(later, earlier)
    }

    /// The main stream continues after the side stream's work so far.
    fn join(&self, side: Stream) -> Result<()> {
        self.stream_after(self.stream, side)
    }

    fn copy_on(&self, stream: Stream, dst: &Array, src: &Array) -> Result<()> {
        self.group.backend().copy(dst, src, stream)
    }

    fn copy(&self, dst: &Array, src: &Array) -> Result<()> {
        self.group.backend().copy(dst, src, self.stream)
    }

    fn reduce(&self, dst: &Array, srcs: &[Array], scale: f32) -> Result<()> {
        self.group.backend().reduce(dst, srcs, scale, self.stream)
    }

    fn gemm(&self, dst: &Array, a: &Array, b: &Array, accumulate: bool) -> Result<()> {
        self.group.backend().gemm(dst, a, b, accumulate, self.stream)
    }

    /// An fp8 output from an f32 product (see `Quantize`).
    fn quantize(&self, q: &crate::backend::Quantize) -> Result<()> {
        self.group.backend().quantize(q, self.stream)
    }

    /// `dst = scaled a @ b` for fp8 operands, or `+=` with `accumulate`.
    fn scaled_gemm(&self, dst: &Array, a: &Array, b: &Array, scales: &GemmScales, accumulate: bool) -> Result<()> {
        self.group.backend().scaled_gemm(dst, a, b, scales, accumulate, self.stream)
    }

    /// `dst = a @ b`, scaled when `scales` is given (fp8 operands).
    fn matmul(&self, dst: &Array, a: &Array, b: &Array, scales: Option<&GemmScales>) -> Result<()> {
        match scales {
            Some(s) => self.scaled_gemm(dst, a, b, s, false),
            None => self.gemm(dst, a, b, false),
        }
    }

    /// `t` as a matrix: itself when its strides allow, else a contiguous
    /// copy at `scratch` (which must hold it).
    fn matrix(&self, t: &Array, scratch: usize) -> Result<Array> {
        match t.as_matrix() {
            Some(m) => Ok(m),
            None => self.packed_matrix(t, scratch),
        }
    }

    /// `t` as the A of an fp8 matmul: a row-major matrix whose rows start
    /// 16 bytes apart (cuBLASLt's fp8 kernels read K-major, aligned rows);
    /// a contiguous copy at `scratch` when `t` is not one already.
    fn k_major_matrix(&self, t: &Array, scratch: usize) -> Result<Array> {
        match t.as_matrix() {
            Some(m) if m.strides[1] == 1 && (m.strides[0] * m.dtype.size()) % 16 == 0 && m.addr % 16 == 0 => Ok(m),
            _ => self.packed_matrix(t, scratch),
        }
    }

    fn packed_matrix(&self, t: &Array, scratch: usize) -> Result<Array> {
        let packed = Array::contiguous(self.local(scratch), t.dtype, &t.shape);
        self.copy(&packed, t)?;
        Ok(packed.as_matrix().expect("a contiguous array is a matrix"))
    }

    /// The elements of `t` as a contiguous, 16-byte aligned vector (scales a
    /// backend reads as one run of f32, perhaps with vector loads): `t`
    /// itself when it is one, else a copy at `scratch`.
    fn vector(&self, t: &Array, scratch: usize) -> Result<Array> {
        let addr = if t.is_contiguous() && t.addr % 16 == 0 {
            t.addr
        } else {
            self.copy(&Array::contiguous(self.local(scratch), t.dtype, &t.shape), t)?;
            self.local(scratch)
        };
        Ok(Array::contiguous(addr, t.dtype, &[t.numel()]))
    }

    /// An fp8 B's scale and bias as cuBLASLt reads them: 16-byte aligned
    /// vectors, copied to their regions of `at` where the caller's are not.
    fn b_vectors(&self, b_scale: &Array, bias: Option<&Array>, at: BVectors) -> Result<(Array, Option<Array>)> {
        let scale = self.vector(b_scale, at.scale)?;
        let bias = match (bias, at.bias) {
            (Some(v), Some(region)) => Some(self.vector(v, region)?),
            (v, _) => v.cloned(),
        };
        Ok((scale, bias))
    }
}

/// Where [`Exec::b_vectors`] copies an fp8 B's scale (one, or `n` row
/// scales) and the bias cuBLASLt adds when the caller's are not 16-byte
/// aligned: planned wherever they are (from agreed shapes only).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct BVectors {
    scale: usize,
    bias: Option<usize>,
}

impl BVectors {
    fn plan(mut region: impl FnMut(usize) -> usize, n: usize, row_wise: bool, bias: Option<&Array>) -> BVectors {
        BVectors { scale: region(4 * if row_wise { n } else { 1 }), bias: bias.map(|t| region(t.dtype.size() * n)) }
    }
}

/// `dst = a @ b` as one strided-batched matmul (see `Backend::gemm`): the
/// operands of an unscaled matmul whose `dst` (`[..., n]`) and `a` (`[...,
/// k]`, the same leading shape) need not be matrices, e.g. rank r's slice
/// `out[:, r*s:(r+1)*s, :]` of a `[batch, seq, n]` output, or a chunk of
/// `a` sliced along its sequence dimension. Split at the outermost
/// dimension where both collapse into equally strided matrices (the
/// fewest, largest ones), `dst`'s one after another with unit column
/// stride, `a`'s row- or column-major, `b` shared (batch stride 0).
/// `None` when no split does: the caller packs or stages instead.
fn batched_operands(dst: &Array, a: &Array, b: &Array) -> Option<[Array; 3]> {
    let lead = dst.ndim().checked_sub(1)?;
    if a.ndim() != dst.ndim() || dst.shape[..lead] != a.shape[..lead] || b.ndim() != 2 {
        return None;
    }
    (1..lead).find_map(|split| {
        let (d, l) = (dst.as_batched(split)?, a.as_batched(split)?);
        let in_order = d.strides[2] == 1 && d.strides[0] >= d.shape[1] * d.strides[1];
        let major = l.strides[2] == 1 || l.strides[1] == 1;
        let shared = Array {
            shape: vec![d.shape[0], b.shape[0], b.shape[1]],
            strides: vec![0, b.strides[0], b.strides[1]],
            ..b.clone()
        };
        (in_order && major).then_some([d, l, shared])
    })
}

/// `shape` as the signature and messages show it.
fn shape_text(shape: &[usize]) -> String {
    format!("{shape:?}")
}
