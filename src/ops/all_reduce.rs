//! `symm_all_reduce` and `symm_all_reduce_rmsnorm`: `output = reduce(input
//! over ranks)`, sum or average, elementwise, summed in f32 in rank order
//! (every rank gets the same bits); and the fused form of inference
//! engines, `residual_out = all_reduce(input) + residual`, `out =
//! rmsnorm(residual_out) * weight` over the last dimension.
//!
//! Integer inputs (plain all-reduce only) are summed exactly in their own
//! type, wrapping modulo 2^bits; their average is that sum divided by the
//! world size, truncating toward zero, as NCCL's `ncclAvg` (which torch's
//! `ReduceOp.AVG` uses on integer tensors).
//!
//! Two algorithms (PyTorch's `one_shot_all_reduce` and
//! `two_shot_all_reduce_`), chosen by `decide::decide_all_reduce` from the
//! agreed size or forced by the call's options:
//!
//! - **one-shot**: every rank reads every rank's input and reduces all of
//!   it; the lowest latency, for small messages;
//! - **two-shot**: each rank reduces a `1/world` slice and the ranks then
//!   gather the reduced slices; half the traffic at two ranks, for large ones.
//!
//! Where the backend has device-side kernels (`Capabilities::all_reduce`,
//! CUDA; every rank on a GPU of its own, at most 16 ranks), one launch does the whole call through the group's all-reduce
//! buffer (`Scratch::AllReduce`): the data carry their arrival (flags in
//! the lines, or a call-numbered flag per chunk), so a call pays no
//! separate barrier, and the buffer counts the calls, so repeated calls
//! replay as graphs. Strided tensors are packed to (and unpacked from)
//! contiguous workspace around it. Elsewhere (the host backend) the same
//! algorithms run over the backend's copies and reductions between
//! barriers, reading a symmetric input in place.

use super::agree::Signature;
use super::symmetric::{Placed, SymmetricPlace};
use super::workspace::Layout;
use super::{check, shape_text, Exec, Prepared, ReduceOp};
use crate::array::{Array, DType};
use crate::backend::{AddRmsNorm, AllReduceAlgorithm, AllReduceCall, AllReduceLayout, AllReduceNorm, Stream};
use crate::error::{err, Result};
use crate::group::Group;
use std::sync::Arc;

/// The fused epilogue's arguments.
#[derive(Clone, Debug)]
pub struct Norm {
    /// Added to the reduced input; its shape and dtype.
    pub residual: Array,
    /// `[hidden]`, the input's dtype.
    pub weight: Array,
    pub eps: f32,
    /// Receives the sum with the residual (may be `residual`).
    pub residual_out: Array,
}

// Bitwise, so that calls can be kept (`memo`): an eps of NaN is refused
// before a call is kept.
impl PartialEq for Norm {
    fn eq(&self, o: &Self) -> bool {
        (&self.residual, &self.weight, self.eps.to_bits(), &self.residual_out)
            == (&o.residual, &o.weight, o.eps.to_bits(), &o.residual_out)
    }
}

impl Eq for Norm {}

impl std::hash::Hash for Norm {
    fn hash<H: std::hash::Hasher>(&self, h: &mut H) {
        (&self.residual, &self.weight, self.eps.to_bits(), &self.residual_out).hash(h)
    }
}

/// Messages up to this size lay out room in the workspace to pack each of
/// their tensors around the device kernel, strided on this rank or not:
/// which are strided may differ between ranks, and the workspace, which
/// grows by a rendezvous, must be asked for alike on every rank. Larger
/// messages instead agree on which are strided (`AllReduce::signature`)
/// rather than hold twice the message in reserve.
pub(super) const PACK_ROOM_MAX_BYTES: usize = 64 << 20;

/// One rank's call, as read from the caller. With `norm`, `output` is the
/// normalized `out`.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct AllReduce {
    pub input: Array,
    pub output: Array,
    pub op: ReduceOp,
    pub norm: Option<Norm>,
    /// The algorithm the caller asks for (`None`: automatic).
    pub algorithm: Option<AllReduceAlgorithm>,
}

/// Collective over `group`: see the module documentation. `call` is `Err`
/// when the caller's arguments could not be read; this rank still takes
/// part in the agreement so its peers fail too. A call identical to an
/// earlier one (input in the same place) reuses its preparation (`memo`).
pub fn all_reduce(group: &Arc<Group>, call: Result<AllReduce>, stream: Stream) -> Result<()> {
    if !group.topology().single_host() {
        return super::across_hosts::all_reduce(group, call, stream);
    }
    let (placed, symmetric) = Placed::of(group, call, |c| &c.input);
    super::run_prepared(group, stream, placed, |Placed { call: c, .. }| {
        let facts = super::decide::Facts::of(group);
        let decision = super::decide::decide_all_reduce(&facts, c.input.numel(), c.input.dtype, c.algorithm);
        let sig = c.signature(symmetric.as_ref()).arg("algorithm", decision.algorithm.name());
        let line = decision.describe(c.input.numel(), c.input.dtype, facts.world);
        let p = c.prepare(&facts, decision.algorithm, symmetric).map(|mut p| {
            p.decided = line;
            p
        });
        (sig, p)
    })
}

/// Whether `a` and `b` are the same tensor (same place, layout and type).
fn same(a: &Array, b: &Array) -> bool {
    a == b
}

impl ReduceOp {
    fn scale(self, world: usize) -> f32 {
        match self {
            ReduceOp::Sum => 1.0,
            ReduceOp::Avg => 1.0 / world as f32,
        }
    }
}

impl AllReduce {
    fn name(&self) -> &'static str {
        if self.norm.is_some() {
            "all_reduce_rmsnorm"
        } else {
            "all_reduce"
        }
    }

    pub(super) fn signature(&self, symmetric: Option<&SymmetricPlace>) -> Signature {
        let mut s = Signature::new(self.name())
            .arg("input.dtype", self.input.dtype)
            .arg("input.shape", shape_text(&self.input.shape))
            .arg("op", self.op.name())
            .arg("input memory", SymmetricPlace::describe(symmetric));
        if let Some(n) = &self.norm {
            s = s
                .arg("residual.shape", shape_text(&n.residual.shape))
                .arg("weight.shape", shape_text(&n.weight.shape))
                .arg("eps", format!("{:e}", n.eps));
        }
        if self.input.numel().saturating_mul(self.input.dtype.size()) > PACK_ROOM_MAX_BYTES {
            // Past the room every rank lays out, which tensors are packed
            // decides the workspace's size: agreed (see the constant).
            let layout = |a: &Array| if a.is_contiguous() { "contiguous" } else { "strided" };
            s = s.arg("input layout", layout(&self.input)).arg("output layout", layout(&self.output));
            if let Some(n) = &self.norm {
                s = s
                    .arg("residual layout", layout(&n.residual))
                    .arg("residual_out layout", layout(&n.residual_out))
                    .arg("weight layout", layout(&n.weight));
            }
        }
        s
    }

    /// The checks of every all-reduce, on one host or across hosts: what
    /// the arguments must be, whatever runs them.
    pub(super) fn check(&self) -> Result<()> {
        let (input, output) = (&self.input, &self.output);
        let floats = matches!(input.dtype, DType::F32 | DType::BF16 | DType::F16);
        if self.norm.is_some() && !floats {
            return Err(err!(
                InvalidArgument,
                "input.dtype is {}; all_reduce_rmsnorm takes f32, bf16 or f16 (an rmsnorm of {} values is not defined)",
                input.dtype,
                input.dtype
            ));
        }
        if !floats && !input.dtype.is_integer() {
            return Err(err!(
                InvalidArgument,
                "input.dtype is {}; expected f32, bf16, f16, int8, uint8, int32 or int64",
                input.dtype
            ));
        }
        let out_name = if self.norm.is_some() { "out" } else { "output" };
        check::same_dtype(output, out_name, input.dtype, "input")?;
        check::shape_is(output, out_name, &input.shape)?;
        let mut outputs: Vec<(String, &Array)> = Vec::new();
        let mut inputs: Vec<(String, &Array)> = vec![("input".into(), input)];
        let in_place = same(output, input);
        if !in_place || self.norm.is_some() {
            outputs.push((out_name.into(), output));
        }
        if let Some(n) = &self.norm {
            let hidden = *input.shape.last().expect("tensors have at least one dimension");
            check::same_dtype(&n.residual, "residual", input.dtype, "input")?;
            check::shape_is(&n.residual, "residual", &input.shape)?;
            check::same_dtype(&n.weight, "weight", input.dtype, "input")?;
            check::shape_is(&n.weight, "weight", &[hidden])?;
            check::same_dtype(&n.residual_out, "residual_out", input.dtype, "input")?;
            check::shape_is(&n.residual_out, "residual_out", &input.shape)?;
            if !n.eps.is_finite() || n.eps < 0.0 {
                return Err(err!(InvalidArgument, "eps is {}; expected a finite value >= 0", n.eps));
            }
            inputs.push(("weight".into(), &n.weight));
            if !same(&n.residual_out, &n.residual) {
                inputs.push(("residual".into(), &n.residual));
                outputs.push(("residual_out".into(), &n.residual_out));
            }
            if in_place {
                return Err(err!(InvalidArgument, "out is input; the fused form writes out apart from its input"));
            }
        }
        if in_place && output.self_overlaps() {
            outputs.push((out_name.into(), output));
        }
        check::outputs_disjoint(&outputs, &inputs)?;
        match &self.norm {
            // In place: residual is read, then written; out and weight
            // must still lie apart from it.
            Some(n) if same(&n.residual_out, &n.residual) => check::outputs_disjoint(
                &[("residual_out (in place of residual)".into(), &n.residual_out)],
                &[(out_name.into(), output), ("weight".into(), &n.weight)],
            ),
            Some(n) if n.residual_out.overlaps(&n.residual) => {
                Err(err!(InvalidArgument, "residual_out overlaps residual; pass residual itself or separate memory"))
            }
            _ => Ok(()),
        }
    }

    fn prepare(
        self,
        facts: &super::decide::Facts,
        algorithm: AllReduceAlgorithm,
        symmetric: Option<SymmetricPlace>,
    ) -> Result<ArPrepared> {
        self.check()?;
        let (input, output) = (&self.input, &self.output);
        let world = facts.world;
        let bytes = check::mul(input.numel(), input.dtype.size(), "input")?;
        // The kernels spin while their peers run: ranks sharing a GPU would wait
        // for each other's blocks, so they take the generic path.
        let kernel = facts.caps.all_reduce && facts.own_devices && world <= AllReduceLayout::MAX_WORLD;
        if input.dtype.is_integer() && !kernel && !facts.caps.reduce_integers {
            return Err(err!(
                Unsupported,
                "input.dtype is {}: this backend all-reduces integers only in its device-side kernels, which need \
                 every rank on a GPU of its own and at most {} ranks (here {world})",
                input.dtype,
                AllReduceLayout::MAX_WORLD
            ));
        }
        let mut layout = Layout::default();
        let plan = if kernel {
            // Contiguous views, else packed copies in the workspace, with
            // room for every tensor's up to PACK_ROOM_MAX_BYTES.
            let (norm, room) = (self.norm.as_ref(), bytes <= PACK_ROOM_MAX_BYTES);
            let mut packed = |t: Option<&Array>, bytes: usize| {
                let needed = !t?.is_contiguous();
                (room || needed).then(|| layout.region(bytes)).filter(|_| needed)
            };
            Plan::Kernel {
                input: packed(Some(input), bytes),
                output: packed(Some(output), bytes),
                residual: packed(norm.map(|n| &n.residual), bytes),
                residual_out: packed(norm.map(|n| &n.residual_out), bytes),
                weight: packed(norm.map(|n| &n.weight), norm.map_or(0, |n| n.weight.numel() * n.weight.dtype.size())),
            }
        } else {
            let staged = if symmetric.is_some() { None } else { Some(layout.region(bytes)) };
            let reduced = (algorithm == AllReduceAlgorithm::TwoShot).then(|| layout.region(bytes));
            let gathered = layout.region(bytes);
            let norm = self.norm_regions(&mut layout);
            Plan::Generic { staged, reduced, gathered, norm }
        };
        let reduce_bytes = if kernel { AllReduceLayout::bytes_for(bytes, world) } else { 0 };
        Ok(ArPrepared {
            call: self,
            algorithm,
            symmetric,
            plan,
            workspace: layout.bytes(),
            reduce_bytes,
            decided: String::new(),
        })
    }
}

impl AllReduce {
    /// The workspace regions of the norm's contiguous operands (the
    /// residual, out, the weight), when the call has a norm.
    pub(super) fn norm_regions(&self, layout: &mut Layout) -> Option<(usize, usize, usize)> {
        let bytes = self.input.numel() * self.input.dtype.size();
        self.norm.as_ref().map(|n| {
            (layout.region(bytes), layout.region(bytes), layout.region(n.weight.numel() * n.weight.dtype.size()))
        })
    }

    /// What an integer sum is divided by.
    fn divisor(&self, world: usize) -> usize {
        match self.op {
            ReduceOp::Sum => 1,
            ReduceOp::Avg => world,
        }
    }

    /// `dst = reduce(srcs)` over `world` ranks: scaled in f32 for floats,
    /// exact for integers.
    pub(super) fn reduce(&self, ex: &Exec<'_>, dst: &Array, srcs: &[Array], world: usize) -> Result<()> {
        if dst.dtype.is_integer() {
            ex.group.backend().reduce_integers(dst, srcs, self.divisor(world), ex.stream)
        } else {
            ex.reduce(dst, srcs, self.op.scale(world))
        }
    }

    /// Writes the outputs from `sum`, the reduced input (contiguous, of
    /// its shape, in the workspace; the norm makes it residual_out in
    /// place), the norm's operands at `norm` (`norm_regions`).
    pub(super) fn finish(&self, ex: &Exec<'_>, sum: &Array, norm: Option<(usize, usize, usize)>) -> Result<()> {
        let dtype = self.input.dtype;
        match (&self.norm, norm) {
            (Some(nm), Some((res, out, w))) => {
                // On contiguous rows: the residual copied in, the sum
                // becoming residual_out in place, out apart; then copied out.
                let hidden = *self.input.shape.last().expect("at least one dimension");
                let rows = self.input.numel() / hidden.max(1);
                let mat = |addr: u64| Array::contiguous(addr, dtype, &[rows, hidden]);
                let (res_c, out_c, sum_c) = (mat(ex.local(res)), mat(ex.local(out)), mat(sum.addr));
                ex.copy(&Array::contiguous(res_c.addr, dtype, &self.input.shape), &nm.residual)?;
                let weight = Array::contiguous(ex.local(w), dtype, &nm.weight.shape);
                ex.copy(&weight, &nm.weight)?;
                let norm = AddRmsNorm {
                    out: &out_c,
                    residual_out: &sum_c,
                    x: &sum_c,
                    residual: &res_c,
                    weight: &weight,
                    eps: nm.eps,
                };
                ex.group.backend().add_rms_norm(&norm, ex.stream)?;
                ex.copy(&nm.residual_out, sum)?;
                ex.copy(&self.output, &Array::contiguous(out_c.addr, dtype, &self.input.shape))
            }
            _ => ex.copy(&self.output, sum),
        }
    }
}

/// Where the call keeps what it stages (workspace offsets).
#[derive(Clone, Debug)]
enum Plan {
    /// The device-side kernel; `Some`: a packed copy of that tensor.
    Kernel {
        input: Option<usize>,
        output: Option<usize>,
        residual: Option<usize>,
        residual_out: Option<usize>,
        weight: Option<usize>,
    },
    /// Over copies, reductions and barriers: the input staged (unless it is
    /// read in place), the two-shot's reduced slices, the gathered sum.
    Generic { staged: Option<usize>, reduced: Option<usize>, gathered: usize, norm: Option<(usize, usize, usize)> },
}

struct ArPrepared {
    call: AllReduce,
    algorithm: AllReduceAlgorithm,
    symmetric: Option<SymmetricPlace>,
    plan: Plan,
    workspace: usize,
    reduce_bytes: usize,
    decided: String,
}

impl Prepared for ArPrepared {
    fn workspace_bytes(&self) -> usize {
        self.workspace
    }

    fn all_reduce_bytes(&self) -> usize {
        self.reduce_bytes
    }

    fn replay_key(&self) -> String {
        format!("{:?} {:?} in place {:?} {:?}", self.call, self.algorithm, self.symmetric, self.plan)
    }

    fn decided(&self) -> Option<String> {
        Some(self.decided.clone())
    }

    fn execute(&self, ex: &Exec<'_>) -> Result<()> {
        match &self.plan {
            Plan::Kernel { .. } => self.kernel(ex, self.call.op.scale(ex.world())),
            Plan::Generic { staged, reduced, gathered, norm } => self.generic(ex, *staged, *reduced, *gathered, *norm),
        }
    }
}

impl ArPrepared {
    /// A contiguous array holding `t`'s elements: `t` itself, or its copy
    /// at `at` in the workspace (copied there first when `fill`).
    fn contiguous(&self, ex: &Exec<'_>, t: &Array, at: Option<usize>, fill: bool) -> Result<Array> {
        match at {
            None => Ok(t.clone()),
            Some(off) => {
                let c = Array::contiguous(ex.local(off), t.dtype, &t.shape);
                if fill {
                    ex.copy(&c, t)?;
                }
                Ok(c)
            }
        }
    }

    fn kernel(&self, ex: &Exec<'_>, scale: f32) -> Result<()> {
        let Plan::Kernel { input: pin, output: pout, residual: pres, residual_out: pro, weight: pw } = &self.plan
        else {
            unreachable!("the kernel plan")
        };
        let c = &self.call;
        let input = self.contiguous(ex, &c.input, *pin, true)?;
        let output = self.contiguous(ex, &c.output, *pout, false)?;
        let reduce = ex.reduce.as_ref().ok_or_else(|| err!(Internal, "the call was given no all-reduce buffer"))?;
        let mut norm = None;
        let mut unpack: Vec<(Array, &Array)> = Vec::new();
        if pout.is_some() {
            unpack.push((output.clone(), &c.output));
        }
        if let Some(n) = &c.norm {
            let residual = self.contiguous(ex, &n.residual, *pres, true)?;
            let residual_out = if same(&n.residual_out, &n.residual) && pres.is_some() {
                residual.clone()
            } else {
                self.contiguous(ex, &n.residual_out, *pro, false)?
            };
            if pres.is_some() || pro.is_some() {
                unpack.push((residual_out.clone(), &n.residual_out));
            }
            let weight = self.contiguous(ex, &n.weight, *pw, true)?;
            norm = Some(AllReduceNorm {
                hidden: *c.input.shape.last().expect("at least one dimension"),
                residual: residual.addr,
                weight: weight.addr,
                residual_out: residual_out.addr,
                eps: n.eps,
            });
        }
        let call = AllReduceCall {
            algorithm: self.algorithm,
            rank: ex.rank(),
            world: ex.world(),
            dtype: c.input.dtype,
            n: c.input.numel(),
            input: input.addr,
            output: output.addr,
            scale,
            divisor: self.call.divisor(ex.world()),
            scratch: ex.on_every_rank(super::state::Scratch::AllReduce, 0)?,
            scratch_bytes: reduce.buffer().size(),
            norm,
            timeout: ex.group.timeout(),
            tag: ex.tag,
        };
        ex.group.backend().all_reduce(&call, ex.stream)?;
        for (from, to) in unpack {
            ex.copy(to, &from)?;
        }
        Ok(())
    }

    fn generic(
        &self,
        ex: &Exec<'_>,
        staged: Option<usize>,
        reduced: Option<usize>,
        gathered: usize,
        norm: Option<(usize, usize, usize)>,
    ) -> Result<()> {
        let c = &self.call;
        let (n, dtype, world, me) = (c.input.numel(), c.input.dtype, ex.world(), ex.rank());
        let flat = |addr: u64, len: usize| Array::contiguous(addr, dtype, &[len]);
        let source = |r: usize| -> Result<u64> {
            match (&self.symmetric, staged) {
                (Some(place), _) => place.on(r),
                (None, Some(off)) => ex.at(r, off),
                (None, None) => Err(err!(Internal, "an all-reduce input neither symmetric nor staged")),
            }
        };
        if let Some(off) = staged {
            ex.copy(&Array::contiguous(ex.local(off), dtype, &c.input.shape), &c.input)?;
        }
        ex.barrier()?;
        let sum = flat(ex.local(gathered), n);
        let size = dtype.size() as u64;
        match (self.algorithm, reduced) {
            (AllReduceAlgorithm::TwoShot, Some(red)) => {
                // This rank's slice, reduced from every rank's input into
                // its workspace; then every rank's reduced slice gathered.
                let (lo, hi) = slice(n, world, me);
                let srcs: Vec<Array> =
                    (0..world).map(|r| Ok(flat(source(r)? + lo as u64 * size, hi - lo))).collect::<Result<_>>()?;
                c.reduce(ex, &flat(ex.local(red) + lo as u64 * size, hi - lo), &srcs, world)?;
                ex.barrier()?;
                for r in ex.rotation() {
                    let (lo, hi) = slice(n, world, r);
                    let at = lo as u64 * size;
                    ex.copy(&flat(sum.addr + at, hi - lo), &flat(ex.at(r, red)? + at, hi - lo))?;
                }
            }
            _ => {
                let srcs: Vec<Array> = (0..world).map(|r| Ok(flat(source(r)?, n))).collect::<Result<_>>()?;
                c.reduce(ex, &sum, &srcs, world)?;
            }
        }
        // No rank may overwrite what a peer still reads (its staged input,
        // its reduced slice, or a symmetric input) before all are done.
        ex.barrier()?;
        c.finish(ex, &Array::contiguous(sum.addr, dtype, &c.input.shape), norm)
    }
}

/// Elements `[lo, hi)` of rank `r`'s slice of `n` over `world` ranks.
fn slice(n: usize, world: usize, r: usize) -> (usize, usize) {
    let per = n.div_ceil(world);
    ((r * per).min(n), ((r + 1) * per).min(n))
}

#[cfg(test)]
mod tests;

#[cfg(test)]
mod gpu;
