//! The tensor-parallel operations and the workspace they share.
//!
//! Each entry point reads the caller's descriptors into a call for
//! `crate::ops` without returning early on a bad argument: the error goes
//! into the call, so that the operation still meets its peers and they
//! fail with `SYMM_ERROR_REMOTE` instead of waiting for this rank.
//!
//! What every operation shares is documented once, on
//! `symm_group_reserve_workspace`.

use super::args::{
    in_ref, non_negative, optional_entries, optional_tensor, optional_tensors, options, reduce_op, tensor_arg, tensors,
};
use super::boundary::call;
use super::group::group;
use super::plan::{all_reduce_from_c, from_c};
use super::types::*;
use crate::backend::Stream;
use crate::error::{err, Result};
use crate::ops::{self, AgMm, AgMmScales, AllReduce, LcAllgather, MmRs, MmRsScales, Norm};
use std::ffi::{c_char, c_int, c_void, CStr};

/// Collective: makes the group's workspace at least `bytes` large now, so
/// that operations up to that size do not grow it later (growing is
/// collective, and on CUDA not allowed during graph capture: an operation
/// that would grow it fails). Every rank passes the same `bytes`. The
/// workspace never shrinks. Growing frees the old workspace once the work
/// that may use it is done: here, everything issued to the device so far;
/// inside an operation, the work of its stream and symm's side streams;
/// but a buffer that a call captured into the caller's CUDA graph used is
/// kept until the group is destroyed, so the graph's replays stay correct
/// after later calls grew it. (The fused reduce-scatter keeps its inboxes
/// in a buffer of its own, made or grown by the first call that needs it.)
///
/// The operations below are collective over the group: every rank calls
/// them in the same order. Before moving data the ranks agree on the call:
/// an argument that is invalid on any rank fails the call on every rank
/// (that rank gets `SYMM_ERROR_INVALID_ARGUMENT` naming the argument, the
/// others `SYMM_ERROR_REMOTE` quoting it), and arguments that differ
/// between ranks fail it everywhere with `SYMM_ERROR_MISMATCH`; outputs
/// are then untouched. A call identical to one all ranks agreed on before
/// skips that check (one bootstrap round trip) unless the group has
/// `SYMM_GROUP_CHECK_ARGS_ALWAYS` or env `SYMM_CHECK_ARGS=always`; a rank
/// whose call then fails before moving data looks at what its peers did
/// with that call (ranks on one host; across hosts it fails the group):
/// where every rank failed it, each gets its own error and the group stays
/// usable; where a peer went ahead, the group fails (that peer stops
/// waiting with `SYMM_ERROR_REMOTE`). A rank that alone differs makes its peers time
/// out, or, where its call too was agreed before, fails the group with
/// `SYMM_ERROR_MISMATCH` at the first signal or data the ranks exchange
/// (each carries its call's tag; not yet NCCL's steps; on CUDA that call's
/// outputs are then undefined and the error comes with the next call), or
/// with `SYMM_ERROR_TIMEOUT` where neither call waits for anything the
/// other sends. Ranks that reach different collectives of the group (a
/// call's agreement, a rendezvous, a reservation) fail it with
/// `SYMM_ERROR_MISMATCH`.
/// After `SYMM_ERROR_TIMEOUT` (or any
/// failure once data moved), outputs may be partly written and the group
/// has failed: every later call returns `SYMM_ERROR_ABORTED` (see
/// `symm_group_health`); destroy it.
#[no_mangle]
pub extern "C" fn symm_group_reserve_workspace(group: symm_group_t, bytes: usize) -> symm_status_t {
    call("symm_group_reserve_workspace", || ops::reserve_workspace(&self::group(group)?, bytes))
}

/// Collective: `all_gather(a_shard, gather_dim) @ bs[i]` for i < `num_b`,
/// as PyTorch's `fused_all_gather_matmul`.
///
/// The gathered A is the ranks' `a_shard`s (rank >= 2, `[..., K]`, any
/// strides) concatenated along `gather_dim` (0 to ndim-1) in rank order.
/// Each `bs[i]` is `[K_total, N_i]` with K_total = K, or K * world when
/// `gather_dim` is the last dimension, row-major or column-major (a weight
/// or its transpose, padded or not; other layouts fail with
/// `SYMM_ERROR_UNSUPPORTED`). `outs[i]` receives gathered A @
/// `bs[i]`: the gathered shape with the last dimension N_i. `ag_out`, if
/// not NULL, receives the gathered A (of `a_shard`'s dtype). Types: f32,
/// bf16 or f16, all the same; or fp8 inputs with scales, into bf16, f16,
/// f32 or fp8 outputs (see `symm_ag_mm_options_t`). Products are summed in
/// f32.
/// `opts` may be NULL.
///
/// `a_shard` may lie in a rendezvoused symmetric buffer, contiguous: where
/// it lies is part of the agreed arguments (the same offset of the same
/// buffer on every rank, or ordinary memory on every rank). There the
/// copy engines pull the peers' shards from where the callers have them
/// (not in fp8). In ordinary memory, a pipelined call's shards over 4 MiB
/// are pushed by each rank from where its caller has them into the peers'
/// workspaces; other shards are first copied into the group's workspace.
///
/// Every rank passes the same dtypes, shapes (of scales too), `gather_dim`
/// and `num_b` (else `SYMM_ERROR_MISMATCH` on every rank). Outputs may be
/// strided but must not overlap themselves, each other or the inputs. On
/// any error before data moved, no output was written.
#[no_mangle]
pub unsafe extern "C" fn symm_fused_ag_mm(
    group: symm_group_t,
    a_shard: *const symm_tensor_t,
    bs: *const symm_tensor_t,
    num_b: c_int,
    gather_dim: c_int,
    ag_out: *const symm_tensor_t,
    outs: *const symm_tensor_t,
    opts: *const symm_ag_mm_options_t,
    stream: *mut c_void,
) -> symm_status_t {
    call("symm_fused_ag_mm", || {
        let g = self::group(group)?;
        let read = || -> Result<AgMm> {
            let n = non_negative(num_b, "num_b")?;
            if n == 0 {
                return Err(err!(InvalidArgument, "num_b is 0; expected at least 1"));
            }
            let defaults = symm_ag_mm_options_t {
                struct_size: 0,
                a_scale: std::ptr::null(),
                b_scales: std::ptr::null(),
                biases: std::ptr::null(),
                algorithm: SYMM_ALGORITHM_AUTO,
                result_scales: std::ptr::null(),
            };
            let oldest = std::mem::offset_of!(symm_ag_mm_options_t, algorithm);
            let o = options(opts, "opts", "SYMM_AG_MM_OPTIONS_INIT", oldest, defaults)?;
            let scales = AgMmScales {
                a_scale: optional_tensor(o.a_scale, "opts->a_scale")?,
                b_scales: optional_tensors(o.b_scales, n, "opts->b_scales")?,
                biases: optional_entries(o.biases, n, "opts->biases")?,
                result_scales: optional_entries(o.result_scales, n, "opts->result_scales")?,
            };
            Ok(AgMm {
                a_shard: tensor_arg(a_shard, "a_shard")?,
                bs: tensors(bs, n, "bs")?,
                gather_dim: gather_dim.into(),
                ag_out: optional_tensor(ag_out, "ag_out")?,
                outs: tensors(outs, n, "outs")?,
                scales,
                algorithm: from_c(o.algorithm, "opts->algorithm")?,
            })
        };
        ops::fused_ag_mm(&g, read(), Stream(stream as usize))
    })
}

/// Collective: `reduce_scatter(a @ b, op, scatter_dim)`, as PyTorch's
/// `fused_matmul_reduce_scatter`.
///
/// `a` is `[..., K]` (rank >= 2, any strides), `b` is `[K, N]` (row- or
/// column-major, as `bs[i]` of `symm_fused_ag_mm`); their
/// product has `a`'s shape with the last dimension N, and its dimension
/// `scatter_dim` (0 to ndim-1) must divide by the world size. Rank r's
/// `out` receives chunk r of that dimension, summed over the ranks
/// (`SYMM_REDUCE_SUM`) or averaged (`SYMM_REDUCE_AVG`). Types: f32, bf16 or
/// f16, all the same; or fp8 inputs with scales, into a bf16, f16, f32 or
/// fp8 `out` (see `symm_mm_rs_options_t`). Products and sums in f32; each
/// rank's product is rounded to `out`'s dtype before it travels (to f32
/// for an fp8 `out`, which is rounded once after the sum). `opts` may be
/// NULL.
///
/// `out` may lie in a rendezvoused symmetric buffer, contiguous: where it
/// lies is part of the agreed arguments (the same offset of the same
/// buffer on every rank, or ordinary memory on every rank). There, at world
/// 2, the fused kernel lets each rank write its product straight into its
/// peer's `out`, where the peer adds its own, the fastest path at small M;
/// each rank's product, its own included, is then rounded to `out`'s dtype
/// before the sum.
///
/// Every rank passes the same dtypes, shapes (of scales too), `scatter_dim`
/// and `op` (else `SYMM_ERROR_MISMATCH` on every rank). `out` may be
/// strided but must not overlap itself or the inputs. On any error before
/// data moved, `out` was not written.
#[no_mangle]
pub unsafe extern "C" fn symm_mm_rs(
    group: symm_group_t,
    a: *const symm_tensor_t,
    b: *const symm_tensor_t,
    scatter_dim: c_int,
    op: symm_reduce_op_t,
    out: *const symm_tensor_t,
    opts: *const symm_mm_rs_options_t,
    stream: *mut c_void,
) -> symm_status_t {
    call("symm_mm_rs", || {
        let g = self::group(group)?;
        let read = || -> Result<MmRs> {
            let defaults = symm_mm_rs_options_t {
                struct_size: 0,
                a_scale: std::ptr::null(),
                b_scale: std::ptr::null(),
                bias: std::ptr::null(),
                algorithm: SYMM_ALGORITHM_AUTO,
                result_scale: std::ptr::null(),
            };
            let oldest = std::mem::offset_of!(symm_mm_rs_options_t, algorithm);
            let o = options(opts, "opts", "SYMM_MM_RS_OPTIONS_INIT", oldest, defaults)?;
            let scales = MmRsScales {
                a_scale: optional_tensor(o.a_scale, "opts->a_scale")?,
                b_scale: optional_tensor(o.b_scale, "opts->b_scale")?,
                bias: optional_tensor(o.bias, "opts->bias")?,
                result_scale: optional_tensor(o.result_scale, "opts->result_scale")?,
            };
            Ok(MmRs {
                a: tensor_arg(a, "a")?,
                b: tensor_arg(b, "b")?,
                scatter_dim: scatter_dim.into(),
                op: reduce_op(op)?,
                out: tensor_arg(out, "out")?,
                scales,
                algorithm: from_c(o.algorithm, "opts->algorithm")?,
            })
        };
        ops::mm_rs(&g, read(), Stream(stream as usize))
    })
}

/// Collective: gathers every rank's `input` along dimension 0 into
/// `output` (`[world * d0, ...]`, rank r's input at rows r*d0), as PyTorch's
/// `_low_contention_all_gather`: pure copies, each rank pulling from one
/// peer at a time with the copy engines (no SMs). Small messages (up to a
/// few MiB per rank, every rank on a GPU of its own) take one SM kernel
/// instead, for latency: the all-reduce's LL lines, with no barrier. Any
/// dtype (integers included: the bits are copied) and strides (strides may
/// differ between ranks). When `input` is contiguous in a rendezvoused
/// symmetric buffer, the copy engines read it in place; otherwise it is
/// first copied to the group's workspace. Every rank passes the same dtype
/// and shape, and its input either contiguous at the same offset of the
/// same symmetric buffer or elsewhere (ordinary memory, or strided) on
/// every rank (else `SYMM_ERROR_MISMATCH`).
#[no_mangle]
pub unsafe extern "C" fn symm_lc_allgather(
    group: symm_group_t,
    input: *const symm_tensor_t,
    output: *const symm_tensor_t,
    stream: *mut c_void,
) -> symm_status_t {
    call("symm_lc_allgather", || {
        let g = self::group(group)?;
        let read = || -> Result<LcAllgather> {
            Ok(LcAllgather { input: tensor_arg(input, "input")?, output: tensor_arg(output, "output")? })
        };
        ops::lc_allgather(&g, read(), Stream(stream as usize))
    })
}

/// The options of an all-reduce (NULL: defaults).
fn all_reduce_options(opts: *const symm_all_reduce_options_t) -> Result<Option<crate::backend::AllReduceAlgorithm>> {
    let defaults = symm_all_reduce_options_t { struct_size: 0, algorithm: SYMM_ALGORITHM_AUTO };
    let oldest = std::mem::offset_of!(symm_all_reduce_options_t, algorithm) + std::mem::size_of::<symm_algorithm_t>();
    let o = options(opts, "opts", "SYMM_ALL_REDUCE_OPTIONS_INIT", oldest, defaults)?;
    all_reduce_from_c(o.algorithm, "opts->algorithm")
}

/// Collective: `output = reduce(input over ranks)`, elementwise, `op`
/// `SYMM_REDUCE_SUM` or `SYMM_REDUCE_AVG`; any shape; f32, bf16 or f16,
/// summed in f32 in rank order, so every rank gets the same bits; or
/// int8, uint8, int32 or int64, summed exactly in the element type
/// (wrapping modulo 2^bits on overflow; AVG divides the wrapped sum by the
/// world size, truncating toward zero, as NCCL's `ncclAvg`). On CUDA,
/// integers need every rank on a GPU of its own and at most 16 ranks
/// (else `SYMM_ERROR_UNSUPPORTED`). `output`
/// has `input`'s dtype and shape, any strides, and may be `input` itself
/// (the same descriptor: in place); otherwise they must not overlap.
/// Strides may differ between ranks; past 64 MiB per rank, whether each
/// tensor is contiguous must be the same on every rank (else
/// `SYMM_ERROR_MISMATCH`).
/// `opts` may be NULL (defaults).
///
/// One-shot (every rank reads all of every rank's input; small messages)
/// or two-shot (reduce-scatter, then all-gather; large ones), chosen by
/// size and world (`symm_plan_all_reduce`) unless `opts->algorithm` forces
/// one. On CUDA one kernel launch does the call: the data carry their
/// arrival (flag-in-data lines, or a flag numbered by the call per chunk)
/// through a symmetric all-reduce buffer of the group, so a call pays no
/// separate barrier, and repeated calls replay as a CUDA graph (the first
/// call of a size, or a larger one, grows that buffer: make it before
/// capturing). An input that lies contiguous in a rendezvoused symmetric
/// buffer (the same offset on every rank) is read where it is; an
/// ordinary one is read by the kernel as it pushes it (no staging pass);
/// strided tensors are packed and unpacked around the kernel.
///
/// The buffer counts the calls on the device, so a group's all-reduce
/// calls must run one after another on the device: issue them on one
/// stream (or order their streams with events), as for the fused
/// reduce-scatter.
///
/// Every rank passes the same dtype, shape, `op`, algorithm option and
/// input place (symmetric or not), else `SYMM_ERROR_MISMATCH` on every rank.
#[no_mangle]
pub unsafe extern "C" fn symm_all_reduce(
    group: symm_group_t,
    input: *const symm_tensor_t,
    output: *const symm_tensor_t,
    op: symm_reduce_op_t,
    opts: *const symm_all_reduce_options_t,
    stream: *mut c_void,
) -> symm_status_t {
    call("symm_all_reduce", || {
        let g = self::group(group)?;
        let read = || -> Result<AllReduce> {
            Ok(AllReduce {
                input: tensor_arg(input, "input")?,
                output: tensor_arg(output, "output")?,
                op: reduce_op(op)?,
                norm: None,
                algorithm: all_reduce_options(opts)?,
            })
        };
        ops::all_reduce(&g, read(), Stream(stream as usize))
    })
}

/// Collective: the all-reduce fused with the residual add and RMSNorm of
/// inference engines (after attention and after the MLP):
/// `residual_out = all_reduce_sum(input) + residual`, then per row (the
/// last dimension, `hidden`)
/// `out = residual_out / sqrt(mean(residual_out^2) + eps) * weight`.
/// `input`, `residual`, `out` and `residual_out` share
/// one shape (`[tokens, hidden]`, or any leading dimensions) and dtype
/// (f32, bf16 or f16; integers: `SYMM_ERROR_INVALID_ARGUMENT`), any
/// strides; `weight` is `[hidden]`. Computed in
/// f32; the all-reduced sum and `residual_out` are rounded to the dtype
/// as the unfused sequence would round them. `residual_out` may be
/// `residual` (the same descriptor: in place); `out` must not overlap any
/// other argument. `opts` and the rules of agreement as `symm_all_reduce`
/// (`eps` and the shapes are agreed too).
#[no_mangle]
pub unsafe extern "C" fn symm_all_reduce_rmsnorm(
    group: symm_group_t,
    input: *const symm_tensor_t,
    residual: *const symm_tensor_t,
    weight: *const symm_tensor_t,
    eps: f32,
    out: *const symm_tensor_t,
    residual_out: *const symm_tensor_t,
    opts: *const symm_all_reduce_options_t,
    stream: *mut c_void,
) -> symm_status_t {
    call("symm_all_reduce_rmsnorm", || {
        let g = self::group(group)?;
        let read = || -> Result<AllReduce> {
            Ok(AllReduce {
                input: tensor_arg(input, "input")?,
                output: tensor_arg(out, "out")?,
                op: ops::ReduceOp::Sum,
                norm: Some(Norm {
                    residual: tensor_arg(residual, "residual")?,
                    weight: tensor_arg(weight, "weight")?,
                    eps,
                    residual_out: tensor_arg(residual_out, "residual_out")?,
                }),
                algorithm: all_reduce_options(opts)?,
            })
        };
        ops::all_reduce(&g, read(), Stream(stream as usize))
    })
}

/// Collective: this rank's call of `operation` (a function's name without
/// `symm_`: "fused_ag_mm", "mm_rs", "lc_allgather", "all_reduce" or
/// "all_reduce_rmsnorm") on `stream`, refused with `message`, for bindings
/// that check a call's arguments themselves: it fails here with
/// `SYMM_ERROR_INVALID_ARGUMENT` and `message`, and its peers' call with
/// `SYMM_ERROR_REMOTE` quoting it, exactly as when symm refuses an
/// argument of that call (the group's state after it is the same too).
/// A NULL or non-UTF-8 `message` is refused with a message of symm's; an
/// unknown `operation` enters no call and fails this rank alone.
#[no_mangle]
pub unsafe extern "C" fn symm_refuse_call(
    group: symm_group_t,
    operation: *const c_char,
    message: *const c_char,
    stream: *mut c_void,
) -> symm_status_t {
    call("symm_refuse_call", || {
        let g = self::group(group)?;
        let operation = in_ref(operation, "operation")?;
        // SAFETY: non-NULL, and the caller promises a NUL-terminated string.
        let operation = unsafe { CStr::from_ptr(operation) }.to_str().unwrap_or("");
        // SAFETY: as above, where not NULL.
        let text = (!message.is_null()).then(|| unsafe { CStr::from_ptr(message) }.to_str().ok()).flatten();
        let reason = err!(InvalidArgument, "{}", text.unwrap_or("refused by the caller (a message that is not text)"));
        let stream = Stream(stream as usize);
        match operation {
            "fused_ag_mm" => ops::fused_ag_mm(&g, Err(reason), stream),
            "mm_rs" => ops::mm_rs(&g, Err(reason), stream),
            "lc_allgather" => ops::lc_allgather(&g, Err(reason), stream),
            "all_reduce" | "all_reduce_rmsnorm" => ops::all_reduce(&g, Err(reason), stream),
            other => Err(err!(
                InvalidArgument,
                "operation is {other:?}; expected fused_ag_mm, mm_rs, lc_allgather, all_reduce or all_reduce_rmsnorm"
            )),
        }
    })
}
