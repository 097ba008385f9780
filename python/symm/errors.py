"""Exceptions raised for failed symm calls, one class per status code."""

from . import _lib


class SymmError(Exception):
    """A symm call failed.

    ``status`` is the C status code, ``status_name`` its name
    ("SYMM_ERROR_TIMEOUT") and ``message`` the library's description.
    """

    def __init__(self, status, message):
        self.status = status
        self.status_name = _lib.lib.symm_status_string(status).decode()
        self.message = message
        super().__init__(f"{message} [{self.status_name}]")


# The builtin second bases let callers catch these the Python way too
# (``except TimeoutError``) without knowing symm.
class SymmInvalidArgument(SymmError, ValueError):
    """An argument is NULL, out of range or malformed. Nothing was changed."""


class SymmInvalidHandle(SymmError, ValueError):
    """A group, buffer or handle is closed or of another kind."""


class SymmUnsupported(SymmError, NotImplementedError):
    """Valid, but not supported by this build, backend or device."""


class SymmTimeoutError(SymmError, TimeoutError):
    """A peer did not arrive in time; the message names it."""


class SymmBootstrapError(SymmError, ConnectionError):
    """Ranks could not find or talk to each other."""


class SymmMismatchError(SymmError, ValueError):
    """Ranks passed arguments that disagree (sizes, shapes, world size...)."""


class SymmOutOfMemoryError(SymmError, MemoryError):
    """Out of device or host memory."""


class SymmCudaError(SymmError):
    """The CUDA driver or a CUDA library failed."""


class SymmNoDeviceError(SymmError):
    """No CUDA driver, or no such device."""


class SymmSystemError(SymmError, OSError):
    """An operating-system call failed."""


class SymmRemoteError(SymmError):
    """Another rank failed the collective this call took part in."""


class SymmInternalError(SymmError):
    """A bug in symm; please report it with the message."""


class SymmAbortedError(SymmError):
    """The group failed earlier (here or on a peer) or was aborted; it refuses
    every operation. Close it and form a new one."""


_BY_STATUS = {
    _lib.ERROR_INVALID_ARGUMENT: SymmInvalidArgument,
    _lib.ERROR_INVALID_HANDLE: SymmInvalidHandle,
    _lib.ERROR_UNSUPPORTED: SymmUnsupported,
    _lib.ERROR_TIMEOUT: SymmTimeoutError,
    _lib.ERROR_BOOTSTRAP: SymmBootstrapError,
    _lib.ERROR_MISMATCH: SymmMismatchError,
    _lib.ERROR_OUT_OF_MEMORY: SymmOutOfMemoryError,
    _lib.ERROR_CUDA: SymmCudaError,
    _lib.ERROR_NO_DEVICE: SymmNoDeviceError,
    _lib.ERROR_SYSTEM: SymmSystemError,
    _lib.ERROR_REMOTE: SymmRemoteError,
    _lib.ERROR_INTERNAL: SymmInternalError,
    _lib.ERROR_ABORTED: SymmAbortedError,
}


def error(status, message):
    """The exception for ``status`` (base ``SymmError`` for an unknown one)."""
    return _BY_STATUS.get(status, SymmError)(status, message)


def check(status, cause=None):
    """Raises the exception for a failed call's status.

    Must run on the thread that made the call, right after it: the message
    comes from the library's per-thread last-error text. ``cause`` is chained
    (an exception raised inside a Python bootstrap callback).
    """
    if status != _lib.SUCCESS:
        raise error(status, _lib.lib.symm_last_error().decode(errors="replace")) from cause
