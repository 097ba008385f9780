//! `symm_fused_ag_mm`: `all_gather(a_shard, gather_dim) @ bs[i]` for one or
//! more B sharing one gathered A, as PyTorch's `fused_all_gather_matmul`,
//! and with fp8 operands and scales as `fused_all_gather_scaled_matmul`
//! (see `super::scaled`).
//!
//! The gathered A is the ranks' shards concatenated along `gather_dim` in
//! rank order; output i is gathered A @ `bs[i]`, the gathered shape with the
//! last dimension N_i. Gathering the last dimension concatenates K: each
//! B then has K * world rows, and output i is the sum over ranks r of
//! `shard_r @ bs[i][r*K .. (r+1)*K]`.
//!
//! Scales: a tensor-wise `a_scale` is this rank's, applied to the whole
//! gathered A (as torch: every rank should pass the same value); a row-wise
//! one belongs to the shard's rows and is gathered with them. Row-wise
//! scales with gather_dim the last dimension would give each K block its
//! own row scales, which one matmul cannot apply: not supported.
//!
//! An fp8 output (torch's default `out_dtype` for fp8 operands) is
//! computed in f32 into the workspace, a shard's rows at a time, then
//! rounded once into the output with its bias and result scale
//! (`Backend::quantize`); never by the fused kernel, and Sequential runs
//! shard by shard like Pipelined (the f32 product of the whole gathered A
//! would need workspace of four times the output).
//!
//! Execution (see `AgMmPrepared::execute`): every rank gets every peer's
//! shard into its own workspace, pushed there by the peer straight from
//! its caller's memory (pipelined), or pulled after the peer staged it
//! (with its row scales) in its own, and copies each to its slice of
//! `ag_out`. For gather_dim < last, shard r times B is slice r of each
//! output, written directly when that slice is a matrix or (unscaled) a
//! batch of equally strided ones, as gathering the sequence dimension of
//! `[batch, seq, hidden]` makes it (one strided-batched matmul), else
//! through scratch. For the last dimension the shards are laid side by side into
//! one matrix and multiplied once over the whole K. At decode sizes the
//! sequential path gathers instead on the all-reduce's LL lines (one
//! launch, no barrier; `Decision::lines`).

use super::agree::Signature;
use super::decide::{self, Decision, Facts, Op};
use super::fused::{self, Fit};
use super::scaled::{self, Mode};
use super::symmetric::{Placed, SymmetricPlace};
use super::workspace::Layout;
use super::{batched_operands, check, shape_text, BVectors, Exec, Prepared};
use crate::array::{Array, DType};
use crate::backend::{AllReduceLayout, FusedGather, FusedMatmul, GemmScales, Quantize, Stream};
use crate::cost::{self, Algorithm};
use crate::error::{err, Result};
use crate::group::Group;
use std::sync::Arc;

/// One rank's call, as read from the caller.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct AgMm {
    pub a_shard: Array,
    pub bs: Vec<Array>,
    pub gather_dim: i64,
    pub ag_out: Option<Array>,
    pub outs: Vec<Array>,
    pub scales: AgMmScales,
    /// The algorithm the caller asks for (`None`: automatic, see `decide`).
    pub algorithm: Option<Algorithm>,
}

/// The fp8 options (torch's `A_scale`, `B_scales`, `biases`,
/// `result_scales`).
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct AgMmScales {
    pub a_scale: Option<Array>,
    /// One per B.
    pub b_scales: Option<Vec<Array>>,
    /// One per B; `None` entries add no bias.
    pub biases: Option<Vec<Option<Array>>>,
    /// One per B, for fp8 outputs; `None` entries scale by 1.
    pub result_scales: Option<Vec<Option<Array>>>,
}

/// Collective over `group`: see the module documentation. `call` is `Err`
/// when the caller's arguments could not be read; this rank still takes
/// part in the agreement so its peers fail too.
pub fn fused_ag_mm(group: &Arc<Group>, call: Result<AgMm>, stream: Stream) -> Result<()> {
    if !group.topology().single_host() {
        return super::across_matmul::fused_ag_mm(group, call, stream);
    }
    let backend = group.backend();
    let (placed, symmetric) = Placed::of(group, call, |c| &c.a_shard);
    super::run_prepared(group, stream, placed, |Placed { call: c, .. }| {
        let facts = Facts::of(group);
        let fit = c.fused_field(group, &facts);
        let signature = c.signature(fit.as_ref()).arg("a_shard memory", SymmetricPlace::describe(symmetric.as_ref()));
        let prepared = c
            .prepare(&facts, backend.kind().name(), fit.as_ref().is_some_and(Fit::fits))
            .and_then(|p| scaled::check_backend(&**backend, p.mode).map(|()| p))
            .map(|p| AgMmPrepared { symmetric_a: symmetric, ..p });
        (super::with_algorithm(signature, prepared.as_ref().map(|p| p.decision.algorithm)), prepared)
    })
}

/// This rank's call checked and laid out as `fused_ag_mm` does, for a
/// group whose ranks do not run the fused kernel together (a group
/// spanning hosts): its signature and prepared call.
pub(super) fn prepare_unfused(group: &Group, c: AgMm) -> (Signature, Result<AgMmPrepared>) {
    let backend = group.backend();
    let signature = c.signature(None);
    let prepared = c
        .prepare(&Facts::of(group), backend.kind().name(), false)
        .and_then(|p| scaled::check_backend(&**backend, p.mode).map(|()| p));
    (signature, prepared)
}

impl AgMm {
    fn signature(&self, fused: Option<&Fit>) -> Signature {
        let a = &self.a_shard;
        let mut s = Signature::new("fused_ag_mm")
            .arg("a_shard.dtype", a.dtype)
            .arg("a_shard.shape", shape_text(&a.shape))
            .arg("gather_dim", self.gather_dim)
            .arg("num_b", self.bs.len());
        for (i, (b, o)) in self.bs.iter().zip(&self.outs).enumerate() {
            s = s.arg(format!("bs[{i}].shape"), shape_text(&b.shape)).arg(format!("outs[{i}].dtype"), o.dtype);
        }
        // The scale mode decides the workspace, so it must agree.
        if let Some(t) = &self.scales.a_scale {
            s = s.arg("opts->a_scale.shape", shape_text(&t.shape));
        }
        for (i, t) in self.scales.b_scales.iter().flatten().enumerate() {
            s = s.arg(format!("opts->b_scales[{i}].shape"), shape_text(&t.shape));
        }
        for (i, t) in self.scales.biases.iter().flatten().enumerate() {
            s = s.arg(format!("opts->biases[{i}]"), if t.is_some() { "set" } else { "none" });
        }
        for (i, t) in self.scales.result_scales.iter().flatten().enumerate() {
            s = s.arg(format!("opts->result_scales[{i}]"), if t.is_some() { "set" } else { "none" });
        }
        match fused {
            Some(f) => s.arg("fused", f),
            None => s,
        }
    }

    /// Whether this rank's call suits the fused kernel (see `fused::field`):
    /// gathering dim 0 into matrices.
    fn fused_field(&self, group: &Group, facts: &Facts) -> Option<Fit> {
        let a = &self.a_shard;
        let k = *a.shape.last()?;
        if self.outs.iter().any(|o| o.dtype.fp8().is_some()) {
            return fused::unfit(facts, a.dtype, k, FP8_OUT_UNFUSED);
        }
        fused::field(group, facts, a.dtype, k, || {
            if self.gather_dim != 0 || self.bs.len() != self.outs.len() {
                return None;
            }
            let lhs = a.as_matrix()?;
            let rows = lhs.shape[0];
            (0..self.bs.len())
                .map(|i| {
                    let (b, c) = (self.bs[i].clone(), self.outs[i].as_row_major_matrix()?);
                    Some(fused::prototype(lhs.clone(), b, c, self.caller_scales(i), rows, group.world()))
                })
                .collect()
        })
    }

    /// The fp8 scales and bias of the matmul by `bs[i]` as the caller
    /// passed them (for the fused layout check; `None` unless set).
    fn caller_scales(&self, i: usize) -> Option<GemmScales> {
        let s = &self.scales;
        let (a, b) = (s.a_scale.clone()?, s.b_scales.as_ref()?.get(i)?.clone());
        let bias = s.biases.as_ref().and_then(|v| v.get(i).cloned().flatten());
        Some(GemmScales { row_wise: Mode::of(&a, &[&b]) == Mode::Row, a, b, bias })
    }

    /// The scale mode of an fp8 call (`None` for f32/bf16/f16), after the
    /// checks that need nothing but the options.
    fn scale_mode(&self) -> Result<Option<Mode>> {
        let (a, s) = (&self.a_shard, &self.scales);
        let scales_set: Vec<&str> = [("opts->a_scale", s.a_scale.is_some()), ("opts->b_scales", s.b_scales.is_some())]
            .iter()
            .filter_map(|&(name, set)| set.then_some(name))
            .collect();
        if a.dtype.fp8().is_none() {
            let biases_set = if s.biases.iter().flatten().any(Option::is_some) { vec!["opts->biases"] } else { vec![] };
            scaled::unscaled(a, "a_shard", &scales_set, &biases_set)?;
            return Ok(None);
        }
        let missing: Vec<&str> =
            ["opts->a_scale", "opts->b_scales"].into_iter().filter(|n| !scales_set.contains(n)).collect();
        scaled::required(a, "a_shard", &missing)?;
        let b_scales: Vec<&Array> = s.b_scales.iter().flatten().collect();
        Ok(Some(Mode::of(s.a_scale.as_ref().expect("required"), &b_scales)))
    }

    /// Checks the call and lays out its workspace; `fits`: whether its
    /// operands suit the fused kernel.
    fn prepare(self, facts: &Facts, backend: &str, fits: bool) -> Result<AgMmPrepared> {
        let world = facts.world;
        let a = &self.a_shard;
        check::matmul_input(a.dtype, "a_shard.dtype")?;
        check::ndim_at_least(a, "a_shard", 2)?;
        let dim = check::dim(self.gather_dim, "gather_dim", a.ndim(), "a_shard")?;
        let mode = self.scale_mode()?;
        let last = a.ndim() - 1;
        let mut gathered = a.shape.clone();
        gathered[dim] = check::mul(a.shape[dim], world, "the gathered a_shard")?;
        let k_total = gathered[last];
        for (i, b) in self.bs.iter().enumerate() {
            let name = format!("bs[{i}]");
            match mode {
                Some(_) => scaled::b_operand(b, &name, a, "a_shard")?,
                None => {
                    check::same_dtype(b, &name, a.dtype, "a_shard")?;
                    check::ndim_is(b, &name, 2)?;
                    check::matmul_operand(b, &name)?;
                }
            }
            if b.shape[0] != k_total {
                let why = if dim == last {
                    format!("a_shard's last dimension {} times the world size {world}", a.shape[last])
                } else {
                    "a_shard's last dimension".to_string()
                };
                return Err(err!(InvalidArgument, "{name}.shape[0] is {}; expected {k_total}, {why}", b.shape[0]));
            }
            if mode.is_some() {
                scaled::sizes(k_total, b.shape[1], &name)?;
            }
        }
        if let Some(mode) = mode {
            self.check_scales(mode, dim)?;
        }
        if let Some(ag) = &self.ag_out {
            check::same_dtype(ag, "ag_out", a.dtype, "a_shard")?;
            check::shape_is(ag, "ag_out", &gathered)?;
        }
        let biases = self.scales.biases.clone().unwrap_or_else(|| vec![None; self.bs.len()]);
        let result_scales = self.scales.result_scales.clone().unwrap_or_else(|| vec![None; self.bs.len()]);
        for (i, ((o, b), (bias, result_scale))) in
            self.outs.iter().zip(&self.bs).zip(biases.iter().zip(&result_scales)).enumerate()
        {
            let name = format!("outs[{i}]");
            match mode {
                Some(_) => scaled::output(o, &name)?,
                None => check::output_dtype(o, &name, a.dtype, backend)?,
            }
            let mut want = gathered[..last].to_vec();
            want.push(b.shape[1]);
            check::shape_is(o, &name, &want)?;
            if let Some(bias) = bias {
                scaled::bias(bias, &format!("opts->biases[{i}]"), b.shape[1], o, &name)?;
            }
            if let Some(t) = result_scale {
                scaled::result_scale(t, &format!("opts->result_scales[{i}]"), o, &name)?;
            }
        }
        let outputs: Vec<(String, &Array)> = self
            .ag_out
            .iter()
            .map(|t| ("ag_out".to_string(), t))
            .chain(self.outs.iter().enumerate().map(|(i, t)| (format!("outs[{i}]"), t)))
            .collect();
        let scale_inputs = self.scales.a_scale.iter().map(|t| ("opts->a_scale".to_string(), t));
        let b_scale_inputs =
            self.scales.b_scales.iter().flatten().enumerate().map(|(i, t)| (format!("opts->b_scales[{i}]"), t));
        let bias_inputs =
            biases.iter().enumerate().filter_map(|(i, t)| Some((format!("opts->biases[{i}]"), t.as_ref()?)));
        let result_scale_inputs = result_scales
            .iter()
            .enumerate()
            .filter_map(|(i, t)| Some((format!("opts->result_scales[{i}]"), t.as_ref()?)));
        let inputs: Vec<(String, &Array)> = std::iter::once(("a_shard".to_string(), a))
            .chain(self.bs.iter().enumerate().map(|(i, t)| (format!("bs[{i}]"), t)))
            .chain(scale_inputs)
            .chain(b_scale_inputs)
            .chain(bias_inputs)
            .chain(result_scale_inputs)
            .collect();
        check::outputs_disjoint(&outputs, &inputs)?;

        // Workspace: every rank's shard back to back (this rank's own at its
        // rank's place, the others pulled there), so that for gather_dim 0
        // they form the gathered A; likewise every rank's row scales; when
        // gathering K, the gathered A laid out as one matrix; then scratch
        // for one product in the output dtype (the shard's rows x the widest
        // N); with fp8 outputs, room for one such product in f32. From
        // agreed shapes and dtypes only.
        let rows = a.numel() / a.shape[last];
        let max_n = self.bs.iter().map(|b| b.shape[1]).max().unwrap_or(0);
        let out_size = self.outs.iter().map(|o| o.dtype.size()).max().unwrap_or(0);
        let shard_bytes = check::mul(a.numel(), a.dtype.size(), "a_shard")?;
        let mut layout = Layout::default();
        let shards = layout.region(check::mul(shard_bytes, world, "the gathered a_shard")?);
        let row_scales = match mode {
            Some(Mode::Row) => Some(layout.region(check::mul(row_scale_slot(rows), world, "the gathered a_scale")?)),
            _ => None,
        };
        let gathered_k = if dim == last {
            Some(layout.region(check::mul(shard_bytes, world, "the gathered a_shard")?))
        } else {
            None
        };
        let scratch = layout.region(check::mul(check::mul(rows, max_n, "the product")?, out_size, "the product")?);
        let fp8_n = self.bs.iter().zip(&self.outs).filter(|(_, o)| o.dtype.fp8().is_some()).map(|(b, _)| b.shape[1]);
        let wide = match fp8_n.max() {
            Some(n) => Some(layout.region(check::mul(check::mul(rows, n, "the product")?, 4, "the product")?)),
            None => None,
        };
        let k = a.shape[last];
        let shape = decide::Shape {
            op: Op::AgMm,
            m: check::mul(rows, world, "the gathered a_shard")?,
            k,
            n: self.bs.iter().map(|b| b.shape[1]).sum(),
            dtype: a.dtype,
            out_bytes: out_size,
            // Row scales travel on the lines too where their slots are
            // unpadded (the gather writes them back to back).
            lines: dim != last && (mode != Some(Mode::Row) || row_scale_slot(rows) == 4 * rows),
            // Pieces of a shard along its first dimension (the gathered
            // one, or the batch of `[batch, seq, hidden]` gathered along
            // the sequence) are contiguous in it. fp8 calls keep whole
            // shards: their scales (row-wise, or a pass through f32 for fp8
            // outputs) are planned per shard.
            split_len: if dim != last && mode.is_none() { a.shape[0] } else { 1 },
        };
        let decision = decide::decide(facts, &shape, fits, self.algorithm)?;
        // The fused kernel's arrival flags, one u32 per slice of each rank's shard.
        let slice_k = cost::gather_slice_k(shard_bytes, k, facts.caps.gather_slice_align);
        let ready = layout.region(4 * world * k.div_ceil(slice_k));
        // On the lines, a strided shard is packed here first: the gather
        // reads an input apart from its output.
        let lines_input = decision.lines.then(|| layout.region(shard_bytes));
        let lines_scales_input = (decision.lines && row_scales.is_some()).then(|| layout.region(4 * rows));
        // fp8: a tensor-wise A scale, each B's scales and bias, aligned
        // where the caller's are not (an fp8 output's bias is added apart,
        // in `quantized`).
        let tensor_scale = (mode == Some(Mode::Tensor)).then(|| layout.region(4));
        let b_vectors = match mode {
            Some(mode) => (self.bs.iter().zip(&self.outs).zip(&biases))
                .map(|((b, o), bias)| {
                    let bias = bias.as_ref().filter(|_| o.dtype.fp8().is_none());
                    BVectors::plan(|bytes| layout.region(bytes), b.shape[1], mode == Mode::Row, bias)
                })
                .collect(),
            None => Vec::new(),
        };
        Ok(AgMmPrepared {
            call: self,
            symmetric_a: None,
            dim,
            mode,
            shards,
            shard_bytes,
            row_scales,
            gathered_k,
            scratch,
            wide,
            ready,
            slice_k,
            lines_bytes: if decision.lines { AllReduceLayout::bytes_for(shard_bytes, world) } else { 0 },
            lines_input,
            lines_scales_input,
            tensor_scale,
            b_vectors,
            // See `pushes`.
            push: decision.algorithm == Algorithm::Pipelined
                && dim != last
                && mode.is_none()
                && shard_bytes > STAGE_FIRST_BYTES,
            decision,
            shape,
            workspace: layout.bytes(),
        })
    }

    /// The scales of an fp8 call in `mode`, gathering along `dim`.
    fn check_scales(&self, mode: Mode, dim: usize) -> Result<()> {
        let a = &self.a_shard;
        let a_scale = self.scales.a_scale.as_ref().expect("checked by scale_mode");
        scaled::a_scale(a_scale, "opts->a_scale", &a.shape, mode)?;
        if mode == Mode::Row && dim == a.ndim() - 1 {
            return Err(err!(
                Unsupported,
                "row-wise scales with gather_dim {dim}, the last dimension, are not supported: each rank's \
                 K block would need its own row scales; use tensor-wise scales or gather another dimension"
            ));
        }
        for (i, (t, b)) in self.scales.b_scales.iter().flatten().zip(&self.bs).enumerate() {
            scaled::b_scale(t, &format!("opts->b_scales[{i}]"), b.shape[1], mode)?;
        }
        Ok(())
    }
}

#[derive(Debug)]
pub(super) struct AgMmPrepared {
    call: AgMm,
    /// Where every rank's `a_shard` lies, if in symmetric memory (agreed).
    symmetric_a: Option<SymmetricPlace>,
    dim: usize,
    /// The scale mode of an fp8 call.
    mode: Option<Mode>,
    /// Workspace offsets: rank r's shard at `shards + r * shard_bytes`.
    shards: usize,
    shard_bytes: usize,
    /// Row-wise: rank r's row scales (f32) at `row_scales + r * slot`
    /// (see [`row_scale_slot`]).
    row_scales: Option<usize>,
    /// The gathered A as one `[rows, K * world]` matrix, when gathering K.
    gathered_k: Option<usize>,
    scratch: usize,
    /// With fp8 outputs: one f32 product of a shard's rows (the widest fp8
    /// output's N), before it is rounded into the output.
    wide: Option<usize>,
    /// The fused kernel's arrival flags: rank r's slice s at
    /// `ready + 4 * (r * slices + s)`.
    ready: usize,
    /// Columns of a shard per pulled slice (see [`cost::gather_slice_k`]).
    slice_k: usize,
    /// Bytes of the all-reduce buffer the LL lines need (`decision.lines`).
    lines_bytes: usize,
    /// On the lines: where a strided shard is packed for the gather.
    lines_input: Option<usize>,
    /// On the lines, row-wise: where strided row scales are packed.
    lines_scales_input: Option<usize>,
    /// fp8, tensor-wise: where `a_scale` is copied when it is not 16-byte
    /// aligned.
    tensor_scale: Option<usize>,
    /// fp8, per B: where its scales and its bias are copied when they are
    /// not 16-byte aligned.
    b_vectors: Vec<BVectors>,
    /// Pipelined: whether the ranks push their shards instead of staging
    /// them to be pulled, unless the shards lie in symmetric memory
    /// (see [`Self::pushes`]).
    push: bool,
    decision: Decision,
    shape: decide::Shape,
    workspace: usize,
}

/// Which rows of the gathered A a matmul covers (for their row scales).
#[derive(Clone, Copy)]
enum Rows {
    Shard(usize),
    All,
}

impl Prepared for AgMmPrepared {
    fn workspace_bytes(&self) -> usize {
        self.workspace
    }

    fn all_reduce_bytes(&self) -> usize {
        self.lines_bytes
    }

    fn decided(&self) -> Option<String> {
        let pushed = if self.pushes() { ", the shards pushed" } else { "" };
        Some(format!("{}{pushed}", self.decision.describe(&self.shape)))
    }

    fn replay_key(&self) -> String {
        format!("{self:?}")
    }

    /// Where [`Self::pushes`] (pipelined shards over 4 MiB in ordinary
    /// memory, not fp8), the ranks push their shards
    /// ([`Self::pipelined_pushed`]). Otherwise a
    /// side stream stages this rank's shard in its workspace, waits for
    /// every rank to be there, then pulls the peers' shards into this rank's
    /// workspace, rank-1 first. Pipelined: the main stream multiplies this
    /// rank's shard at once (from the caller's memory when it is a matrix)
    /// and each pulled shard as it lands, or each piece of it
    /// (`Self::pieces`). Sequential: one matmul over the gathered A once
    /// everything has landed (cuBLAS runs one large matmul faster than
    /// pieces, which pays when the pulls are short). Row scales travel with
    /// their shards. On the LL lines, see [`Self::gather_on_lines`].
    fn execute(&self, ex: &Exec<'_>) -> Result<()> {
        if self.decision.algorithm == Algorithm::Fused {
            return self.fused(ex);
        }
        if self.decision.lines {
            self.gather_on_lines(ex)?;
            return self.multiply_gathered(ex);
        }
        if self.pushes() {
            return self.pipelined_pushed(ex);
        }
        let a = &self.call.a_shard;
        let (dim, len, me, world) = (self.dim, a.shape[self.dim], ex.rank(), ex.world());
        let offset = |r: usize| self.shards + r * self.shard_bytes;
        let local_shard = |r: usize| self.staged_shard(ex, r);
        let gathers_k = dim == a.ndim() - 1;
        let whole =
            self.decision.algorithm == Algorithm::Sequential && !gathers_k && self.gathered_matrix(ex).is_some();
        let pipelined = !gathers_k && !whole;
        // Staging this rank's shard (for the peers to pull) is the side
        // stream's work, ahead of the barrier; this rank's own matmul reads
        // the shard where the caller has it, at once. (fp8 reads the staged
        // copy and its row scales, which want aligned, K-major rows.)
        let own_in_place = pipelined && self.mode.is_none() && a.as_matrix().is_some();
        // A shard in symmetric memory (not fp8) is pulled by the peers from
        // where the caller has it (agreed: its place is in the signature),
        // and staged only where this rank itself reads it from the
        // workspace (one matmul over the gathered A).
        let caller_place = self.symmetric_a.as_ref().filter(|_| self.mode.is_none());
        let peers_read_caller = caller_place.is_some();
        let stage_own = !peers_read_caller || !own_in_place;
        // A small shard is staged on the main stream, first: the driver
        // copies within a GPU on its multiprocessors, so on the side stream
        // the copy (and the barrier and pulls behind it) would wait for a
        // matmul holding every one of them, as a one-wave matmul at small M
        // does for all its time (27 us of 45 at ag_mm 512x4096x7168 on an
        // H200, bench/results/). So is one that no peer reads.
        let stage_first = self.shard_bytes <= STAGE_FIRST_BYTES || peers_read_caller;
        if stage_first && stage_own {
            self.stage(ex, ex.stream)?;
        }
        let side = ex.side()?;
        ex.fork(side)?;
        if !stage_first {
            self.stage(ex, side)?;
            if pipelined && !own_in_place {
                ex.join(side)?;
            }
        }
        ex.barrier_on(side)?;
        if pipelined {
            let staged = local_shard(me);
            self.multiply_shard(ex, if own_in_place { a } else { &staged }, me, len)?;
        }
        // Pipelined, each peer's shard comes in the decision's pieces along
        // its first dimension, each multiplied once it has landed.
        let pieces = if pipelined { self.pieces() } else { 1 };
        for step in 1..world {
            let r = (me + world - step) % world;
            // Row scales (fp8: one piece) first, so that they have landed
            // with the shard.
            if self.row_scales.is_some() {
                let remote = self.row_scale_vector(ex.at(r, 0)?, r);
                ex.copy_on(side, &self.row_scale_vector(ex.local(0), r), &remote)?;
            }
            let at = match caller_place {
                Some(place) => place.on(r)?,
                None => ex.at(r, offset(r))?,
            };
            let remote = Array::contiguous(at, a.dtype, &a.shape);
            for (from, rows) in piece_ranges(a.shape[0], pieces) {
                let piece = |t: &Array| if pieces == 1 { t.clone() } else { t.narrow(0, from, rows) };
                ex.copy_on(side, &piece(&local_shard(r)), &piece(&remote))?;
                if pipelined {
                    ex.join(side)?;
                    self.multiply_rows(ex, &piece(&local_shard(r)), r, len, from, rows)?;
                }
            }
        }
        // The pulls have landed once the main stream joins the side here;
        // the closing barrier (every rank has pulled this rank's shard, so
        // the next call may overwrite it) then overlaps the matmuls below.
        ex.join(side)?;
        ex.barrier_on(side)?;
        self.finish(ex, whole, (!stage_own).then_some(a))?;
        ex.join(side)
    }
}

/// Signal channels announcing the pushed pieces of a shard, one per piece.
const PUSHED: usize = super::CHANNEL + 1;
const _: () = assert!(PUSHED + cost::MAX_GATHER_PIECES <= crate::backend::SIGNAL_CHANNELS);

/// Shards of at most this many bytes are staged on the main stream before
/// the matmuls (a copy of a few microseconds) and pulled, never pushed
/// (see [`AgMmPrepared::pushes`]).
const STAGE_FIRST_BYTES: usize = 4 << 20;

impl AgMmPrepared {
    /// Whether the ranks push their shards into each other's workspaces
    /// ([`Self::pipelined_pushed`]) instead of staging them to be pulled.
    /// From agreed inputs only, as the two exchange different signals:
    /// pipelined, gathering a dimension before the last, not fp8 (whose
    /// own matmul reads the staged shard and row scales), a shard not in
    /// symmetric memory (there the peers pull it in place), and larger than
    /// [`STAGE_FIRST_BYTES`]: a smaller one stages in a few us, and its
    /// pull lands within this rank's own matmul with no kernel between the
    /// two matmuls, where a pushed one's signals (kernels) wait for a
    /// matmul holding every multiprocessor to end.
    fn pushes(&self) -> bool {
        self.push && self.symmetric_a.is_none()
    }

    /// Pipelined with pushes: a side stream waits for every rank (barrier:
    /// a peer's workspace is free once its main stream has reached this
    /// call), then copies this rank's shard from the caller's memory
    /// straight into its slot in each peer's workspace (`rank+1` first, so
    /// that each step uses different links), a piece at a time, back to
    /// back. A third stream signals each piece once it has landed and waits
    /// for the same piece from `rank-1`, which the main stream then
    /// multiplies (kept off the copies' stream: a signal kernel may wait for
    /// a matmul to free a multiprocessor, and the next copy would wait with
    /// it). Against staging for pulls, this saves a copy on the SMs ahead
    /// of the matmuls (31 us for a 64 MiB shard on an H200, bench/results/)
    /// and the closing barrier: no peer reads this rank's memory, and every
    /// piece sent here has landed once it is multiplied. A shard the copy
    /// engines cannot read as it lies (no row-major matrix, or with
    /// `ag_out` not contiguous) is staged first and pushed from there.
    fn pipelined_pushed(&self, ex: &Exec<'_>) -> Result<()> {
        let a = &self.call.a_shard;
        let (len, me, world) = (a.shape[self.dim], ex.rank(), ex.world());
        let in_place = a.is_contiguous() || (a.as_row_major_matrix().is_some() && self.call.ag_out.is_none());
        let own = match in_place {
            true => a.clone(),
            false => {
                self.stage(ex, ex.stream)?;
                self.staged_shard(ex, me)
            }
        };
        let (side, signals) = (ex.side()?, ex.signal_side()?);
        ex.fork(side)?;
        ex.barrier_on(side)?;
        self.multiply_shard(ex, &own, me, len)?;
        let pieces = self.pieces();
        for step in 1..world {
            let (to, from) = ((me + step) % world, (me + world - step) % world);
            let theirs = Array::contiguous(ex.at(to, self.shards + me * self.shard_bytes)?, a.dtype, &a.shape);
            let landed = self.staged_shard(ex, from);
            for (j, (start, rows)) in piece_ranges(a.shape[0], pieces).enumerate() {
                let piece = |t: &Array| if pieces == 1 { t.clone() } else { t.narrow(0, start, rows) };
                ex.copy_on(side, &piece(&theirs), &piece(&own))?;
                ex.stream_after(signals, side)?;
                ex.put_signal(to, PUSHED + j, signals)?;
                ex.wait_signal(from, PUSHED + j, signals)?;
                ex.join(signals)?;
                self.multiply_rows(ex, &piece(&landed), from, len, start, rows)?;
            }
        }
        self.finish(ex, false, in_place.then_some(a))?;
        ex.join(side)
    }

    /// The pieces the pipelined path pulls each peer's shard in, along its
    /// first dimension (contiguous runs of the staged shard): the
    /// decision's, at most `Shape::split_len` (the shard's length there
    /// where the call gathers a dimension before the last and is not fp8,
    /// else 1) and [`cost::MAX_GATHER_PIECES`] (a signal channel each when
    /// pushed).
    fn pieces(&self) -> usize {
        self.decision.pieces.clamp(1, self.shape.split_len.clamp(1, cost::MAX_GATHER_PIECES))
    }

    /// Sequential at small shards (`Decision::lines`): every rank's shard
    /// into its place in this rank's workspace by one launch of the
    /// device-side all-gather over the group's all-reduce buffer, whose LL
    /// lines carry their own flags (no barrier, no copy engine: a few us
    /// where the copies cost ~25), and row scales by a second. A strided
    /// shard (or scale vector) is first packed apart.
    fn gather_on_lines(&self, ex: &Exec<'_>) -> Result<()> {
        let a = &self.call.a_shard;
        let input = match (a.is_contiguous(), self.lines_input) {
            (true, _) => a.addr,
            (false, Some(at)) => {
                ex.copy(&Array::contiguous(ex.local(at), a.dtype, &a.shape), a)?;
                ex.local(at)
            }
            (false, None) => return Err(err!(Internal, "a strided shard on the lines has no packing region")),
        };
        ex.all_gather_lines(input, ex.local(self.shards), self.shard_bytes)?;
        // Row scales: a second gather into their slots, back to back
        // (`Shape::lines` holds them unpadded).
        let (Some(slots), Some(a_scale)) = (self.row_scales, &self.call.scales.a_scale) else { return Ok(()) };
        let input = match (a_scale.is_contiguous(), self.lines_scales_input) {
            (true, _) => a_scale.addr,
            (false, Some(at)) => {
                ex.copy(&Array::contiguous(ex.local(at), DType::F32, &a_scale.shape), a_scale)?;
                ex.local(at)
            }
            (false, None) => return Err(err!(Internal, "strided row scales on the lines have no packing region")),
        };
        ex.all_gather_lines(input, ex.local(slots), 4 * self.shard_rows())
    }

    /// Once every rank's shard (and row scales) lies in this rank's
    /// workspace: `ag_out`, and the products not made shard by shard (one
    /// matmul over the gathered A when `whole`; over the whole K when
    /// gathering K).
    /// `own`: where this rank's shard is read for `ag_out` where it is not
    /// staged.
    fn finish(&self, ex: &Exec<'_>, whole: bool, own: Option<&Array>) -> Result<()> {
        let AgMm { a_shard: a, bs, ag_out, outs, .. } = &self.call;
        let (dim, len, world) = (self.dim, a.shape[self.dim], ex.world());
        if let Some(ag) = ag_out {
            for r in 0..world {
                let shard = match own {
                    Some(own) if r == ex.rank() => own.clone(),
                    _ => self.staged_shard(ex, r),
                };
                ex.copy(&ag.narrow(dim, r * len, len), &shard)?;
            }
        }
        if whole {
            let lhs = self.gathered_matrix(ex).expect("checked by the caller");
            for (i, (b, out)) in bs.iter().zip(outs).enumerate() {
                let m = self.direct_output(out).expect("checked by gathered_matrix");
                ex.matmul(&m, &lhs, b, self.scales(ex, i, Rows::All)?.as_ref())?;
            }
        }
        if let Some(offset) = self.gathered_k {
            // Lay the shards side by side (pitched copies), then one matmul
            // over the whole K per B.
            let mut shape = a.shape.clone();
            shape[dim] *= world;
            let gathered = Array::contiguous(ex.local(offset), a.dtype, &shape);
            for r in 0..world {
                ex.copy(&gathered.narrow(dim, r * len, len), &self.staged_shard(ex, r))?;
            }
            for (i, out) in outs.iter().enumerate() {
                self.gemm_into(ex, i, out, &gathered, Rows::All)?;
            }
        }
        Ok(())
    }

    /// Copies this rank's shard (and row scales) into their places in its
    /// workspace, on `stream`.
    pub(super) fn stage(&self, ex: &Exec<'_>, stream: Stream) -> Result<()> {
        ex.copy_on(stream, &self.staged_shard(ex, ex.rank()), &self.call.a_shard)?;
        if let (Some(a_scale), true) = (&self.call.scales.a_scale, self.row_scales.is_some()) {
            let staged = Array::contiguous(self.row_scale_addr(ex.local(0), ex.rank()), DType::F32, &a_scale.shape);
            ex.copy_on(stream, &staged, a_scale)?;
        }
        Ok(())
    }

    /// Bytes of the largest piece a rank contributes to the gather (its
    /// shard, or its row scales).
    pub(super) fn piece_bytes(&self) -> usize {
        self.shard_bytes.max(4 * self.shard_rows())
    }

    /// Rank r's shard where it lies in this rank's workspace once gathered.
    pub(super) fn staged_shard(&self, ex: &Exec<'_>, r: usize) -> Array {
        let a = &self.call.a_shard;
        Array::contiguous(ex.local(self.shards + r * self.shard_bytes), a.dtype, &a.shape)
    }

    /// Rank r's row scales (row-wise fp8 calls) where they lie in this
    /// rank's workspace once gathered.
    pub(super) fn staged_row_scales(&self, ex: &Exec<'_>, r: usize) -> Option<Array> {
        self.row_scales.map(|_| self.row_scale_vector(ex.local(0), r))
    }

    /// Every output (and `ag_out`) from every rank's shard and row scales
    /// already in this rank's workspace (where a group spanning hosts
    /// gathers them): one matmul over the gathered A where it is one
    /// matrix, else shard by shard, or over the whole K.
    pub(super) fn multiply_gathered(&self, ex: &Exec<'_>) -> Result<()> {
        let a = &self.call.a_shard;
        let gathers_k = self.dim == a.ndim() - 1;
        let whole = !gathers_k && self.gathered_matrix(ex).is_some();
        if !gathers_k && !whole {
            for r in 0..ex.world() {
                self.multiply_shard(ex, &self.staged_shard(ex, r), r, a.shape[self.dim])?;
            }
        }
        self.finish(ex, whole, None)
    }

    /// Across hosts (`super::across_matmul`): whether this rank's own
    /// shard is multiplied while the others are gathered
    /// (`decide::across_hosts_overlap`).
    pub(super) fn overlaps_gather(&self, world: usize) -> bool {
        let a = &self.call.a_shard;
        let gathers_k = self.dim == a.ndim() - 1;
        let rows = a.numel() / a.shape[a.ndim() - 1].max(1);
        !gathers_k && world > 1 && decide::across_hosts_overlap(rows, a.dtype)
    }

    /// The products of the shards of `ranks`, from where they are staged
    /// (their row scales too), as soon as those have landed.
    pub(super) fn multiply_staged(&self, ex: &Exec<'_>, ranks: &[usize]) -> Result<()> {
        let len = self.call.a_shard.shape[self.dim];
        ranks.iter().try_for_each(|&r| self.multiply_shard(ex, &self.staged_shard(ex, r), r, len))
    }

    /// Once every shard has landed and been multiplied: `ag_out`.
    pub(super) fn finish_staged(&self, ex: &Exec<'_>) -> Result<()> {
        self.finish(ex, false, None)
    }

    /// Fused (gathering dim 0 into matrices, see `fused_field`): the main
    /// stream zeroes the arrival flags, stages this rank's shard for the
    /// peers, and launches one matmul per B, which starts with this rank's
    /// own rows read in place. A side stream forked before the matmuls (so
    /// it never waits for them) waits for every rank (barrier), pulls the
    /// peers' shards rank+1 first, each in slices of k flagged one by one
    /// (a tile waits only for the slice it reads next), and waits for
    /// every rank again (then nobody still reads a shard the next call
    /// overwrites). One multiprocessor is left to the side stream's barrier
    /// kernels.
    fn fused(&self, ex: &Exec<'_>) -> Result<()> {
        let AgMm { a_shard: a, bs, ag_out, outs, .. } = &self.call;
        let (me, world) = (ex.rank(), ex.world());
        let backend = ex.group.backend();
        let lhs = a.as_matrix().expect("checked by fused_field");
        let (rows, k) = (lhs.shape[0], lhs.shape[1]);
        let slices = k / self.slice_k; // it divides k (cost::gather_slice_k)
        backend.zero(ex.local(self.ready), 4 * world * slices, ex.stream)?;
        // Staged for the peers on the main stream, before the matmul: a copy
        // within one device runs on the SMs (measured: on the side stream,
        // beside a persistent kernel that leaves it one SM, it made the
        // whole operation 9-12x slower).
        for (dst, src) in self.sliced(ex.local(self.shards), me, world, a) {
            ex.copy(&dst, &src)?;
        }
        if let (Some(a_scale), true) = (&self.call.scales.a_scale, self.row_scales.is_some()) {
            // This rank's row scales too: the kernel reads every chunk's
            // from the gathered slots.
            ex.copy(&Array::contiguous(self.row_scale_addr(ex.local(0), me), DType::F32, &a_scale.shape), a_scale)?;
        }
        let side = ex.side()?;
        ex.fork(side)?;
        // The matmuls are enqueued first, so they start while the host is
        // still issuing the side stream's work.
        let gathered = Array::contiguous(ex.local(self.shards), a.dtype, &[rows * world, k]);
        for (i, (b, out)) in bs.iter().zip(outs).enumerate() {
            let gather = FusedGather {
                ready: ex.local(self.ready),
                slice_k: self.slice_k,
                local_chunk: me,
                local: lhs.clone(),
                scale_slot: row_scale_slot(rows) / 4,
            };
            let scales = self.scales(ex, i, Rows::All)?;
            let c = out.as_row_major_matrix().expect("checked");
            let call = FusedMatmul {
                gather: Some(gather),
                order: (0..world).map(|i| (me + i) % world).collect(),
                spare_sms: 1,
                timeout: ex.group.timeout(),
                ..fused::prototype(gathered.clone(), b.clone(), c, scales, rows, world)
            };
            backend.fused_matmul(&call, ex.stream)?;
        }
        ex.barrier_on(side)?;
        for step in 1..world {
            let r = (me + step) % world;
            if self.row_scales.is_some() {
                let remote = self.row_scale_vector(ex.at(r, 0)?, r);
                ex.copy_on(side, &self.row_scale_vector(ex.local(0), r), &remote)?;
            }
            // Slice by slice, each one contiguous copy, flagged as it lands.
            for s in 0..slices {
                let block = |base: u64| self.slice_block(base, s, r, rows, world, a.dtype);
                ex.copy_on(side, &block(ex.local(self.shards)), &block(ex.at(r, self.shards)?))?;
                ex.ws()?.write_value(me, self.ready + 4 * (r * slices + s), 1, side)?;
            }
        }
        ex.barrier_on(side)?;
        ex.join(side)?;
        if let Some(ag) = ag_out {
            let len = a.shape[0];
            for r in 0..world {
                for (src, dst) in self.sliced(ex.local(self.shards), r, world, &ag.narrow(0, r * len, len)) {
                    ex.copy(&dst, &src)?;
                }
            }
        }
        Ok(())
    }

    /// The fused path's gathered A at `base` is slice-major,
    /// `[slices][rows * world][slice_k]` (row-major with one slice), so that
    /// a rank's slice is one contiguous block: that of rank `r`, slice `s`.
    fn slice_block(&self, base: u64, s: usize, r: usize, rows: usize, world: usize, dtype: DType) -> Array {
        let w = self.slice_k;
        let at = base + ((s * rows * world + r * rows) * w * dtype.size()) as u64;
        Array::contiguous(at, dtype, &[rows, w])
    }

    /// Pairs (rank `r`'s rows in the gathered A at `base`, the same
    /// elements of `t`, shaped like a shard) to copy between them, either
    /// way: one pair when `t` is contiguous, else one per slice.
    fn sliced(&self, base: u64, r: usize, world: usize, t: &Array) -> Vec<(Array, Array)> {
        let (w, k) = (self.slice_k, t.shape[t.ndim() - 1]);
        let (slices, rows) = (k / w, t.numel() / k);
        let block = |s| self.slice_block(base, s, r, rows, world, t.dtype);
        if t.is_contiguous() {
            // [rows, slices, w]: in the gathered A, slice planes apart.
            let g = block(0);
            let gathered = Array { shape: vec![rows, slices, w], strides: vec![w, rows * world * w, 1], ..g };
            return vec![(gathered, Array::contiguous(t.addr, t.dtype, &[rows, slices, w]))];
        }
        (0..slices)
            .map(|s| {
                let part = t.narrow(t.ndim() - 1, s * w, w);
                (Array::contiguous(block(s).addr, t.dtype, &part.shape), part)
            })
            .collect()
    }

    /// Rows of A per shard.
    fn shard_rows(&self) -> usize {
        let a = &self.call.a_shard;
        a.numel() / a.shape[a.ndim() - 1]
    }

    /// Where rank r's row scales lie in the workspace that starts at `base`.
    fn row_scale_addr(&self, base: u64, r: usize) -> u64 {
        let offset = self.row_scales.expect("row-wise call") + r * row_scale_slot(self.shard_rows());
        base + offset as u64
    }

    fn row_scale_vector(&self, base: u64, r: usize) -> Array {
        Array::contiguous(self.row_scale_addr(base, r), DType::F32, &[self.shard_rows()])
    }

    /// The scales of a matmul by `bs[i]` over `rows` of the gathered A, for
    /// an fp8 call.
    fn scales(&self, ex: &Exec<'_>, i: usize, rows: Rows) -> Result<Option<GemmScales>> {
        let Some(mode) = self.mode else { return Ok(None) };
        let s = &self.call.scales;
        let b_scale = &s.b_scales.as_ref().expect("an fp8 call has B scales")[i];
        let a = match (mode, rows) {
            (Mode::Tensor, _) => {
                let a_scale = s.a_scale.as_ref().expect("an fp8 call has an A scale");
                ex.vector(a_scale, self.tensor_scale.expect("planned for tensor-wise calls"))?
            }
            (Mode::Row, Rows::Shard(r)) => self.row_scale_vector(ex.local(0), r),
            (Mode::Row, Rows::All) => {
                Array::contiguous(self.row_scale_addr(ex.local(0), 0), DType::F32, &[self.shard_rows() * ex.world()])
            }
        };
        // An fp8 output's bias is added when it is rounded (`quantized`).
        let fp8_out = self.call.outs[i].dtype.fp8().is_some();
        let bias = s.biases.as_ref().and_then(|v| v[i].as_ref()).filter(|_| !fp8_out);
        let (b, bias) = ex.b_vectors(b_scale, bias, self.b_vectors[i])?;
        Ok(Some(GemmScales { row_wise: mode == Mode::Row, a, b, bias }))
    }

    /// The gathered A as one matrix in this rank's workspace, when it is one
    /// (gathering dim 0) and every output is a matrix too.
    /// Row scales must then form one vector too: no padding between the
    /// ranks' slots.
    fn gathered_matrix(&self, ex: &Exec<'_>) -> Option<Array> {
        let a = &self.call.a_shard;
        let padded_scales = self.row_scales.is_some() && row_scale_slot(self.shard_rows()) != self.shard_rows() * 4;
        let fp8_out = self.wide.is_some();
        if self.dim != 0 || padded_scales || fp8_out || self.call.outs.iter().any(|o| self.direct_output(o).is_none()) {
            return None;
        }
        let mut shape = a.shape.clone();
        shape[0] *= ex.world();
        Array::contiguous(ex.local(self.shards), a.dtype, &shape).as_matrix()
    }

    /// Shard r (staged, or this rank's input, a matrix either way) times
    /// every B, into slice r of each output.
    fn multiply_shard(&self, ex: &Exec<'_>, shard: &Array, r: usize, len: usize) -> Result<()> {
        self.multiply_rows(ex, shard, r, len, 0, shard.shape[0])
    }

    /// `rows` indices of shard r's first dimension from `from` (`lhs`,
    /// those of the shard, a matrix) times every B, into their place in
    /// each output: along the gathered dimension where that is the first,
    /// else those indices (of the batch) of the output's slice r.
    fn multiply_rows(&self, ex: &Exec<'_>, lhs: &Array, r: usize, len: usize, from: usize, rows: usize) -> Result<()> {
        for (i, out) in self.call.outs.iter().enumerate() {
            let dst = match self.dim {
                0 => out.narrow(0, r * len + from, rows),
                d => out.narrow(d, r * len, len).narrow(0, from, rows),
            };
            self.gemm_into(ex, i, &dst, lhs, Rows::Shard(r))?;
        }
        Ok(())
    }

    /// `dst = lhs @ bs[i]` over `rows` of the gathered A (`lhs`: those rows
    /// with `dst`'s leading shape, a matrix): straight into `dst` when it
    /// is a matrix (that an fp8 matmul can write: unit column stride,
    /// 16-byte aligned rows) or, unscaled, a batch of equally strided ones
    /// (a slice along a middle dimension: one strided-batched matmul); else
    /// into contiguous scratch of `dst`'s dtype and then copied (no
    /// conversion, so every backend's plain strided copy serves). An fp8
    /// `dst` goes through f32 (see [`Self::quantized`]).
    fn gemm_into(&self, ex: &Exec<'_>, i: usize, dst: &Array, lhs: &Array, rows: Rows) -> Result<()> {
        let (b, scales) = (&self.call.bs[i], self.scales(ex, i, rows)?);
        let matrix = lhs.as_matrix().expect("the shards and the gathered A are matrices");
        if dst.dtype.fp8().is_some() {
            return self.quantized(ex, i, dst, &matrix, scales.as_ref());
        }
        let scales = scales.as_ref();
        if let Some(m) = self.direct_output(dst) {
            return ex.matmul(&m, &matrix, b, scales);
        }
        if let Some([d, l, r]) = scales.is_none().then(|| batched_operands(dst, lhs, b)).flatten() {
            return ex.gemm(&d, &l, &r, false);
        }
        let product = Array::contiguous(ex.local(self.scratch), dst.dtype, &dst.shape);
        ex.matmul(&product.as_matrix().expect("contiguous"), &matrix, b, scales)?;
        ex.copy(dst, &product)
    }

    /// `dst` as the matrix a matmul writes in place: row-major, and for
    /// fp8 operands one that cuBLASLt's fp8 kernels can write (16-byte
    /// aligned rows); `None` sends the product through scratch.
    fn direct_output(&self, dst: &Array) -> Option<Array> {
        dst.as_row_major_matrix().filter(|m| self.mode.is_none() || writable_by_fp8(m))
    }

    /// An fp8 output: `lhs @ bs[i]` scaled, in f32 in the workspace, then
    /// with its bias and result scale rounded once into `dst` (a matrix),
    /// or into scratch and copied (any other strides).
    fn quantized(&self, ex: &Exec<'_>, i: usize, dst: &Array, lhs: &Array, scales: Option<&GemmScales>) -> Result<()> {
        let b = &self.call.bs[i];
        let wide = self.wide.expect("workspace for fp8 outputs");
        let product = Array::contiguous(ex.local(wide), DType::F32, &[lhs.shape[0], b.shape[1]]);
        ex.matmul(&product, lhs, b, scales)?;
        let s = &self.call.scales;
        let entry = |v: &Option<Vec<Option<Array>>>| v.as_ref().and_then(|v| v[i].clone());
        let (bias, scale) = (entry(&s.biases), entry(&s.result_scales));
        let quantize = |dst: &Array| {
            let q = Quantize { dst, src: &product, bias: bias.as_ref(), bias_weight: 1.0, scale: scale.as_ref() };
            ex.quantize(&q)
        };
        match dst.as_matrix() {
            Some(m) => quantize(&m),
            None => {
                let staged = Array::contiguous(ex.local(self.scratch), dst.dtype, &dst.shape);
                quantize(&staged.as_matrix().expect("contiguous"))?;
                ex.copy(dst, &staged)
            }
        }
    }
}

/// `pieces` near-equal runs (from, length) covering `0..len`, none empty.
fn piece_ranges(len: usize, pieces: usize) -> impl Iterator<Item = (usize, usize)> {
    let pieces = pieces.clamp(1, len.max(1));
    (0..pieces).map(move |j| (j * len / pieces, (j + 1) * len / pieces - j * len / pieces))
}

/// Why a call with fp8 outputs does not run the fused kernel.
pub(super) const FP8_OUT_UNFUSED: &str = "fp8 outputs are computed in f32 and then rounded, outside the fused kernel";

/// Bytes between the ranks' row scales in the workspace: 16-byte aligned,
/// as vector loads of scale arrays (cuBLASLt's outer-vector scales) want.
fn row_scale_slot(rows: usize) -> usize {
    (rows * 4).next_multiple_of(16)
}

/// Whether cuBLASLt's fp8 kernels can write matrix `m` in place.
fn writable_by_fp8(m: &Array) -> bool {
    m.strides[1] == 1 && (m.strides[0] * m.dtype.size()) % 16 == 0 && m.addr % 16 == 0
}

#[cfg(test)]
mod gpu;

#[cfg(test)]
mod tests;
