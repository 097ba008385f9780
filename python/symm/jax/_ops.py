"""The operations as JAX functions: where they run (inside ``jax.shard_map``
over the group's devices), shapes and dtypes are checked and the results'
shapes computed at trace time; then each lowers to a custom call of symm's
handlers, differentiable (``_grads``) and batchable (``_calls``).

The devices meet the calls in the order they run them. On a GPU that is
the stream's, and the calls are pure: every device runs the same SPMD
program, so when XLA drops a call whose result is unused, or merges two
equal calls, it does so on every device alike and the collectives still
pair up. XLA's CPU runtime runs calls that do not depend on each other
concurrently, so there each call is ordered after the one before
(``_order``).
"""

import jax.numpy as jnp
import numpy as np

from .._lib import MAX_DIMS
from ..ops import _dim
from . import _grads
from ._context import axis as _axis
from ._context import vma

# What the matmuls take; the all-gather moves any of symm's types; the
# all-reduce sums floats (in f32) and integers (exactly, wrapping).
MATMUL_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
INT_DTYPES = (jnp.int8, jnp.uint8, jnp.int32, jnp.int64)
COPY_DTYPES = MATMUL_DTYPES + (jnp.float8_e4m3fn, jnp.float8_e5m2) + INT_DTYPES
ALL_REDUCE_DTYPES = MATMUL_DTYPES + INT_DTYPES
REDUCE_OPS = ("sum", "avg")


def _shape(x, name):
    """What the handlers refuse at run time, refused while tracing: more
    than MAX_DIMS dimensions, or an empty one."""
    if x.ndim > MAX_DIMS:
        raise ValueError(f"{name} has {x.ndim} dimensions; symm takes at most {MAX_DIMS}")
    if 0 in x.shape:
        raise ValueError(f"{name} has shape {tuple(x.shape)}; symm takes no empty arrays")


def _dtype(x, name, allowed):
    dt = jnp.dtype(x.dtype)
    if dt not in [jnp.dtype(a) for a in allowed]:
        names = ", ".join(jnp.dtype(a).name for a in allowed)
        raise TypeError(f"{name} has dtype {dt.name}; expected one of {names}")
    return dt


def fused_ag_mm(a_shard, bs, gather_dim=0, *, return_ag=False, axis_name=None):
    """``all_gather(a_shard, gather_dim) @ b`` for ``b`` in ``bs`` (one
    ``[K, N]`` matrix or a list; ``K * world`` rows when gathering the last
    dimension). Returns the product (a list for a list of ``bs``), or
    ``(gathered_a, products)`` with ``return_ag``. ``axis_name`` names the
    shard_map axis of the group's devices (default: the shard_map's only
    one)."""
    axis, world = _axis(axis_name)
    single = not isinstance(bs, (list, tuple))
    blist = [bs] if single else list(bs)
    if not blist:
        raise ValueError("bs is empty")
    if a_shard.ndim < 2:
        raise ValueError(f"a_shard has {a_shard.ndim} dimensions; expected at least 2")
    dt = _dtype(a_shard, "a_shard", MATMUL_DTYPES)
    _shape(a_shard, "a_shard")
    dim = _dim(gather_dim, a_shard.ndim, "gather_dim")
    gathered = list(a_shard.shape)
    gathered[dim] *= world
    for i, b in enumerate(blist):
        if b.ndim != 2:
            raise ValueError(f"bs[{i}] has {b.ndim} dimensions; expected 2")
        _shape(b, f"bs[{i}]")
        if jnp.dtype(b.dtype) != dt:
            raise TypeError(f"bs[{i}] has dtype {jnp.dtype(b.dtype).name}; a_shard has {dt.name}")
        if b.shape[0] != gathered[-1]:
            raise ValueError(f"bs[{i}] has {b.shape[0]} rows; the gathered a_shard has {gathered[-1]} columns")
    vmas = tuple(vma(x) for x in (a_shard, *blist))
    out = _grads.ag_mm(dim, len(blist), return_ag, axis, world, vmas)(a_shard, *blist)
    products = out[: len(blist)]
    products = products[0] if single else list(products)
    return (out[-1], products) if return_ag else products


def mm_rs(a, b, scatter_dim=0, op="sum", *, axis_name=None):
    """``reduce_scatter(a @ b, op, scatter_dim)``: this device's chunk of
    dimension ``scatter_dim`` of the product, summed (``op="sum"``) or
    averaged (``"avg"``) over the devices. ``a`` is ``[..., K]``, ``b``
    ``[K, N]``."""
    axis, world = _axis(axis_name)
    if op not in REDUCE_OPS:
        raise ValueError(f"op is {op!r}; expected one of {REDUCE_OPS}")
    if a.ndim < 2 or b.ndim != 2:
        raise ValueError(f"a has {a.ndim} dimensions and b {b.ndim}; expected at least 2 and exactly 2")
    dt = _dtype(a, "a", MATMUL_DTYPES)
    if jnp.dtype(b.dtype) != dt:
        raise TypeError(f"b has dtype {jnp.dtype(b.dtype).name}; a has {dt.name}")
    _shape(a, "a")
    _shape(b, "b")
    if b.shape[0] != a.shape[-1]:
        raise ValueError(f"b has {b.shape[0]} rows; a has {a.shape[-1]} columns")
    shape = [*a.shape[:-1], b.shape[1]]
    dim = _dim(scatter_dim, len(shape), "scatter_dim")
    if shape[dim] % world:
        raise ValueError(f"dimension {dim} of the product ({shape[dim]}) does not divide by the world size ({world})")
    shape[dim] //= world
    return _grads.mm_rs(dim, op, axis, world, (vma(a), vma(b)))(a, b)


def lc_allgather(x, *, axis_name=None):
    """Every device's ``x`` gathered along dimension 0 (``[world * d0, ...]``),
    moved by copy engines (small messages: one SM kernel, for latency)."""
    axis, world = _axis(axis_name)
    if x.ndim < 1:
        raise ValueError("x has no dimension 0 to gather along")
    _dtype(x, "x", COPY_DTYPES)
    _shape(x, "x")
    return _grads.lc_allgather(axis, world, vma(x))(x)


ALL_REDUCE_ALGORITHMS = (None, "auto", "one_shot", "two_shot")


def _ar_algorithm(algorithm):
    if algorithm not in ALL_REDUCE_ALGORITHMS:
        raise ValueError(f"algorithm is {algorithm!r}; expected 'one_shot', 'two_shot', 'auto' or None")
    return algorithm or "auto"


def all_reduce(x, op="sum", *, algorithm=None, axis_name=None):
    """``x`` summed (``op="sum"``) or averaged (``"avg"``) over the devices,
    elementwise, any shape (0-d too): f32, bf16 or f16 summed in f32; int8, uint8,
    int32 or int64 summed exactly, wrapping on overflow ("avg": the wrapped
    sum divided by the world size, truncating toward zero, as NCCL).
    ``algorithm``: "one_shot", "two_shot" or None (symm's choice by size)."""
    axis, world = _axis(axis_name)
    if op not in REDUCE_OPS:
        raise ValueError(f"op is {op!r}; expected one of {REDUCE_OPS}")
    _dtype(x, "x", ALL_REDUCE_DTYPES)
    _shape(x, "x")
    if x.ndim == 0:  # as psum; the handlers take arrays of 1 to 8 dimensions
        return all_reduce(x.reshape(1), op, algorithm=algorithm, axis_name=axis_name).reshape(())
    return _grads.all_reduce(op, _ar_algorithm(algorithm), axis, world, vma(x))(x)


def all_reduce_rmsnorm(x, residual, weight, eps=1e-6, *, algorithm=None, axis_name=None):
    """``r = all_reduce_sum(x) + residual``, ``out = r / sqrt(mean(r**2,
    last dim) + eps) * weight``; returns ``(out, r)``. ``x`` and
    ``residual`` are ``[..., hidden]``, ``weight`` ``[hidden]``, one dtype."""
    axis, _ = _axis(axis_name)
    dt = _dtype(x, "x", MATMUL_DTYPES)
    if x.ndim < 1 or residual.shape != x.shape or weight.shape != (x.shape[-1],):
        raise ValueError(
            f"x {x.shape}, residual {residual.shape}, weight {weight.shape}: expected residual of x's shape "
            "and weight [hidden]"
        )
    for name, t in (("residual", residual), ("weight", weight)):
        if jnp.dtype(t.dtype) != dt:
            raise TypeError(f"{name} has dtype {jnp.dtype(t.dtype).name}; x has {dt.name}")
    _shape(x, "x")
    if isinstance(eps, (bool, np.bool_)) or not isinstance(eps, (int, float, np.integer, np.floating)):
        raise TypeError(f"eps must be a number, got {eps!r}")
    with np.errstate(over="ignore"):  # past f32's range: inf, refused below
        eps32 = float(np.float32(eps))
    if not np.isfinite(eps32) or eps32 < 0:
        raise ValueError(f"eps is {eps}; expected a finite value >= 0 (in f32)")
    vmas = (vma(x), vma(residual), vma(weight))
    return _grads.all_reduce_rmsnorm(eps32, _ar_algorithm(algorithm), axis, vmas)(x, residual, weight)
