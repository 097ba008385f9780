"""The C ABI of include/symm.h in ctypes: constants, structs and every
function's argument and result types, declared once here.

tests/test_library.py checks this module against the header (every function
declared with the header's arity, constants equal, struct layouts equal to
what a C compiler makes of the header), so header drift fails a test instead
of corrupting a call.
"""

import ctypes
from ctypes import POINTER, c_char, c_char_p, c_int, c_int32, c_int64, c_size_t, c_uint32, c_void_p

from . import _loader

# --- scalar types -----------------------------------------------------------
status_t = c_int32
backend_t = c_int32
dtype_t = c_int32
reduce_op_t = c_int32
# Opaque handles (symm_group_t, symm_buffer_t, symm_handle_t) and CUstream
# values are pointers the Python side only passes back.
handle_t = c_void_p
stream_t = c_void_p

# --- constants (names without the SYMM_ prefix) -------------------------------
VERSION_MAJOR = 0
VERSION_MINOR = 1
VERSION_PATCH = 0
VERSION_CODE = VERSION_MAJOR * 10000 + VERSION_MINOR * 100 + VERSION_PATCH

SUCCESS = 0
ERROR_INVALID_ARGUMENT = 1
ERROR_INVALID_HANDLE = 2
ERROR_UNSUPPORTED = 3
ERROR_TIMEOUT = 4
ERROR_BOOTSTRAP = 5
ERROR_MISMATCH = 6
ERROR_OUT_OF_MEMORY = 7
ERROR_CUDA = 8
ERROR_NO_DEVICE = 9
ERROR_SYSTEM = 10
ERROR_REMOTE = 11
ERROR_INTERNAL = 12
ERROR_ABORTED = 13

BACKEND_AUTO = 0
BACKEND_CUDA = 1
BACKEND_HOST = 2

GROUP_ALLOW_SHARED_DEVICE = 1
GROUP_CHECK_ARGS_ALWAYS = 2
SIGNAL_CHANNELS = 16
MAX_DIMS = 8

DTYPE_F32 = 1
DTYPE_BF16 = 2
DTYPE_F16 = 3
DTYPE_FP8_E4M3 = 4
DTYPE_FP8_E5M2 = 5
DTYPE_INT8 = 6
DTYPE_UINT8 = 7
DTYPE_INT32 = 8
DTYPE_INT64 = 9

REDUCE_SUM = 0
REDUCE_AVG = 1

ALGORITHM_AUTO = -1
ALGORITHM_SEQUENTIAL = 0
ALGORITHM_PIPELINED = 1
ALGORITHM_FUSED = 2
ALGORITHM_ONE_SHOT = 3
ALGORITHM_TWO_SHOT = 4

XLA_PLATFORM_CPU = 1
XLA_PLATFORM_CUDA = 2

LOG_OFF = 0
LOG_WARN = 1
LOG_INFO = 2
LOG_TRACE = 3

MAX_SYMMETRIC_ARGS = 8
PEERS_READ = 1
PEERS_WRITE = 2


# --- structs ------------------------------------------------------------------
class UniqueId(ctypes.Structure):
    _fields_ = [("internal", c_char * 128)]


class GroupConfig(ctypes.Structure):
    _fields_ = [
        ("struct_size", c_size_t),
        ("backend", backend_t),
        ("timeout_ms", c_int32),
        ("flags", c_uint32),
    ]


AllgatherFn = ctypes.CFUNCTYPE(c_int, c_void_p, c_void_p, c_void_p, c_size_t)
BarrierFn = ctypes.CFUNCTYPE(c_int, c_void_p)


class Bootstrap(ctypes.Structure):
    _fields_ = [
        ("struct_size", c_size_t),
        ("ctx", c_void_p),
        ("allgather", AllgatherFn),
        ("barrier", BarrierFn),
    ]


class Tensor(ctypes.Structure):
    _fields_ = [
        ("data", c_void_p),
        ("dtype", dtype_t),
        ("ndim", c_int32),
        ("shape", c_int64 * MAX_DIMS),
        ("strides", c_int64 * MAX_DIMS),  # in elements
    ]


# The options of the operations: fp8 scales and biases, the algorithm, fp8
# outputs' result scales (see symm.h).
class AgMmOptions(ctypes.Structure):
    _fields_ = [
        ("struct_size", c_size_t),
        ("a_scale", POINTER(Tensor)),
        ("b_scales", POINTER(Tensor)),
        ("biases", POINTER(Tensor)),
        ("algorithm", c_int32),
        ("result_scales", POINTER(Tensor)),
    ]


class MmRsOptions(ctypes.Structure):
    _fields_ = [
        ("struct_size", c_size_t),
        ("a_scale", POINTER(Tensor)),
        ("b_scale", POINTER(Tensor)),
        ("bias", POINTER(Tensor)),
        ("algorithm", c_int32),
        ("result_scale", POINTER(Tensor)),
    ]


class AllReduceOptions(ctypes.Structure):
    _fields_ = [
        ("struct_size", c_size_t),
        ("algorithm", c_int32),
    ]


class Plan(ctypes.Structure):
    _fields_ = [
        ("struct_size", c_size_t),
        ("algorithm", c_int32),
        ("compute_ms", ctypes.c_double),
        ("comm_ms", ctypes.c_double),
        ("exposed_ms", ctypes.c_double),
        ("total_ms", ctypes.c_double),
    ]


class BuildInfo(ctypes.Structure):
    _fields_ = [
        ("struct_size", c_size_t),
        ("version_code", c_int32),
        ("version", c_char_p),
        ("kernels", c_char_p),
        ("kernels_build", c_char_p),
    ]


class SymmetricArgs(ctypes.Structure):
    _fields_ = [
        ("struct_size", c_size_t),
        ("count", c_int32),
        ("names", c_char_p * MAX_SYMMETRIC_ARGS),
        ("access", c_uint32 * MAX_SYMMETRIC_ARGS),
    ]


# void (*)(void *ctx, int level, const char *message)
LogCallbackFn = ctypes.CFUNCTYPE(None, c_void_p, c_int, c_char_p)

# The header's C spelling of each struct, for the layout check.
C_STRUCT_NAMES = {
    UniqueId: "symm_unique_id_t",
    GroupConfig: "symm_group_config_t",
    Bootstrap: "symm_bootstrap_t",
    Tensor: "symm_tensor_t",
    AgMmOptions: "symm_ag_mm_options_t",
    MmRsOptions: "symm_mm_rs_options_t",
    AllReduceOptions: "symm_all_reduce_options_t",
    Plan: "symm_plan_t",
    BuildInfo: "symm_build_info_t",
    SymmetricArgs: "symm_symmetric_args_t",
}

# --- functions: name -> (restype, argtypes) --------------------------------------


def _in_range(ctype):
    """``ctype`` as an argument type that refuses a Python int it cannot
    hold (ctypes keeps the low bits: rank 2**32 + 1 would be rank 1, a size
    of 2**64 + 16 bytes 16): ``ctypes.ArgumentError`` naming the argument."""
    bits = 8 * ctypes.sizeof(ctype)
    lo, hi = (-(1 << (bits - 1)), (1 << (bits - 1)) - 1) if ctype(-1).value < 0 else (0, (1 << bits) - 1)

    class InRange(ctype):
        @classmethod
        def from_param(cls, value):
            if isinstance(value, int) and not lo <= value <= hi:
                raise ValueError(f"{value} is out of range ({lo}..{hi})")
            return ctype.from_param(value)

    InRange.__name__ = InRange.__qualname__ = ctype.__name__
    return InRange


# The arguments callers pass as Python ints. (The operations' own are
# checked or made in Python, and pass as plain C types.)
_int, _int32, _int64, _u32, _size = (_in_range(t) for t in (c_int, c_int32, c_int64, c_uint32, c_size_t))
_h = handle_t
_out_h = POINTER(handle_t)
FUNCTIONS = {
    # buffers, rendezvous, signals
    "symm_create": (status_t, [_h, _size, _out_h]),
    "symm_buffer_ptr": (status_t, [_h, POINTER(c_void_p)]),
    "symm_buffer_size": (status_t, [_h, POINTER(c_size_t)]),
    "symm_buffer_destroy": (status_t, [_h]),
    "symm_rendezvous": (status_t, [_h, _out_h]),
    "symm_handle_peer_ptr": (status_t, [_h, _int, POINTER(c_void_p)]),
    "symm_handle_signal_pad_ptr": (status_t, [_h, _int, POINTER(c_void_p)]),
    "symm_handle_destroy": (status_t, [_h]),
    "symm_barrier": (status_t, [_h, _int, stream_t]),
    "symm_put_signal": (status_t, [_h, _int, _int, stream_t]),
    "symm_wait_signal": (status_t, [_h, _int, _int, stream_t]),
    "symm_write_value": (status_t, [_h, _int, _size, _u32, stream_t]),
    "symm_wait_value": (status_t, [_h, _int, _size, _u32, stream_t]),
    # groups
    "symm_get_unique_id": (status_t, [POINTER(UniqueId)]),
    "symm_get_unique_id_at": (status_t, [c_char_p, POINTER(UniqueId)]),
    "symm_group_init": (status_t, [_out_h, _int, _int, _int, POINTER(UniqueId), POINTER(GroupConfig)]),
    "symm_group_init_bootstrap": (
        status_t,
        [_out_h, _int, _int, _int, POINTER(Bootstrap), POINTER(GroupConfig)],
    ),
    "symm_group_init_env": (status_t, [_out_h, POINTER(GroupConfig)]),
    "symm_group_init_local": (status_t, [_out_h, _int, POINTER(c_int), POINTER(GroupConfig)]),
    "symm_group_destroy": (status_t, [_h]),
    "symm_group_rank": (status_t, [_h, POINTER(c_int)]),
    "symm_group_world_size": (status_t, [_h, POINTER(c_int)]),
    "symm_group_device": (status_t, [_h, POINTER(c_int)]),
    "symm_group_backend": (status_t, [_h, POINTER(backend_t)]),
    "symm_group_set_timeout": (status_t, [_h, _int]),
    "symm_group_check_async_error": (status_t, [_h]),
    "symm_group_abort": (status_t, [_h]),
    "symm_group_health": (status_t, [_h, POINTER(status_t)]),
    "symm_group_reserve_workspace": (status_t, [_h, _size]),
    # operations
    "symm_fused_ag_mm": (
        status_t,
        [
            _h,
            POINTER(Tensor),
            POINTER(Tensor),
            c_int,
            c_int,
            POINTER(Tensor),
            POINTER(Tensor),
            POINTER(AgMmOptions),
            stream_t,
        ],
    ),
    "symm_mm_rs": (
        status_t,
        [_h, POINTER(Tensor), POINTER(Tensor), c_int, reduce_op_t, POINTER(Tensor), POINTER(MmRsOptions), stream_t],
    ),
    "symm_lc_allgather": (status_t, [_h, POINTER(Tensor), POINTER(Tensor), stream_t]),
    "symm_all_reduce": (
        status_t,
        [_h, POINTER(Tensor), POINTER(Tensor), reduce_op_t, POINTER(AllReduceOptions), stream_t],
    ),
    "symm_refuse_call": (status_t, [_h, c_char_p, c_char_p, stream_t]),
    "symm_all_reduce_rmsnorm": (
        status_t,
        [
            _h,
            POINTER(Tensor),
            POINTER(Tensor),
            POINTER(Tensor),
            ctypes.c_float,
            POINTER(Tensor),
            POINTER(Tensor),
            POINTER(AllReduceOptions),
            stream_t,
        ],
    ),
    # cost queries
    "symm_plan_ag_mm": (status_t, [_h, _int64, _int64, _int64, dtype_t, POINTER(Plan)]),
    "symm_plan_mm_rs": (status_t, [_h, _int64, _int64, _int64, dtype_t, POINTER(Plan)]),
    "symm_plan_all_reduce": (status_t, [_h, _int64, dtype_t, POINTER(Plan)]),
    # which arguments an operation uses in place from symmetric memory
    "symm_op_symmetric_args": (status_t, [c_char_p, POINTER(SymmetricArgs)]),
    # XLA FFI handlers: which group serves a device
    "symm_xla_bind_device": (status_t, [_int32, _int, _h]),
    # version and errors
    "symm_get_version": (status_t, [POINTER(c_int32)]),
    "symm_status_string": (c_char_p, [status_t]),
    "symm_last_error": (c_char_p, []),
    # logging and build information
    "symm_set_log_callback": (status_t, [LogCallbackFn, c_void_p]),
    "symm_set_log_level": (status_t, [_int]),
    "symm_get_build_info": (status_t, [POINTER(BuildInfo)]),
}


def _declare(cdll):
    for name, (restype, argtypes) in FUNCTIONS.items():
        try:
            fn = getattr(cdll, name)
        except AttributeError:
            raise ImportError(
                f"{cdll._name} has no {name}: it is older than this symm package; "
                "rebuild it or point SYMM_LIBRARY at a newer one"
            ) from None
        fn.restype = restype
        fn.argtypes = argtypes
    return cdll


lib = _declare(_loader.load())
