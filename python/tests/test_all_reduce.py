"""symm.all_reduce and symm.all_reduce_rmsnorm on the host backend against
numpy float64 references: ranks as threads, poisoned outputs, every
algorithm, in place, strided, symmetric inputs, DLPack, bound calls, and
argument errors that fail every rank."""

import ml_dtypes
import numpy as np
import pytest
from fakes import DLPackOnly
from ranks import on_threads

import symm

TOLERANCE = {np.float32: 1e-5, np.float16: 2e-3, ml_dtypes.bfloat16: 1e-2}
DTYPES = list(TOLERANCE)
ALGORITHMS = [None, "one_shot", "two_shot"]


def groups_of(world):
    return symm.local_groups(world, backend="host", timeout_ms=10000)


def inputs(world, shape, dtype, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(shape).astype(dtype) for _ in range(world)]


def assert_close(got, ref, dtype):
    err = np.abs(got.astype(np.float64) - ref).max() / max(np.abs(ref).max(), 1e-30)
    assert err <= TOLERANCE[dtype], f"relative error {err:.2e} for {np.dtype(dtype).name}"


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_sum_and_avg(world, dtype, algorithm):
    xs = inputs(world, (5, 37), dtype, world)

    def rank_main(g):
        out = np.full((5, 37), np.nan, dtype)
        got = symm.all_reduce(g, xs[g.rank], out=out, algorithm=algorithm)
        assert got is out
        avg = symm.all_reduce(g, xs[g.rank], op="avg", algorithm=algorithm)
        assert avg.dtype == dtype and avg.shape == (5, 37)
        return out, avg

    ref = sum(x.astype(np.float64) for x in xs)
    results = on_threads(rank_main, groups_of(world))
    for out, avg in results:
        assert_close(out, ref, dtype)
        assert_close(avg, ref / world, dtype)
        np.testing.assert_array_equal(out, results[0][0])  # the same bits everywhere


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_in_place_strided_and_dlpack(algorithm):
    world = 3
    xs = inputs(world, (8, 12), np.float32, 1)
    ref = sum(x.astype(np.float64) for x in xs)

    def rank_main(g):
        x = xs[g.rank].copy()
        assert symm.all_reduce(g, x, inplace=True, algorithm=algorithm) is x
        whole = np.full((8, 24), np.nan, np.float32)
        symm.all_reduce(g, xs[g.rank].T, out=whole[:, ::2].T, algorithm=algorithm)
        assert np.isnan(whole[:, 1::2]).all(), "wrote outside the output"
        out = np.full((8, 12), np.nan, np.float32)
        symm.all_reduce(g, DLPackOnly(xs[g.rank]), out=out, algorithm=algorithm)
        return x, whole[:, ::2], out

    for x, strided, out in on_threads(rank_main, groups_of(world)):
        assert_close(x, ref, np.float32)
        assert_close(strided, ref, np.float32)
        assert_close(out, ref, np.float32)


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16, np.int32])
def test_zero_dimensional(dtype):
    """A 0-d array reduces as one element and stays 0-d, as torch's
    all_reduce and JAX's psum take scalars: given out=, allocated, in
    place, repeated (the kept call) and bound."""
    world = 3
    xs = [np.array(2.5 * (r + 1) if dtype != np.int32 else 7 * (r + 1), dtype) for r in range(world)]
    ref = sum(x.astype(np.float64) for x in xs)

    def rank_main(g):
        x, got = xs[g.rank], []
        for _ in range(2):
            out = np.array(np.nan if dtype != np.int32 else -1, dtype)
            assert symm.all_reduce(g, x, out=out) is out
            got.append(out)
        got.append(symm.all_reduce(g, x, op="avg"))
        y = x.copy()
        symm.all_reduce(g, y, inplace=True)
        got.append(y)
        got.append(symm.bind(symm.all_reduce, g, x)())
        return got

    for got in on_threads(rank_main, groups_of(world)):
        assert all(r.shape == () and r.dtype == dtype for r in got)
        for i in (0, 1, 3, 4):
            np.testing.assert_allclose(got[i].astype(np.float64), ref, rtol=1e-2)
        want_avg = ref / world if dtype != np.int32 else ref // world
        np.testing.assert_allclose(got[2].astype(np.float64), want_avg, rtol=1e-2)


def test_symmetric_input_and_plan():
    world = 2

    def rank_main(g):
        with g.create(1 << 16) as buf, buf.rendezvous():
            x = buf.array(np.float32, (64,), offset=512)
            x[:] = np.arange(64) + g.rank
            out = symm.all_reduce(g, x)
        plans = [g.plan("all_reduce", n, dtype="bf16") for n in (4096, 64 << 20)]
        return out, plans

    for out, plans in on_threads(rank_main, groups_of(world)):
        np.testing.assert_array_equal(out, 2 * np.arange(64) + 1)
        assert plans[0]["algorithm"] == "one_shot" and plans[1]["algorithm"] == "two_shot"
        assert 0 < plans[0]["total_ms"] < plans[1]["total_ms"]


INT_DTYPES = [np.int8, np.uint8, np.int32, np.int64]


def int_inputs(world, shape, dtype, seed):
    """Values f32 (and f64, summed) cannot hold: int64 near +-2^60 and its
    limits, int32 around 2^25 + 1 and its limits (sums wrap), int8 and
    uint8 over their whole range."""
    rng = np.random.default_rng(seed)
    info = np.iinfo(dtype)
    out = []
    for _ in range(world):
        if info.bits >= 32:
            base = (1 << 60) if info.bits == 64 else (1 << 25) + 1
            small = rng.integers(-(1 << 19), 1 << 19, shape)
            x = np.where(rng.random(shape) < 0.25, info.max - np.abs(small), base + small).astype(dtype)
            x = np.where(rng.random(shape) < 0.5, -x, x)
        else:
            x = rng.integers(info.min, info.max, shape, dtype, endpoint=True)
        out.append(x.astype(dtype))
    return out


def int_reference(xs, dtype, avg):
    """The sum wrapped to the type (Python integers, exact), divided
    truncating toward zero for an average, as NCCL's ncclAvg."""
    bits, signed = np.iinfo(dtype).bits, np.iinfo(dtype).min < 0
    flat = [x.reshape(-1).tolist() for x in xs]
    out = []
    for vals in zip(*flat):
        s = sum(vals) % (1 << bits)
        if signed and s >= 1 << (bits - 1):
            s -= 1 << bits
        if avg:
            s = abs(s) // len(xs) * (1 if s >= 0 else -1)
        out.append(s)
    return np.array(out, dtype).reshape(xs[0].shape)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("dtype", INT_DTYPES)
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_integers_sum_and_avg_exactly(world, dtype, algorithm):
    xs = int_inputs(world, (5, 37), dtype, world)

    def rank_main(g):
        out = np.full((5, 37), 0x5A, dtype)
        assert symm.all_reduce(g, xs[g.rank], out=out, algorithm=algorithm) is out
        avg = symm.all_reduce(g, xs[g.rank], op="avg", algorithm=algorithm)
        assert avg.dtype == dtype
        strided = np.full((5, 74), 0x5A, dtype)
        symm.all_reduce(g, xs[g.rank].T, out=strided[:, ::2].T, algorithm=algorithm)
        assert (strided[:, 1::2] == dtype(0x5A)).all(), "wrote outside the output"
        return out, avg, strided[:, ::2]

    want, want_avg = int_reference(xs, dtype, False), int_reference(xs, dtype, True)
    for out, avg, strided in on_threads(rank_main, groups_of(world)):
        np.testing.assert_array_equal(out, want)
        np.testing.assert_array_equal(avg, want_avg)
        np.testing.assert_array_equal(strided, want)


def test_integer_reference_wraps_and_truncates():
    i8 = [np.array([100, -3, 127], np.int8), np.array([100, 0, 1], np.int8)]
    np.testing.assert_array_equal(int_reference(i8, np.int8, False), [-56, -3, -128])
    np.testing.assert_array_equal(int_reference(i8, np.int8, True), [-28, -1, -64])
    big = (1 << 60) + 1
    i64 = [np.array([big, -7], np.int64), np.array([big + 2, -8], np.int64)]
    np.testing.assert_array_equal(int_reference(i64, np.int64, True), [big + 1, -7])


def test_integers_refused_by_the_rmsnorm_and_planned():
    def rank_main(g):
        x = np.ones((2, 8), np.int32)
        with pytest.raises(symm.SymmInvalidArgument, match="all_reduce_rmsnorm takes f32, bf16 or f16"):
            symm.all_reduce_rmsnorm(g, x, x.copy(), np.ones(8, np.int32))
        return g.plan("all_reduce", 4096, dtype="int64")

    for plan in on_threads(rank_main, groups_of(2)):
        assert plan["algorithm"] == "one_shot"


def test_rmsnorm_in_place_needs_a_writable_residual():
    """In place, the residual is an output: a read-only one is refused on
    its rank (the peers' calls fail with it) and left as it was."""

    def rank_main(g):
        x, w = np.ones((2, 8), np.float32), np.ones(8, np.float32)
        res = np.full((2, 8), 2.0, np.float32)
        res.flags.writeable = g.rank != 0
        want = symm.SymmInvalidArgument if g.rank == 0 else symm.SymmRemoteError
        with pytest.raises(want, match="residual is read-only" if g.rank == 0 else "rank 0"):
            symm.all_reduce_rmsnorm(g, x, res, w, inplace=True)
        assert (res == 2.0).all()

    on_threads(rank_main, groups_of(2))


def rmsnorm_ref(s, residual, weight, eps, dtype):
    r = (s.astype(dtype).astype(np.float64) + residual.astype(np.float64)).astype(dtype).astype(np.float64)
    inv = 1 / np.sqrt((r * r).mean(axis=-1, keepdims=True) + eps)
    return r * inv * weight.astype(np.float64), r


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_rmsnorm(world, dtype, algorithm):
    tokens, hidden, eps = 3, 64, 1e-6
    xs = inputs(world, (tokens, hidden), dtype, 3)
    (residual,) = inputs(1, (tokens, hidden), dtype, 4)
    (weight,) = inputs(1, (hidden,), dtype, 5)
    want, r = rmsnorm_ref(sum(x.astype(np.float64) for x in xs), residual, weight, eps, dtype)

    def rank_main(g):
        out, ro = symm.all_reduce_rmsnorm(g, xs[g.rank], residual, weight, eps, algorithm=algorithm)
        res = residual.copy()
        out2, ro2 = symm.all_reduce_rmsnorm(g, xs[g.rank], res, weight, eps, algorithm=algorithm, inplace=True)
        assert ro2 is res
        return out, ro, out2, ro2

    for out, ro, out2, ro2 in on_threads(rank_main, groups_of(world)):
        for o, x in ((out, ro), (out2, ro2)):
            assert_close(o, want, dtype)
            assert_close(x, r, dtype)


def test_bound_all_reduce_repeats():
    world = 2
    xs = inputs(world, (16,), np.float32, 6)

    def rank_main(g):
        x = xs[g.rank].copy()
        call = symm.bind(symm.all_reduce, g, x, algorithm="one_shot")
        outs = []
        for k in range(3):
            x[:] = xs[g.rank] * (k + 1)
            outs.append(call().copy())
        return outs

    for outs in on_threads(rank_main, groups_of(world)):
        for k, out in enumerate(outs):
            assert_close(out, (k + 1) * sum(x.astype(np.float64) for x in xs), np.float32)


def test_errors_fail_every_rank():
    def mismatch(g):
        with pytest.raises(symm.SymmMismatchError, match="input.shape"):
            symm.all_reduce(g, np.ones((4 + g.rank,), np.float32))
        with pytest.raises(symm.SymmMismatchError, match="algorithm"):
            symm.all_reduce(g, np.ones(4, np.float32), algorithm="one_shot" if g.rank else "two_shot")

    on_threads(mismatch, groups_of(2))

    def bad_out(g):
        out = np.zeros(3 if g.rank == 1 else 4, np.float32)
        err = symm.SymmInvalidArgument if g.rank == 1 else symm.SymmRemoteError
        with pytest.raises(err, match="output.shape"):
            symm.all_reduce(g, np.ones(4, np.float32), out=out)
        with pytest.raises(ValueError, match="algorithm"):
            symm.all_reduce(g, np.ones(4, np.float32), algorithm="three_shot")

    on_threads(bad_out, groups_of(3))

    def bad_weight(g):
        x = np.ones((2, 8), np.float32)
        with pytest.raises((symm.SymmInvalidArgument, symm.SymmRemoteError), match="weight.shape"):
            symm.all_reduce_rmsnorm(g, x, x.copy(), np.ones(4 if g.rank == 0 else 8, np.float32))

    on_threads(bad_weight, groups_of(2))
