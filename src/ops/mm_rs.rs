//! `symm_mm_rs`: `reduce_scatter(a @ b, op, scatter_dim)`, as PyTorch's
//! `fused_matmul_reduce_scatter`, and with fp8 operands and scales as
//! `fused_scaled_matmul_reduce_scatter` (see `super::scaled`): each rank's
//! product is `(a * a_scale) @ (b * b_scale) + bias`, so, as in torch, the
//! bias is in every rank's product (a sum holds it world times, an average
//! once).
//!
//! Each rank's product `a @ b` has the shape of `a` with the last dimension
//! N; `scatter_dim` of that shape is split into `world` equal chunks, and
//! rank r receives the sum (or mean) over ranks of their chunk r.
//!
//! Execution (pipelined, see `MmRsPrepared::execute`): every rank computes its chunk r of the product for every r,
//! in the output dtype (as NCCL-then-cuBLAS and PyTorch's fused op do: half
//! the bytes over the links of f32 partials; each partial is still summed
//! over K in f32), into region r of its workspace (a chunk is a slice of `a` along
//! `scatter_dim`, or, for the last dimension, a slice of `b`'s columns).
//! After a barrier, rank r sums region r of every rank in rank order (so
//! that the result does not depend on who computes it), scales it for avg
//! and converts it into `out`.
//!
//! An fp8 `out` (torch's default `out_dtype` for fp8 operands) is rounded
//! once, after the sum: the partials are f32 (without the bias), summed in
//! f32 into the workspace, then the bias (times the world size for a sum,
//! once for an average, as torch's per-rank bias adds up to) and the
//! result scale are applied as the sum is rounded into `out`
//! (`Backend::quantize`). Not the fused kernel, whose partials are in the
//! output type.

use super::agree::Signature;
use super::decide::{self, Decision, Facts, Op};
use super::fused::{self, Fit};
use super::scaled::{self, Mode};
use super::state::Scratch;
use super::symmetric::{Placed, SymmetricPlace};
use super::workspace::Layout;
use super::{batched_operands, check, shape_text, BVectors, Exec, Prepared};
use crate::array::{Array, DType};
use crate::backend::{AllReduceLayout, FusedMatmul, FusedScatter, GemmScales, Quantize, Stream};
use crate::cost::Algorithm;
use crate::error::{err, Result};
use crate::group::Group;
use std::sync::Arc;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    Sum,
    Avg,
}

impl ReduceOp {
    pub(crate) fn name(self) -> &'static str {
        match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Avg => "avg",
        }
    }
}

/// One rank's call, as read from the caller.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct MmRs {
    pub a: Array,
    pub b: Array,
    pub scatter_dim: i64,
    pub op: ReduceOp,
    pub out: Array,
    pub scales: MmRsScales,
    /// The algorithm the caller asks for (`None`: automatic, see `decide`).
    pub algorithm: Option<Algorithm>,
}

/// The fp8 options (torch's `A_scale`, `B_scale`, `bias`, `result_scale`).
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct MmRsScales {
    pub a_scale: Option<Array>,
    pub b_scale: Option<Array>,
    pub bias: Option<Array>,
    /// For an fp8 `out`.
    pub result_scale: Option<Array>,
}

/// Collective over `group`: see the module documentation. `call` is `Err`
/// when the caller's arguments could not be read; this rank still takes
/// part in the agreement so its peers fail too.
pub fn mm_rs(group: &Arc<Group>, call: Result<MmRs>, stream: Stream) -> Result<()> {
    if !group.topology().single_host() {
        return super::across_matmul::mm_rs(group, call, stream);
    }
    let backend = group.backend();
    // A symmetric `out`: the fused kernel may let the peers write into it.
    let (placed, symmetric) = Placed::of(group, call, |c| &c.out);
    super::run_prepared(group, stream, placed, |Placed { call: c, .. }| {
        let facts = Facts::of(group);
        let fit = c.fused_field(group, &facts);
        let signature = c.signature(fit.as_ref(), symmetric.as_ref());
        let prepared = c
            .prepare(&facts, backend.kind().name(), fit.as_ref().is_some_and(Fit::fits))
            .and_then(|p| scaled::check_backend(&**backend, p.mode).map(|()| p))
            .map(|p| MmRsPrepared { symmetric_out: symmetric, ..p });
        (super::with_algorithm(signature, prepared.as_ref().map(|p| p.decision.algorithm)), prepared)
    })
}

/// This rank's call checked and laid out as `mm_rs` does, for a group
/// whose ranks do not run the fused kernel together nor write into each
/// other's `out` (a group spanning hosts): its signature and prepared call.
pub(super) fn prepare_unfused(group: &Group, c: MmRs) -> (Signature, Result<MmRsPrepared>) {
    let backend = group.backend();
    let signature = c.signature(None, None);
    let prepared = c
        .prepare(&Facts::of(group), backend.kind().name(), false)
        .and_then(|p| scaled::check_backend(&**backend, p.mode).map(|()| p));
    (signature, prepared)
}

impl MmRs {
    /// `symmetric`: where `out` lies, an agreed argument (`SymmetricPlace`).
    fn signature(&self, fused: Option<&Fit>, symmetric: Option<&SymmetricPlace>) -> Signature {
        let mut s = Signature::new("mm_rs")
            .arg("a.dtype", self.a.dtype)
            .arg("a.shape", shape_text(&self.a.shape))
            .arg("b.shape", shape_text(&self.b.shape))
            .arg("scatter_dim", self.scatter_dim)
            .arg("op", self.op.name())
            .arg("out.dtype", self.out.dtype)
            .arg("out memory", SymmetricPlace::describe(symmetric));
        // The scale mode decides the workspace, so it must agree.
        let options = [("opts->a_scale", &self.scales.a_scale), ("opts->b_scale", &self.scales.b_scale)];
        for (name, t) in options {
            if let Some(t) = t {
                s = s.arg(format!("{name}.shape"), shape_text(&t.shape));
            }
        }
        s = s.arg("opts->bias", if self.scales.bias.is_some() { "set" } else { "none" });
        s = s.arg("opts->result_scale", if self.scales.result_scale.is_some() { "set" } else { "none" });
        match fused {
            Some(f) => s.arg("fused", f),
            None => s,
        }
    }

    /// The scale mode of an fp8 call (`None` for f32/bf16/f16), after the
    /// checks that need nothing but the options.
    fn scale_mode(&self) -> Result<Option<Mode>> {
        let (a, s) = (&self.a, &self.scales);
        let scales_set: Vec<&str> = [("opts->a_scale", s.a_scale.is_some()), ("opts->b_scale", s.b_scale.is_some())]
            .iter()
            .filter_map(|&(name, set)| set.then_some(name))
            .collect();
        if a.dtype.fp8().is_none() {
            let biases_set = if s.bias.is_some() { vec!["opts->bias"] } else { vec![] };
            scaled::unscaled(a, "a", &scales_set, &biases_set)?;
            return Ok(None);
        }
        let missing: Vec<&str> =
            ["opts->a_scale", "opts->b_scale"].into_iter().filter(|n| !scales_set.contains(n)).collect();
        scaled::required(a, "a", &missing)?;
        Ok(Some(Mode::of(s.a_scale.as_ref().expect("required"), &[s.b_scale.as_ref().expect("required")])))
    }

    /// Whether this rank's call suits the fused kernel (see `fused::field`):
    /// scattering dim 0 of matrices.
    fn fused_field(&self, group: &Group, facts: &Facts) -> Option<Fit> {
        let k = *self.a.shape.last()?;
        if self.out.dtype.fp8().is_some() {
            return fused::unfit(facts, self.a.dtype, k, FP8_OUT_UNFUSED);
        }
        fused::field(group, facts, self.a.dtype, k, || {
            if self.scatter_dim != 0 {
                return None;
            }
            let (lhs, out) = (self.a.as_matrix()?, self.out.as_row_major_matrix()?);
            if lhs.shape[0] % group.world() != 0 {
                return None;
            }
            let rows = lhs.shape[0] / group.world();
            Some(vec![fused::prototype(lhs, self.b.clone(), out, self.caller_scales(), rows, group.world())])
        })
    }

    /// The fp8 scales and bias as the caller passed them (for the fused
    /// layout check; `None` unless both scales are set).
    fn caller_scales(&self) -> Option<GemmScales> {
        let s = &self.scales;
        let (a, b) = (s.a_scale.clone()?, s.b_scale.clone()?);
        Some(GemmScales { row_wise: Mode::of(&a, &[&b]) == Mode::Row, a, b, bias: s.bias.clone() })
    }

    /// Checks the call and lays out its workspace; `fits`: whether its
    /// operands suit the fused kernel.
    fn prepare(self, facts: &Facts, backend: &str, fits: bool) -> Result<MmRsPrepared> {
        let world = facts.world;
        let (a, b) = (&self.a, &self.b);
        check::matmul_input(a.dtype, "a.dtype")?;
        check::ndim_at_least(a, "a", 2)?;
        let mode = self.scale_mode()?;
        match mode {
            Some(_) => scaled::b_operand(b, "b", a, "a")?,
            None => {
                check::same_dtype(b, "b", a.dtype, "a")?;
                check::ndim_is(b, "b", 2)?;
                check::matmul_operand(b, "b")?;
            }
        }
        let dim = check::dim(self.scatter_dim, "scatter_dim", a.ndim(), "a")?;
        let last = a.ndim() - 1;
        if b.shape[0] != a.shape[last] {
            return Err(err!(
                InvalidArgument,
                "b.shape[0] is {}; expected {}, a's last dimension",
                b.shape[0],
                a.shape[last]
            ));
        }
        let mut chunk = a.shape.clone();
        chunk[last] = b.shape[1];
        if chunk[dim] % world != 0 {
            return Err(err!(
                InvalidArgument,
                "dimension {dim} of a @ b ({:?}) has size {}, which the world size {world} does not divide; \
                 expected a multiple of {world}",
                chunk,
                chunk[dim]
            ));
        }
        chunk[dim] /= world;
        let onto_pieces = onto_pull_pieces(&self, dim, mode, world, &chunk);
        if let Some(mode) = mode {
            scaled::sizes(b.shape[0], chunk[last], "b")?;
            let s = &self.scales;
            scaled::a_scale(s.a_scale.as_ref().expect("required"), "opts->a_scale", &a.shape, mode)?;
            scaled::b_scale(s.b_scale.as_ref().expect("required"), "opts->b_scale", b.shape[1], mode)?;
            scaled::output(&self.out, "out")?;
        } else {
            check::output_dtype(&self.out, "out", a.dtype, backend)?;
        }
        check::shape_is(&self.out, "out", &chunk)?;
        if let Some(bias) = &self.scales.bias {
            scaled::bias(bias, "opts->bias", b.shape[1], &self.out, "out")?;
        }
        if let Some(t) = &self.scales.result_scale {
            scaled::result_scale(t, "opts->result_scale", &self.out, "out")?;
        }
        let options = [
            ("opts->a_scale", &self.scales.a_scale),
            ("opts->b_scale", &self.scales.b_scale),
            ("opts->bias", &self.scales.bias),
            ("opts->result_scale", &self.scales.result_scale),
        ];
        let inputs: Vec<(String, &Array)> = [("a".to_string(), a), ("b".to_string(), b)]
            .into_iter()
            .chain(options.into_iter().filter_map(|(name, t)| Some((name.to_string(), t.as_ref()?))))
            .collect();
        check::outputs_disjoint(&[("out".into(), &self.out)], &inputs)?;

        let shape = decide::Shape {
            op: Op::MmRs,
            m: a.numel() / a.shape[a.ndim() - 1],
            k: a.shape[a.ndim() - 1],
            n: b.shape[1],
            dtype: a.dtype,
            out_bytes: partial_dtype(&self.out).size(),
            // Chunks of whole LL lines (the partials are floats).
            lines: self.out.numel() * partial_dtype(&self.out).size() % 8 == 0,
            split_len: onto_pieces.unwrap_or(1),
        };
        let decision = decide::decide(facts, &shape, fits, self.algorithm)?;
        let algorithm = decision.algorithm;

        // Workspace: one product chunk per destination rank (peers pull
        // them), local copies of the peers' chunks for this rank, the
        // reduced chunk (when `out` is not contiguous), then room to pack
        // `a` (or a slice of it) into a matrix, and its row scales into a
        // vector. Fused instead: the inbox, a slot per source rank that the
        // peers' kernels write into, in the mailbox (memory no other call
        // writes), and the kernel's state with its tile flags in a buffer
        // of its own (see `Scratch::Flags`). With an fp8 `out` the chunks
        // and the reduced chunk are f32, and the rounded chunk gets a place
        // of its own (for an `out` that is no matrix). Agreed shapes and
        // dtypes only.
        let chunk_bytes = check::mul(self.out.numel(), partial_dtype(&self.out).size(), "the product")?;
        let rows = a.numel() / a.shape[last];
        let mut layout = Layout::default();
        let (mut mailbox, mut flags) = (Layout::default(), Layout::default());
        let mut region = |bytes| layout.region(bytes);
        let (chunks, staged, reduced, packed_a, state, inbox) = if algorithm == Algorithm::Fused {
            let out_rows = self.out.numel() / self.out.shape[last];
            let state = flags.region(FusedMatmul::state_bytes(out_rows, b.shape[1], world));
            (Vec::new(), Vec::new(), 0, 0, state, mailbox.region(check::mul(chunk_bytes, world, "the product")?))
        } else {
            // Back to back, so that for scatter_dim 0 they form the whole product.
            let product = region(check::mul(chunk_bytes, world, "the product")?);
            let chunks = (0..world).map(|r| product + r * chunk_bytes).collect();
            let staged = (0..world).map(|_| region(chunk_bytes)).collect();
            let reduced = region(chunk_bytes);
            (chunks, staged, reduced, region(check::mul(a.numel(), a.dtype.size(), "a")?), 0, 0)
        };
        let packed_scale = match mode {
            Some(Mode::Row) => Some(region(check::mul(rows, 4, "a_scale")?)),
            Some(Mode::Tensor) => Some(region(4)),
            None => None,
        };
        let rounded = self.out.dtype.fp8().map(|_| region(self.out.numel()));
        // B's scales and bias, aligned where the caller's are not (an fp8
        // `out`'s bias is added once, after the sum).
        let bias = self.scales.bias.as_ref().filter(|_| self.out.dtype.fp8().is_none());
        let b_vectors = mode.map(|mode| BVectors::plan(&mut region, b.shape[1], mode == Mode::Row, bias));
        Ok(MmRsPrepared {
            call: self,
            symmetric_out: None,
            dim,
            mode,
            onto_pieces,
            chunks,
            staged,
            reduced,
            packed_a,
            state,
            inbox,
            packed_scale,
            rounded,
            b_vectors,
            lines_bytes: if decision.lines { AllReduceLayout::bytes_for(chunk_bytes, world) } else { 0 },
            decision,
            shape,
            workspace: layout.bytes(),
            mailbox: mailbox.bytes(),
            flags: flags.bytes(),
        })
    }
}

#[derive(Debug)]
pub(super) struct MmRsPrepared {
    call: MmRs,
    /// Where every rank's `out` lies, if in symmetric memory (agreed).
    symmetric_out: Option<SymmetricPlace>,
    dim: usize,
    /// The scale mode of an fp8 call.
    mode: Option<Mode>,
    /// The pieces [`Self::pipelined_onto_pulls`] cuts each chunk into,
    /// where it applies ([`onto_pull_pieces`]).
    onto_pieces: Option<usize>,
    /// Workspace offsets: `chunks[r]` holds the product chunk for rank r;
    /// `staged[q]` the copy of rank q's chunk for this rank.
    chunks: Vec<usize>,
    staged: Vec<usize>,
    reduced: usize,
    packed_a: usize,
    /// Fused: the offset of the kernel's state (with its tile flags) in
    /// the flags buffer, and of the inbox (`world` chunks) in the mailbox.
    state: usize,
    inbox: usize,
    /// fp8: where `a_scale` (row-wise: a slice of it) is copied when it is
    /// not a 16-byte aligned vector.
    packed_scale: Option<usize>,
    /// With an fp8 `out`: where the rounded chunk goes when `out` is no
    /// matrix (then copied).
    rounded: Option<usize>,
    /// fp8: where B's scales and bias are copied when they are not 16-byte
    /// aligned.
    b_vectors: Option<BVectors>,
    /// Bytes of the all-reduce buffer the LL lines need (`decision.lines`).
    lines_bytes: usize,
    decision: Decision,
    shape: decide::Shape,
    workspace: usize,
    mailbox: usize,
    flags: usize,
}

impl Prepared for MmRsPrepared {
    fn workspace_bytes(&self) -> usize {
        self.workspace
    }

    fn decided(&self) -> Option<String> {
        Some(self.decision.describe(&self.shape))
    }

    fn mailbox_bytes(&self) -> usize {
        self.mailbox
    }

    fn flags_bytes(&self) -> usize {
        self.flags
    }

    fn all_reduce_bytes(&self) -> usize {
        self.lines_bytes
    }

    fn replay_key(&self) -> String {
        format!("{self:?}")
    }

    fn execute(&self, ex: &Exec<'_>) -> Result<()> {
        if self.decision.algorithm == Algorithm::Fused {
            return self.fused(ex);
        }
        let MmRs { a, b, out, .. } = &self.call;
        // One matmul over all of `a` when its rows are the chunks in order
        // (packed first where `a` is no matrix: whether it is one differs
        // between ranks, and the two paths synchronize differently).
        let whole = self.dim == 0 && self.decision.algorithm == Algorithm::Sequential;
        if whole {
            let lhs = self.lhs(ex, a)?;
            let dst = Array::contiguous(ex.local(self.chunks[0]), partial_dtype(out), &[lhs.shape[0], b.shape[1]]);
            let scales = self.scales(ex, self.call.scales.a_scale.as_ref())?;
            ex.matmul(&dst, &lhs, b, scales.as_ref())?;
        } else if self.decision.lines {
            self.products(ex)?;
        } else {
            return self.pipelined(ex);
        }
        match self.decision.lines {
            true => self.reduce_on_device(ex),
            false => self.sequential(ex),
        }
    }
}

impl MmRsPrepared {
    /// Fused (dim 0 of matrices, see `fused_field`): one kernel, and no
    /// barrier before it. The peers' chunks first (rank+1 first), each tile
    /// pushed into the destination's inbox slot for this rank once that
    /// rank's previous call has read its inbox, and flagged; this rank's own
    /// chunk last, each tile summed with the peers' partials as their flags
    /// arrive and written to `out`. The kernel keeps the count of calls
    /// that this takes in the flags buffer (`FusedScatter`).
    fn fused(&self, ex: &Exec<'_>) -> Result<()> {
        let MmRs { a, b, out, .. } = &self.call;
        let (me, world) = (ex.rank(), ex.world());
        let backend = ex.group.backend();
        let lhs = a.as_matrix().expect("checked by fused_field");
        let rows = lhs.shape[0] / world;
        let scale = match self.call.op {
            ReduceOp::Sum => 1.0,
            ReduceOp::Avg => 1.0 / world as f32,
        };
        // Row-wise scales packed into one vector (the packing copy runs
        // before the kernel on this stream); chunk c's rows at c * rows.
        let scales = self.scales(ex, self.call.scales.a_scale.as_ref())?;
        let call = FusedMatmul {
            order: (1..=world).map(|i| (me + i) % world).collect(),
            scatter: Some(FusedScatter {
                rank: me,
                inbox: ex.on_every_rank(Scratch::Mailbox, self.inbox)?,
                state: ex.on_every_rank(Scratch::Flags, self.state)?,
                out: match &self.symmetric_out {
                    Some(place) => Some((0..world).map(|r| place.on(r)).collect::<Result<_>>()?),
                    None => None,
                },
                tag: ex.tag,
            }),
            alpha: scale,
            timeout: ex.group.timeout(),
            ..fused::prototype(lhs, b.clone(), out.as_row_major_matrix().expect("checked"), scales, rows, world)
        };
        backend.fused_matmul(&call, ex.stream)
    }

    /// (Part of) `a` as the left operand: a matrix, packed where its
    /// strides do not allow one (or, for fp8, are not K-major).
    fn lhs(&self, ex: &Exec<'_>, a: &Array) -> Result<Array> {
        match self.mode {
            Some(_) => ex.k_major_matrix(a, self.packed_a),
            None => ex.matrix(a, self.packed_a),
        }
    }

    /// The scales of an fp8 call for the rows of `a_scale` given (all of
    /// it, or the slice of one chunk), over all of `b`'s columns.
    fn scales(&self, ex: &Exec<'_>, a_scale: Option<&Array>) -> Result<Option<GemmScales>> {
        let (Some(mode), Some(a_scale)) = (self.mode, a_scale) else { return Ok(None) };
        let s = &self.call.scales;
        let b_scale = s.b_scale.as_ref().expect("an fp8 call has a B scale");
        let a = ex.vector(a_scale, self.packed_scale.expect("planned for fp8 calls"))?;
        // An fp8 `out`'s bias is added once, after the sum.
        let bias = s.bias.as_ref().filter(|_| self.call.out.dtype.fp8().is_none());
        let (b, bias) = ex.b_vectors(b_scale, bias, self.b_vectors.expect("planned for fp8 calls"))?;
        Ok(Some(GemmScales { row_wise: mode == Mode::Row, a, b, bias }))
    }

    /// A chunk of the product (or of the reduction) at `addr`.
    pub(super) fn chunk(&self, addr: u64) -> Array {
        Array::contiguous(addr, partial_dtype(&self.call.out), &self.call.out.shape)
    }

    /// After a barrier, the reduction reads every rank's chunk for this rank
    /// where it lies (over the links for peers): fewest steps, for small
    /// problems.
    fn sequential(&self, ex: &Exec<'_>) -> Result<()> {
        ex.barrier()?;
        let me = ex.rank();
        let srcs: Vec<Array> =
            (0..ex.world()).map(|q| Ok(self.chunk(ex.at(q, self.chunks[me])?))).collect::<Result<_>>()?;
        self.reduce_into_out(ex, &srcs)?;
        // No rank's next call may overwrite chunks a peer still reads.
        ex.barrier()
    }

    /// Sequential at small chunks (`Decision::lines`), after the products:
    /// one launch of the device-side reduce-scatter pushes each chunk to
    /// its rank (as LL lines or in flagged pieces: no barrier before or
    /// after) and sums this rank's, scaled for avg, into `out` where it is
    /// contiguous in the partials' type, else into the workspace, finished
    /// there as [`Self::reduce_into_out`] finishes.
    fn reduce_on_device(&self, ex: &Exec<'_>) -> Result<()> {
        let out = &self.call.out;
        let scale = match self.call.op {
            ReduceOp::Sum => 1.0,
            ReduceOp::Avg => 1.0 / ex.world() as f32,
        };
        let input = ex.local(self.chunks[0]);
        if self.rounded.is_none() && out.is_contiguous() {
            return ex.device_reduce_scatter(input, out, scale);
        }
        let reduced = self.chunk(ex.local(self.reduced));
        ex.device_reduce_scatter(input, &reduced, scale)?;
        match self.rounded {
            Some(rounded) => self.quantize_into_out(ex, &reduced, rounded),
            None => ex.copy(out, &reduced),
        }
    }

    /// Pipelined: the chunks for the peers first (rank+1, rank+2, ...),
    /// each announced to its destination by a signal as soon as it is
    /// computed; a side stream pulls the chunks the peers computed for this
    /// rank (copy engines on CUDA) while the main stream computes the rest;
    /// the final reduction reads local memory only. The side stream forks
    /// after the first product: forked before it, a graph's replay may
    /// start the side's first wait (a kernel polling for the peer's signal)
    /// before the matmul, which then runs without that SM for the whole
    /// wait (its first matmul 0.296 -> 0.36 ms at 8192x7168x4096 on two
    /// H200s); the peer's signal comes after its own first product anyway.
    fn pipelined(&self, ex: &Exec<'_>) -> Result<()> {
        if let Some(pieces) = self.onto_pieces {
            return self.pipelined_onto_pulls(ex, pieces);
        }
        let (world, me) = (ex.world(), ex.rank());
        let whole_a = self.whole_a(ex)?;
        let (side, signals) = (ex.side()?, ex.signal_side()?);
        for step in 1..=world {
            let r = (me + step) % world;
            self.product(ex, r, whole_a.as_ref())?;
            if step == 1 {
                ex.fork(side)?; // after the first product (see above)
            }
            if r != me {
                // From a stream of its own: a signal kernel first waits for
                // the peer to have taken the previous one, which on the
                // main stream held the next matmul back (7 us between the
                // two at 512x14336x8192 on two H100s).
                ex.fork(signals)?;
                ex.put_signal(r, READY, signals)?;
            }
        }
        for step in 1..world {
            let q = (me + world - step) % world;
            ex.wait_signal(q, READY, side)?;
            ex.copy_on(side, &self.chunk(ex.local(self.staged[q])), &self.chunk(ex.at(q, self.chunks[me])?))?;
        }
        ex.join(side)?;
        // Once every rank has pulled its chunks (side barrier), the next
        // call may overwrite them; that barrier overlaps the reduction.
        ex.barrier_on(side)?;
        let srcs: Vec<Array> =
            (0..world).map(|q| self.chunk(ex.local(if q == me { self.chunks[me] } else { self.staged[q] }))).collect();
        self.reduce_into_out(ex, &srcs)?;
        if world > 1 {
            // Forked only for a chunk sent to a peer; joining a stream not
            // forked in a graph capture would end the capture.
            ex.join(signals)?;
        }
        ex.join(side)
    }

    /// Scattering N multiplies all of `a` (as a matrix, with its scales)
    /// by column slices of `b` (and of its scales and bias): that matrix.
    fn whole_a(&self, ex: &Exec<'_>) -> Result<Option<(Array, Option<GemmScales>)>> {
        let a = &self.call.a;
        if self.dim != a.ndim() - 1 {
            return Ok(None);
        }
        Ok(Some((self.lhs(ex, a)?, self.scales(ex, self.call.scales.a_scale.as_ref())?)))
    }

    /// Chunk r of this rank's product, into `chunks[r]` (`whole_a`: see
    /// [`Self::whole_a`]).
    fn product(&self, ex: &Exec<'_>, r: usize, whole_a: Option<&(Array, Option<GemmScales>)>) -> Result<()> {
        let MmRs { a, b, out, .. } = &self.call;
        let (dim, len, a_scale) = (self.dim, out.shape[self.dim], self.call.scales.a_scale.as_ref());
        let (lhs, rhs, scales) = match whole_a {
            Some((m, s)) => (m.clone(), b.narrow(1, r * len, len), s.as_ref().map(|s| s.columns(r * len, len))),
            None => {
                let part = a.narrow(dim, r * len, len);
                if self.mode.is_none() {
                    return self.multiply_into(ex, &self.chunk(ex.local(self.chunks[r])), &part, None, false);
                }
                let rows = a_scale.filter(|_| self.mode == Some(Mode::Row)).map(|s| s.narrow(dim, r * len, len));
                let scales = self.scales(ex, rows.as_ref().or(a_scale))?;
                (self.lhs(ex, &part)?, b.clone(), scales)
            }
        };
        let dst = Array::contiguous(ex.local(self.chunks[r]), partial_dtype(out), &[lhs.shape[0], rhs.shape[1]]);
        ex.matmul(&dst, &lhs, &rhs, scales.as_ref())
    }

    /// Every chunk of this rank's product, each in its place (`chunk(r)`):
    /// what a group spanning hosts reduces across its levels.
    pub(super) fn products(&self, ex: &Exec<'_>) -> Result<()> {
        let whole_a = self.whole_a(ex)?;
        (0..ex.world()).try_for_each(|r| self.product(ex, r, whole_a.as_ref()))
    }

    /// Bytes of one chunk of the product.
    pub(super) fn chunk_bytes(&self) -> usize {
        self.call.out.numel() * partial_dtype(&self.call.out).size()
    }

    /// Rank r's chunk of this rank's product (after [`Self::products`]).
    pub(super) fn product_chunk(&self, ex: &Exec<'_>, r: usize) -> Array {
        self.chunk(ex.local(self.chunks[r]))
    }

    /// Pipelined for two ranks without the final pass over the chunk: the
    /// peer's chunk first, announced whole, or in the pieces below where
    /// the cost model found its pull exposed (`decision.pieces`): then the
    /// peer starts pulling after the first piece. Then this rank's own
    /// chunk in pieces, each but the first multiplied onto the peer's
    /// partial for it, which the side stream has pulled into `out` (or,
    /// where `out` is not contiguous, the workspace's reduced chunk)
    /// meanwhile (C += A @ B, one rounding). Only the first piece, computed
    /// before any partial has arrived, is summed by a reduction at the end.
    /// This saves a final pass that read two chunks and wrote one after the
    /// last matmul (about 7% of the call at 16384x4096x8192 on two H100s,
    /// bench/results/). Pieces are runs of the chunk's first dimension:
    /// rows of a matrix, or the batch of a `[batch, seq, hidden]` scattered
    /// along its sequence.
    fn pipelined_onto_pulls(&self, ex: &Exec<'_>, pieces: usize) -> Result<()> {
        let MmRs { a, out, .. } = &self.call;
        let (me, units) = (ex.rank(), out.shape[0]);
        let peer = 1 - me;
        // Rows of a matrix: `a` as one (packed where it is not).
        let lhs = if self.dim == 0 { Some(self.lhs(ex, a)?) } else { None };
        let a_part = |r: usize, start: usize, len: usize| match &lhs {
            Some(m) => m.narrow(0, r * units + start, len),
            None => a.narrow(0, start, len).narrow(self.dim, r * out.shape[self.dim], out.shape[self.dim]),
        };
        // fp8 (rows of a matrix only): the scales of those rows.
        let a_scale = self.call.scales.a_scale.as_ref();
        let scale_part = |r: usize, start: usize, len: usize| match (self.mode, a_scale) {
            (Some(Mode::Row), Some(s)) => Some(s.narrow(0, r * units + start, len)),
            (_, s) => s.cloned(),
        };
        let bound = |j: usize| j * units / pieces;
        let span = |j: usize| (bound(j), bound(j + 1) - bound(j));
        let piece = |t: &Array, j: usize| {
            let (start, len) = span(j);
            t.narrow(0, start, len)
        };
        // The pieces in the order they are pulled: the first is summed last.
        let order = || (1..pieces).chain([0]);
        let in_pieces = self.decision.pieces > 1;
        let (side, signals) = (ex.side()?, ex.signal_side()?);
        let theirs = self.chunk(ex.local(self.chunks[peer]));
        let announced: Vec<(usize, usize)> = match in_pieces {
            true => order().map(span).collect(),
            false => vec![(0, units)],
        };
        // A channel per piece: a second signal on one channel would wait
        // for the peer to take the first, which a backend running its
        // streams one after another never does.
        for (i, &(start, len)) in announced.iter().enumerate() {
            self.multiply_into(
                ex,
                &theirs.narrow(0, start, len),
                &a_part(peer, start, len),
                scale_part(peer, start, len).as_ref(),
                false,
            )?;
            if i == 0 {
                ex.fork(side)?; // after the first product, as in `pipelined`
            }
            ex.fork(signals)?; // as in `pipelined`
            ex.put_signal(peer, READY + i, signals)?;
        }
        let target = match out.is_contiguous() {
            true => out.clone(),
            false => self.chunk(ex.local(self.reduced)),
        };
        let pulled = self.chunk(ex.at(peer, self.chunks[me])?);
        let (own, staged) = (self.chunk(ex.local(self.chunks[me])), self.chunk(ex.local(self.staged[peer])));
        let (start, len) = span(0);
        self.multiply_into(ex, &piece(&own, 0), &a_part(me, start, len), scale_part(me, start, len).as_ref(), false)?;
        for (i, j) in order().enumerate() {
            if in_pieces || i == 0 {
                ex.wait_signal(peer, READY + i, side)?;
            }
            let into = if j == 0 { &staged } else { &target };
            ex.copy_on(side, &piece(into, j), &piece(&pulled, j))?;
            ex.join(side)?;
            if j != 0 {
                let (start, len) = span(j);
                self.multiply_into(
                    ex,
                    &piece(&target, j),
                    &a_part(me, start, len),
                    scale_part(me, start, len).as_ref(),
                    true,
                )?;
            }
        }
        // Once both ranks have pulled (side barrier), the next call may
        // overwrite the chunks; it overlaps the last reduction.
        ex.barrier_on(side)?;
        let mut srcs = [piece(&own, 0), piece(&staged, 0)];
        if me == 1 {
            srcs.swap(0, 1); // rank order, as reduce_into_out sums
        }
        ex.reduce(&piece(&target, 0), &srcs, 1.0)?;
        if !out.is_contiguous() {
            ex.copy(out, &target)?;
        }
        ex.join(signals)?;
        ex.join(side)
    }

    /// `dst` (a contiguous piece of a chunk) = (or, `accumulate`, +=)
    /// `part` (the slice of `a` it comes from, any strides) @ b: fp8 with
    /// `a_scale` (those rows' scales, or the tensor's) as one K-major
    /// matrix; else unscaled, as one matrix, else as a batch of strided
    /// matrices (a slice along the sequence of a `[batch, seq, hidden]`,
    /// read in place), else packed first.
    fn multiply_into(
        &self,
        ex: &Exec<'_>,
        dst: &Array,
        part: &Array,
        a_scale: Option<&Array>,
        accumulate: bool,
    ) -> Result<()> {
        let b = &self.call.b;
        let matrix = dst.as_matrix().expect("a contiguous piece");
        if let Some(scales) = self.scales(ex, a_scale)? {
            return ex.scaled_gemm(&matrix, &self.lhs(ex, part)?, b, &scales, accumulate);
        }
        if let Some(l) = part.as_matrix() {
            return ex.gemm(&matrix, &l, b, accumulate);
        }
        if let Some([d, l, rhs]) = batched_operands(dst, part, b) {
            return ex.gemm(&d, &l, &rhs, accumulate);
        }
        ex.gemm(&matrix, &self.lhs(ex, part)?, b, accumulate)
    }

    /// Sums `srcs` in rank order (so every rank's result is reproducible),
    /// scaled for avg, into `out`.
    pub(super) fn reduce_into_out(&self, ex: &Exec<'_>, srcs: &[Array]) -> Result<()> {
        let out = &self.call.out;
        let scale = match self.call.op {
            ReduceOp::Sum => 1.0,
            ReduceOp::Avg => 1.0 / ex.world() as f32,
        };
        if let Some(rounded) = self.rounded {
            return self.reduce_into_fp8(ex, srcs, scale, rounded);
        }
        if out.is_contiguous() {
            ex.reduce(out, srcs, scale)
        } else {
            let reduced = self.chunk(ex.local(self.reduced));
            ex.reduce(&reduced, srcs, scale)?;
            ex.copy(out, &reduced)
        }
    }

    /// An fp8 `out`: the f32 sum into the workspace, then its bias (world
    /// times for a sum: every rank's product had it) and result scale as it
    /// is rounded into `out` (a matrix), or into `rounded` and copied.
    fn reduce_into_fp8(&self, ex: &Exec<'_>, srcs: &[Array], scale: f32, rounded: usize) -> Result<()> {
        let reduced = self.chunk(ex.local(self.reduced));
        ex.reduce(&reduced, srcs, scale)?;
        self.quantize_into_out(ex, &reduced, rounded)
    }

    /// The f32 sum `reduced` with its bias and result scale, rounded into
    /// an fp8 `out` (a matrix), or into `rounded` and copied.
    fn quantize_into_out(&self, ex: &Exec<'_>, reduced: &Array, rounded: usize) -> Result<()> {
        let MmRs { a, out, op, scales, .. } = &self.call;
        let n = *out.shape.last().expect("out has dimensions");
        let sum = Array::contiguous(reduced.addr, DType::F32, &[out.numel() / n, n]);
        // Scattering N: this rank's columns of the bias.
        let bias = match &scales.bias {
            Some(b) if self.dim == a.ndim() - 1 => Some(b.narrow(0, ex.rank() * n, n)),
            other => other.clone(),
        };
        let bias_weight = match op {
            ReduceOp::Sum => ex.world() as f32,
            ReduceOp::Avg => 1.0,
        };
        let quantize = |dst: &Array| {
            let q = Quantize { dst, src: &sum, bias: bias.as_ref(), bias_weight, scale: scales.result_scale.as_ref() };
            ex.quantize(&q)
        };
        match out.as_matrix() {
            Some(m) => quantize(&m),
            None => {
                let staged = Array::contiguous(ex.local(rounded), out.dtype, &out.shape);
                quantize(&staged.as_matrix().expect("contiguous"))?;
                ex.copy(out, &staged)
            }
        }
    }
}

/// The type of the partials: the output's, or f32 for an fp8 output.
fn partial_dtype(out: &Array) -> DType {
    if out.dtype.fp8().is_some() {
        DType::F32
    } else {
        out.dtype
    }
}

/// Why a call with an fp8 `out` does not run the fused kernel.
const FP8_OUT_UNFUSED: &str = "an fp8 out is summed in f32 and then rounded, outside the fused kernel";

/// The pieces [`MmRsPrepared::pipelined_onto_pulls`] cuts each chunk
/// (`chunk`: its shape) into, where it applies: two ranks, a sum, matrices
/// scattered by rows or `[batch, seq, hidden]` along the sequence (pieces
/// of the batch; fp8 operands: matrices only, into a 16-bit or f32 `out`),
/// and at least two pieces of about [`MIN_PIECE_ROWS`]. From agreed
/// arguments only: the pieces decide the signals the ranks exchange.
fn onto_pull_pieces(call: &MmRs, dim: usize, mode: Option<Mode>, world: usize, chunk: &[usize]) -> Option<usize> {
    let by_rows = (call.a.ndim(), dim) == (2, 0);
    let layout = match mode {
        None => by_rows || (call.a.ndim(), dim) == (3, 1),
        // An fp8 `out` is summed in f32 and rounded after the sum.
        Some(_) => by_rows && call.out.dtype.fp8().is_none(),
    };
    let applies = world == 2 && call.op == ReduceOp::Sum && layout;
    let rows = chunk[..chunk.len() - 1].iter().product();
    applies.then(|| onto_pull_pieces_of(chunk[0], rows)).flatten()
}

/// [`onto_pull_pieces`] of a chunk of `rows` rows in `units` runs of its
/// first dimension, where the path applies.
pub(crate) fn onto_pull_pieces_of(units: usize, rows: usize) -> Option<usize> {
    let pieces = (rows / MIN_PIECE_ROWS).min(MAX_PIECES).min(units);
    (pieces >= 2).then_some(pieces)
}

/// Rows of this rank's chunk per piece at least, and most pieces, of
/// [`MmRsPrepared::pipelined_onto_pulls`]: pieces large enough that cuBLASLt
/// runs them about as fast as the whole chunk, and few enough that their
/// pulls and joins cost little. Measured on 2 x H200 (bench/results/):
/// 512-row pieces of 4096x2048x8192 ran 13% slower than the whole matmul,
/// and at most 2 pieces took 0.90-0.95 x the time of at most 4 there and
/// at 8192x2048x4096 (batch 4), the same elsewhere.
const MIN_PIECE_ROWS: usize = 512;
const MAX_PIECES: usize = 2;

/// Signal channel announcing "the chunk for you is in my workspace", and
/// the channels after it, one per piece of [`MmRsPrepared::pipelined_onto_pulls`].
const READY: usize = super::CHANNEL + 1;
const _: () = assert!(READY + MAX_PIECES <= crate::backend::SIGNAL_CHANNELS);

#[cfg(test)]
mod gpu;

#[cfg(test)]
mod tests;
