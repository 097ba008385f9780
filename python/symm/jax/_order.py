"""The order of the calls on XLA's CPU platform, and the tokens it leaves.

symm pairs the devices' calls in the order each device makes them. On a GPU
that is the order of the device's stream, the same on every device. XLA's
CPU runtime instead runs the operations of a program that do not depend on
each other concurrently, in an order that differs between devices and runs:
two independent calls could meet their peers' other call, and calls of the
same shapes would then exchange each other's data.

So on the CPU platform each call is an ordered effect (``IN_ORDER``): JAX
threads a token through every such call of a program (and from one program
to the next), and the custom call takes the token in and gives a new one
out (``_primitives``), which XLA's CPU runtime honours as a dependency (a
token merely passed through an optimization barrier is dropped before it
runs). The handlers skip token buffers. GPU calls stay pure: the stream
orders them, and tokens would only tie XLA's scheduler.
"""

import atexit
import dataclasses

from jax._src import core, effects  # JAX's tokens; the effect kinds
from jax.extend.core import Effect


@dataclasses.dataclass(frozen=True)
class _InOrder(Effect):
    def __str__(self):
        return "symm call order"


# Where both effects may stand: lowered, in control flow (lax.map, scan,
# cond), in the custom VJPs and under jax.checkpoint.
_ALLOWED = (
    effects.lowerable_effects,
    effects.control_flow_allowed_effects,
    effects.custom_derivatives_allowed_effects,
    effects.remat_allowed_effects,
)

IN_ORDER = _InOrder()
for kinds in (effects.ordered_effects, effects.shardable_ordered_effects, *_ALLOWED):  # shardable: in shard_map
    kinds.add_type(_InOrder)


@dataclasses.dataclass(frozen=True)
class _Dispatched(Effect):
    def __str__(self):
        return "symm call"


# Unordered, beside IN_ORDER: JAX's ahead-of-time executables (``.lower().
# compile()``) take a fast path on a second call unless a program has
# unordered effects or host callbacks, and that path leaves out the order
# token the program expects (XLA then reads past its arguments and crashes).
DISPATCHED = _Dispatched()
for kinds in _ALLOWED:
    kinds.add_type(_Dispatched)


def _failure(token, wait):
    """The error of a failed program's output ``token``, else None (also
    for one still running, without ``wait``)."""
    if token is None or (isinstance(token, core.Token) and not (wait or token._buf.is_ready())):
        return None
    try:
        token.block_until_ready()
    except Exception as e:  # that program's error, raised to its caller already
        return e
    return None


# What the handlers' errors start with (``symm_<operation>: ...``).
_SYMM_FAILURE = ("symm_fused_ag_mm:", "symm_mm_rs:", "symm_lc_allgather:", "symm_all_reduce")


def _is_symms(error):
    return error is not None and any(s in str(error) for s in _SYMM_FAILURE)


def _drop_if_failed(tokens, wait=False):
    """If the last program with symm calls failed (its order token did),
    forgets that token (``tokens``: its thread's runtime tokens), and, if
    a symm call failed it, every other token a symm call failed (the
    program's other ordered effects', its devices' runtime tokens). A
    failure of the user's own (an io_callback's) stays JAX's to report."""
    error = _failure(tokens.current_tokens.get(IN_ORDER), wait)
    if error is None:
        return
    del tokens.current_tokens[IN_ORDER]
    if not _is_symms(error):
        return
    for eff, token in list(tokens.current_tokens.items()):
        if _is_symms(_failure(token, True)):
            del tokens.current_tokens[eff]
    for device, token in list(tokens.output_runtime_tokens.items()):
        if _is_symms(_failure(token, True)):
            del tokens.output_runtime_tokens[device]


def _fresh_after_failure():
    """A failed call fails every output of its program, its tokens among
    them, and JAX hands those to the next program with ordered effects,
    which would fail with the old error however good its own calls; JAX's
    barrier (``jax.effects_barrier``, and its wait at exit) would raise it
    again and again. So once a program with symm calls has failed, its
    failed tokens are dropped (``_drop_if_failed``) when the next program
    takes its tokens, after a barrier has raised the failure once, and at
    exit; later programs start fresh ones. (A program dispatched while the failing one still ran has
    its token already and fails with it, as work queued behind a failed
    kernel does.)"""
    from jax._src import dispatch  # JAX's runtime tokens; no public hook

    tokens = getattr(dispatch, "RuntimeTokenSet", None)
    take = getattr(tokens, "get_token_input", None)
    barrier = getattr(tokens, "block_until_ready", None)
    held = dispatch.runtime_tokens
    if (
        take is None
        or barrier is None
        or not isinstance(getattr(held, "current_tokens", None), dict)
        or not isinstance(getattr(held, "output_runtime_tokens", None), dict)
    ):
        return  # another JAX than this was written for: failures then carry on

    def get_token_input(self, eff, devices):
        _drop_if_failed(self)
        return take(self, eff, devices)

    def block_until_ready(self):
        try:
            barrier(self)
        except Exception:
            _drop_if_failed(self, wait=True)
            raise

    tokens.get_token_input = get_token_input
    tokens.block_until_ready = block_until_ready
    # Runs before JAX's own wait at exit (registered when jax was imported).
    atexit.register(lambda: _drop_if_failed(dispatch.runtime_tokens, wait=True))


def wait_for_calls():
    """Waits for the symm calls of programs this thread dispatched (each
    program's calls wait for the previous program's: its order token)."""
    from jax._src import dispatch

    token = getattr(dispatch.runtime_tokens, "current_tokens", {}).get(IN_ORDER)
    _failure(token, True)  # a failure is that program's, raised to its caller


_fresh_after_failure()
