//! Plan queries: which algorithm a fused operation would run on a group
//! and what it is predicted to cost, so a framework's scheduler can plan
//! around it without running anything. The answer comes from the same
//! decision the operations make (`ops::decide`), for operands in the fused
//! kernel's layout and options that leave the algorithm automatic.

use super::args::{dtype, out_ptr, out_struct_size, write};
use super::boundary::call;
use super::group::group;
use super::types::*;
use crate::array::DType;
use crate::backend::AllReduceAlgorithm;
use crate::cost::Algorithm;
use crate::error::{err, Result};
use crate::ops::decide::{self, Facts, Op};

/// A prediction, in milliseconds. Initialize with `SYMM_PLAN_INIT`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct symm_plan_t {
    /// `sizeof(symm_plan_t)`.
    pub struct_size: usize,
    /// `SYMM_ALGORITHM_*` that the operation would run.
    pub algorithm: symm_algorithm_t,
    /// Matmul time, including what splitting it costs.
    pub compute_ms: f64,
    /// Communication time if it ran alone.
    pub comm_ms: f64,
    /// Communication not hidden behind the matmul.
    pub exposed_ms: f64,
    /// The whole operation.
    pub total_ms: f64,
}

fn query(g: symm_group_t, m: i64, k: i64, n: i64, dt: symm_dtype_t, out: *mut symm_plan_t, op: Op) -> Result<()> {
    let out = out_ptr(out, "plan")?;
    let size = out_struct_size(out, "plan", "initialize it with SYMM_PLAN_INIT")?;
    let dim = |v: i64, name: &str| {
        usize::try_from(v)
            .ok()
            .filter(|&v| v > 0)
            .ok_or_else(|| err!(InvalidArgument, "{name} is {v}; it must be positive"))
    };
    let g = group(g)?;
    let (dtype, m, k, n) = (dtype(dt, "dtype")?, dim(m, "m")?, dim(k, "k")?, dim(n, "n")?);
    crate::ops::check::matmul_input(dtype, "dtype")?;
    // fp8 operands: a bf16 product, as the scaled operations usually write.
    let out_bytes = if dtype.fp8().is_some() { 2 } else { dtype.size() };
    // Matrices, gathered or scattered along dimension 0: shards of
    // m / world rows (fp8 calls keep them whole); a sum's two-rank chunks in
    // the pieces mm_rs cuts them into.
    let world = g.world().max(1);
    let split_len = match op {
        _ if dtype.fp8().is_some() => 1,
        Op::AgMm => m / world,
        Op::MmRs if world == 2 => crate::ops::mm_rs::onto_pull_pieces_of(m / world, m / world).unwrap_or(1),
        Op::MmRs => 1,
    };
    let shape = decide::Shape { op, m, k, n, dtype, out_bytes, lines: true, split_len };
    let d = decide::decide(&Facts::of(&g), &shape, true, None)?;
    let e = d.estimate;
    write(
        out,
        symm_plan_t {
            struct_size: size,
            algorithm: to_c(d.algorithm),
            compute_ms: e.compute_ms,
            comm_ms: e.comm_ms,
            exposed_ms: e.exposed_ms,
            total_ms: e.total_ms,
        },
    );
    Ok(())
}

/// Predicts `symm_fused_ag_mm` of an `m_total x k` gathered A (all ranks'
/// rows) times B of `n` columns (the sum over every B) on this group: shards
/// that are matrices, gathered along dimension 0 (fp8 operands: into a bf16
/// output).
#[no_mangle]
pub extern "C" fn symm_plan_ag_mm(
    group: symm_group_t,
    m_total: i64,
    k: i64,
    n: i64,
    dtype: symm_dtype_t,
    plan: *mut symm_plan_t,
) -> symm_status_t {
    call("symm_plan_ag_mm", || query(group, m_total, k, n, dtype, plan, Op::AgMm))
}

/// Predicts `symm_mm_rs` of this rank's `m x k` A times a `k x n` B on this
/// group, a sum scattered along dimension 0 (fp8 operands: into a bf16
/// `out`).
#[no_mangle]
pub extern "C" fn symm_plan_mm_rs(
    group: symm_group_t,
    m: i64,
    k: i64,
    n: i64,
    dtype: symm_dtype_t,
    plan: *mut symm_plan_t,
) -> symm_status_t {
    call("symm_plan_mm_rs", || query(group, m, k, n, dtype, plan, Op::MmRs))
}

/// Predicts `symm_all_reduce` of `numel` elements of `dtype` per rank on
/// this group: `algorithm` is `SYMM_ALGORITHM_ONE_SHOT` or
/// `SYMM_ALGORITHM_TWO_SHOT` (what a call with automatic options runs),
/// `comm_ms`, `exposed_ms` and `total_ms` its predicted time, `compute_ms` 0.
#[no_mangle]
pub extern "C" fn symm_plan_all_reduce(
    group: symm_group_t,
    numel: i64,
    dtype: symm_dtype_t,
    plan: *mut symm_plan_t,
) -> symm_status_t {
    call("symm_plan_all_reduce", || {
        let out = out_ptr(plan, "plan")?;
        let size = out_struct_size(out, "plan", "initialize it with SYMM_PLAN_INIT")?;
        let g = super::group::group(group)?;
        let dtype = self::dtype(dtype, "dtype")?;
        let numel = usize::try_from(numel)
            .ok()
            .filter(|&n| n > 0)
            .ok_or_else(|| err!(InvalidArgument, "numel is {numel}; it must be positive"))?;
        if !matches!(dtype, DType::F32 | DType::BF16 | DType::F16) && !dtype.is_integer() {
            return Err(err!(
                InvalidArgument,
                "dtype is {dtype}; expected f32, bf16, f16, int8, uint8, int32 or int64"
            ));
        }
        let d = decide::decide_all_reduce(&Facts::of(&g), numel, dtype, None);
        let algorithm = all_reduce_to_c(d.algorithm);
        let ms = d.total_ms;
        write(
            out,
            symm_plan_t { struct_size: size, algorithm, compute_ms: 0.0, comm_ms: ms, exposed_ms: ms, total_ms: ms },
        );
        Ok(())
    })
}

/// The C value of an all-reduce algorithm.
pub(super) fn all_reduce_to_c(a: AllReduceAlgorithm) -> symm_algorithm_t {
    match a {
        AllReduceAlgorithm::OneShot => SYMM_ALGORITHM_ONE_SHOT,
        AllReduceAlgorithm::TwoShot => SYMM_ALGORITHM_TWO_SHOT,
    }
}

/// An all-reduce options struct's `algorithm` (`None`: automatic).
pub(super) fn all_reduce_from_c(a: symm_algorithm_t, name: &str) -> Result<Option<AllReduceAlgorithm>> {
    match a {
        SYMM_ALGORITHM_AUTO => Ok(None),
        SYMM_ALGORITHM_ONE_SHOT => Ok(Some(AllReduceAlgorithm::OneShot)),
        SYMM_ALGORITHM_TWO_SHOT => Ok(Some(AllReduceAlgorithm::TwoShot)),
        other => Err(err!(
            InvalidArgument,
            "{name} is {other}; expected SYMM_ALGORITHM_AUTO, SYMM_ALGORITHM_ONE_SHOT or SYMM_ALGORITHM_TWO_SHOT"
        )),
    }
}

/// The C value of an algorithm.
pub(super) fn to_c(a: Algorithm) -> symm_algorithm_t {
    match a {
        Algorithm::Sequential => SYMM_ALGORITHM_SEQUENTIAL,
        Algorithm::Pipelined => SYMM_ALGORITHM_PIPELINED,
        Algorithm::Fused => SYMM_ALGORITHM_FUSED,
    }
}

/// An options struct's `algorithm` (`None`: automatic).
pub(super) fn from_c(a: symm_algorithm_t, name: &str) -> Result<Option<Algorithm>> {
    match a {
        SYMM_ALGORITHM_AUTO => Ok(None),
        SYMM_ALGORITHM_SEQUENTIAL => Ok(Some(Algorithm::Sequential)),
        SYMM_ALGORITHM_PIPELINED => Ok(Some(Algorithm::Pipelined)),
        SYMM_ALGORITHM_FUSED => Ok(Some(Algorithm::Fused)),
        other => Err(err!(InvalidArgument, "{name} is {other}; expected a SYMM_ALGORITHM_* value")),
    }
}
