"""What was loaded: the library's file and version, and what it says of
its operations' arguments."""

import ctypes

from . import _lib
from ._lib import lib
from .errors import check


def library_version():
    """The loaded library's version as ``(major, minor, patch)``."""
    code = ctypes.c_int32()
    check(lib.symm_get_version(ctypes.byref(code)))
    return (code.value // 10000, code.value // 100 % 100, code.value % 100)


def library_path():
    """The file the library was loaded from."""
    return lib._name


def check_compatible():
    """Refuses a library of another major version: its ABI is not the one declared in ``_lib``."""
    major = library_version()[0]
    if major != _lib.VERSION_MAJOR:
        found = ".".join(map(str, library_version()))
        raise ImportError(f"{library_path()} is symm {found}; this package needs major version {_lib.VERSION_MAJOR}")


# The operations symm_op_symmetric_args knows (C names without "symm_").
OPERATIONS = ("fused_ag_mm", "mm_rs", "lc_allgather", "all_reduce", "all_reduce_rmsnorm")
_ACCESS = {_lib.PEERS_READ: "read", _lib.PEERS_WRITE: "write"}
# The C header's parameter names that the Python functions spell otherwise.
_PYTHON_NAMES = {"input": "x"}


def symmetric_args(operation, c_names=False):
    """The arguments of ``operation`` ("fused_ag_mm", "mm_rs",
    "lc_allgather", "all_reduce", "all_reduce_rmsnorm": the Python
    functions of the same names) that symm uses where they are when they
    lie in symmetric memory: a dict of argument name -> "read" (the peers
    read it in place instead of a copy in the workspace) or "write" (the
    peers may write into it). Such a tensor must be contiguous at the same
    offset of the same rendezvoused buffer on every rank, and where it lies
    is part of the arguments the ranks agree on: in symmetric memory on
    every rank or on none (then the call works the same, through a copy),
    else ``SymmMismatchError``. Names are the Python functions'
    parameters; ``c_names=True`` gives those of ``include/symm.h``
    (``symm_op_symmetric_args``, which answers this)."""
    out = _lib.SymmetricArgs(struct_size=ctypes.sizeof(_lib.SymmetricArgs))
    check(lib.symm_op_symmetric_args(str(operation).encode(), ctypes.byref(out)))
    names = [out.names[i].decode() for i in range(out.count)]
    if not c_names:
        names = [_PYTHON_NAMES.get(n, n) for n in names]
    return {n: _ACCESS[out.access[i]] for i, n in enumerate(names)}
