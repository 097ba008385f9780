"""Ownership of one C object (group, buffer or handle).

The wrapper classes and every numpy view of symm memory hold a reference to
an ``Owned``; the C object is destroyed when the last of them lets go. So
``close()`` on a wrapper is idempotent and never unmaps memory that a live
numpy array still points into: the destroy then happens when that array dies.

A process forked from the owner inherits the object's memory but not its
place in the group (its peers, its device): there ``raw`` is None, every
use raises, and nothing is destroyed.
"""

import os
import weakref

from . import _lib
from .errors import SymmInvalidHandle


class Owned:
    __slots__ = ("raw", "_destroy", "_keep", "__weakref__")

    _live = weakref.WeakSet()

    def __init__(self, raw, destroy, keep=None):
        self.raw = raw
        # Bound here so the destroy function is still reachable when this
        # object is collected during interpreter shutdown.
        self._destroy = destroy
        # What the C object may call back into while it lives (a Python
        # bootstrap's ctypes callbacks).
        self._keep = keep
        Owned._live.add(self)

    def __del__(self):
        # Destroy accepts every handle symm returned; a failure here could
        # only be a bug, and there is no caller left to raise to.
        if self.raw is not None:
            self._destroy(self.raw)

    def __reduce__(self):
        # A copy would destroy the C object a second time; a pickle would
        # carry a pointer into another process.
        raise TypeError("a symm group, buffer or handle cannot be pickled or deep-copied")

    @staticmethod
    def _forked():
        for o in list(Owned._live):
            o.raw = None


os.register_at_fork(after_in_child=Owned._forked)


def raw_of(owned, what):
    """The C object of ``owned`` (a wrapper's), or the error to raise:
    ``what`` closed (``owned`` None), or inherited through a fork."""
    if owned is None:
        raise SymmInvalidHandle(_lib.ERROR_INVALID_HANDLE, f"{what} is closed")
    if owned.raw is None:
        raise SymmInvalidHandle(
            _lib.ERROR_INVALID_HANDLE,
            f"{what} belongs to the process this one was forked from; form a new group here",
        )
    return owned.raw
