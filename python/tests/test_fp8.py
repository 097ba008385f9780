"""Scaled fp8 matmuls on the host backend with ml_dtypes arrays, against
float64 references of ``torch._scaled_mm``'s definition:
``(a * a_scale) @ (b * b_scale) + bias``, with fp8 values decoded by
ml_dtypes (independently of the library)."""

import ml_dtypes
import numpy as np
import pytest
from ranks import on_threads

import symm

E4M3, E5M2 = ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2
BF16 = ml_dtypes.bfloat16
TOLERANCE = {np.dtype(np.float32): 1e-5, np.dtype(np.float16): 2e-3, np.dtype(BF16): 1e-2}


def fp8(rng, shape, dtype=E4M3):
    return rng.uniform(-4, 4, shape).astype(dtype)


def weight_t(rng, k, n, dtype=E4M3):
    """B as torch._scaled_mm wants it: column-major, ``w.T`` of a row-major [N, K]."""
    return fp8(rng, (n, k), dtype).T


def scales(rng, shape):
    return rng.uniform(0.25, 2, shape).astype(np.float32)


def f64(x):
    return np.asarray(x).astype(np.float64)


def assert_close(got, ref):
    err = np.abs(f64(got) - ref).max() / np.abs(ref).max()
    assert err <= TOLERANCE[got.dtype], f"relative error {err:.2e} for {got.dtype}"


def groups_of(world):
    return symm.local_groups(world, backend="host", timeout_ms=10000)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("row_wise", [False, True])
@pytest.mark.parametrize("gather_dim", [0, 1])
def test_ag_mm_scaled_with_bias(world, row_wise, gather_dim):
    """Shards [2, 3, 32] gathered along dim 0 or 1; two Bs (e4m3 and e5m2),
    the second with a bias; bf16 outputs allocated."""
    rng = np.random.default_rng(10 + world)
    shards = [fp8(rng, (2, 3, 32)) for _ in range(world)]
    bs = [weight_t(rng, 32, 16), weight_t(rng, 32, 32, E5M2)]
    a_scales = [scales(rng, (2, 3, 1) if row_wise else (1,)) for _ in range(world)]
    if not row_wise:
        a_scales = [a_scales[0]] * world  # tensor-wise: one value for the whole gathered A
    b_scales = [scales(rng, (1, b.shape[1]) if row_wise else (1,)) for b in bs]
    bias = rng.standard_normal(32).astype(BF16)

    def rank_main(g):
        r = g.rank
        return symm.fused_ag_mm(
            g,
            shards[r],
            bs,
            gather_dim,
            return_ag=True,
            a_scale=a_scales[r],
            b_scales=b_scales,
            biases=[None, bias],
            out_dtype=BF16,
        )

    gathered = np.concatenate([f64(s) * f64(sa) for s, sa in zip(shards, a_scales)], axis=gather_dim)
    for ag, outs in on_threads(rank_main, groups_of(world)):
        assert ag.dtype == E4M3
        np.testing.assert_array_equal(f64(ag), np.concatenate([f64(s) for s in shards], axis=gather_dim))
        for i, (out, b, sb) in enumerate(zip(outs, bs, b_scales)):
            assert out.dtype == BF16
            ref = gathered @ (f64(b) * f64(sb))
            assert_close(out, ref + (f64(bias) if i == 1 else 0))


@pytest.mark.parametrize("out_dtype", [np.float32, np.float16])
def test_ag_mm_gathering_k_tensor_wise_into_given_outputs(out_dtype):
    world = 2
    rng = np.random.default_rng(20)
    shards = [fp8(rng, (5, 16), E5M2) for _ in range(world)]
    b = weight_t(rng, 16 * world, 48)
    sa, sb = np.array([0.5], np.float32), np.array([[3.0]], np.float32)

    def rank_main(g):
        out = np.full((5, 48), np.nan, out_dtype)
        symm.fused_ag_mm(g, shards[g.rank], b, -1, out=out, a_scale=sa, b_scales=sb)
        return out

    ref = np.concatenate([f64(s) for s in shards], axis=1) @ f64(b) * 1.5
    for out in on_threads(rank_main, groups_of(world)):
        assert_close(out, ref)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("row_wise", [False, True])
@pytest.mark.parametrize("scatter_dim", [0, 1])
def test_mm_rs_scaled_bias_in_every_rank(world, row_wise, scatter_dim):
    """As torch's fused_scaled_matmul_reduce_scatter: every rank's product
    includes its bias, and the sum adds them all."""
    rng = np.random.default_rng(30 + world)
    n = 16 * world
    a = [fp8(rng, (4 * world, 32)) for _ in range(world)]
    b = [weight_t(rng, 32, n) for _ in range(world)]
    sa = [scales(rng, (4 * world, 1) if row_wise else (1,)) for _ in range(world)]
    sb = [scales(rng, (1, n) if row_wise else (1,)) for _ in range(world)]
    bias = [rng.standard_normal(n).astype(np.float16) for _ in range(world)]

    def rank_main(g):
        r = g.rank
        return symm.mm_rs(g, a[r], b[r], scatter_dim, a_scale=sa[r], b_scale=sb[r], bias=bias[r], out_dtype=np.float16)

    total = sum((f64(x) * f64(s)) @ (f64(y) * f64(t)) + f64(c) for x, y, s, t, c in zip(a, b, sa, sb, bias))
    for r, out in enumerate(on_threads(rank_main, groups_of(world))):
        assert out.dtype == np.float16
        assert_close(out, np.split(total, world, axis=scatter_dim)[r])


def test_mm_rs_avg_f32_from_a_transposed_a():
    """A column-major (transposed) fp8 ``a`` is packed K-major by symm."""
    world = 2
    rng = np.random.default_rng(40)
    a = [fp8(rng, (32, 8)).T for _ in range(world)]  # [8, 32], strides (1, 8)
    b = [weight_t(rng, 32, 16, E5M2) for _ in range(world)]
    sa = [scales(rng, (8, 1)) for _ in range(world)]
    sb = [scales(rng, (1, 16)) for _ in range(world)]

    def rank_main(g):
        r = g.rank
        return symm.mm_rs(g, a[r], b[r], 0, op="avg", a_scale=sa[r], b_scale=sb[r], out_dtype=np.float32)

    mean = sum((f64(x) * f64(s)) @ (f64(y) * f64(t)) for x, y, s, t in zip(a, b, sa, sb)) / world
    for r, out in enumerate(on_threads(rank_main, groups_of(world))):
        assert_close(out, np.split(mean, world)[r])


def test_fp8_argument_errors_fail_every_rank():
    rng = np.random.default_rng(50)
    a, b = fp8(rng, (4, 32)), weight_t(rng, 32, 16)
    one = np.ones(1, np.float32)
    cases = [
        ({"bs": b}, symm.SymmInvalidArgument, "fp8 matmuls need scales"),
        ({"bs": np.ascontiguousarray(b), "a_scale": one, "b_scales": one}, symm.SymmUnsupported, "column-major"),
        (
            {"bs": b, "a_scale": one, "b_scales": one, "out_dtype": BF16, "result_scales": one},
            symm.SymmInvalidArgument,
            "a result scale applies to fp8 outputs only",
        ),
        (
            {"bs": b, "a_scale": one, "b_scales": one, "result_scales": np.ones(2, np.float32)},
            symm.SymmInvalidArgument,
            "expected one element",
        ),
        ({"bs": b, "a_scale": one.astype(BF16), "b_scales": one}, symm.SymmInvalidArgument, "scales are f32"),
        (
            {"bs": b, "a_scale": one, "b_scales": one, "biases": np.zeros(16, BF16), "out_dtype": np.float32},
            symm.SymmUnsupported,
            "bias needs a bf16, f16 or fp8 output",
        ),
    ]

    def rank_main(g):
        for kwargs, error, match in cases:
            with pytest.raises(error, match=match):
                symm.fused_ag_mm(g, a, gather_dim=0, **kwargs)
        with pytest.raises(symm.SymmInvalidArgument, match="scales apply to fp8 matmuls only"):
            symm.mm_rs(g, a.astype(np.float32), f64(b).astype(np.float32), 0, a_scale=one, b_scale=one)

    on_threads(rank_main, groups_of(2))


# --- fp8 outputs: the reference is exact (small dyadic inputs, power-of-two
# scales), then clamped to the format's largest finite value and rounded by
# ml_dtypes' own conversion (round to nearest even), not by symm. ------------
FP8_MAX = {np.dtype(E4M3): 448.0, np.dtype(E5M2): 57344.0}


def dyadic(rng, shape, dtype):
    """Values of at most 3 significant bits in [-4, 4]: exact in every format."""
    return (rng.integers(-8, 9, shape) / 2.0).astype(dtype)


def rounded(ref, dtype):
    """``ref`` (float64, exact) as an fp8 output: saturated, NaN kept."""
    m = FP8_MAX[np.dtype(dtype)]
    return np.where(np.isnan(ref), np.nan, np.clip(ref, -m, m)).astype(dtype)


def assert_fp8_equal(got, want):
    assert got.dtype == want.dtype
    g, w = f64(got), f64(want)
    assert np.array_equal(np.isnan(g), np.isnan(w))
    ok = ~np.isnan(w)
    np.testing.assert_array_equal(g[ok], w[ok])


def exercised(ref, dtype):
    """The reference meets saturation, NaN and exact ties between codes."""
    codes = f64(np.arange(256, dtype=np.uint8).view(dtype))
    values = np.unique(codes[np.isfinite(codes)])
    midpoints = (values[1:] + values[:-1]) / 2
    finite = ref[~np.isnan(ref)]
    saturated = (np.abs(finite) > FP8_MAX[np.dtype(dtype)]).any()
    return np.isnan(ref).any() and saturated and np.isin(finite, midpoints).any()


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("row_wise", [False, True])
def test_ag_mm_fp8_outputs_by_default(world, row_wise):
    """Outputs allocated without out_dtype are fp8 (each B's type, as torch):
    outs[0] e4m3 with a bias and a result scale, outs[1] e5m2 with neither.
    One element of rank 0's shard is NaN."""
    rng = np.random.default_rng(60 + world)
    shards = [dyadic(rng, (4, 32), E4M3) for _ in range(world)]
    shards[0][1, 3] = np.nan
    bs = [dyadic(rng, (16, 32), E4M3).T, dyadic(rng, (32, 32), E5M2).T]
    sa = [np.exp2(rng.integers(-2, 2, (4, 1) if row_wise else (1,))).astype(np.float32) for _ in range(world)]
    if not row_wise:
        sa = [sa[0]] * world
    sb = [np.exp2(rng.integers(-1, 2, (1, b.shape[1]) if row_wise else (1,))).astype(np.float32) for b in bs]
    bias = dyadic(rng, 16, BF16)
    rs = np.array([16.0], np.float32)

    def rank_main(g):
        r = g.rank
        return symm.fused_ag_mm(
            g, shards[r], bs, 0, a_scale=sa[r], b_scales=sb, biases=[bias, None], result_scales=[rs, None]
        )

    gathered = np.concatenate([f64(s) * f64(x) for s, x in zip(shards, sa)])
    ref0 = ((gathered @ (f64(bs[0]) * f64(sb[0]))) + f64(bias)) * 16.0
    ref1 = gathered @ (f64(bs[1]) * f64(sb[1]))
    assert exercised(ref0, E4M3)
    for outs in on_threads(rank_main, groups_of(world)):
        assert_fp8_equal(outs[0], rounded(ref0, E4M3))
        assert_fp8_equal(outs[1], rounded(ref1, E5M2))


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("op", ["sum", "avg"])
@pytest.mark.parametrize("scatter_dim", [0, 1])
def test_mm_rs_fp8_out_rounded_once_after_the_sum(world, op, scatter_dim):
    """out defaults to a's type (fp8, as torch), transposed outputs too;
    the ranks' products, each with the bias, summed (or averaged) exactly,
    times the result scale, then rounded once."""
    rng = np.random.default_rng(70 + world)
    n = 16 * world if scatter_dim == 1 else 32
    a = [dyadic(rng, (4 * world, 32), E5M2) for _ in range(world)]
    a[world - 1][2, 5] = np.nan
    b = [dyadic(rng, (n, 32), E4M3).T for _ in range(world)]
    sa = [np.exp2(rng.integers(-1, 2, (4 * world, 1))).astype(np.float32) for _ in range(world)]
    sb = [np.exp2(rng.integers(-1, 2, (1, n))).astype(np.float32) for _ in range(world)]
    bias = dyadic(rng, n, np.float16)
    rs = np.array([4096.0 if op == "sum" else 2048.0], np.float32)

    def rank_main(g):
        r = g.rank
        out = symm.mm_rs(g, a[r], b[r], scatter_dim, op=op, a_scale=sa[r], b_scale=sb[r], bias=bias, result_scale=rs)
        assert out.dtype == E5M2
        shape = out.shape
        given = np.full(shape[::-1], np.nan, E5M2).T  # a transposed output
        symm.mm_rs(g, a[r], b[r], scatter_dim, op=op, out=given, a_scale=sa[r], b_scale=sb[r], bias=bias, result_scale=rs)
        return out, given

    total = sum((f64(x) * f64(s)) @ (f64(y) * f64(t)) + f64(bias) for x, y, s, t in zip(a, b, sa, sb))
    if op == "avg":
        total /= world
    total *= f64(rs)
    if world != 3 or op == "sum":  # an average over 3 is not exact: ties would depend on f32 rounding
        assert exercised(total, E5M2)
    for r, (out, given) in enumerate(on_threads(rank_main, groups_of(world))):
        want = rounded(np.split(total, world, axis=scatter_dim)[r], E5M2)
        if world == 3 and op == "avg":
            # Within one code of the exact mean's (f32 sums, then / 3).
            g, w = f64(out), f64(want)
            assert np.array_equal(np.isnan(g), np.isnan(w))
            ok = ~np.isnan(w)
            assert (np.abs(g[ok] - w[ok]) <= np.abs(w[ok]) / 4 + 2.0**-16).all()
        else:
            assert_fp8_equal(out, want)
        assert_fp8_equal(given, out)
