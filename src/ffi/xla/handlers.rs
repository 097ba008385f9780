//! The exported XLA FFI handlers: one per operation and platform.
//!
//! Each reads the call into the same `crate::ops` call the C API builds,
//! with the rank taken from the device the call runs on (`registry`).
//! As in the C API, a call whose buffers or attributes are wrong still
//! enters the collective with its error, so the other devices' calls fail
//! with it instead of waiting.
//!
//! Calling convention (what `symm.jax` lowers to):
//! - fused_ag_mm: args `a_shard, b_0 .. b_{n-1}`; results `out_0 .. out_{n-1}`
//!   and, when requested, `ag_out` last; attribute `gather_dim` (int).
//! - mm_rs: args `a, b`; result `out`; attributes `scatter_dim` (int) and
//!   `op` ("sum" or "avg").
//! - lc_allgather: arg `input`; result `output`; no attributes.
//! - all_reduce: arg `input`; result `output`; attributes `op` ("sum" or
//!   "avg") and `algorithm` ("auto", "one_shot" or "two_shot").
//! - all_reduce_rmsnorm: args `input, residual, weight`; results `out,
//!   residual_out`; attributes `eps` (a string holding the f32 value) and
//!   `algorithm`.
//! - every call may carry `groups` (int64 array): the handles of the groups
//!   bound when the program was traced. A device now bound to another
//!   group refuses the call: a program traced before `symm.jax` was shut
//!   down and initialized again must not run on the new group, whose ranks
//!   may sit on other devices.

use super::api::Api;
use super::c_api::*;
use super::frame::{self, Attrs, Frame, Request, XlaBuffer};
use super::registry::{self, Platform};
use crate::backend::AllReduceAlgorithm;
use crate::backend::{BackendKind, Stream};
use crate::error::{err, Error, Result};
use crate::group::Group;
use crate::ops::{self, AgMm, AgMmScales, AllReduce, LcAllgather, MmRs, MmRsScales, Norm, ReduceOp};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;

#[derive(Clone, Copy)]
enum Op {
    AgMm,
    MmRs,
    LcAllgather,
    AllReduce,
    AllReduceRmsNorm,
}

impl Op {
    fn name(self) -> &'static str {
        match self {
            Op::AgMm => "symm_fused_ag_mm",
            Op::MmRs => "symm_mm_rs",
            Op::LcAllgather => "symm_lc_allgather",
            Op::AllReduce => "symm_all_reduce",
            Op::AllReduceRmsNorm => "symm_all_reduce_rmsnorm",
        }
    }
}

macro_rules! handler {
    ($(#[$doc:meta])* $name:ident, $platform:expr, $op:expr) => {
        $(#[$doc])*
        #[no_mangle]
        pub unsafe extern "C" fn $name(frame: *mut XLA_FFI_CallFrame) -> *mut XLA_FFI_Error {
            // SAFETY: XLA passes its call frame.
            unsafe { serve(frame, $platform, $op) }
        }
    };
}

handler!(
    /// `symm_fused_ag_mm` on XLA's CUDA platform.
    symm_xla_fused_ag_mm_cuda, Platform::Cuda, Op::AgMm
);
handler!(
    /// `symm_mm_rs` on XLA's CUDA platform.
    symm_xla_mm_rs_cuda, Platform::Cuda, Op::MmRs
);
handler!(
    /// `symm_lc_allgather` on XLA's CUDA platform.
    symm_xla_lc_allgather_cuda, Platform::Cuda, Op::LcAllgather
);
handler!(
    /// `symm_all_reduce` on XLA's CUDA platform.
    symm_xla_all_reduce_cuda, Platform::Cuda, Op::AllReduce
);
handler!(
    /// `symm_all_reduce_rmsnorm` on XLA's CUDA platform.
    symm_xla_all_reduce_rmsnorm_cuda, Platform::Cuda, Op::AllReduceRmsNorm
);
handler!(
    /// `symm_all_reduce` on XLA's CPU platform, over the host backend.
    symm_xla_all_reduce_cpu, Platform::Cpu, Op::AllReduce
);
handler!(
    /// `symm_all_reduce_rmsnorm` on XLA's CPU platform, over the host backend.
    symm_xla_all_reduce_rmsnorm_cpu, Platform::Cpu, Op::AllReduceRmsNorm
);
handler!(
    /// `symm_fused_ag_mm` on XLA's CPU platform, over the host backend.
    symm_xla_fused_ag_mm_cpu, Platform::Cpu, Op::AgMm
);
handler!(
    /// `symm_mm_rs` on XLA's CPU platform, over the host backend.
    symm_xla_mm_rs_cpu, Platform::Cpu, Op::MmRs
);
handler!(
    /// `symm_lc_allgather` on XLA's CPU platform, over the host backend.
    symm_xla_lc_allgather_cpu, Platform::Cpu, Op::LcAllgather
);

/// The boundary of every handler: answers the metadata handshake, runs the
/// call, and turns errors and panics into an XLA error carrying our message.
///
/// # Safety
/// `frame` is NULL or the call frame XLA passes.
unsafe fn serve(frame: *mut XLA_FFI_CallFrame, platform: Platform, op: Op) -> *mut XLA_FFI_Error {
    // SAFETY: per the contract.
    let Some(api) = (unsafe { frame::api_of(frame) }) else {
        // No API table, so no way to make an error: XLA never does this.
        return std::ptr::null_mut();
    };
    let result = catch_unwind(AssertUnwindSafe(|| {
        // SAFETY: per the contract, and `api` came from this frame.
        match unsafe { frame::open(frame, api) }? {
            Request::Metadata(md) => {
                frame::fill_metadata(md);
                Ok(())
            }
            Request::Call(f) => execute(&f, platform, op),
        }
    }))
    .unwrap_or_else(|payload| {
        let what = payload
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| payload.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "unknown panic".into());
        Err(err!(Internal, "panic inside symm: {what}"))
    });
    match result {
        Ok(()) => std::ptr::null_mut(),
        Err(e) => error(api, op, e),
    }
}

fn error(api: Api<'_>, op: Op, e: Error) -> *mut XLA_FFI_Error {
    api.error(&e.context(op.name()))
}

fn execute(f: &Frame<'_>, platform: Platform, op: Op) -> Result<()> {
    if f.stage() != XLA_FFI_ExecutionStage_EXECUTE {
        return Err(err!(InvalidArgument, "called at execution stage {}; symm handles only execute", f.stage()));
    }
    let ordinal = f.api.device_ordinal(f.ctx())?;
    let (handle, group) = registry::lookup(platform, ordinal)?;
    let whose = format!("{} device {ordinal}, rank {} of {}", platform.name(), group.rank(), group.world());
    let stream = match platform {
        Platform::Cpu => Ok(Stream(0)),
        Platform::Cuda => f.api.stream(f.ctx()).map(|s| Stream(s as usize)),
    };
    // From here on every failure enters the collective (see the module doc).
    let ready = stream.clone().and_then(|_| check_backend(&group, platform, ordinal)).and_then(|_| op_attrs(f, handle));
    let on = stream.unwrap_or_default();
    let result = match op {
        Op::AgMm => ops::fused_ag_mm(&group, ready.and_then(|a| read_ag_mm(f, a)), on),
        Op::MmRs => ops::mm_rs(&group, ready.and_then(|a| read_mm_rs(f, a)), on),
        Op::LcAllgather => ops::lc_allgather(&group, ready.and_then(|a| read_lc_allgather(f, a)), on),
        Op::AllReduce => ops::all_reduce(&group, ready.and_then(|a| read_all_reduce(f, a, false)), on),
        Op::AllReduceRmsNorm => ops::all_reduce(&group, ready.and_then(|a| read_all_reduce(f, a, true)), on),
    };
    result.map_err(|e| e.context(whose))
}

/// The group must run on the memory XLA hands us: host memory under the
/// CPU platform, this very GPU under CUDA.
fn check_backend(group: &Arc<Group>, platform: Platform, ordinal: i32) -> Result<()> {
    let kind = group.backend().kind();
    match platform {
        Platform::Cpu if kind != BackendKind::Host => Err(err!(
            InvalidArgument,
            "XLA's CPU platform needs a group on the host backend; this one is on {}",
            kind.name()
        )),
        Platform::Cuda if kind != BackendKind::Cuda => {
            Err(err!(InvalidArgument, "XLA's CUDA platform needs a group on the cuda backend; this one is on host"))
        }
        Platform::Cuda if group.device() != ordinal => Err(err!(
            InvalidArgument,
            "the group bound to CUDA device {ordinal} runs on device {}; bind each device to its own rank",
            group.device()
        )),
        _ => Ok(()),
    }
}

/// The call's attributes but `groups`, read once: the call's program must
/// have been traced for the group now bound to the device (`handle`),
/// where `groups` says which it was.
fn op_attrs(f: &Frame<'_>, handle: usize) -> Result<Attrs> {
    let mut attrs = f.attrs()?;
    match attrs.optional_ints("groups")? {
        Some(traced) if !traced.iter().any(|&h| h as usize == handle) => Err(err!(
            InvalidHandle,
            "this program was traced for other symm groups than the one now bound to the device (symm.jax was shut \
             down and initialized again since); trace it again (jax.clear_caches())"
        )),
        _ => Ok(attrs),
    }
}

fn arrays(bufs: &[XlaBuffer<'_>], name: &str) -> Result<Vec<crate::array::Array>> {
    bufs.iter().enumerate().map(|(i, b)| b.array(&format!("{name}[{i}]"))).collect()
}

fn counted<'a, 'b>(bufs: &'b [XlaBuffer<'a>], n: usize, what: &str) -> Result<&'b [XlaBuffer<'a>]> {
    if bufs.len() != n {
        return Err(err!(InvalidArgument, "{} {what}; expected {n}", bufs.len()));
    }
    Ok(bufs)
}

fn read_ag_mm(f: &Frame<'_>, mut attrs: Attrs) -> Result<AgMm> {
    let (args, rets) = (f.args()?, f.rets()?);
    let gather_dim = attrs.int("gather_dim")?;
    attrs.finish()?;
    if args.len() < 2 {
        return Err(err!(InvalidArgument, "{} arguments; expected a_shard and at least one B", args.len()));
    }
    let num_b = args.len() - 1;
    let ag_out = match rets.len() {
        n if n == num_b => None,
        n if n == num_b + 1 => Some(rets[num_b].array("ag_out")?),
        n => {
            return Err(err!(InvalidArgument, "{n} results for {num_b} B matrices; expected {num_b} or {}", num_b + 1))
        }
    };
    Ok(AgMm {
        a_shard: args[0].array("a_shard")?,
        bs: arrays(&args[1..], "bs")?,
        gather_dim,
        ag_out,
        outs: arrays(&rets[..num_b], "outs")?,
        scales: AgMmScales::default(),
        algorithm: None,
    })
}

fn read_mm_rs(f: &Frame<'_>, mut attrs: Attrs) -> Result<MmRs> {
    let (args, rets) = (f.args()?, f.rets()?);
    let scatter_dim = attrs.int("scatter_dim")?;
    let op = match attrs.string("op")?.as_str() {
        "sum" => ReduceOp::Sum,
        "avg" => ReduceOp::Avg,
        other => return Err(err!(InvalidArgument, "attribute op is {other:?}; expected \"sum\" or \"avg\"")),
    };
    attrs.finish()?;
    let args = counted(&args, 2, "arguments")?;
    let out = counted(&rets, 1, "results")?[0].array("out")?;
    let (a, b) = (args[0].array("a")?, args[1].array("b")?);
    Ok(MmRs { a, b, scatter_dim, op, out, scales: MmRsScales::default(), algorithm: None })
}

fn read_lc_allgather(f: &Frame<'_>, attrs: Attrs) -> Result<LcAllgather> {
    let (args, rets) = (f.args()?, f.rets()?);
    attrs.finish()?;
    let input = counted(&args, 1, "arguments")?[0].array("input")?;
    let output = counted(&rets, 1, "results")?[0].array("output")?;
    Ok(LcAllgather { input, output })
}

fn algorithm(name: &str) -> Result<Option<AllReduceAlgorithm>> {
    match name {
        "auto" => Ok(None),
        "one_shot" => Ok(Some(AllReduceAlgorithm::OneShot)),
        "two_shot" => Ok(Some(AllReduceAlgorithm::TwoShot)),
        other => Err(err!(InvalidArgument, "attribute algorithm is {other:?}; expected auto, one_shot or two_shot")),
    }
}

fn read_all_reduce(f: &Frame<'_>, mut attrs: Attrs, norm: bool) -> Result<AllReduce> {
    let (args, rets) = (f.args()?, f.rets()?);
    let algorithm = algorithm(&attrs.string("algorithm")?)?;
    if !norm {
        let op = match attrs.string("op")?.as_str() {
            "sum" => ReduceOp::Sum,
            "avg" => ReduceOp::Avg,
            other => return Err(err!(InvalidArgument, "attribute op is {other:?}; expected \"sum\" or \"avg\"")),
        };
        attrs.finish()?;
        let input = counted(&args, 1, "arguments")?[0].array("input")?;
        let output = counted(&rets, 1, "results")?[0].array("output")?;
        return Ok(AllReduce { input, output, op, norm: None, algorithm });
    }
    let eps_text = attrs.string("eps")?;
    let eps: f32 = eps_text
        .trim()
        .parse()
        .map_err(|_| err!(InvalidArgument, "attribute eps is {eps_text:?}; expected a number"))?;
    attrs.finish()?;
    let args = counted(&args, 3, "arguments")?;
    let rets = counted(&rets, 2, "results")?;
    Ok(AllReduce {
        input: args[0].array("input")?,
        output: rets[0].array("out")?,
        op: ReduceOp::Sum,
        norm: Some(Norm {
            residual: args[1].array("residual")?,
            weight: args[2].array("weight")?,
            eps,
            residual_out: rets[1].array("residual_out")?,
        }),
        algorithm,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::ErrorKind;

    #[test]
    fn kinds_keep_their_meaning_in_xla_codes() {
        use super::super::api::error_code;
        assert_eq!(error_code(ErrorKind::InvalidArgument), XLA_FFI_Error_Code_INVALID_ARGUMENT);
        assert_eq!(error_code(ErrorKind::Timeout), XLA_FFI_Error_Code_DEADLINE_EXCEEDED);
        assert_eq!(error_code(ErrorKind::Remote), XLA_FFI_Error_Code_ABORTED);
    }
}
