"""What the operations need to know about an array argument, from whichever
protocol the object speaks: pointer, shape, strides in elements, dtype, and
whether the memory is host or CUDA memory.

Order of preference: a numpy array as itself (so extension dtypes such as
``ml_dtypes.bfloat16`` and ``float8_e4m3fn`` keep their name); a plain
torch tensor read directly when the library's stream is torch's current
stream (nothing to order then); then DLPack, which also carries bf16 and
lets the producer order its pending work before our stream; then
``__cuda_array_interface__``; then ``__array_interface__``. torch's 8-bit
floats go through DLPack as bytes (``view(torch.uint8)``, same shape and
strides) and keep their name: not every torch version exports them through
DLPack, and none through the array interfaces.

Every call of an operation reads its arguments here, and at small sizes
the GPU finishes an operation sooner than Python can issue it, so the
common cases (numpy, torch) take the short paths.
"""

import sys
from typing import NamedTuple

import numpy as np

from . import _dlpack
from ._stream import current_torch_stream

MAX_DIMS = 8  # symm_tensor_t's shape/strides capacity


class ArrayView(NamedTuple):
    ptr: int
    shape: tuple
    strides: tuple  # in elements
    dtype: str  # numpy-style name: "float32", "bfloat16", ...
    memory: str  # "host", "cuda", "managed" (usable from both), or "meta" (a torch meta tensor: no data)
    writable: bool
    keepalive: tuple  # what must stay alive while the library uses ptr
    copied: str = None  # why ptr is a copy made here, not the object's memory (None: it is the object's)

    def accessible_from(self, backend):
        return accessible(self.memory, backend)


def accessible(memory, backend):
    """Whether a ``backend`` group can use arrays in ``memory``."""
    return memory == "managed" or memory == ("host" if backend == "host" else "cuda")


def _contiguous_strides(shape):
    strides, step = [], 1
    for n in reversed(shape):
        strides.insert(0, step)
        step *= n
    return tuple(strides)


def _element_strides(byte_strides, itemsize, what):
    strides = []
    for s in byte_strides:
        q, r = divmod(s, itemsize)
        if r:
            raise ValueError(f"{what} has strides {byte_strides} bytes, not whole {itemsize}-byte elements")
        strides.append(q)
    return tuple(strides)


_NUMPY_NAMES = {}  # dtype -> name (numpy computes .name in Python, slowly)


def _from_numpy(arr, keep):
    dtype = arr.dtype
    name = _NUMPY_NAMES.get(dtype)
    if name is None:
        if not dtype.isnative:  # its name would not say so, and the library reads this machine's order
            raise TypeError(
                f"the array's dtype {dtype.str} is not in this machine's byte order; pass "
                "arr.astype(arr.dtype.newbyteorder('='))"
            )
        name = _NUMPY_NAMES.setdefault(dtype, dtype.name)
    ptr, readonly = arr.__array_interface__["data"]
    return ArrayView(
        ptr,
        arr.shape,
        _element_strides(arr.strides, dtype.itemsize, "the array"),
        name,
        "host",
        not readonly,
        (keep, arr),
    )


_TORCH_NAMES = {}  # torch dtype -> numpy-style name, filled on first use


def _torch_name(torch, dtype):
    if not _TORCH_NAMES:
        fp8 = {getattr(torch, n): n for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n)}
        _TORCH_NAMES.update({torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16", **fp8})
    return _TORCH_NAMES.get(dtype) or str(dtype).removeprefix("torch.")


def torch_fields(torch, t, stream):
    """``(ptr, shape, strides, dtype name, memory)`` of a plain strided torch
    tensor, read directly, or None where DLPack's rules apply: a CUDA tensor
    whose pending work is on another stream than the library's (DLPack
    orders it), and what DLPack refuses to export (tensors requiring grad,
    conjugate or negative views). The hot path of every call: attribute
    reads only."""
    if t.requires_grad or t.layout is not torch.strided or t.is_conj() or t.is_neg():
        return None
    device, ptr = t.get_device(), t.data_ptr()
    if device >= 0:
        if not t.is_cuda or current_torch_stream(torch, device) != (stream or 0):
            return None
        memory = "cuda"
    else:
        memory = "meta" if not ptr and t.is_meta else "host"
    return ptr, tuple(t.shape), t.stride(), _torch_name(torch, t.dtype), memory


def _from_torch(t, stream):
    fields = torch_fields(sys.modules["torch"], t, stream)
    return None if fields is None else ArrayView(*fields, True, (t,))


_DLPACK_MEMORY = {
    _dlpack.KDL_CPU: "host",
    _dlpack.KDL_CUDA_HOST: "host",
    _dlpack.KDL_CUDA: "cuda",
    _dlpack.KDL_CUDA_MANAGED: "managed",
}


# Producers of DLPack whose arrays are immutable (their legacy capsules
# carry no read-only flag): refused as outputs.
_IMMUTABLE_DLPACK = ("jax", "jaxlib")


def _from_dlpack(obj, stream):
    device_type = _dlpack.device_type_of(obj)
    if device_type not in _DLPACK_MEMORY:
        raise ValueError(f"DLPack device type {device_type} is neither host nor CUDA memory")
    # For CUDA memory the producer makes its pending work visible to
    # `stream` (None: the legacy default stream, as for our NULL stream).
    capsule = obj.__dlpack__() if _DLPACK_MEMORY[device_type] == "host" else obj.__dlpack__(stream=stream)
    ptr, shape, strides, dtype = _dlpack.read(capsule)
    strides = _contiguous_strides(shape) if strides is None else strides
    # Legacy capsules carry no read-only flag: view() refuses the outputs of
    # producers known to be immutable; another that hands out DLPack for
    # memory it must not see written is outside this contract.
    return ArrayView(ptr, shape, strides, dtype, _DLPACK_MEMORY[device_type], True, (obj, capsule))


def _from_cai(obj):
    cai = obj.__cuda_array_interface__
    if cai.get("mask") is not None:
        raise ValueError("masked __cuda_array_interface__ arrays are not supported")
    ptr, readonly = cai["data"]
    dtype = np.dtype(cai["typestr"])
    shape = tuple(cai["shape"])
    byte_strides = cai.get("strides")
    strides = (
        _contiguous_strides(shape)
        if byte_strides is None
        else _element_strides(tuple(byte_strides), dtype.itemsize, "the CUDA array")
    )
    return ArrayView(ptr or 0, shape, strides, dtype.name, "cuda", not readonly, (obj,))


# torch's 8-bit float dtypes (by name) -> our (ml_dtypes-style) names.
_TORCH_FP8 = {"torch.float8_e4m3fn": "float8_e4m3fn", "torch.float8_e5m2": "float8_e5m2"}


def _torch_fp8(obj):
    """The fp8 dtype name of a torch tensor of one, else None."""
    if type(obj).__module__.split(".")[0] != "torch":
        return None
    return _TORCH_FP8.get(str(getattr(obj, "dtype", "")))


def _resolved(t, stream, output, name):
    """The view of a torch negative or conjugate view: its values are not
    in its memory (torch negates or conjugates as it reads), and DLPack
    exports the memory as it is. An input is read from a copy holding the
    values, as torch's ops compute with them; an output is refused, as no
    write through the memory gives the values written."""
    kind, shown = ("a negative view", "negated") if t.is_neg() else ("a conjugate view", "conjugated")
    if output:
        raise ValueError(
            f"{name} is {kind} (torch shows its memory {shown}), which symm cannot write through; pass a "
            "tensor without the bit (x.resolve_neg(), x.resolve_conj())"
        )
    v = view(t.resolve_neg().resolve_conj(), stream)
    return v._replace(keepalive=(t, *v.keepalive), copied=kind)


def _detached(torch, t, stream, output, name):
    """The view of a torch tensor requiring grad: its data, as torch's ops
    read it (their autograd formula is not symm's to run). Written, it is
    refused while grad mode is on, as torch's ops refuse such an out=."""
    if output and torch.is_grad_enabled():
        raise ValueError(
            f"{name} requires grad, and symm writes it: functions with out=... arguments don't support automatic "
            "differentiation (torch's rule); pass one that does not, or call under torch.no_grad()"
        )
    v = view(t.detach(), stream, output, name)
    return v._replace(keepalive=(t, *v.keepalive))


def view(obj, stream=None, output=False, name="the array"):
    """The ``ArrayView`` of ``obj``. ``stream`` (a CUstream int or None) is
    the stream the library will use, for the DLPack exchange; ``output``
    whether the library writes it (``name`` says which argument it is)."""
    if type(obj) is np.ndarray:
        return _checked(_from_numpy(obj, obj))
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(obj, torch.Tensor):
        if type(obj) is torch.Tensor:
            v = _from_torch(obj, stream)
            if v is not None:
                return _checked(v)
        if obj.requires_grad:
            return _detached(torch, obj, stream, output, name)
        if obj.is_neg() or obj.is_conj():
            return _resolved(obj, stream, output, name)
    fp8 = _torch_fp8(obj)
    if isinstance(obj, np.ndarray):
        if isinstance(obj, np.ma.MaskedArray):  # its mask would be ignored
            raise TypeError(f"{name} is a masked array, which symm does not support; pass arr.filled(value)")
        v = _from_numpy(obj, obj)
    elif fp8 is not None:
        raw = _from_dlpack(obj.view(sys.modules["torch"].uint8), stream)
        v = raw._replace(dtype=fp8, keepalive=(obj, *raw.keepalive))
    elif hasattr(obj, "__dlpack__"):
        if output and type(obj).__module__.split(".")[0] in _IMMUTABLE_DLPACK:
            raise ValueError(
                f"{name} is a jax array, which is immutable: symm cannot write it "
                "(pass a writable array, or use symm.jax's operations, which return new arrays)"
            )
        v = _from_dlpack(obj, stream)
    elif hasattr(obj, "__cuda_array_interface__"):
        v = _from_cai(obj)
    elif hasattr(obj, "__array_interface__"):
        if output and isinstance(obj, np.generic):
            raise ValueError(f"{name} is a numpy scalar, which is immutable: symm cannot write it; pass an array")
        v = _from_numpy(np.asarray(obj), obj)
    else:
        raise TypeError(
            f"{type(obj).__name__} is not an array: pass a numpy array, or an object with "
            "__dlpack__, __cuda_array_interface__ or __array_interface__"
        )
    return _checked(v)


def _checked(v):
    if len(v.shape) > MAX_DIMS:
        raise ValueError(f"arrays of up to {MAX_DIMS} dimensions are supported; this one has {len(v.shape)}")
    return v
