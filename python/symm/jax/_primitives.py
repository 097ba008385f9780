"""The JAX primitives that lower to symm's custom calls: ``symm_call``
(pure, on GPUs) and ``symm_ordered_call`` (on XLA's CPU platform, an
ordered effect that threads a token: see ``_order``).

Lowering is the first point where the mesh's devices are known (shard_map
traces over an abstract mesh), so it is where a mesh that lists the devices
in another order than the group's ranks is refused: the handlers find each
device's rank from the device, so such a mesh would gather and scatter the
devices' data in the wrong places.
"""

import jax
import numpy as np
from jax._src import core  # the token aval JAX compares by identity
from jax.extend.core import Primitive
from jax.interpreters import mlir

from ._order import DISPATCHED, IN_ORDER
from ._setup import state

_call_p = Primitive("symm_call")
_call_p.multiple_results = True
_ordered_p = Primitive("symm_ordered_call")
_ordered_p.multiple_results = True


@_call_p.def_abstract_eval
def _abstract(*args, target, results, attrs):
    return results


@_ordered_p.def_effectful_abstract_eval
def _abstract_ordered(*args, target, results, attrs):
    return results, {IN_ORDER, DISPATCHED}


def _check_mesh(ctx):
    """The devices of the mesh the call is lowered over must be the group's
    in rank order (``_context.axis`` checked the sizes while tracing)."""
    mesh = getattr(ctx.module_context.axis_context, "mesh", None)
    if mesh is None:
        return  # not a shard_map's (the operations refused that while tracing)
    if isinstance(mesh, jax.sharding.AbstractMesh):
        # Its devices are chosen later, from the arguments: no way to see their order.
        raise ValueError(
            "symm.jax operations need jax.shard_map over a concrete mesh (symm.jax.mesh(), or jax.set_mesh "
            "of one), not an abstract mesh: the devices' order must be checked against the ranks'"
        )
    listed, ranks = list(mesh.devices.flat), state().devices
    if listed != ranks:
        raise ValueError(
            f"the mesh lists the devices {[d.id for d in listed]} but the symm group's ranks are on devices "
            f"{[d.id for d in ranks]}: each device's data would go to another device's place. Build the mesh "
            "over the devices in the order symm.jax.init was given them (symm.jax.mesh() does)"
        )


def _ffi_attrs(attrs):
    # A tuple (hashable, as a primitive's parameters must be) is an int64 array.
    return {k: np.array(v, dtype=np.int64) if isinstance(v, tuple) else v for k, v in attrs}


def _lower(ctx, *args, target, results, attrs):
    _check_mesh(ctx)
    return jax.ffi.ffi_lowering(target)(ctx, *args, **_ffi_attrs(attrs))


def _lower_ordered(ctx, *args, target, results, attrs):
    _check_mesh(ctx)
    token = ctx.tokens_in.get(IN_ORDER)
    with_token = ctx.replace(
        avals_in=(core.abstract_token, *ctx.avals_in), avals_out=(core.abstract_token, *ctx.avals_out)
    )
    token, *outs = jax.ffi.ffi_lowering(target)(with_token, token, *args, **_ffi_attrs(attrs))
    ctx.set_tokens_out(mlir.TokenSet({IN_ORDER: token}))
    return outs


mlir.register_lowering(_call_p, _lower)
mlir.register_lowering(_ordered_p, _lower_ordered)


def call(target, results, args, attrs, ordered):
    """The custom call ``target`` on ``args`` with attributes ``attrs``
    (a tuple value is an int64 array), ``ordered`` after the program's
    previous symm call or not; ``results`` are the result avals."""
    p = _ordered_p if ordered else _call_p
    return p.bind(*args, target=target, results=tuple(results), attrs=tuple(sorted(attrs.items())))
