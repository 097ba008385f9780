"""Reverse-mode rules (``jax.custom_vjp``) for the operations, each built
from symm's own operations, the transposes pairing up:

- all-gather + matmul: d a is the matmul of the cotangent with ``b^T``
  reduce-scattered along the gather dimension (``mm_rs``); d b is
  ``gathered_a^T @ d out`` (the gathered ``a`` the forward call returns).
- matmul + reduce-scatter: d a is the cotangent all-gathered along the
  scatter dimension times ``b^T`` (``fused_ag_mm``, which also returns the
  gathered cotangent for d b = ``a^T @ gathered``).
- all-gather: a reduce-scatter of the cotangent (``mm_rs`` with an
  identity ``b``: the products are exact, the sum is the reduction's).
- all-reduce: an all-reduce of the cotangent.

With shard_map's ``check_vma`` a cotangent that does not vary over the axis
is the total already (see ``_context``): the reductions above then reduce
to a copy or a slice, as ``jax.lax.psum``'s and ``all_gather_invariant``'s
transposes do. Cotangents of inputs that do not vary over an axis are
summed over it (``fit``).
"""

from functools import lru_cache
from math import gcd

import jax
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero

from . import _calls
from ._context import checked, fit, is_share, vary

F32 = jnp.float32
FP8 = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))


def _dense(ct):
    if type(ct) is SymbolicZero:
        return vary(jnp.zeros(ct.aval.shape, ct.aval.dtype), ct.aval.mat.varying)
    return ct


def _leading_dot(x, y):
    """``x^T @ y`` over all leading dimensions: ``[..., K], [..., N] -> [K, N]``,
    summed in f32."""
    lead = tuple(range(x.ndim - 1))
    return jax.lax.dot_general(x, y, ((lead, lead), ((), ())), preferred_element_type=F32).astype(x.dtype)


def reduce_scatter(y, dim, axes, world):
    """The sum over the devices of ``y``, this device's chunk of ``dim``:
    ``mm_rs`` of ``y`` (viewed as narrow rows) with an identity."""
    if jnp.dtype(y.dtype) in FP8:
        name = jnp.dtype(y.dtype).name
        raise TypeError(f"symm.jax has no gradient in {name}: it would reduce-scatter {name} cotangents")
    y = jnp.moveaxis(y, dim, 0)
    chunk = (y.shape[0] // world, *y.shape[1:])
    per = y.size // world
    width = gcd(per, 64)  # divides each device's chunk, so chunks stay whole rows
    out = _calls.mm_rs(0, "sum", axes, axes)(y.reshape(y.size // width, width), jnp.eye(width, dtype=y.dtype))
    return jnp.moveaxis(out.reshape(chunk), 0, dim)


@lru_cache(maxsize=None)
def ag_mm(dim, n_b, return_ag, axis, world, in_vmas):
    axes = frozenset().union(*in_vmas) | {axis}
    raw = _calls.ag_mm

    @jax.custom_vjp
    def f(a, *bs):
        return raw(dim, n_b, return_ag, axes, axes)(a, *bs)

    def fwd(a, *bs):
        a, bs = a.value, [b.value for b in bs]
        outs = raw(dim, n_b, True, axes, axes)(a, *bs)
        return (outs if return_ag else outs[:n_b]), (outs[n_b], *bs)

    def bwd(res, cts):
        gathered, *bs = res
        d_ps = [_dense(ct) for ct in cts[:n_b]]
        # One mm_rs for all products: [dP_0 | dP_1 | ...] @ [b_0 | b_1 | ...]^T.
        d_cat = d_ps[0] if n_b == 1 else jnp.concatenate(d_ps, -1)
        b_cat = bs[0] if n_b == 1 else jnp.concatenate(bs, 1)
        da = _calls.mm_rs(dim, "sum", axes, axes)(d_cat, b_cat.T)
        if return_ag and type(cts[n_b]) is not SymbolicZero:
            da = da + reduce_scatter(cts[n_b], dim, axes, world)
        dbs = [_leading_dot(gathered, d) for d in d_ps]
        return (fit(da, in_vmas[0]), *(fit(db, v) for db, v in zip(dbs, in_vmas[1:])))

    f.defvjp(fwd, bwd, symbolic_zeros=True)
    return f


@lru_cache(maxsize=None)
def mm_rs(dim, op, axis, world, in_vmas):
    axes = frozenset().union(*in_vmas) | {axis}
    raw = _calls.mm_rs(dim, op, axes, axes)

    @jax.custom_vjp
    def f(a, b):
        return raw(a, b)

    def fwd(a, b):
        return raw(a, b), (a, b)

    def bwd(res, ct):
        a, b = res
        if op == "avg":
            ct = ct / jnp.asarray(world, ct.dtype)
        da, gathered = _calls.ag_mm(dim, 1, True, axes, axes)(ct, b.T)
        return fit(da, in_vmas[0]), fit(_leading_dot(a, gathered), in_vmas[1])

    f.defvjp(fwd, bwd)
    return f


@lru_cache(maxsize=None)
def lc_allgather(axis, world, x_vma):
    axes = x_vma | {axis}
    raw = _calls.lc_allgather(axes, axes - {axis})

    @jax.custom_vjp
    def f(x):
        return raw(x)

    def fwd(x):
        return raw(x), None

    def bwd(_, ct):
        if is_share(ct, axis):
            dx = reduce_scatter(ct, 0, axes, world)
        else:  # the total already: this device's rows of it
            rows = ct.shape[0] // world
            dx = jax.lax.dynamic_slice_in_dim(ct, jax.lax.axis_index(axis) * rows, rows, 0)
        return (fit(dx, x_vma),)

    f.defvjp(fwd, bwd)
    return f


def _per_device(dx, axis):
    """``dx``, the cotangent of every device's input of an all-reduce (the
    sum over them of the reduction's), typed as varying over ``axis``, as
    that input is: ``fit`` then sums the devices' for an ``x`` that is one
    value on all (an invariant x is each device's input, world times)."""
    return vary(dx, {axis}) if checked() else dx


@lru_cache(maxsize=None)
def all_reduce(op, algorithm, axis, world, x_vma):
    axes = x_vma | {axis}
    raw = _calls.all_reduce(op, algorithm, axes, axes - {axis})

    @jax.custom_vjp
    def f(x):
        return raw(x)

    def fwd(x):
        return raw(x), None

    def bwd(_, ct):
        dx = raw(ct) if is_share(ct, axis) else ct if op == "sum" else ct / jnp.asarray(world, ct.dtype)
        return (fit(_per_device(dx, axis), x_vma),)

    f.defvjp(fwd, bwd)
    return f


@lru_cache(maxsize=None)
def all_reduce_rmsnorm(eps, algorithm, axis, in_vmas):
    x_vma, res_vma, w_vma = in_vmas
    axes = x_vma | res_vma | w_vma | {axis}
    out_r = (x_vma - {axis}) | res_vma
    out_norm = out_r | w_vma
    raw = _calls.all_reduce_rmsnorm(eps, algorithm, axes, out_r, out_norm)
    summed = _calls.all_reduce("sum", algorithm, axes, axes - {axis})

    def norm(r, w):
        return r * jax.lax.rsqrt(jnp.mean(r * r, -1, keepdims=True) + eps) * w

    @jax.custom_vjp
    def f(x, residual, weight):
        return raw(x, residual, weight)

    def fwd(x, residual, weight):
        out, r = raw(x, residual, weight)
        return (out, r), (r, weight)

    def bwd(res, cts):
        r, weight = res
        ct_out, ct_r = cts
        _, vjp = jax.vjp(norm, r.astype(F32), weight.astype(F32))
        dr, dw = vjp(ct_out.astype(F32))
        dr = (dr + ct_r.astype(F32)).astype(r.dtype)
        dx = summed(dr) if is_share(dr, axis) else dr
        return fit(_per_device(dx, axis), x_vma), fit(dr, res_vma), fit(dw.astype(weight.dtype), w_vma)

    f.defvjp(fwd, bwd)
    return f
