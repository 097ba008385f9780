"""``symm_tensor_t`` descriptors of array arguments, checked for what the
C side cannot see: dtype spelling, memory kind and writability."""

import sys

from . import _lib
from ._arrays import MAX_DIMS, accessible, torch_fields, view

# numpy-style dtype names (ml_dtypes' for bf16 and fp8; torch's and DLPack's
# integer names are the same) -> SYMM_DTYPE_*.
DTYPES = {
    "float32": _lib.DTYPE_F32,
    "bfloat16": _lib.DTYPE_BF16,
    "float16": _lib.DTYPE_F16,
    "float8_e4m3fn": _lib.DTYPE_FP8_E4M3,
    "float8_e5m2": _lib.DTYPE_FP8_E5M2,
    "int8": _lib.DTYPE_INT8,
    "uint8": _lib.DTYPE_UINT8,
    "int32": _lib.DTYPE_INT32,
    "int64": _lib.DTYPE_INT64,
}


class Arg:
    """One array argument of an operation: its shape and dtype name, its C
    descriptor (the one the call reads: ``array_of`` moves it into its
    array), the object given and what keeps its memory alive for the call;
    ``copied`` says why the call reads a copy of the object's values (None:
    it reads the object's memory); ``output``, whether the call writes it."""

    __slots__ = ("shape", "dtype", "c", "obj", "_keep", "name", "copied", "output")

    def __init__(self, group, obj, name, stream, output=False):
        # Plain torch tensors (most calls) skip the general reader's
        # ArrayView: at small sizes the host's time is the call's time.
        torch = sys.modules.get("torch")
        fields, copied = None, None
        if torch is not None and type(obj) is torch.Tensor:
            fields = torch_fields(torch, obj, stream)
        if fields is None:
            v = view(obj, stream, output, name)
            ptr, shape, strides, dtype, memory, writable, keep, copied = v
        else:
            ptr, shape, strides, dtype, memory = fields
            writable, keep = True, obj
            if len(shape) > MAX_DIMS:  # view() checks its own
                raise ValueError(f"arrays of up to {MAX_DIMS} dimensions are supported; this one has {len(shape)}")
        code = DTYPES.get(dtype)
        if code is None:
            raise TypeError(f"{name} has dtype {dtype}; symm supports {', '.join(DTYPES)}")
        if not accessible(memory, group.backend):
            if memory == "meta":
                raise ValueError(f"{name} is a meta tensor: it has no data")
            raise ValueError(f"{name} is in {memory} memory, which a {group.backend} group cannot use")
        if output and not writable:
            raise ValueError(f"{name} is read-only")
        n = len(shape)
        self.shape, self.dtype, self.obj, self._keep = shape, dtype, obj, keep
        self.name, self.copied, self.output = name, copied, output
        self.c = c = _lib.Tensor(ptr, code, n)
        c.shape[:n] = shape
        c.strides[:n] = strides


_ARRAY_TYPES = {}  # n -> Tensor * n (made once: every call builds arrays)


def array_of(args):
    """A C array of the descriptors of ``args`` (None: an absent entry,
    NULL data), each arg's ``c`` then the array's element (so that a kept
    call can rewrite its address)."""
    n = len(args)
    t = _ARRAY_TYPES.get(n)
    if t is None:
        t = _ARRAY_TYPES.setdefault(n, _lib.Tensor * n)
    array = t(*[_lib.Tensor() if a is None else a.c for a in args])
    for i, a in enumerate(args):
        if a is not None:
            a.c = array[i]
    return array
