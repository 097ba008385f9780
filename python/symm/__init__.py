"""symm: symmetric memory and fused tensor-parallel operations for
multi-GPU programs (ctypes bindings of libsymm.so)."""

from ._info import check_compatible as _check_compatible
from ._info import library_path, library_version
from ._lib import SIGNAL_CHANNELS
from ._loader import LibraryNotFoundError
from .errors import (
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
from .ops import bind, fused_ag_mm, lc_allgather, mm_rs

__version__ = "0.1.0"

__all__ = [
    "SIGNAL_CHANNELS",
    "Buffer",
    "Group",
    "Handle",
    "LibraryNotFoundError",
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
    "fused_ag_mm",
    "get_unique_id",
    "library_path",
    "library_version",
    "lc_allgather",
    "local_groups",
    "mm_rs",
]

_check_compatible()
