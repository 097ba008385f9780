"""The custom calls themselves, unchecked (``_ops`` checks), each with a
``jax.vmap`` rule: a batch folds into a dimension the operation already
treats independently where that is exact (the rows of a matmul, the
columns of ``b``, the elements of an all-reduce), else the batch runs one
call after another (``lax.map``; every device loops alike, so the
collectives still pair up).

Inputs reach a call typed alike (shard_map's ``check_vma`` requires it);
``vary`` names the axes they are made to vary over and ``out`` those each
result varies over.
"""

from functools import lru_cache

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_batching import custom_vmap

from .._lib import XLA_PLATFORM_CPU
from . import _primitives
from ._context import result, vary
from ._setup import state


def _once_only(primals, tangents):
    raise NotImplementedError(
        "symm.jax operations are differentiable once (jax.grad, jax.vjp, jax.value_and_grad); derivatives of "
        "their derivatives (jax.grad of jax.grad, jax.hessian) and forward mode (jax.jvp) are not implemented"
    )


def _ffi(target, results, args, attrs):
    """The custom call; its JVP (reached only by differentiating the
    gradients, whose rules are ``_grads``') says it is not implemented."""
    call = jax.custom_jvp(lambda *xs: _custom_call(target, results, xs, attrs))
    call.defjvp(_once_only)
    return call(*args)


def _custom_call(target, results, args, attrs):
    now = state()
    several = isinstance(results, (list, tuple))
    # The handles of the groups traced for: a device bound to others since refuses the call.
    attrs = {**attrs, "groups": now.handles}
    ordered = now.platform == XLA_PLATFORM_CPU  # in program order (see _order)
    out = _primitives.call(target, results if several else (results,), args, attrs, ordered)
    return tuple(out) if several else out[0]


def _sequential(f, in_batched, args):
    """vmap by a loop: ``f`` on each element of the batched ``args``."""
    batched = [x for x, b in zip(args, in_batched) if b]

    def one(xs):
        it = iter(xs)
        return f(*[next(it) if b else x for x, b in zip(args, in_batched)])

    out = jax.lax.map(one, batched)
    return out, jax.tree.map(lambda _: True, out)


def _batch_last(y, size):
    """``[..., size * n]`` whose columns are ``size`` blocks -> ``[size, ..., n]``."""
    y = y.reshape(*y.shape[:-1], size, y.shape[-1] // size)
    return jnp.moveaxis(y, -2, 0)


def _columns(b):
    """``[size, K, N]`` -> ``[K, size * N]``: the batch's matrices side by side."""
    size, k, n = b.shape
    return jnp.moveaxis(b, 0, 1).reshape(k, size * n)


@lru_cache(maxsize=None)
def ag_mm(dim, n_b, return_ag, axes, out):
    """``(a, *bs) -> (*products, [gathered a])``."""

    def call(a, *bs):
        a, *bs = (vary(x, axes) for x in (a, *bs))
        gathered = list(a.shape)
        gathered[dim] *= _world()
        results = [result(a, (*gathered[:-1], b.shape[1]), a.dtype, out) for b in bs]
        if return_ag:
            results.append(result(a, gathered, a.dtype, out))
        return _ffi("symm_fused_ag_mm", results, (a, *bs), {"gather_dim": np.int64(dim)})

    f = custom_vmap(call)

    @f.def_vmap
    def rule(size, in_batched, a, *bs):
        a_b, bs_b = in_batched[0], in_batched[1:]
        if not any(bs_b):  # the batch is one more leading dimension of a
            outs = ag_mm(dim + 1, n_b, return_ag, axes, out)(a, *bs)
            return outs, (True,) * len(outs)
        if not a_b:  # each batched b's matrices become more columns
            outs = ag_mm(dim, n_b, return_ag, axes, out)(a, *[_columns(b) if bb else b for b, bb in zip(bs, bs_b)])
            prods = tuple(_batch_last(p, size) if bb else p for p, bb in zip(outs[:n_b], bs_b))
            return prods + outs[n_b:], tuple(bs_b) + (False,) * (len(outs) - n_b)
        return _sequential(f, in_batched, (a, *bs))

    return f


@lru_cache(maxsize=None)
def mm_rs(dim, op, axes, out):
    """``(a, b) -> reduce_scatter(a @ b, op, dim)``."""

    def call(a, b):
        a, b = vary(a, axes), vary(b, axes)
        shape = [*a.shape[:-1], b.shape[1]]
        shape[dim] //= _world()
        return _ffi("symm_mm_rs", result(a, shape, a.dtype, out), (a, b), {"scatter_dim": np.int64(dim), "op": op})

    f = custom_vmap(call)

    @f.def_vmap
    def rule(size, in_batched, a, b):
        a_b, b_b = in_batched
        if not b_b:
            return mm_rs(dim + 1, op, axes, out)(a, b), True
        if not a_b and dim != a.ndim - 1:  # scattering rows: columns are independent
            return _batch_last(mm_rs(dim, op, axes, out)(a, _columns(b)), size), True
        return _sequential(f, in_batched, (a, b))

    return f


@lru_cache(maxsize=None)
def lc_allgather(axes, out):
    """``x -> all_gather(x, 0)``."""

    def call(x):
        x = vary(x, axes)
        shape = (x.shape[0] * _world(), *x.shape[1:])
        return _ffi("symm_lc_allgather", result(x, shape, x.dtype, out), (x,), {})

    f = custom_vmap(call)

    @f.def_vmap
    def rule(size, in_batched, x):
        # Gather along dimension 0 of [d0, batch, ...], then put the batch first.
        return jnp.moveaxis(lc_allgather(axes, out)(jnp.moveaxis(x, 0, 1)), 1, 0), True

    return f


@lru_cache(maxsize=None)
def all_reduce(op, algorithm, axes, out):
    """``x -> all_reduce(x, op)``, elementwise: a batch is more elements."""

    def call(x):
        x = vary(x, axes)
        return _ffi("symm_all_reduce", result(x, x.shape, x.dtype, out), (x,), {"op": op, "algorithm": algorithm})

    f = custom_vmap(call)

    @f.def_vmap
    def rule(size, in_batched, x):
        return f(x), True

    return f


@lru_cache(maxsize=None)
def all_reduce_rmsnorm(eps, algorithm, axes, out_r, out_norm):
    """``(x, residual, weight) -> (rmsnorm(all_reduce(x) + residual) * weight, r)``."""

    def call(x, residual, weight):
        x, residual, weight = (vary(t, axes) for t in (x, residual, weight))
        results = (result(x, x.shape, x.dtype, out_norm), result(x, x.shape, x.dtype, out_r))
        attrs = {"eps": repr(float(np.float32(eps))), "algorithm": algorithm}
        return _ffi("symm_all_reduce_rmsnorm", results, (x, residual, weight), attrs)

    f = custom_vmap(call)

    @f.def_vmap
    def rule(size, in_batched, x, residual, weight):
        if in_batched[2]:
            return _sequential(f, in_batched, (x, residual, weight))
        # Rows normalize independently: the batch is more rows.
        shape = (size, *(x.shape[1:] if in_batched[0] else x.shape))
        x, residual = (t if b else jnp.broadcast_to(t, shape) for t, b in zip((x, residual), in_batched))
        return f(x, residual, weight), (True, True)

    return f


def _world():
    return len(state().devices)
