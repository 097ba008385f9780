"""Every operation at worlds 5 and 8 on the host backend (ranks as
threads): nothing in symm may assume two or four ranks. Against float64
references, outputs poisoned, every gather / scatter dimension, each
all-reduce algorithm and the fused RMSNorm, and a bad argument on one rank
failing every rank."""

import numpy as np
import pytest
from ranks import on_threads

import symm

WORLDS = [5, 8]


def groups_of(world):
    return symm.local_groups(world, backend="host", timeout_ms=20000)


def inputs(world, shape, seed):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(shape).astype(np.float32) for _ in range(world)]


def assert_close(got, ref, tolerance=1e-5):
    assert not np.isnan(got).any(), "an element was not written"
    err = np.abs(got.astype(np.float64) - ref).max() / np.abs(ref).max()
    assert err <= tolerance, f"relative error {err:.2e}"


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("dim", [0, 1, 2])
def test_ag_mm_every_gather_dim(world, dim):
    shape = [3, 2, 16]
    shards = inputs(world, shape, 1)
    k = 16 * (world if dim == 2 else 1)
    bs = inputs(2, (k, 24), 2)
    gathered = np.concatenate([s.astype(np.float64) for s in shards], dim)

    def rank_main(g):
        out_shape = list(gathered.shape[:-1]) + [24]
        outs = [np.full(out_shape, np.nan, np.float32) for _ in bs]
        ag = np.full(gathered.shape, np.nan, np.float32)
        symm.fused_ag_mm(g, shards[g.rank], bs, dim, out=outs, ag_out=ag)
        return ag, outs

    for ag, outs in on_threads(rank_main, groups_of(world)):
        np.testing.assert_array_equal(ag.astype(np.float64), gathered)
        for out, b in zip(outs, bs):
            assert_close(out, gathered @ b.astype(np.float64))


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("dim", [0, 1, 2])
@pytest.mark.parametrize("op", ["sum", "avg"])
def test_mm_rs_every_scatter_dim(world, dim, op):
    a = inputs(world, (2 * world, world, 16), 3)
    b = inputs(world, (16, 8 * world), 4)
    total = sum(x.astype(np.float64) @ y.astype(np.float64) for x, y in zip(a, b))
    if op == "avg":
        total /= world
    want = np.split(total, world, axis=dim)

    def rank_main(g):
        out = np.full(want[g.rank].shape, np.nan, np.float32)
        symm.mm_rs(g, a[g.rank], b[g.rank], dim, op=op, out=out)
        return out

    for r, out in enumerate(on_threads(rank_main, groups_of(world))):
        assert_close(out, want[r])


@pytest.mark.parametrize("world", WORLDS)
def test_lc_allgather(world):
    xs = [x.astype(np.int32) for x in inputs(world, (7, 3), 5)]

    def rank_main(g):
        out = np.full((7 * world, 3), -1, np.int32)
        symm.lc_allgather(g, xs[g.rank], out=out)
        return out

    for out in on_threads(rank_main, groups_of(world)):
        np.testing.assert_array_equal(out, np.concatenate(xs))


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("algorithm", [None, "one_shot", "two_shot"])
def test_all_reduce(world, algorithm):
    # 1000 elements: uneven across 5 or 8 ranks' chunks.
    xs = inputs(world, (8, 125), 6)
    ref = sum(x.astype(np.float64) for x in xs)

    def rank_main(g):
        out = np.full((8, 125), np.nan, np.float32)
        symm.all_reduce(g, xs[g.rank], out=out, algorithm=algorithm)
        return out

    for out in on_threads(rank_main, groups_of(world)):
        assert_close(out, ref)


@pytest.mark.parametrize("world", WORLDS)
def test_all_reduce_rmsnorm(world):
    xs, (res,), (w,) = inputs(world, (3, 64), 7), inputs(1, (3, 64), 8), inputs(1, (64,), 9)
    total = sum(x.astype(np.float64) for x in xs) + res
    ref = total / np.sqrt((total**2).mean(-1, keepdims=True) + 1e-6) * w

    def rank_main(g):
        out, res_out = np.full((3, 64), np.nan, np.float32), np.full((3, 64), np.nan, np.float32)
        symm.all_reduce_rmsnorm(g, xs[g.rank], res, w, eps=1e-6, out=out, residual_out=res_out)
        return out, res_out

    for out, res_out in on_threads(rank_main, groups_of(world)):
        assert_close(res_out, total)
        assert_close(out, ref, 1e-4)


@pytest.mark.parametrize("world", WORLDS)
def test_one_rank_with_another_shape_fails_every_rank(world):
    xs = inputs(world, (4, 8), 10)

    def rank_main(g):
        x = xs[g.rank] if g.rank != world - 1 else np.ones((4, 9), np.float32)
        out = np.full(x.shape, np.nan, np.float32)
        with pytest.raises(symm.SymmError):
            symm.all_reduce(g, x, out=out)
        return out

    for out in on_threads(rank_main, groups_of(world)):
        assert np.isnan(out).all(), "a refused call wrote its output"
