//! Cost queries: what a fused operation is predicted to cost on a group,
//! and which algorithm symm would run, so a framework's scheduler can plan
//! around it without running anything.

use super::args::{dtype, out_ptr, write};
use super::boundary::call;
use super::group::group;
use super::types::*;
use crate::error::{err, Result};
use crate::plan::{self, Algorithm, DeviceModel, Problem};

/// The algorithm chosen for an operation.
pub type symm_algorithm_t = i32;
/// Communicate everything, then one matmul (or matmul, then reduce).
pub const SYMM_ALGORITHM_SEQUENTIAL: symm_algorithm_t = 0;
/// One matmul piece per rank, communication overlapped with the matmul.
pub const SYMM_ALGORITHM_PIPELINED: symm_algorithm_t = 1;
/// One persistent matmul kernel over the whole problem whose tiles wait for
/// gathered rows or push reduce-scatter partials (Hopper, sm_90a; bf16/f16,
/// gather or scatter dim 0, B K-major, i.e. a Linear weight's transpose;
/// the query assumes that layout, other layouts run the pipelined path).
pub const SYMM_ALGORITHM_FUSED: symm_algorithm_t = 2;

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

/// The operation a plan query is about.
#[derive(Clone, Copy, PartialEq, Eq)]
enum PlannedOp {
    AgMm,
    MmRs,
}

fn query(
    g: symm_group_t,
    m: i64,
    k: i64,
    n: i64,
    dt: symm_dtype_t,
    out: *mut symm_plan_t,
    op: PlannedOp,
) -> Result<()> {
    let out = out_ptr(out, "plan")?;
    // SAFETY: non-NULL; struct_size is the first field of every version.
    let size = unsafe { std::ptr::read(out as *const usize) };
    if size < std::mem::size_of::<symm_plan_t>() {
        return Err(err!(InvalidArgument, "plan->struct_size is {size}; initialize it with SYMM_PLAN_INIT"));
    }
    let dim = |v: i64, name: &str| {
        usize::try_from(v)
            .ok()
            .filter(|&v| v > 0)
            .ok_or_else(|| err!(InvalidArgument, "{name} is {v}; it must be positive"))
    };
    let g = group(g)?;
    let (dtype, k, m, n, world) = (dtype(dt, "dtype")?, dim(k, "k")?, dim(m, "m")?, dim(n, "n")?, g.world());
    let fused = crate::ops::fused::available(&g, dtype, k);
    let fused_preferred =
        op == PlannedOp::MmRs && fused && crate::ops::mm_rs::fused_preferred(&**g.backend(), m, n, world, dtype);
    let problem = Problem { m, k, n, world, elem_bytes: dtype.size(), fused };
    let model = match op {
        PlannedOp::AgMm => plan::ag_mm,
        PlannedOp::MmRs => plan::mm_rs,
    };
    let estimates = model(&problem, &DeviceModel::HOPPER);
    let chosen = plan::choose(&estimates, fused_preferred)?;
    let e = estimates
        .iter()
        .find(|e| e.algorithm == chosen)
        .copied()
        .unwrap_or_else(|| plan::best(&estimates, fused_preferred));
    write(
        out,
        symm_plan_t {
            struct_size: size,
            algorithm: match e.algorithm {
                Algorithm::Sequential => SYMM_ALGORITHM_SEQUENTIAL,
                Algorithm::Pipelined => SYMM_ALGORITHM_PIPELINED,
                Algorithm::Fused => SYMM_ALGORITHM_FUSED,
            },
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
    call("symm_plan_ag_mm", || query(group, m_total, k, n, dtype, plan, PlannedOp::AgMm))
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
    call("symm_plan_mm_rs", || query(group, m, k, n, dtype, plan, PlannedOp::MmRs))
}
