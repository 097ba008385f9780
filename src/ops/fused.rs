//! When an operation may run as one fused kernel (`Algorithm::Fused`):
//! the backend has the kernel, every rank has a device of its own (two
//! ranks' persistent kernels on one GPU would wait for each other), and the
//! problem is one the kernel takes. The shape-level part depends on agreed
//! arguments only; the layout-level part (strides, alignment, output type)
//! is local, so it goes into the call's signature: ranks that differ fail
//! with `Mismatch` instead of choosing different algorithms.

use crate::array::{Array, DType};
use crate::backend::{FusedMatmul, GemmScales};
use crate::group::Group;
use std::time::Duration;

/// Most ranks the fused kernel takes (`SYMM_GEMM_MAX_CHUNKS`).
const MAX_WORLD: usize = 16;

/// Whether the group can run fused kernels for `dtype` (bf16, f16 or fp8)
/// with inner size `k` (rows of whole 16-byte units, TMA's rule).
pub fn available(group: &Group, dtype: DType, k: usize) -> bool {
    let world = group.world();
    let mut devices: Vec<i32> = group.ranks().iter().map(|r| r.device).collect();
    devices.sort_unstable();
    devices.dedup();
    (2..=MAX_WORLD).contains(&world)
        && devices.len() == world
        && (matches!(dtype, DType::BF16 | DType::F16) || dtype.fp8().is_some())
        && (k * dtype.size()) % 16 == 0
        && k <= i32::MAX as usize
        && group.backend().has_fused_matmul()
}

/// The signature field for a call the group could fuse (`None` when it
/// cannot, e.g. on the host backend: the signature then has no field):
/// "yes, out <dtype>" when every launch of `launches` (this rank's operands,
/// workspace addresses left as placeholders) suits the kernel, else "no"
/// and why.
pub fn field(
    group: &Group,
    dtype: DType,
    k: usize,
    launches: impl FnOnce() -> Option<Vec<FusedMatmul>>,
) -> Option<String> {
    if !available(group, dtype, k) {
        return None;
    }
    let Some(launches) = launches() else {
        return Some("no (the operands are not matrices in the kernel's layout)".into());
    };
    for l in &launches {
        if let Err(e) = group.backend().fused_matmul_supports(l) {
            return Some(format!("no ({})", e.msg));
        }
    }
    let outs: Vec<String> = launches.iter().map(|l| l.c.dtype.to_string()).collect();
    Some(format!("yes, out {}", outs.join(" ")))
}

/// Whether a call with this signature field takes the fused path.
pub fn chosen(field: Option<&String>) -> bool {
    field.is_some_and(|f| f.starts_with("yes"))
}

/// A launch over this rank's operands (and fp8 scales) with placeholder
/// workspace addresses, for the layout check.
pub fn prototype(
    a: Array,
    b: Array,
    c: Array,
    scales: Option<GemmScales>,
    chunk_rows: usize,
    world: usize,
) -> FusedMatmul {
    FusedMatmul {
        a,
        b,
        c,
        chunk_rows,
        order: (0..world).collect(),
        gather: None,
        scatter: None,
        alpha: 1.0,
        scales,
        spare_sms: 0,
        timeout: Duration::from_secs(1),
    }
}
