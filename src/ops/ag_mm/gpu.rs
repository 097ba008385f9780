//! `fused_ag_mm`'s pipelined path with each peer's shard in pieces, on
//! `SYMM_TEST_WORLD` GPUs (default 2; one process, a thread per rank): the
//! pieces forced on small shapes, pulled and pushed (2-D and 3-D shards
//! gathered along dim 0, a 3-D one along dim 1 in pieces of its batch,
//! lengths the pieces do not divide, more pieces than rows), and chosen by
//! the cost model on a comm-heavy shape (16384 x 4096 x 1024, pushed; rows
//! at every piece's edges checked); bf16 against a float64 reference by
//! relative error, outputs poisoned with NaN first. Named `gpu_*`; skipped
//! with fewer GPUs.
use super::*;
use crate::array::DType;
use crate::backend::cuda::gpu_testing::{gpu_on, rel_err};
use crate::group::Group;
use crate::ops::testing::{cuda_groups, gpu_test_world, on_each};
use half::bf16;

/// Value `i` of a tensor tagged `tag`: small, of both signs, never zero
/// throughout.
fn value(tag: usize, i: usize) -> f64 {
    ((i * 37 + tag * 101) % 23) as f64 / 8.0 - 1.375
}

fn bf16s(v: impl Iterator<Item = f64>) -> Vec<u8> {
    v.flat_map(|x| bf16::from_f64(x).to_le_bytes()).collect()
}

/// `call` on `g`, pipelined, with the decision's pieces replaced by
/// `pieces` and its choice to push by `push` where given; the pieces it
/// ran in.
fn run(g: &Arc<Group>, call: AgMm, pieces: Option<usize>, push: Option<bool>, stream: Stream) -> usize {
    let mut ran = 0;
    crate::ops::run_prepared(g, stream, Ok(call), |c| {
        let signature = c.signature(None);
        let prepared = c.prepare(&Facts::of(g), "cuda", false).map(|mut p| {
            p.decision.pieces = pieces.unwrap_or(p.decision.pieces);
            p.push = push.unwrap_or(p.push);
            ran = p.pieces();
            p
        });
        (crate::ops::with_algorithm(signature, prepared.as_ref().map(|p| p.decision.algorithm)), prepared)
    })
    .unwrap_or_else(|e| panic!("{}", e.msg));
    ran
}

/// Each rank's shard `shard` (rows of k) gathered along `dim` times B
/// [k, n] into its place; `check(owner)`: the rows of each owner's shard
/// to compare. Returns the pieces each rank ran in.
fn case(
    groups: &[Arc<Group>],
    shard: &[usize],
    dim: usize,
    n: usize,
    pieces: Option<usize>,
    push: Option<bool>,
    check: &(dyn Fn(usize) -> Vec<usize> + Sync),
) -> Vec<usize> {
    let world = groups.len();
    let k = shard[shard.len() - 1];
    let rows = shard.iter().product::<usize>() / k;
    let mut out_shape = shard.to_vec();
    out_shape[dim] *= world;
    *out_shape.last_mut().unwrap() = n;
    // Row q of `owner`'s shard: its row in the output (all but the last
    // dimension flattened).
    let out_row = |owner: usize, q: usize| {
        let (mut idx, mut rest) = (vec![0; shard.len() - 1], q);
        for d in (0..shard.len() - 1).rev() {
            (idx[d], rest) = (rest % shard[d], rest / shard[d]);
        }
        idx[dim] += owner * shard[dim];
        idx.iter().zip(&out_shape).fold(0, |flat, (&i, &len)| flat * len + i)
    };
    let what = format!("{shard:?} along {dim} x {n} in {pieces:?} (push {push:?})");
    on_each(groups, |r, g| {
        let gpu = gpu_on(r as i32);
        let a = gpu.upload(&bf16s((0..rows * k).map(|i| value(r, i))));
        let b = gpu.upload(&bf16s((0..k * n).map(|i| value(50, i))));
        let out = gpu.upload(&bf16s(std::iter::repeat_n(f64::NAN, world * rows * n)));
        let call = AgMm {
            a_shard: Array::contiguous(a.ptr, DType::BF16, shard),
            bs: vec![Array::contiguous(b.ptr, DType::BF16, &[k, n])],
            gather_dim: dim as i64,
            ag_out: None,
            outs: vec![Array::contiguous(out.ptr, DType::BF16, &out_shape)],
            scales: AgMmScales::default(),
            algorithm: Some(Algorithm::Pipelined),
        };
        let ran = run(g, call, pieces, push, gpu.stream());
        gpu.sync();
        let bytes = gpu.read_at(out.ptr, world * rows * n * 2);
        let got: Vec<f32> = bytes.chunks(2).map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32()).collect();
        assert!(got.iter().all(|v| v.is_finite()), "{what}: rank {r} left an output element unwritten");
        let (mut mine, mut want) = (Vec::new(), Vec::new());
        for owner in 0..world {
            for q in check(owner) {
                for j in 0..n {
                    mine.push(got[out_row(owner, q) * n + j]);
                    want.push((0..k).map(|h| value(owner, q * k + h) * value(50, h * n + j)).sum::<f64>());
                }
            }
        }
        let err = rel_err(&mine, &want);
        assert!(err < 1.5e-2, "{what}: rank {r} relative error {err}");
        ran
    })
}

#[test]
fn gpu_ag_mm_pipelined_in_pieces() {
    let world = gpu_test_world();
    let Some(groups) = cuda_groups(world) else { return };
    // Forced: every row checked.
    let forced =
        [(vec![1000usize, 512], 0, 3usize), (vec![5, 40, 256], 0, 2), (vec![6, 256], 0, 8), (vec![5, 40, 256], 1, 3)];
    for (shard, dim, pieces) in forced {
        let rows = shard.iter().product::<usize>() / shard[shard.len() - 1];
        // A different N for each: a call equal to an earlier one (its
        // buffers may land at the same addresses) reuses its prepared form.
        for (push, n) in [(false, 384), (true, 320)] {
            let ran = case(&groups, &shard, dim, n, Some(pieces), Some(push), &|_| (0..rows).collect());
            assert!(ran.iter().all(|&c| c == pieces.min(shard[0])), "{shard:?}: ran in {ran:?}");
        }
    }
    // Chosen: a comm-heavy gather (pieces at world 2), the first and last
    // row of every piece checked.
    let shard = [16384 / world, 4096];
    let len = shard[0];
    let ran = case(&groups, &shard, 0, 1024, None, None, &|_| {
        let c = 8;
        (0..c).flat_map(|j| [j * len / c, ((j + 1) * len / c).max(1) - 1]).collect()
    });
    assert!(ran.windows(2).all(|w| w[0] == w[1]), "ranks ran in {ran:?} pieces");
    if world == 2 {
        assert!(ran[0] > 1, "16384 x 4096 x 1024 at world 2: the cost model's pieces, {}", ran[0]);
    }
}
