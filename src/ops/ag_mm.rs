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
use super::{check, shape_text, BVectors, Exec, Prepared};
use crate::array::Array;
use crate::backend::{AllReduceLayout, GemmScales, Stream};
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
                && shard_bytes > cost::STAGED_SHARD_BYTES,
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

    /// The decision's path (see `paths`): the fused kernel, the LL lines,
    /// the shards pushed by their owners ([`Self::pushes`]), or pulled.
    fn execute(&self, ex: &Exec<'_>) -> Result<()> {
        if self.decision.algorithm == Algorithm::Fused {
            return self.fused(ex);
        }
        if self.alone(ex) {
            return self.multiply_alone(ex);
        }
        if self.decision.lines {
            self.gather_on_lines(ex)?;
            return self.multiply_gathered(ex);
        }
        if self.pushes() {
            return self.pipelined_pushed(ex);
        }
        self.pulled(ex)
    }
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

mod paths;

#[cfg(test)]
mod gpu;

#[cfg(test)]
mod tests;
