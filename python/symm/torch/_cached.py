"""The eager calls' host time: a call's arguments are read once per kind
of call, not on every call.

An operator call is keyed by everything symm's Python side reads from
its tensors besides their addresses (shapes, strides, dtypes, devices),
its other arguments and the stream. The first call of a key goes through
``symm.bind`` (every check, then the call); later ones reuse its C
arguments with the new tensors' addresses written into their
descriptors, and allocate only the outputs. The library itself checks
and agrees on every call as always."""

import torch

import symm
from symm._stream import current_torch_stream

_CALLS = {}  # key -> _Template
_MAX = 512  # distinct kinds of call kept (a program has a few per layer)


class _Template:
    """A bound call's C function and arguments, and where each tensor's
    address goes (``slots``: one descriptor list per tensor, inputs then
    outputs), with the outputs' shapes and dtypes."""

    __slots__ = ("fn", "args", "slots", "outputs")

    def __init__(self, fn, args, slots, outputs):
        self.fn, self.args, self.slots, self.outputs = fn, args, slots, outputs


def _describe(t):
    return (t.shape, t.stride(), t.dtype, t.device)


def _stream(t):
    return current_torch_stream(torch, t.get_device()) if t.is_cuda else 0


def _call(group, key, tensors, outputs, bind, slots):
    """Runs the call of ``key`` on ``tensors`` into new ``outputs`` (a list
    of ``(shape, dtype)``, allocated like ``tensors[0]``) and returns them.
    ``bind(outs)`` binds the call on a miss; ``slots(args)`` lists, for
    each tensor then each output, the descriptors holding its address."""
    t0 = tensors[0]
    outs = [torch.empty(shape, dtype=dtype, device=t0.device) for shape, dtype in outputs]
    template = _CALLS.get(key)
    if template is None:
        bound = bind(outs)
        bound()
        if len(_CALLS) >= _MAX:
            _CALLS.clear()
        # The arguments alone: the bound call's references to the tensors go.
        _CALLS[key] = _Template(bound.fn, bound.args, slots(bound.args), outputs)
        return outs
    for descs, t in zip(template.slots, (*tensors, *outs)):
        ptr = t.data_ptr()
        for d in descs:
            d.data = ptr
    group._check(template.fn(group.raw, *template.args))
    return outs


def fused_ag_mm(group, A, Bs, gather_dim, return_A):
    """``symm.fused_ag_mm`` of plain (non-fp8) tensors: (gathered or None, outputs)."""
    tensors = (A, *Bs)
    key = ("ag_mm", id(group), gather_dim, return_A, _stream(A), *map(_describe, tensors))
    full = list(A.shape)
    full[gather_dim % A.dim()] *= group.world_size
    outputs = [((*full[:-1], B.shape[1]), B.dtype) for B in Bs] + ([(full, A.dtype)] if return_A else [])
    n = len(Bs)

    def bind(outs):
        ag = outs[n] if return_A else None
        return symm.bind(symm.fused_ag_mm, group, A, list(Bs), gather_dim, out=outs[:n], ag_out=ag)

    def slots(args):  # (a, bs[], num_b, dim, ag_out, outs[], opts, stream)
        return [[args[0]], *([b] for b in args[1]), *([o] for o in args[5]), *([[args[4]]] if return_A else [])]

    outs = _call(group, key, tensors, outputs, bind, slots)
    return (outs[n] if return_A else None), outs[:n]


def mm_rs(group, A, B, reduce_op, scatter_dim):
    key = ("mm_rs", id(group), reduce_op, scatter_dim, _stream(A), _describe(A), _describe(B))
    shape = [*A.shape[:-1], B.shape[1]]
    dim = scatter_dim % A.dim()
    if shape[dim] % group.world_size:
        raise ValueError(f"dimension {dim} of the product ({shape[dim]}) does not divide by {group.world_size}")
    shape[dim] //= group.world_size

    def bind(outs):
        return symm.bind(symm.mm_rs, group, A, B, scatter_dim, op=reduce_op, out=outs[0])

    def slots(args):  # (a, b, dim, op, out, opts, stream)
        return [[args[0]], [args[1]], [args[4]]]

    return _call(group, key, (A, B), [(shape, A.dtype)], bind, slots)[0]


def lc_allgather(group, x):
    key = ("lc", id(group), _stream(x), _describe(x))
    shape = (x.shape[0] * group.world_size, *x.shape[1:])

    def bind(outs):
        return symm.bind(symm.lc_allgather, group, x, out=outs[0])

    return _call(group, key, (x,), [(shape, x.dtype)], bind, lambda args: [[args[0]], [args[1]]])[0]


def all_reduce(group, x, reduce_op, algorithm, out=None, inplace=False):
    """Into a new tensor, into ``out``, or in place."""
    given = (x,) if inplace else (x,) if out is None else (x, out)
    key = ("ar", id(group), reduce_op, algorithm, inplace, out is None, _stream(x), *map(_describe, given))
    outputs = [] if (inplace or out is not None) else [(x.shape, x.dtype)]

    def bind(outs):
        target = out if out is not None else (outs[0] if outs else None)
        return symm.bind(symm.all_reduce, group, x, op=reduce_op, out=target, algorithm=algorithm, inplace=inplace)

    def slots(args):  # (input, output, op, opts, stream); in place: one descriptor
        if inplace:
            return [[args[0], args[1]]]
        return [[args[0]], [args[1]]]

    outs = _call(group, key, given, outputs, bind, slots)
    return outs[0] if outputs else (x if inplace else out)
