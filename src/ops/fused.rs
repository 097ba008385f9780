//! Whether a call's operands suit the fused kernel (`Algorithm::Fused`).
//! The group-level part (the kernel, the ranks' devices, the dtype and k)
//! is `decide::Facts::fused_possible`, from agreed facts; the layout-level
//! part (strides, alignment, output type) is local, so it goes into the
//! call's signature: ranks that differ fail with `Mismatch` instead of
//! choosing different algorithms.

use super::decide::Facts;
use crate::array::{Array, DType};
use crate::backend::{FusedMatmul, GemmScales};
use crate::group::Group;
use std::fmt;
use std::time::Duration;

/// How a call the group could fuse suits the kernel.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Fit {
    /// Every launch suits it; the output dtype of each.
    Fits(Vec<DType>),
    /// Why not.
    Unfit(String),
}

impl Fit {
    pub fn fits(&self) -> bool {
        matches!(self, Fit::Fits(_))
    }
}

/// The signature's text.
impl fmt::Display for Fit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Fit::Fits(outs) => {
                let outs: Vec<String> = outs.iter().map(DType::to_string).collect();
                write!(f, "yes, out {}", outs.join(" "))
            }
            Fit::Unfit(why) => write!(f, "no ({why})"),
        }
    }
}

/// How this rank's call suits the kernel (`None` when the group cannot
/// fuse it at all, e.g. on the host backend: the signature then has no
/// field): `launches` are this rank's operands, workspace addresses left
/// as placeholders.
pub fn field(
    group: &Group,
    facts: &Facts,
    dtype: DType,
    k: usize,
    launches: impl FnOnce() -> Option<Vec<FusedMatmul>>,
) -> Option<Fit> {
    if !facts.fused_possible(dtype, k) {
        return None;
    }
    let Some(launches) = launches() else {
        return Some(Fit::Unfit("the operands are not matrices in the kernel's layout".into()));
    };
    for l in &launches {
        if let Err(e) = group.backend().fused_matmul_supports(l) {
            return Some(Fit::Unfit(e.msg));
        }
    }
    Some(Fit::Fits(launches.iter().map(|l| l.c.dtype).collect()))
}

/// For a call the kernel never runs (`why`): `Unfit` where the group could
/// fuse its dtype and k, so that the signature says why, else `None` (as
/// [`field`]).
pub fn unfit(facts: &Facts, dtype: DType, k: usize, why: &str) -> Option<Fit> {
    facts.fused_possible(dtype, k).then(|| Fit::Unfit(why.into()))
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
