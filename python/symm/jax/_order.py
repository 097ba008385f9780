"""The calls in program order on XLA's CPU platform.

symm pairs the devices' calls in the order each device makes them. On a GPU
that is the order of the device's stream, the same on every device. XLA's
CPU runtime instead runs the operations of a program that do not depend on
each other concurrently, in an order that differs between devices and runs:
two independent calls could meet their peers' other call, and calls of the
same shapes would then exchange each other's data.

So on the CPU platform each call is an ordered effect: JAX threads a token
through every such call of a program (and from one program to the next),
and the custom call takes the token in and gives a new one out, which XLA's
CPU runtime honours as a dependency (a token merely passed through an
optimization barrier is dropped before it runs). The handlers skip token
buffers. GPU calls stay pure ``jax.ffi.ffi_call``s: the stream orders them,
and tokens would only tie XLA's scheduler.
"""

import atexit
import dataclasses

import jax
from jax._src import core, effects  # the token aval JAX compares by identity; the effect kinds
from jax.extend.core import Effect, Primitive
from jax.interpreters import mlir


@dataclasses.dataclass(frozen=True)
class _InOrder(Effect):
    def __str__(self):
        return "symm call order"


IN_ORDER = _InOrder()
for kinds in (
    effects.ordered_effects,
    effects.shardable_ordered_effects,  # inside shard_map
    effects.lowerable_effects,
    effects.control_flow_allowed_effects,  # lax.map, scan, cond
    effects.custom_derivatives_allowed_effects,  # the custom VJPs
    effects.remat_allowed_effects,  # jax.checkpoint
):
    kinds.add_type(_InOrder)

_call_p = Primitive("symm_ordered_call")
_call_p.multiple_results = True


@_call_p.def_effectful_abstract_eval
def _abstract(*args, target, results, attrs):
    return results, {IN_ORDER}


def _lower(ctx, *args, target, results, attrs):
    token = ctx.tokens_in.get(IN_ORDER)
    with_token = ctx.replace(
        avals_in=(core.abstract_token, *ctx.avals_in), avals_out=(core.abstract_token, *ctx.avals_out)
    )
    token, *outs = jax.ffi.ffi_lowering(target)(with_token, token, *args, **dict(attrs))
    ctx.set_tokens_out(mlir.TokenSet({IN_ORDER: token}))
    return outs


mlir.register_lowering(_call_p, _lower)


def _drop_if_failed(tokens):
    """Forgets the order token JAX holds for the next program (``tokens``,
    its thread's runtime tokens) if the program that made it failed."""
    held = tokens.current_tokens.get(IN_ORDER)
    if isinstance(held, core.Token) and held._buf.is_ready():
        try:
            held.block_until_ready()
        except Exception:  # that program's error, raised to its caller already
            del tokens.current_tokens[IN_ORDER]


def _fresh_after_failure():
    """A failed call fails every output of its program, the order token
    among them, and JAX hands that token to the next program with ordered
    effects, which would fail with the old error however good its own
    calls, and JAX would raise it again at exit. So a failed token is
    dropped, and the next program starts a fresh one. (A program dispatched
    while the failing one still ran has its token already and fails with
    it, as work queued behind a failed kernel does.)"""
    from jax._src import dispatch  # JAX's runtime tokens; no public hook

    tokens = getattr(dispatch, "RuntimeTokenSet", None)
    take = getattr(tokens, "get_token_input", None)
    if take is None or not isinstance(getattr(dispatch.runtime_tokens, "current_tokens", None), dict):
        return  # another JAX than this was written for: failures then carry on

    def get_token_input(self, eff, devices):
        if eff == IN_ORDER:
            _drop_if_failed(self)
        return take(self, eff, devices)

    tokens.get_token_input = get_token_input
    # Runs before JAX's own wait at exit (registered when jax was imported).
    atexit.register(lambda: _drop_if_failed(dispatch.runtime_tokens))


_fresh_after_failure()


def call(target, results, args, attrs):
    """The custom call ``target`` on ``args`` with attributes ``attrs``,
    ordered after the program's previous symm call; ``results`` are the
    result avals."""
    return _call_p.bind(*args, target=target, results=tuple(results), attrs=tuple(sorted(attrs.items())))
