"""symm: symmetric memory and fused tensor-parallel operations for
multi-GPU programs (ctypes bindings of libsymm.so).

Env ``SYMM_DEBUG`` (``WARN``, ``INFO``, ``DEBUG``, ``TRACE``; unset = off)
makes the library log one line per event to stderr, or to the file
``SYMM_DEBUG_FILE`` names (``%h`` = host name, ``%p`` = process id)."""

import ctypes as _ctypes

from ._info import check_compatible as _check_compatible
from ._info import library_path, library_version, symmetric_args
from ._lib import SIGNAL_CHANNELS
from ._loader import LibraryNotFoundError
from .errors import (
    SymmAbortedError,
    SymmBootstrapError,
    SymmCudaError,
    SymmError,
    SymmInternalError,
    SymmInvalidArgument,
    SymmInvalidHandle,
    SymmMismatchError,
    SymmNoDeviceError,
    SymmOutOfMemoryError,
    SymmRemoteError,
    SymmSystemError,
    SymmTimeoutError,
    SymmUnsupported,
)
from .group import Group, get_unique_id, local_groups
from .memory import Buffer, Handle
from .ops import all_reduce, all_reduce_rmsnorm, bind, fused_ag_mm, lc_allgather, mm_rs


def build_info():
    """How the loaded library was built, as a dict: ``version`` ("0.1.0"),
    ``version_code``, ``kernels`` ("fatbin": compiled by nvcc into the
    library, or "nvrtc": compiled from embedded sources at first use) and
    ``kernels_build`` (one line: the nvcc version and path, or how NVRTC is used)."""
    from . import _lib
    from .errors import check

    info = _lib.BuildInfo(struct_size=_ctypes.sizeof(_lib.BuildInfo))
    check(_lib.lib.symm_get_build_info(_ctypes.byref(info)))
    return {
        "version": info.version.decode(),
        "version_code": info.version_code,
        "kernels": info.kernels.decode(),
        "kernels_build": info.kernels_build.decode("utf-8", "replace"),
    }


__version__ = "0.1.0"

__all__ = [
    "SIGNAL_CHANNELS",
    "Buffer",
    "Group",
    "Handle",
    "all_reduce",
    "all_reduce_rmsnorm",
    "LibraryNotFoundError",
    "SymmAbortedError",
    "SymmBootstrapError",
    "SymmCudaError",
    "SymmError",
    "SymmInternalError",
    "SymmInvalidArgument",
    "SymmInvalidHandle",
    "SymmMismatchError",
    "SymmNoDeviceError",
    "SymmOutOfMemoryError",
    "SymmRemoteError",
    "SymmSystemError",
    "SymmTimeoutError",
    "SymmUnsupported",
    "bind",
    "build_info",
    "fused_ag_mm",
    "get_unique_id",
    "library_path",
    "library_version",
    "lc_allgather",
    "local_groups",
    "mm_rs",
    "symmetric_args",
]

_check_compatible()
