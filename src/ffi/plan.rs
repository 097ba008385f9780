//! Plan queries: which algorithm a fused operation would run on a group
//! and what it is predicted to cost, so a framework's scheduler can plan
//! around it without running anything. The answer comes from the same
//! decision the operations make (`ops::decide`), for operands in the fused
//! kernel's layout and options that leave the algorithm automatic.

use super::args::{dtype, out_ptr, out_struct_size, write};
use super::boundary::call;
use super::group::group;
use super::types::*;
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
    let d = decide::decide(&Facts::of(&g), &decide::Shape { op, m, k, n, dtype }, true, None)?;
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
/// rows) times B of `n` columns (the sum over every B) on this group.
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

/// Predicts `symm_mm_rs` of this rank's `m x k` A times a `k x n` B on this group.
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
