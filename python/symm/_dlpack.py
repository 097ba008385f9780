"""Reads a DLPack capsule (``__dlpack__``) with ctypes.

Only the legacy ``"dltensor"`` capsule is requested (every producer still
offers it). The capsule is left unconsumed, so its own destructor runs the
producer's deleter: holding the capsule keeps the memory alive, and dropping
it releases the memory, with no deleter call to get right here.
"""

import ctypes
from ctypes import POINTER, c_int32, c_int64, c_uint8, c_uint16, c_uint64, c_void_p

KDL_CPU = 1
KDL_CUDA = 2
KDL_CUDA_HOST = 3
KDL_CUDA_MANAGED = 13

# DLDataTypeCode -> name prefix; a dtype is prefix + bits ("float16").
_CODES = {0: "int", 1: "uint", 2: "float", 4: "bfloat"}
# DLPack 1.1's 8-bit float codes -> the full (ml_dtypes/torch) name.
_FP8_CODES = {10: "float8_e4m3fn", 12: "float8_e5m2"}


class _Device(ctypes.Structure):
    _fields_ = [("device_type", c_int32), ("device_id", c_int32)]


class _DataType(ctypes.Structure):
    _fields_ = [("code", c_uint8), ("bits", c_uint8), ("lanes", c_uint16)]


class _Tensor(ctypes.Structure):
    _fields_ = [
        ("data", c_void_p),
        ("device", _Device),
        ("ndim", c_int32),
        ("dtype", _DataType),
        ("shape", POINTER(c_int64)),
        ("strides", POINTER(c_int64)),
        ("byte_offset", c_uint64),
    ]


_get_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_get_pointer.restype = c_void_p
_get_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]


def device_type_of(obj):
    """The DLPack device type from ``__dlpack_device__``."""
    device_type, _device_id = obj.__dlpack_device__()
    return int(device_type)


def read(capsule):
    """``(ptr, shape, strides, dtype_name)`` of a ``"dltensor"`` capsule;
    strides are in elements, or None for compact row-major."""
    addr = _get_pointer(capsule, b"dltensor")  # raises ValueError if it is another kind of capsule
    t = _Tensor.from_address(addr)  # a DLManagedTensor begins with its DLTensor
    if t.dtype.lanes != 1 or (t.dtype.code not in _CODES and t.dtype.code not in _FP8_CODES):
        dt = t.dtype
        raise TypeError(f"DLPack dtype (code {dt.code}, bits {dt.bits}, lanes {dt.lanes}) is not supported")
    shape = tuple(t.shape[i] for i in range(t.ndim))
    strides = tuple(t.strides[i] for i in range(t.ndim)) if t.strides else None
    ptr = (t.data or 0) + t.byte_offset
    dtype = _FP8_CODES.get(t.dtype.code) or f"{_CODES[t.dtype.code]}{t.dtype.bits}"
    return ptr, shape, strides, dtype
