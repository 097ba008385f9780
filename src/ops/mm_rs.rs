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
use super::symmetric::{Placed, SymmetricPlace};
use super::workspace::Layout;
use super::{check, shape_text, BVectors, Exec, Prepared};
use crate::array::{Array, DType};
use crate::backend::{AllReduceLayout, FusedMatmul, GemmScales, Stream};
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

    /// The decision's path (see `paths`): the fused kernel; sequential, by
    /// one matmul over all of `a` or chunk by chunk, then a device-side
    /// reduce-scatter (`Decision::lines`) or a reduction of the chunks
    /// where they lie; or pipelined.
    fn execute(&self, ex: &Exec<'_>) -> Result<()> {
        if self.decision.algorithm == Algorithm::Fused {
            return self.fused(ex);
        }
        if self.alone(ex) {
            return self.multiply_alone(ex);
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

mod paths;

#[cfg(test)]
mod gpu;

#[cfg(test)]
mod tests;
