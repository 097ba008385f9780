"""Ownership of one C object (group, buffer or handle).

The wrapper classes and every numpy view of symm memory hold a reference to
an ``Owned``; the C object is destroyed when the last of them lets go. So
``close()`` on a wrapper is idempotent and never unmaps memory that a live
numpy array still points into: the destroy then happens when that array dies.
"""


class Owned:
    __slots__ = ("raw", "_destroy", "_keep")

    def __init__(self, raw, destroy, keep=None):
        self.raw = raw
        # Bound here so the destroy function is still reachable when this
        # object is collected during interpreter shutdown.
        self._destroy = destroy
        # What the C object may call back into while it lives (a Python
        # bootstrap's ctypes callbacks).
        self._keep = keep

    def __del__(self):
        # Destroy accepts every handle symm returned; a failure here could
        # only be a bug, and there is no caller left to raise to.
        self._destroy(self.raw)
