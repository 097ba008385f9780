//! Kept calls: an operation called again with exactly the same arguments
//! (addresses included) skips its checks, its signature and the
//! agreement, and its preparation, which together are a good part of the
//! host time of a small call, and reuses the prepared call and replay key
//! of the first call.
//!
//! Safe where an operation's preparation reads nothing but its arguments
//! and the group's fixed properties (its agreed settings included):
//! `fused_ag_mm`, and `mm_rs`, `all_reduce` and `lc_allgather` keyed with
//! where their symmetric tensor lies (`symmetric::Placed`). A prepared call
//! stands for a signature every rank agreed on: it is kept after the
//! agreement, found under the collective
//! lock, and forgotten whenever the group forgets its agreed signatures, so
//! a call that skips the agreement here is one whose agreement every peer
//! skips too. Not used when the group checks arguments on every call.

use super::state;
use super::{Prepared, ScratchIds};
use crate::backend::{CallTag, ReplayKey};
use crate::group::Group;
use std::any::{Any, TypeId};
use std::collections::hash_map::DefaultHasher;
use std::hash::{Hash, Hasher};
use std::sync::{Arc, Mutex};

/// One kept call: its arguments, its preparation, and its replay key for
/// the scratch buffers it last ran with.
pub struct Entry<C, P> {
    call: C,
    pub prepared: Arc<P>,
    /// The tag of the agreed call (see `agree`).
    pub tag: CallTag,
    key: Mutex<Option<(ScratchIds, ReplayKey)>>,
}

impl<C, P: Prepared> Entry<C, P> {
    /// The replay key for scratch buffers: made once per set of them.
    pub fn key(&self, ids: ScratchIds, make: impl FnOnce() -> String) -> ReplayKey {
        let mut key = crate::sync::lock(&self.key);
        match &*key {
            Some((last, k)) if *last == ids => k.clone(),
            _ => {
                let k = ReplayKey::new(make());
                *key = Some((ids, k.clone()));
                k
            }
        }
    }
}

fn hash<C: Hash + 'static>(call: &C) -> u64 {
    let mut h = DefaultHasher::new();
    TypeId::of::<C>().hash(&mut h);
    call.hash(&mut h);
    h.finish()
}

/// The prepared call equal to `call`, if any. Call with the collective
/// lock held.
pub fn find<C, P>(group: &Group, call: &C) -> Option<Arc<Entry<C, P>>>
where
    C: Hash + Eq + Send + Sync + 'static,
    P: Send + Sync + 'static,
{
    state::of(group).prepared(hash(call)).into_iter().find_map(|e| {
        let e: Arc<dyn Any + Send + Sync> = e;
        let e = e.downcast::<Entry<C, P>>().ok()?;
        (e.call == *call).then_some(e)
    })
}

/// Keeps a call that every rank just agreed on. Call with the collective
/// lock held, after the agreement.
pub fn keep<C, P>(group: &Group, call: C, prepared: Arc<P>, tag: CallTag) -> Arc<Entry<C, P>>
where
    C: Hash + Eq + Send + Sync + 'static,
    P: Send + Sync + 'static,
{
    let h = hash(&call);
    let entry = Arc::new(Entry { call, prepared, tag, key: Mutex::new(None) });
    state::of(group).keep_prepared(h, entry.clone());
    entry
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::array::{Array, DType};
    use crate::backend::Stream;
    use crate::ops::mm_rs::MmRsPrepared;
    use crate::ops::symmetric::Placed;
    use crate::ops::testing::{host_groups, on_each};
    use crate::ops::{mm_rs, MmRs, MmRsScales, ReduceOp};

    fn arr(v: &mut [f32], shape: &[usize]) -> Array {
        Array::contiguous(v.as_mut_ptr() as u64, DType::F32, shape)
    }

    /// mm_rs on 2 ranks, [4, 3] @ [3, 2] summed, rank r's A = (r + 1) * base
    /// with base[0][0] = step: each call's output against its own
    /// reference, outputs poisoned (NaN) first. A repeated call reuses its
    /// preparation (one kept entry); a call into another output is prepared
    /// anew (a second entry) and leaves the first output alone.
    #[test]
    fn identical_calls_reuse_their_preparation_and_compute_afresh() {
        let groups = host_groups(2);
        on_each(&groups, |r, g| {
            let base = |step: f32| {
                let mut m: Vec<f32> = (0..12).map(|i| 0.5 + i as f32).collect();
                m[0] = step;
                m
            };
            let scale = (r + 1) as f32;
            let mut a: Vec<f32> = vec![0.0; 12];
            let bv: Vec<f32> = (0..6).map(|i| 1.0 - 0.25 * i as f32).collect();
            let mut b = bv.clone();
            let (mut out1, mut out2) = (vec![f32::NAN; 4], vec![f32::NAN; 4]);
            // Rows 2r, 2r+1 of (1 + 2) * base @ b.
            let want = |step: f32| -> Vec<f32> {
                let m = base(step);
                (0..4)
                    .map(|i| (2 * r + i / 2, i % 2))
                    .map(|(row, col)| 3.0 * (0..3).map(|k| m[row * 3 + k] * bv[k * 2 + col]).sum::<f32>())
                    .collect()
            };
            let kept = |g: &Group, call: &MmRs| {
                let (key, _) = Placed::of(g, Ok(call.clone()), |c| &c.out);
                find::<Placed<MmRs>, MmRsPrepared>(g, &key.unwrap()).is_some()
            };
            for (step, into_second) in [(1.0, false), (2.0, false), (3.0, true), (4.0, false)] {
                a.copy_from_slice(&base(step).iter().map(|x| x * scale).collect::<Vec<_>>());
                let out = if into_second { &mut out2 } else { &mut out1 };
                out.fill(f32::NAN);
                let call = MmRs {
                    a: arr(&mut a, &[4, 3]),
                    b: arr(&mut b, &[3, 2]),
                    scatter_dim: 0,
                    op: ReduceOp::Sum,
                    out: arr(out, &[2, 2]),
                    scales: MmRsScales::default(),
                    algorithm: None,
                };
                let seen = kept(g, &call);
                mm_rs(g, Ok(call.clone()), Stream(0)).unwrap();
                assert_eq!(seen, step == 2.0 || step == 4.0, "step {step}: kept before the call: {seen}");
                assert!(kept(g, &call));
                let close =
                    |got: &[f32], w: &[f32]| got.iter().zip(w).all(|(x, y)| (x - y).abs() <= 1e-5 * y.abs().max(1.0));
                let (got, w) = (if into_second { &out2 } else { &out1 }, want(step));
                assert!(close(got, &w), "step {step}: {got:?} != {w:?}");
                if into_second {
                    assert!(close(&out1, &want(2.0)), "a call into another output wrote the first: {out1:?}");
                }
            }
        });
        groups.iter().for_each(|g| g.release_scratch());
    }
}
