"""What was loaded: the library's file and version."""

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
