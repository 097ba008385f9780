"""The eager calls' host time: an operation's prepared call is kept per
group and kind of call, so that calling it again on arrays alike costs
the library call and the addresses only.

A call is keyed by everything its preparation reads from its arguments
except the arrays' addresses: each plain torch tensor's shape, strides,
dtype and device (CPU or CUDA), with the current stream of a CUDA one's device (the
stream the call runs on, and whether the tensor is read directly, follow
from it); each numpy array's shape, strides, dtype and writability; the
other arguments' values (None, bools, ints, floats, strings, and dtypes:
torch's, numpy's and numpy's scalar types); and which arguments are the
same object. A hit
writes the arrays' addresses into the kept C descriptors and allocates
the outputs the call allocates; the library checks, and agrees on, every
call as always. Anything else (tensors needing DLPack's exchange: those
requiring grad, negative views, complex ones (which may be conjugate
views, and which the call refuses), other layouts; other array types,
stream objects) takes the full preparation every time.

Where the compiled ``_fastcall_ext`` loads (CPython 3.10 or newer), the
hit path runs in C: a key of its own (bytes, equal where this module's
keys are equal), and the kept call of one of the five
operations it knows (``Native``) made by its C function directly; a miss
comes back here (``slow_call``). Without it, all of this runs in Python."""

import ctypes
import math
import sys
import threading

import numpy as np

from . import _lib
from ._stream import current_torch_stream

try:
    from . import _fastcall_ext as _ext
except ImportError:  # not built (a source tree), or an interpreter older than its ABI
    _ext = None

MAX_CALLS = 64  # kinds of call kept per operation and group (the oldest go)
MAX_DEPTH = 8  # lists in lists the key describes (_fastcall_ext.c's too)


class _Slow(Exception):
    """A result the cache cannot assemble."""


_SCALARS = {type(None), bool, int, str}


def _part(x, objs, ptrs, torch, streams, depth=0):
    """The key of one argument, adding its arrays to ``objs`` and their
    addresses to ``ptrs``; None where the cache does not describe it.
    ``streams`` caches the current stream per CUDA device for this call."""
    t = type(x)
    if t is _TENSOR[0]:
        # Complex tensors (which may be conjugate views) are refused by the call anyway.
        if x.requires_grad or x.layout is not _TENSOR[1] or x.dtype.is_complex or x.is_neg():
            return None
        dev = x.get_device()  # -1: CPU (or no device at all: not described)
        if dev < 0:
            if not x.is_cpu:
                return None
        elif x.is_cuda:
            stream = streams.get(dev)
            if stream is None:
                stream = streams[dev] = current_torch_stream(torch, dev)
            dev = (dev, stream)
        else:
            return None
        objs.append(x)
        ptrs.append(x.data_ptr())
        return (x.shape, x.stride(), x.dtype, dev)
    if t in _SCALARS:
        return (t, x)
    if t is np.ndarray:
        objs.append(x)
        ptrs.append(x.__array_interface__["data"][0])
        return (x.shape, x.strides, x.dtype, x.flags.writeable)
    if t is float:  # -0.0 == 0.0 as keys, not as arguments
        return (t, x, math.copysign(1.0, x))
    if t is list or t is tuple:
        if depth == MAX_DEPTH:
            return None
        parts = [t]
        for y in x:
            p = _part(y, objs, ptrs, torch, streams, depth + 1)
            if p is None:
                return None
            parts.append(p)
        return tuple(parts)
    if t is _TENSOR[2] or isinstance(x, (np.dtype, type)):  # out_dtype: torch.bfloat16, np.float16, ...
        return (t, x)
    return None


# (torch.Tensor, torch.strided, torch.dtype) once torch is imported; Nones before.
_TENSOR = (None, None, None)


def key_of(args, kwargs):
    """``(key, objs, ptrs)`` of a call's arguments (after the group): its
    key and its arrays, in order, with their addresses; or None."""
    global _TENSOR
    torch = sys.modules.get("torch")
    if torch is not None and _TENSOR[0] is None:
        _TENSOR = (torch.Tensor, torch.strided, torch.dtype)
    objs, ptrs, key, streams = [], [], [], {}
    for x in args:
        p = _part(x, objs, ptrs, torch, streams)
        if p is None:
            return None
        key.append(p)
    for name, x in kwargs.items():  # a name is a str, a positional part never
        p = _part(x, objs, ptrs, torch, streams)
        if p is None:
            return None
        key.append(name)
        key.append(p)
    if len(objs) > 1 and len(set(map(id, objs))) != len(objs):  # an array given twice: which positions alias
        first = {}
        key.append(tuple(first.setdefault(id(o), i) for i, o in enumerate(objs)))
    return tuple(key), objs, ptrs


def _allocator(obj):
    """A function making an array like the allocated output ``obj``
    (returning it and its address), or None."""
    if type(obj) is np.ndarray:
        if not obj.flags.c_contiguous:
            return None
        shape, dtype = obj.shape, obj.dtype

        def make():
            x = np.empty(shape, dtype)
            return x, x.__array_interface__["data"][0]

        return make
    torch = sys.modules.get("torch")
    if torch is not None and type(obj) is torch.Tensor and obj.is_contiguous():
        shape, dtype, device = obj.shape, obj.dtype, obj.device
        empty = torch.empty

        def make():
            x = empty(shape, dtype=dtype, device=device)
            return x, x.data_ptr()

        return make
    return None


def _args_in(keep, found):
    """The ``Arg``s in ``keep`` (nested lists, tuples and dicts)."""
    if isinstance(keep, (list, tuple)):
        for x in keep:
            _args_in(x, found)
    elif isinstance(keep, dict):
        _args_in(list(keep.values()), found)
    elif keep is not None:
        found.append(keep)  # an Arg
    return found


def written(keep):
    """The torch tensors among the outputs in ``keep`` (``Arg``s), each once."""
    torch = sys.modules.get("torch")
    if torch is None:
        return ()
    found = {id(a.obj): a.obj for a in _args_in(keep, []) if a.output and isinstance(a.obj, torch.Tensor)}
    return tuple(found.values())


def bump(tensor):
    """Tells autograd that a call wrote ``tensor`` (its version, as torch's
    in-place ops bump it): a backward that saved it before then raises
    instead of using the new values. Inference tensors keep no version."""
    if not tensor.is_inference():
        sys.modules["torch"].autograd.graph.increment_version(tensor)


class Template:
    """A prepared call without its arrays: the C function and arguments,
    the descriptors each array's address goes into, how to allocate the
    outputs, how to assemble the result, and which arrays given are torch
    tensors it writes (``bumped``). ``busy`` is held while a call writes its
    descriptors: another thread's call of the same kind then prepares its
    own."""

    __slots__ = ("fn", "args", "writes", "makers", "result", "bumped", "busy", "native")

    def __init__(self, fn, args, writes, makers, result, bumped):
        self.fn, self.args, self.writes, self.makers, self.result = fn, args, writes, makers, result
        self.bumped = bumped
        self.busy = threading.Lock()
        # The same call for the C path (which has its own busy flag), or None.
        self.native = _native(fn, args, writes, makers, result, bumped) if _ext is not None else None

    @classmethod
    def of(cls, call, objs):
        """The template of the prepared ``call`` (a ``_Call``) of the arrays
        ``objs``, or None where it holds anything unaccounted for."""
        index = {id(o): i for i, o in enumerate(objs)}
        allocated, makers, writes = [], [], []
        for arg in _args_in(call.keep, []):
            i = index.get(id(arg.obj))
            if i is None:
                make = _allocator(arg.obj)
                if make is None:
                    return None
                i = index[id(arg.obj)] = len(objs) + len(allocated)
                allocated.append(arg.obj)
                makers.append(make)
            writes.append((i, arg.c))
        everything = [*objs, *allocated]

        def spec(x):
            if isinstance(x, (list, tuple)):
                return (type(x), [spec(y) for y in x])
            i = index.get(id(x))
            if i is None or everything[i] is not x:
                raise _Slow
            return i

        try:
            result = spec(call.result)
        except _Slow:
            return None
        if not set(range(len(objs), len(everything))) <= set(_leaves(result)):
            return None  # an allocated output the call would not return
        bumped = tuple(i for i, o in enumerate(objs) if any(o is w for w in call.written))
        return cls(call.fn, call.args, writes, makers, result, bumped)

    def __call__(self, group, objs, ptrs):
        for make in self.makers:
            x, ptr = make()
            objs.append(x)
            ptrs.append(ptr)
        for i, desc in self.writes:
            desc.data = ptrs[i]
        group._check(self.fn(group.raw, *self.args))
        for i in self.bumped:
            bump(objs[i])
        return _built(self.result, objs)


def _leaves(spec):
    if type(spec) is int:
        yield spec
    else:
        for s in spec[1]:
            yield from _leaves(s)


def _built(spec, objs):
    if type(spec) is int:
        return objs[spec]
    kind, items = spec
    return kind([_built(s, objs) for s in items])


# The operations the C path makes itself, by their C functions (in
# _fastcall_ext.c's enum Op order).
_NATIVE_OPS = {
    "symm_fused_ag_mm": 0,
    "symm_mm_rs": 1,
    "symm_lc_allgather": 2,
    "symm_all_reduce": 3,
    "symm_all_reduce_rmsnorm": 4,
}
_WORD = (1 << 64) - 1


def _word(x):
    """A C argument as ctypes passes it, as a machine word (an int), or None."""
    if x is None:
        return 0
    if type(x) is int or type(x) is bool:
        return int(x) & _WORD  # two's complement: the callee reads the int it declares
    if type(x) is float:  # a C float (the one float any of _NATIVE_OPS takes): its bits
        return int.from_bytes(bytes(ctypes.c_float(x)), sys.byteorder)
    if isinstance(x, (ctypes.Structure, ctypes.Array)):
        return ctypes.addressof(x)  # given where a pointer is declared: passed by reference
    if isinstance(x, ctypes._Pointer):
        return ctypes.cast(x, ctypes.c_void_p).value or 0
    return None


def _native(fn, args, writes, makers, result, bumped):
    """The kept call as a ``_fastcall_ext.Native``, or None where it is not
    one of ``_NATIVE_OPS`` made by its ctypes function (wrapped, say)."""
    op = _NATIVE_OPS.get(getattr(fn, "__name__", None))
    if op is None or not isinstance(fn, ctypes._CFuncPtr):
        return None
    words = [_word(a) for a in args]
    if None in words:
        return None
    data = _lib.Tensor.data.offset
    at = tuple((i, ctypes.addressof(desc) + data) for i, desc in writes)
    address = ctypes.cast(fn, ctypes.c_void_p).value
    return _ext.Native(op, address, tuple(words), at, tuple(makers), result, (args, writes), bumped)


def call(group, prepare_call, args, kwargs):
    """``prepare_call(group, *args, **kwargs)()``, through the group's cache."""
    if _ext is not None:
        return _ext.call(group, prepare_call, args, kwargs)
    caches = getattr(group, "_calls", None)
    return slow_call(group, prepare_call, args, kwargs, key_of(args, kwargs) if type(caches) is dict else None)


def slow_call(group, prepare_call, args, kwargs, found):
    """``call`` given ``found``, ``key_of``'s result (None: no key): a
    kept call made in Python, or a call prepared in full (and kept where
    new). The C path comes here for all but its own hits, so a template
    with a ``native`` found here is in use by another thread."""
    if found is None:
        return prepare_call(group, *args, **kwargs)()
    caches = group._calls
    key, objs, ptrs = found
    cache = caches.get(prepare_call)
    if cache is None:
        cache = caches.setdefault(prepare_call, {})
    template = cache.get(key)
    if template is not None and template.native is None and template.busy.acquire(False):
        try:
            return template(group, objs, ptrs)
        finally:
            template.busy.release()
    prepared = prepare_call(group, *args, **kwargs)
    result = prepared()
    if template is None:
        template = Template.of(prepared, objs)
        if template is not None:
            if len(cache) >= MAX_CALLS:
                del cache[next(iter(cache))]  # the oldest kept
            cache[key] = template
    return result


def _ext_torch_probe():
    """Gives the C path torch's types (it asks on every call until then)."""
    torch = sys.modules.get("torch")
    if torch is not None:
        get = getattr(torch._C, "_cuda_getCurrentRawStream", None)
        try:
            # One empty tensor per dtype the C path reads from the DLPack exchange alone.
            dtypes = [getattr(torch, name, None) for name in _EXCHANGED_DTYPES]
            samples = tuple(torch.empty(0, dtype=d) for d in dtypes if isinstance(d, torch.dtype))
            stream_of = get or (lambda dev: current_torch_stream(torch, dev))
            _ext.set_torch(torch.Tensor, torch.strided, torch.dtype, stream_of, samples)
        except (AttributeError, TypeError):  # a torch whose tensors it cannot read: they take the full path
            _ext.configure(np.ndarray, np.dtype, slow_call, None, bump)


# symm's dtypes, and complex ones (never described: the table says which).
_EXCHANGED_DTYPES = ("float32", "bfloat16", "float16", "float8_e4m3fn", "float8_e5m2", "int8", "uint8", "int32",
                     "int64", "complex64", "complex128")


if _ext is not None:
    _ext.configure(np.ndarray, np.dtype, slow_call, _ext_torch_probe, bump)
