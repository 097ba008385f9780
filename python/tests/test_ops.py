"""The operations on the host backend against numpy float64 references:
ranks as threads, seeded inputs, outputs poisoned beforehand, and argument
errors that fail every rank instead of hanging any."""

import ml_dtypes
import numpy as np
import pytest
from fakes import DLPackOnly, FakeCudaArray
from ranks import on_threads

import symm

# Largest error allowed, relative to the reference's largest magnitude:
# inputs are exact in the dtype and products are summed in f32, so the
# error is the output's rounding to the dtype (half an ulp: 2^-9 for bf16,
# 2^-12 for f16), up to once per rank where partial sums are rounded.
TOLERANCE = {np.float32: 1e-5, np.float16: 2e-3, ml_dtypes.bfloat16: 1e-2}
DTYPES = list(TOLERANCE)


def random(rng, shape, dtype):
    return rng.standard_normal(shape).astype(dtype)


def assert_close(got, ref, dtype):
    err = np.abs(got.astype(np.float64) - ref).max() / np.abs(ref).max()
    assert err <= TOLERANCE[dtype], f"relative error {err:.2e} > {TOLERANCE[dtype]:.0e} for {np.dtype(dtype).name}"


def poisoned(shape, dtype):
    """An output that shows any element the operation failed to write (NaN)."""
    return np.full(shape, np.nan, dtype)


def strided_poisoned(shape, dtype):
    """A poisoned output with gaps: every other column of a larger array.
    Returns (output view, the whole array) to check the gaps stay NaN."""
    whole = poisoned((*shape[:-1], 2 * shape[-1]), dtype)
    return whole[..., ::2], whole


def groups_of(world):
    return symm.local_groups(world, backend="host", timeout_ms=10000)


# --- fused all-gather + matmul --------------------------------------------------
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("dtype", DTYPES)
def test_ag_mm_2d_allocated_outputs(world, dtype):
    rng = np.random.default_rng(1)
    shards = [random(rng, (6, 16), dtype) for _ in range(world)]
    b = random(rng, (16, 10), dtype)

    def rank_main(g):
        return symm.fused_ag_mm(g, shards[g.rank], b, 0, return_ag=True)

    gathered = np.concatenate(shards).astype(np.float64)
    for ag, out in on_threads(rank_main, groups_of(world)):
        assert ag.dtype == dtype and out.dtype == dtype and out.shape == (6 * world, 10)
        np.testing.assert_array_equal(ag.astype(np.float64), gathered)
        assert_close(out, gathered @ b.astype(np.float64), dtype)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("dtype", DTYPES)
def test_ag_mm_3d_middle_dim_two_bs_into_strided_outputs(world, dtype):
    rng = np.random.default_rng(2)
    shards = [random(rng, (2, 3, 16), dtype) for _ in range(world)]
    bs = [random(rng, (16, 7), dtype), random(rng, (16, 5), dtype)]
    gathered = np.concatenate(shards, axis=1).astype(np.float64)

    def rank_main(g):
        outs = [strided_poisoned((2, 3 * world, b.shape[1]), dtype) for b in bs]
        ag = poisoned((2, 3 * world, 16), dtype)
        got = symm.fused_ag_mm(g, shards[g.rank], bs, 1, out=[o for o, _ in outs], ag_out=ag)
        assert got[0] is outs[0][0] and got[1] is outs[1][0]
        np.testing.assert_array_equal(ag.astype(np.float64), gathered)
        for (view, whole), b in zip(outs, bs):
            assert_close(view, gathered @ b.astype(np.float64), dtype)
            assert np.isnan(whole[..., 1::2].astype(np.float32)).all(), "wrote outside the output"

    on_threads(rank_main, groups_of(world))


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("dtype", DTYPES)
def test_ag_mm_gather_along_k_from_transposed_shards(world, dtype):
    """gather_dim is the last dimension (K grows to K * world), given as -1,
    and each shard is a transposed (non-contiguous) view."""
    rng = np.random.default_rng(3)
    shards = [random(rng, (8, 5), dtype).T for _ in range(world)]  # [5, 8], strides (1, 5)
    b = random(rng, (8 * world, 6), dtype)
    gathered = np.concatenate(shards, axis=1).astype(np.float64)

    def rank_main(g):
        return symm.fused_ag_mm(g, shards[g.rank], [b], -1)

    for (out,) in on_threads(rank_main, groups_of(world)):
        assert_close(out, gathered @ b.astype(np.float64), dtype)


# --- matmul + reduce-scatter -------------------------------------------------------
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("dtype", DTYPES)
def test_mm_rs_2d_sum(world, dtype):
    rng = np.random.default_rng(4)
    a = [random(rng, (6, 16), dtype) for _ in range(world)]
    b = [random(rng, (16, 8), dtype) for _ in range(world)]
    total = sum(x.astype(np.float64) @ y.astype(np.float64) for x, y in zip(a, b))

    def rank_main(g):
        return symm.mm_rs(g, a[g.rank], b[g.rank], 0)

    for r, out in enumerate(on_threads(rank_main, groups_of(world))):
        assert out.shape == (6 // world, 8) and out.dtype == dtype
        assert_close(out, np.split(total, world, axis=0)[r], dtype)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scatter_dim", [1, -1])
def test_mm_rs_3d_avg_into_strided_output(world, dtype, scatter_dim):
    rng = np.random.default_rng(5)
    a = [random(rng, (2, 6, 16), dtype) for _ in range(world)]
    b = [random(rng, (16, 6), dtype) for _ in range(world)]
    mean = sum(x.astype(np.float64) @ y.astype(np.float64) for x, y in zip(a, b)) / world

    def rank_main(g):
        shape = [2, 6, 6]
        shape[scatter_dim] //= world
        out, whole = strided_poisoned(tuple(shape), dtype)
        assert symm.mm_rs(g, a[g.rank], b[g.rank], scatter_dim, op="avg", out=out) is out
        assert_close(out, np.split(mean, world, axis=scatter_dim)[g.rank], dtype)
        assert np.isnan(whole[..., 1::2].astype(np.float32)).all(), "wrote outside the output"

    on_threads(rank_main, groups_of(world))


def test_mm_rs_into_symmetric_memory_agreed_by_every_rank():
    """`out` inside a rendezvoused buffer, at the same offset on every rank:
    the sums land there. Where `out` lies is an agreed argument (the fused
    kernel lets peers write into it), so a rank whose `out` is elsewhere
    fails every rank with a mismatch instead of any rank hanging."""
    world, dtype = 2, np.float32
    rng = np.random.default_rng(8)
    a = [random(rng, (4, 16), dtype) for _ in range(world)]
    b = [random(rng, (16, 8), dtype) for _ in range(world)]
    total = sum(x.astype(np.float64) @ y.astype(np.float64) for x, y in zip(a, b))

    def rank_main(g):
        with g.create(4096) as buf, buf.rendezvous():
            out = buf.array(dtype, (2, 8), offset=512)
            out[:] = np.nan
            assert symm.mm_rs(g, a[g.rank], b[g.rank], 0, out=out) is out
            assert_close(out, np.split(total, world, axis=0)[g.rank], dtype)
            # A call that neither rank made before (a repeated call skips the
            # agreement): rank 0's out elsewhere in the buffer, rank 1's not in it.
            elsewhere = poisoned((2, 8), dtype) if g.rank == 1 else buf.array(dtype, (2, 8), offset=1024)
            with pytest.raises(symm.SymmMismatchError, match="out memory"):
                symm.mm_rs(g, a[g.rank], b[g.rank], 0, out=elsewhere)
            if g.rank == 1:
                assert np.isnan(elsewhere).all(), "the failed call wrote its output"

    on_threads(rank_main, groups_of(world))


# --- copy-engine all-gather -------------------------------------------------------
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("dtype", [np.float32, np.float16, ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn])
def test_lc_allgather_is_exact(world, dtype):
    rng = np.random.default_rng(6)
    xs = [random(rng, (3, 10), dtype)[:, ::2] for _ in range(world)]  # strided inputs
    gathered = np.concatenate(xs)

    def rank_main(g):
        out = poisoned((3 * world, 5), dtype)
        assert symm.lc_allgather(g, xs[g.rank], out=out) is out
        allocated = symm.lc_allgather(g, xs[g.rank])
        for got in (out, allocated):
            np.testing.assert_array_equal(got.view(np.uint8), gathered.view(np.uint8))

    on_threads(rank_main, groups_of(world))


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("dtype", [np.int8, np.uint8, np.int32, np.int64])
def test_lc_allgather_integers_bit_exact(world, dtype):
    rng = np.random.default_rng(8)
    info = np.iinfo(dtype)
    xs = [rng.integers(info.min, info.max, (3, 10), dtype, endpoint=True)[:, ::2] for _ in range(world)]
    gathered = np.concatenate(xs)

    def rank_main(g):
        out = np.full((3 * world, 5), 0x5A, dtype)
        assert symm.lc_allgather(g, xs[g.rank], out=out) is out
        allocated = symm.lc_allgather(g, xs[g.rank])
        assert allocated.dtype == dtype
        for got in (out, allocated):
            np.testing.assert_array_equal(got, gathered)

    on_threads(rank_main, groups_of(world))


def test_lc_allgather_from_symmetric_memory():
    """An input inside a rendezvoused buffer, at the same offset on every rank."""
    world = 3

    def rank_main(g):
        with g.create(4096) as buf, buf.rendezvous() as h:
            x = buf.array(np.float32, (4, 8), offset=256)
            x[:] = np.arange(32).reshape(4, 8) + 100 * g.rank
            h.barrier()
            out = symm.lc_allgather(g, x)
            h.barrier()  # peers may still read x until every rank is done
        expect = np.concatenate([np.arange(32).reshape(4, 8) + 100 * r for r in range(world)])
        np.testing.assert_array_equal(out, expect)

    on_threads(rank_main, groups_of(world))


def test_reserved_workspace_serves_the_operation():
    rng = np.random.default_rng(7)
    xs = [random(rng, (64, 64), np.float32) for _ in range(2)]

    def rank_main(g):
        g.reserve_workspace(1 << 20)
        return symm.lc_allgather(g, xs[g.rank])

    for out in on_threads(rank_main, groups_of(2)):
        np.testing.assert_array_equal(out, np.concatenate(xs))


def test_dlpack_inputs():
    """Inputs that speak only DLPack work; outputs like them cannot be
    allocated, so ``out`` is required."""
    rng = np.random.default_rng(8)
    shards = [random(rng, (4, 8), np.float32) for _ in range(2)]
    b = random(rng, (8, 3), np.float32)

    def rank_main(g):
        out = poisoned((8, 3), np.float32)
        symm.fused_ag_mm(g, DLPackOnly(shards[g.rank]), DLPackOnly(b), 0, out=out)
        assert_close(out, np.concatenate(shards).astype(np.float64) @ b, np.float32)
        with pytest.raises(symm.SymmInvalidArgument, match="pass out="):
            symm.fused_ag_mm(g, DLPackOnly(shards[g.rank]), b, 0)

    on_threads(rank_main, groups_of(2))


# --- bound calls ------------------------------------------------------------------
@pytest.mark.parametrize("world", [2, 3])
def test_bound_calls_repeat_the_operations(world):
    """Each bound operation, called three times on inputs changed in place
    between calls, computes what the plain call computes on each; outputs
    it allocated at bind time are returned every time."""
    rng = np.random.default_rng(11)
    dtype = ml_dtypes.bfloat16
    shards = [random(rng, (4, 16), dtype) for _ in range(world)]
    rows = [random(rng, (4 * world, 16), dtype) for _ in range(world)]
    b = random(rng, (16, 8), dtype)

    def rank_main(g):
        me = g.rank
        out = poisoned((4 * world, 8), dtype)
        ag_mm = symm.bind(symm.fused_ag_mm, g, shards[me], b, 0, out=out)
        mm_rs = symm.bind(symm.mm_rs, g, rows[me], b, 0, op="avg")
        gather = symm.bind(symm.lc_allgather, g, shards[me])
        results = []
        for step in range(3):
            out[:] = np.nan
            shards[me][0, 0] = step  # the same arrays, new values
            rows[me][0, 0] = step
            g_barrier(g)
            assert ag_mm() is out
            rs = mm_rs()
            gathered = gather()
            results.append((out.copy(), rs.copy(), gathered.copy(), rs is mm_rs(), gathered is gather()))
            g_barrier(g)
        return results

    for rank, results in enumerate(on_threads(rank_main, groups_of(world))):
        for step, (ag, rs, gathered, same_rs, same_gathered) in enumerate(results):
            snap = [x.astype(np.float64) for x in shards]
            snap_rows = [x.astype(np.float64) for x in rows]
            for x in snap + snap_rows:
                x[0, 0] = step
            assert_close(ag, np.concatenate(snap) @ b.astype(np.float64), dtype)
            mean = sum(snap_rows) / world @ b.astype(np.float64)
            assert_close(rs, mean[4 * rank : 4 * rank + 4], dtype)
            np.testing.assert_array_equal(gathered.astype(np.float64), np.concatenate(snap))
            assert same_rs and same_gathered, "a bound call returns the outputs it allocated at bind time"


def g_barrier(g):
    """Every rank here before any goes on (an all-gather of one value)."""
    symm.lc_allgather(g, np.zeros(1, np.float32))


def test_bind_rejects_what_it_cannot_read_and_peers_learn_at_their_call():
    """An argument Python cannot read fails at bind, on that rank; the
    peer, whose bind succeeded, fails at its first call with
    SymmRemoteError instead of waiting. bind takes only symm's operations."""
    a, b = np.ones((4, 8), np.float32), np.ones((8, 3), np.float32)

    def rank_main(g):
        if g.rank == 1:
            with pytest.raises(symm.SymmInvalidArgument, match="a has dtype float64"):
                symm.bind(symm.mm_rs, g, a.astype(np.float64), b, 0)
        else:
            call = symm.bind(symm.mm_rs, g, a, b, 0)
            with pytest.raises(symm.SymmRemoteError, match="rank 1"):
                call()

    on_threads(rank_main, groups_of(2))
    (g,) = groups_of(1)
    with pytest.raises(TypeError, match="bind takes"):
        symm.bind(np.matmul, g, a, b)
    call = symm.bind(symm.lc_allgather, g, a)
    g.close()
    with pytest.raises(symm.SymmInvalidHandle, match="closed"):
        call()
    with pytest.raises(symm.SymmInvalidHandle, match="closed"):
        symm.bind(symm.lc_allgather, g, a)  # at once, not at the first call


# --- argument errors --------------------------------------------------------------
def fail_on_rank_1(call, error, match, then=None):
    """Rank 1 makes a bad call: it raises ``error``; rank 0, whose own call
    is fine, learns of it (SymmRemoteError) instead of timing out. Then
    every rank runs ``then(group)`` if given: the ranks' results."""

    def rank_main(g):
        if g.rank == 1:
            with pytest.raises(error, match=match):
                call(g, bad=True)
        else:  # the reason itself, as the failing rank's library would quote it
            with pytest.raises(symm.SymmRemoteError, match="rank 1: .*" + match):
                call(g, bad=False)
        return then(g) if then else None

    return on_threads(rank_main, groups_of(2))


def test_library_rejection_on_one_rank_fails_all():
    a, b = np.ones((4, 8), np.float32), np.ones((8, 3), np.float32)
    fail_on_rank_1(lambda g, bad: symm.fused_ag_mm(g, a, b[:7] if bad else b, 0), symm.SymmInvalidArgument, r"bs\[0\]")


def test_python_side_rejection_on_one_rank_fails_all():
    a, b = np.ones((4, 8), np.float32), np.ones((8, 3), np.float32)

    def call(g, bad):
        return symm.mm_rs(g, a.astype(np.float64) if bad else a, b, 0)

    fail_on_rank_1(call, symm.SymmInvalidArgument, "a has dtype float64")


class BrokenStream:
    """A stream object whose protocol raises."""

    def __cuda_stream__(self):
        raise RuntimeError("stream gone")


def test_any_python_side_failure_on_one_rank_fails_all_and_the_group_goes_on():
    """Whatever fails on one rank before its call reaches the library (a
    misspelt algorithm, checked with the other arguments; an eps no float
    holds; a stream object that raises; an output that cannot be allocated;
    the same in bind) fails there as a SymmError, and reaches the peer at
    once as SymmRemoteError instead of its timeout; the group goes on."""
    a, b, w = np.ones((4, 8), np.float32), np.ones((8, 3), np.float32), np.ones(8, np.float32)
    # [8, 2**50]: an output [8, 2**50] of f32 is more memory than there is.
    endless_b = np.lib.stride_tricks.as_strided(b, shape=(8, 1 << 50), strides=(0, 0))
    cases = [
        (lambda g, bad: symm.all_reduce(g, a, algorithm="twoshot" if bad else None), "algorithm is 'twoshot'"),
        (lambda g, bad: symm.mm_rs(g, a, b, 0, algorithm="fast" if bad else None), "algorithm is 'fast'"),
        (lambda g, bad: symm.fused_ag_mm(g, a, b, 0, algorithm=["fast"] if bad else None), "algorithm is \\['fast'\\]"),
        (lambda g, bad: symm.all_reduce_rmsnorm(g, a, a, w, eps=10**400 if bad else 1e-6), "eps is not a float"),
        (lambda g, bad: symm.all_reduce(g, a, stream=BrokenStream() if bad else None), "RuntimeError: stream gone"),
        (lambda g, bad: symm.bind(symm.all_reduce, g, a, algorithm="twoshot" if bad else None)(), "algorithm is"),
    ]
    for call, match in cases:
        check_rank_1_fails_and_group_goes_on(call, symm.SymmInvalidArgument, match)
    oom = lambda g, bad: symm.fused_ag_mm(g, a, endless_b if bad else b, 0)  # noqa: E731
    check_rank_1_fails_and_group_goes_on(oom, symm.SymmOutOfMemoryError, "MemoryError")


@pytest.mark.parametrize("how", ["keyword", "positional", "bound"])
def test_arguments_that_do_not_fit_the_signature_fail_all(how):
    """A keyword the operation does not take, or one argument too many, is
    Python's TypeError on its rank and the peers' SymmRemoteError at once,
    as any bad argument: not a wait for the timeout."""
    x = np.ones((2, 3), np.float32)
    bad = {
        "keyword": lambda g: symm.all_reduce(g, x, inplcae=True),
        "positional": lambda g: symm.all_reduce(g, x, "sum", None, None, None, False, "extra"),
        "bound": lambda g: symm.bind(symm.all_reduce, g, x, outt=None)(),
    }[how]

    def call(g, bad_here):
        return bad(g) if bad_here else symm.all_reduce(g, x)

    check_rank_1_fails_and_group_goes_on(lambda g, bad: call(g, bad), TypeError, "argument")


def check_rank_1_fails_and_group_goes_on(call, error, match):
    """``fail_on_rank_1``, then an all-reduce on the same group."""
    x = [np.arange(6, dtype=np.float32).reshape(2, 3) * (r + 1) for r in range(2)]

    def all_reduce(g):
        return symm.all_reduce(g, x[g.rank], out=poisoned((2, 3), np.float32))

    for got in fail_on_rank_1(call, error, match, then=all_reduce):
        np.testing.assert_array_equal(got.astype(np.float64), x[0].astype(np.float64) * 3)


def test_ranks_that_disagree_all_fail_with_mismatch():
    def rank_main(g):
        with pytest.raises(symm.SymmMismatchError):
            symm.lc_allgather(g, np.ones((4 + g.rank, 2), np.float32))

    on_threads(rank_main, groups_of(2))


def test_output_and_argument_checks():
    (g,) = groups_of(1)
    a, b = np.ones((4, 8), np.float32), np.ones((8, 3), np.float32)
    readonly = np.zeros((4, 3), np.float32)
    readonly.flags.writeable = False
    cases = [
        (lambda: symm.fused_ag_mm(g, a, b, 0, out=readonly), "out\\[0\\] is read-only"),
        (lambda: symm.fused_ag_mm(g, a, b, 0, out=np.zeros((4, 4), np.float32)), "shape"),
        (lambda: symm.fused_ag_mm(g, a, b, 2), "gather_dim is 2"),
        (lambda: symm.fused_ag_mm(g, a, b, None), "gather_dim must be an int, got None \\["),
        (lambda: symm.fused_ag_mm(g, a, b, 0.0), "gather_dim must be an int, got 0.0 \\["),
        (lambda: symm.fused_ag_mm(g, a, b, "0"), "gather_dim must be an int, got '0' \\["),
        (lambda: symm.mm_rs(g, a, b, None), "scatter_dim must be an int, got None \\["),
        (lambda: symm.fused_ag_mm(g, a, [b, b], 0, out=[np.zeros((4, 3), np.float32)]), "1 outputs for 2 B"),
        (lambda: symm.fused_ag_mm(g, a, b[None], 0), "bs\\[0\\] has 3 dimensions"),
        (lambda: symm.mm_rs(g, a, b, 0, op="max"), "op is 'max'"),
        (lambda: symm.mm_rs(g, [[1.0]], b, 0), "list is not an array"),
        (lambda: symm.lc_allgather(g, FakeCudaArray(shape=(2,), typestr="<f4", data=(4096, False))), "cuda memory"),
        (lambda: symm.lc_allgather(g, a, stream="s"), "stream must be"),
    ]
    for call, match in cases:
        with pytest.raises(symm.SymmInvalidArgument, match=match):
            call()
    g.close()
    with pytest.raises(symm.SymmInvalidHandle, match="closed"):
        symm.lc_allgather(g, a)


@pytest.mark.parametrize("world", [1, 2])
def test_algorithm_keyword(world):
    """A forced algorithm runs (the same result for each), "fused" where the
    fused kernel cannot run (the host backend) fails on every rank, an
    unknown name fails before the call, and the default is the plan query's
    choice."""
    rng = np.random.default_rng(3)
    a = [random(rng, (2 * world, 16), np.float32) for _ in range(world)]
    b = random(rng, (16, 4), np.float32)
    full = np.concatenate(a).astype(np.float64)
    total = sum(x.astype(np.float64) @ b for x in a)

    def rank(g):
        r = g.rank
        assert g.plan("mm_rs", 2 * world, 16, 4, "f32")["algorithm"] == "sequential"
        for algorithm in (None, "sequential", "pipelined"):
            got = symm.mm_rs(g, a[r], b, 0, algorithm=algorithm)
            assert_close(got, np.split(total, world)[r], np.float32)
            assert_close(symm.fused_ag_mm(g, a[r], b, 0, algorithm=algorithm), full @ b, np.float32)
        if world > 1:
            with pytest.raises(symm.SymmUnsupported, match="options ask for the fused algorithm"):
                symm.mm_rs(g, a[r], b, 0, algorithm="fused")
            with pytest.raises(symm.SymmUnsupported, match="options ask for the fused algorithm"):
                symm.fused_ag_mm(g, a[r], b, 0, algorithm="fused")
        with pytest.raises(ValueError, match="algorithm is 'fastest'"):
            symm.mm_rs(g, a[r], b, 0, algorithm="fastest")

    on_threads(rank, groups_of(world))


def test_ranks_forcing_different_algorithms_mismatch():
    rng = np.random.default_rng(4)
    a = [random(rng, (4, 16), np.float32) for _ in range(2)]
    b = random(rng, (16, 4), np.float32)

    def rank(g):
        with pytest.raises(symm.SymmMismatchError, match="algorithm is sequential on rank 0 but pipelined on rank 1"):
            symm.mm_rs(g, a[g.rank], b, 0, algorithm=["sequential", "pipelined"][g.rank])

    on_threads(rank, groups_of(2))
