"""symm.jax under jax.grad and jax.vmap on JAX's CPU platform (host
backend), at worlds 1, 2 and 4 (groups over the first devices of 4):

- gradients of a loss through each operation inside shard_map against the
  same loss with XLA's own collectives (``all_gather``, ``psum_scatter``,
  ``psum``) and jnp matmuls, in f32 from the same inputs, with and without
  shard_map's ``check_vma``;
- ``jax.vmap`` of each operation against a Python loop over the batch, for
  the batchings that fold into one call and those that run one per element.

Needs jax (CI: SYMM_REQUIRE_JAX=1, pinned jax)."""

import os
from functools import partial

import numpy as np
import pytest

if os.environ.get("SYMM_REQUIRE_JAX") != "1":
    pytest.importorskip("jax")
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import symm.jax as sj  # noqa: E402

DEVICES = 4
# Before JAX makes its CPU client (the same settings as test_jax_cpu.py).
jax.config.update("jax_num_cpu_devices", DEVICES)
jax.config.update("jax_platforms", "cpu")

F32 = jnp.float32
# Relative to the reference's largest magnitude; bf16 inputs are exact in
# f32, so the error is the bf16 roundings of the products and partial sums.
TOLERANCE = {jnp.float32: 2e-5, jnp.bfloat16: 3e-2}


@pytest.fixture(params=[1, 2, 4], ids=lambda w: f"world{w}")
def world(request):
    assert len(jax.devices()) == DEVICES, "JAX made its CPU client before this module configured it"
    sj.init(jax.devices()[: request.param], timeout_ms=60_000)
    yield request.param
    sj.shutdown()


def random(seed, shape, dtype=F32):
    x = np.random.default_rng(seed).standard_normal(shape)
    x += np.where(x >= 0, 0.25, -0.25)  # no zeros: a dropped term shows
    return jnp.asarray(x, dtype)


def rel_err(got, ref):
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    assert got.shape == ref.shape
    assert np.all(np.isfinite(got))
    return np.abs(got - ref).max() / np.abs(ref).max()


def check_grads(body, ref_body, in_specs, out_specs, args, dtype=F32, seed=100):
    """d loss / d args for ``loss = sum_i <out_i, w_i>`` through
    ``shard_map(body)`` against the same with ``ref_body`` (in f32; a dict
    gives one per check_vma), with check_vma on and off."""
    mesh = sj.mesh("x")
    many = isinstance(out_specs, tuple)

    def loss(f, weights, check_vma):
        mapped = jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=check_vma)

        def value(*xs):
            outs = mapped(*xs)
            outs = outs if many else (outs,)
            return sum(jnp.vdot(o.astype(F32), w) for o, w in zip(outs, weights))

        return value

    shapes = jax.eval_shape(jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs), *args)
    weights = [random(seed + i, s.shape) for i, s in enumerate(shapes if many else (shapes,))]
    argnums = tuple(range(len(args)))
    ref_args = [x.astype(F32) for x in args]
    for check_vma in (True, False):
        got = jax.jit(jax.grad(loss(body, weights, check_vma), argnums))(*args)
        ref_f = ref_body[check_vma] if isinstance(ref_body, dict) else ref_body
        ref = jax.jit(jax.grad(loss(ref_f, weights, check_vma), argnums))(*ref_args)
        for i, (g, r) in enumerate(zip(got, ref)):
            assert g.dtype == args[i].dtype
            err = rel_err(g, r)
            assert err <= TOLERANCE[dtype], f"d/d arg {i} (check_vma={check_vma}): relative error {err:.2e}"


def gather(x, dim):
    return jax.lax.all_gather(x, "x", axis=dim, tiled=True)


def matmul(a, b):
    return jnp.matmul(a, b, precision=jax.lax.Precision.HIGHEST)


# --- gradients ------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [F32, jnp.bfloat16])
def test_grad_ag_mm_column_parallel(world, dtype):
    """The tensor-parallel layout: rows of a and columns of b sharded."""
    a, b = random(1, (world * 4, 16), dtype), random(2, (16, world * 8), dtype)
    body = partial(sj.fused_ag_mm, gather_dim=0, axis_name="x")
    check_grads(body, lambda a, b: matmul(gather(a, 0), b), (P("x"), P(None, "x")), P(None, "x"), (a, b), dtype)


def test_grad_ag_mm_two_bs_gathered_a_and_replicated_bs(world):
    a = random(3, (world * 4, 16))
    b0, b1 = random(4, (16, 12)), random(5, (16, 8))

    def body(a, b0, b1):
        ag, (o0, o1) = sj.fused_ag_mm(a, [b0, b1], 0, return_ag=True)
        return ag, o0, o1

    def ref(a, b0, b1):
        ag = gather(a, 0)
        return ag, matmul(ag, b0), matmul(ag, b1)

    check_grads(body, ref, (P("x"), P(), P()), (P("x"),) * 3, (a, b0, b1))


@pytest.mark.parametrize("dim", [1, 2])
def test_grad_ag_mm_other_dims(world, dim):
    """Gathering a middle dimension, and the last (K: b has world * k rows)."""
    shape = [2, 3, 8]
    shape[dim] *= world
    a = random(6, shape)
    b = random(7, (shape[-1], 5))
    spec = P(*[("x" if d == dim else None) for d in range(3)])
    body = partial(sj.fused_ag_mm, gather_dim=dim)
    check_grads(body, lambda a, b: matmul(gather(a, dim), b), (spec, P()), P("x"), (a, b))


@pytest.mark.parametrize("dtype", [F32, jnp.bfloat16])
@pytest.mark.parametrize("op", ["sum", "avg"])
def test_grad_mm_rs_row_parallel(world, dtype, op):
    """The tensor-parallel layout: columns of a and rows of b sharded."""
    a, b = random(8, (world * 4, world * 8), dtype), random(9, (world * 8, 12), dtype)
    body = partial(sj.mm_rs, scatter_dim=0, op=op)

    def ref(a, b):
        out = jax.lax.psum_scatter(matmul(a, b), "x", scatter_dimension=0, tiled=True)
        return out / world if op == "avg" else out

    check_grads(body, ref, (P(None, "x"), P("x")), P("x"), (a, b), dtype)


def test_grad_mm_rs_last_dim_3d(world):
    a, b = random(10, (2, 3, world * 4)), random(11, (world * 4, world * 6))
    body = partial(sj.mm_rs, scatter_dim=-1, axis_name="x")

    def ref(a, b):
        return jax.lax.psum_scatter(matmul(a, b), "x", scatter_dimension=2, tiled=True)

    check_grads(body, ref, (P(None, None, "x"), P("x")), P(None, None, "x"), (a, b))


@pytest.mark.parametrize("out_spec", [P("x"), P()], ids=["stacked", "replicated"])
def test_grad_lc_allgather(world, out_spec):
    """Stacked copies: each device's cotangent is a share (reduce-scattered);
    replicated (check_vma): the total (sliced). XLA's invariant all-gather
    is the reference only under check_vma (without it shard_map divides a
    replicated output's cotangent by the world, which only a summing
    transpose undoes)."""
    x = random(12, (world * 3, 5, 4))
    gather_as = partial(jax.lax.all_gather, axis_name="x", tiled=True)
    ref = {True: partial(gather_as, to="invarying" if out_spec == P() else "varying"), False: gather_as}
    check_grads(sj.lc_allgather, ref, P("x"), out_spec, (x,))


@pytest.mark.parametrize("op", ["sum", "avg"])
@pytest.mark.parametrize("out_spec", [P("x"), P()], ids=["stacked", "replicated"])
@pytest.mark.parametrize("in_spec", [P("x"), P()], ids=["sharded_x", "replicated_x"])
def test_grad_all_reduce(world, op, out_spec, in_spec):
    """A replicated x (one value, every device's input) sums world copies:
    its gradient is world times the cotangent's (sum)."""
    x = random(13, ((world if in_spec == P("x") else 1) * 3, 24))
    ref = partial(jax.lax.pmean if op == "avg" else jax.lax.psum, axis_name="x")
    check_grads(partial(sj.all_reduce, op=op), ref, in_spec, out_spec, (x,))


def rmsnorm(x, residual, weight, eps):
    r = jax.lax.psum(x, "x") + residual
    return r * jax.lax.rsqrt(jnp.mean(r * r, -1, keepdims=True) + eps) * weight, r


@pytest.mark.parametrize("sharded_residual", [False, True], ids=["replicated_residual", "sharded_residual"])
@pytest.mark.parametrize("sharded_x", [True, False], ids=["sharded_x", "replicated_x"])
def test_grad_all_reduce_rmsnorm(world, sharded_residual, sharded_x):
    tokens, hidden, eps = 3, 32, 1e-5
    x = random(14, ((world if sharded_x else 1) * tokens, hidden))
    residual = random(15, ((world if sharded_residual else 1) * tokens, hidden))
    weight = random(16, (hidden,))
    body = partial(sj.all_reduce_rmsnorm, eps=eps)
    ref = partial(rmsnorm, eps=eps)
    res_spec, out_spec = (P("x"), P("x")) if sharded_residual else (P(), P())
    x_spec = P("x") if sharded_x else P()
    check_grads(body, ref, (x_spec, res_spec, P()), (out_spec, out_spec), (x, residual, weight))


@pytest.mark.parametrize("remat", [False, True], ids=["", "checkpoint"])
def test_grad_chain_of_operations(world, remat):
    """A column- then row-parallel MLP: fused_ag_mm -> nonlinearity -> mm_rs;
    under jax.checkpoint the backward pass runs the forward's calls again,
    on every device alike and (on the CPU platform) in program order."""
    x, w1, w2 = random(17, (world * 4, 16)), random(18, (16, world * 8)), random(19, (world * 8, 16))

    def body(x, w1, w2):
        return sj.mm_rs(jnp.tanh(sj.fused_ag_mm(x, w1)), w2)

    def ref(x, w1, w2):
        h = jnp.tanh(matmul(gather(x, 0), w1))
        return jax.lax.psum_scatter(matmul(h, w2), "x", scatter_dimension=0, tiled=True)

    body = jax.checkpoint(body) if remat else body
    check_grads(body, ref, (P("x"), P(None, "x"), P("x")), P("x"), (x, w1, w2))


def test_grad_of_fp8_allgather_is_refused(world):
    """Its transpose would reduce-scatter fp8 cotangents (without check_vma
    every cotangent is a share to be summed)."""
    mesh = sj.mesh("x")
    x = random(20, (world * 2, 16), jnp.float8_e4m3fn)
    f = jax.shard_map(sj.lc_allgather, mesh=mesh, in_specs=P("x"), out_specs=P("x"), check_vma=False)
    with pytest.raises(TypeError, match="no gradient in float8_e4m3fn"):
        jax.grad(lambda x: f(x).astype(F32).sum())(x)


def test_second_derivatives_say_they_are_not_implemented(world):
    """The operations' gradient rules run symm's calls, which have no
    derivative of their own: differentiating a gradient says so, for every
    operation, rather than failing somewhere inside JAX."""
    mesh = sj.mesh("x")
    x, w = random(21, (world * world * 2, 8)), random(22, (8, 8))
    bodies = {
        "fused_ag_mm": lambda x: sj.fused_ag_mm(x, w),
        "mm_rs": lambda x: sj.mm_rs(x, w),
        "lc_allgather": sj.lc_allgather,
        "all_reduce": sj.all_reduce,
        "all_reduce_rmsnorm": lambda x: sj.all_reduce_rmsnorm(x, x, w[0])[0],
    }
    for name, body in bodies.items():
        f = jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x"))

        def loss(x, f=f):
            return (f(x) ** 2).sum()

        jax.grad(loss)(x)  # once is fine
        with pytest.raises(NotImplementedError, match="differentiable once"):
            jax.grad(lambda x, loss=loss: jax.grad(loss)(x).sum())(x)


# --- vmap -------------------------------------------------------------------------------
def check_vmap(body, in_axes, in_specs, out_specs, args, looped=False):
    """``vmap(body, in_axes)`` inside shard_map against a loop over the
    batch of ``body`` inside shard_map (outputs batched along 0); ``looped``:
    whether the batch must run one call per element rather than fold."""
    mesh = sj.mesh("x")
    size = next(x.shape[0] for x, ax in zip(args, in_axes) if ax is not None)
    batched_specs = tuple(s if ax is None else P(None, *s) for s, ax in zip(in_specs, in_axes))
    many = isinstance(out_specs, tuple)
    out_batched = tuple(P(None, *s) for s in out_specs) if many else P(None, *out_specs)
    vmapped = jax.vmap(body, in_axes=in_axes)
    f = jax.jit(jax.shard_map(vmapped, mesh=mesh, in_specs=batched_specs, out_specs=out_batched))
    one = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs))
    assert (" scan[" in str(jax.make_jaxpr(f)(*args))) == looped
    got = f(*args)
    for i in range(size):
        want = one(*[x if ax is None else x[i] for x, ax in zip(args, in_axes)])
        for g, w in zip(got if many else (got,), want if many else (want,)):
            np.testing.assert_allclose(np.asarray(g[i]), np.asarray(w), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("in_axes", [(0, None), (None, 0), (0, 0)], ids=["a", "b", "both"])
def test_vmap_ag_mm(world, in_axes):
    a, b = random(30, (3, world * 4, 16)), random(31, (3, 16, 8))
    a, b = (x if ax is not None else x[0] for x, ax in zip((a, b), in_axes))

    def body(a, b):
        ag, out = sj.fused_ag_mm(a, b, 0, return_ag=True)
        return ag, out

    check_vmap(body, in_axes, (P("x"), P()), (P("x"), P("x")), (a, b), looped=in_axes == (0, 0))


@pytest.mark.parametrize("in_axes,dim", [((0, None), 0), ((None, 0), 0), ((None, 0), 1), ((0, 0), 0)])
def test_vmap_mm_rs(world, in_axes, dim):
    a, b = random(32, (2, world * 4, world * 8)), random(33, (2, world * 8, world * 4))
    a, b = (x if ax is not None else x[0] for x, ax in zip((a, b), in_axes))
    out_spec = P("x") if dim == 0 else P(None, "x")
    looped = in_axes == (0, 0) or (in_axes == (None, 0) and dim == 1)
    check_vmap(partial(sj.mm_rs, scatter_dim=dim), in_axes, (P(None, "x"), P("x")), out_spec, (a, b), looped)


def test_vmap_lc_allgather_and_all_reduce(world):
    x = random(34, (3, world * 2, 5))
    check_vmap(sj.lc_allgather, (0,), (P("x"),), P("x"), (x,))
    check_vmap(partial(sj.all_reduce, op="avg"), (0,), (P("x"),), P("x"), (x,))


@pytest.mark.parametrize("in_axes", [(0, None, None), (None, 0, None), (0, 0, 0)], ids=["x", "residual", "all"])
def test_vmap_all_reduce_rmsnorm(world, in_axes):
    x, residual, weight = random(35, (2, world * 2, 16)), random(36, (2, 2, 16)), random(37, (2, 16))
    args = tuple(t if ax is not None else t[0] for t, ax in zip((x, residual, weight), in_axes))
    check_vmap(sj.all_reduce_rmsnorm, in_axes, (P("x"), P(), P()), (P("x"), P("x")), args, looped=in_axes[2] == 0)


def test_vmap_outside_shard_map_and_grad_of_vmap(world):
    """vmap of the jitted shard_map (the batch reaches the operation through
    shard_map's own batching), and a gradient through a vmapped operation."""
    mesh = sj.mesh("x")
    a, b = random(38, (3, world * 4, 16)), random(39, (16, 8))
    f = jax.jit(jax.shard_map(sj.fused_ag_mm, mesh=mesh, in_specs=(P("x"), P()), out_specs=P("x")))
    got = jax.vmap(f, in_axes=(0, None))(a, b)
    for i in range(3):
        np.testing.assert_allclose(np.asarray(got[i]), np.asarray(f(a[i], b)), rtol=1e-6)

    def loss(body):
        specs = dict(in_specs=(P(None, "x"), P()), out_specs=P(None, "x"))
        g = jax.shard_map(jax.vmap(body, in_axes=(0, None)), mesh=mesh, **specs)
        return lambda a, b: (g(a, b) ** 2).sum()

    got = jax.jit(jax.grad(loss(sj.fused_ag_mm), (0, 1)))(a, b)
    ref = jax.jit(jax.grad(loss(lambda a, b: matmul(gather(a, 0), b)), (0, 1)))(a, b)
    for g, r in zip(got, ref):
        assert rel_err(g, r) <= TOLERANCE[F32]
