"""symm.jax on CUDA: one process driving two GPUs, or SYMM_TEST_WORLD
(JAX's default on one host; 1 runs them on one GPU, a group of one
rank), the three operations under jit + shard_map against jnp references
and against what XLA itself does (``jax.lax.all_gather`` then a matmul, a
matmul then ``jax.lax.psum_scatter``). Skipped unless JAX sees that many
GPUs; run it in its own pytest process (test_jax_cpu.py pins JAX to CPU):

    XLA_PYTHON_CLIENT_MEM_FRACTION=0.5 python3 -m pytest -q python/tests/test_jax_cuda.py
"""

import os
from functools import partial

import numpy as np
import pytest
from ranks import GPU_TEST_WORLD

# XLA takes 75% of each GPU by default; symm's workspace is allocated beside it.
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.5")
jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

try:
    GPUS = jax.devices("gpu")
except RuntimeError:
    GPUS = []
WORLD = int(os.environ.get("SYMM_TEST_WORLD", GPU_TEST_WORLD))
if len(GPUS) < WORLD:
    pytest.skip(f"needs JAX with {WORLD} CUDA GPUs, JAX sees {len(GPUS)}", allow_module_level=True)

import symm.jax as sj  # noqa: E402

HIGHEST = jax.lax.Precision.HIGHEST
TOLERANCE = {jnp.float32: 1e-4, jnp.float16: 4e-3, jnp.bfloat16: 2e-2}
DTYPES = list(TOLERANCE)


@pytest.fixture(scope="module")
def mesh():
    sj.init(GPUS[:WORLD], timeout_ms=60_000)
    yield sj.mesh("x")
    sj.shutdown()


def random(seed, shape, dtype):
    x = np.random.default_rng(seed).standard_normal(shape)
    x += np.where(x >= 0, 0.25, -0.25)  # no zeros: an unwritten element shows
    return jnp.asarray(x, dtype)


def rel_err(got, ref):
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    assert got.shape == ref.shape
    return np.abs(got - ref).max() / np.abs(ref).max()


def f64(x):
    return np.asarray(x, np.float64)


def smap(mesh, body, in_specs, out_specs):
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs))


@pytest.mark.parametrize("dtype", DTYPES)
def test_ag_mm_against_jnp_and_xla_all_gather(mesh, dtype):
    a = random(1, (WORLD * 256, 512), dtype)  # device r holds rows 256r..
    w = random(2, (512, WORLD * 384), dtype)  # device r holds columns 384r..

    def ours(a, w):
        ag, out = sj.fused_ag_mm(a, w, 0, return_ag=True, axis_name="x")
        return ag, out

    def xla(a, w):
        ag = jax.lax.all_gather(a, "x", axis=0, tiled=True)
        # HIGHEST: XLA's default multiplies f32 through TF32 on these GPUs.
        return ag, jnp.matmul(ag, w, precision=HIGHEST, preferred_element_type=jnp.float32).astype(dtype)

    specs = dict(in_specs=(P("x"), P(None, "x")), out_specs=(P("x"), P(None, "x")))
    ag, out = smap(mesh, ours, **specs)(a, w)
    ag_ref, out_xla = smap(mesh, xla, **specs)(a, w)
    np.testing.assert_array_equal(np.asarray(ag), np.asarray(ag_ref))  # each device's copy, stacked
    assert rel_err(out, f64(a) @ f64(w)) <= TOLERANCE[dtype]
    assert rel_err(out, out_xla) <= TOLERANCE[dtype]


def test_ag_mm_last_dim_and_two_bs(mesh):
    dtype = jnp.bfloat16
    a = random(3, (384, WORLD * 256), dtype)
    b0, b1 = random(4, (WORLD * 256, 128), dtype), random(5, (WORLD * 256, 64), dtype)
    f = smap(mesh, lambda a, b0, b1: tuple(sj.fused_ag_mm(a, [b0, b1], -1)), (P(None, "x"), P(), P()), P("x"))
    o0, o1 = f(a, b0, b1)
    for got, b in ((o0, b0), (o1, b1)):
        for r in range(WORLD):
            assert rel_err(np.split(np.asarray(got), WORLD)[r], f64(a) @ f64(b)) <= TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", ["sum", "avg"])
def test_mm_rs_against_jnp_and_xla_psum_scatter(mesh, dtype, op):
    a = random(6, (WORLD * 256, WORLD * 512), dtype)  # device r: K-slice r
    w = random(7, (WORLD * 512, 384), dtype)

    def ours(a, w):
        return sj.mm_rs(a, w, 0, op, axis_name="x")

    def xla(a, w):
        part = jnp.matmul(a, w, precision=HIGHEST, preferred_element_type=jnp.float32)
        out = jax.lax.psum_scatter(part, "x", scatter_dimension=0, tiled=True)
        return (out / WORLD if op == "avg" else out).astype(dtype)

    specs = dict(in_specs=(P(None, "x"), P("x")), out_specs=P("x"))
    got = smap(mesh, ours, **specs)(a, w)
    ref = f64(a) @ f64(w) / (WORLD if op == "avg" else 1)
    assert rel_err(got, ref) <= TOLERANCE[dtype]
    assert rel_err(got, smap(mesh, xla, **specs)(a, w)) <= TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32, jnp.float8_e4m3fn])
def test_lc_allgather_against_xla_all_gather(mesh, dtype):
    x = random(8, (WORLD * 1024, 257), dtype)
    ours = smap(mesh, lambda x: sj.lc_allgather(x, axis_name="x"), P("x"), P("x"))
    xla = smap(mesh, lambda x: jax.lax.all_gather(x, "x", axis=0, tiled=True), P("x"), P("x"))
    got = ours(x)
    np.testing.assert_array_equal(f64(got), f64(xla(x)))
    np.testing.assert_array_equal(f64(np.split(np.asarray(got), WORLD)[-1]), f64(x))


def test_repeated_calls_and_larger_shapes_regrow_the_workspace(mesh):
    """Many calls in a row (stream-ordered, no host sync between them), then
    a larger shape that grows the workspace."""
    dtype = jnp.bfloat16
    f = smap(mesh, lambda a, w: sj.fused_ag_mm(a, w), (P("x"), P(None, "x")), P(None, "x"))
    for m in (128, 2048):
        a, w = random(9, (WORLD * m, 1024), dtype), random(10, (1024, WORLD * 512), dtype)
        outs = [f(a, w) for _ in range(10)]
        ref = f64(a) @ f64(w)
        for out in outs:
            assert rel_err(out, ref) <= TOLERANCE[dtype]


def grads(mesh, body, in_specs, out_specs, args, check_vma=True):
    w = random(20, jax.eval_shape(jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs), *args).shape,
               jnp.float32)

    def loss(*xs):
        out = jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=check_vma)(*xs)
        return jnp.vdot(out.astype(jnp.float32), w)

    return jax.jit(jax.grad(loss, tuple(range(len(args)))))(*args)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_grad_of_tensor_parallel_mlp_against_xla(mesh, dtype):
    """jax.grad through fused_ag_mm -> gelu -> mm_rs (the backward runs
    mm_rs and fused_ag_mm on the GPUs) against XLA's collectives."""
    x = random(21, (WORLD * 128, 256), dtype)
    w1, w2 = random(22, (256, WORLD * 256), dtype), random(23, (WORLD * 256, 256), dtype)

    def ours(x, w1, w2):
        return sj.mm_rs(jax.nn.gelu(sj.fused_ag_mm(x, w1, axis_name="x")), w2, axis_name="x")

    def xla(x, w1, w2):
        mm = partial(jnp.matmul, precision=HIGHEST, preferred_element_type=jnp.float32)
        h = jax.nn.gelu(mm(jax.lax.all_gather(x, "x", axis=0, tiled=True), w1).astype(x.dtype))
        return jax.lax.psum_scatter(mm(h, w2), "x", scatter_dimension=0, tiled=True).astype(x.dtype)

    specs = ((P("x"), P(None, "x"), P("x")), P("x"))
    got = grads(mesh, ours, *specs, (x, w1, w2))
    ref = grads(mesh, xla, *specs, (x, w1, w2))
    for g, r in zip(got, ref):
        assert rel_err(g, r) <= 4 * TOLERANCE[dtype]


def test_grad_of_allgather_and_all_reduce_and_vmap(mesh):
    """Without check_vma the all-gather's gradient is a reduce-scatter (mm_rs
    with an identity), the all-reduce's an all-reduce; then vmap folding a
    batch into the rows of a."""
    x = random(24, (WORLD * 64, 128), jnp.bfloat16)
    for ours, xla in (
        (sj.lc_allgather, lambda x: jax.lax.all_gather(x, "x", tiled=True)),
        (sj.all_reduce, lambda x: jax.lax.psum(x, "x")),
    ):
        for check_vma in (True, False):
            got = grads(mesh, ours, P("x"), P("x"), (x,), check_vma)[0]
            ref = grads(mesh, xla, P("x"), P("x"), (x,), check_vma)[0]
            assert rel_err(got, ref) <= TOLERANCE[jnp.bfloat16]
    a, b = random(25, (3, WORLD * 128, 256), jnp.bfloat16), random(26, (256, 512), jnp.bfloat16)
    f = smap(mesh, jax.vmap(partial(sj.fused_ag_mm, axis_name="x"), in_axes=(0, None)), (P(None, "x"), P()),
             P(None, "x"))
    got = f(a, b)
    for i in range(3):
        assert rel_err(np.split(np.asarray(got[i]), WORLD)[0], f64(a[i]) @ f64(b)) <= TOLERANCE[jnp.bfloat16]
