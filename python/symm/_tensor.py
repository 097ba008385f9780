"""``symm_tensor_t`` descriptors of array arguments, checked for what the
C side cannot see: dtype spelling, memory kind and writability."""

from . import _lib
from ._arrays import view

# numpy-style dtype names (ml_dtypes' for bf16 and fp8) -> SYMM_DTYPE_*.
DTYPES = {
    "float32": _lib.DTYPE_F32,
    "bfloat16": _lib.DTYPE_BF16,
    "float16": _lib.DTYPE_F16,
    "float8_e4m3fn": _lib.DTYPE_FP8_E4M3,
    "float8_e5m2": _lib.DTYPE_FP8_E5M2,
}


class Arg:
    """One array argument of an operation: its view (kept alive for the
    call) and its C descriptor."""

    def __init__(self, group, obj, name, stream, output=False):
        self.view = v = view(obj, stream)
        if v.dtype not in DTYPES:
            raise TypeError(f"{name} has dtype {v.dtype}; symm supports {', '.join(DTYPES)}")
        if not v.accessible_from(group.backend):
            raise ValueError(f"{name} is in {v.memory} memory, which a {group.backend} group cannot use")
        if output and not v.writable:
            raise ValueError(f"{name} is read-only")
        self.c = _lib.Tensor(v.ptr, DTYPES[v.dtype], len(v.shape))
        self.c.shape[: len(v.shape)] = v.shape
        self.c.strides[: len(v.strides)] = v.strides

    @property
    def shape(self):
        return self.view.shape


_ARRAY_TYPES = {}  # n -> Tensor * n (made once: every call builds arrays)


def array_of(args):
    """A C array of the descriptors of ``args``."""
    n = len(args)
    t = _ARRAY_TYPES.get(n)
    if t is None:
        t = _ARRAY_TYPES.setdefault(n, _lib.Tensor * n)
    return t(*[a.c for a in args])
