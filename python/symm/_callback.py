"""Adapts Python callables to ``symm_bootstrap_t`` for ``Group.from_callback``.

symm calls the callbacks on the thread that made the symm call, inside that
call (group formation, and later collectives such as rendezvous). Two rules
follow:

- The ctypes function objects must outlive every C object that can still
  call them: the owner (``_owned.Owned``) of the group and of each buffer
  and handle made from it keeps the adapter.
- A Python exception must never unwind through C: it is caught, stored, the
  callback returns nonzero (symm then fails with SYMM_ERROR_BOOTSTRAP), and
  the stored exception is chained as the SymmError's ``__cause__``.
"""

import ctypes
import threading

from . import _lib


class CallbackBootstrap:
    def __init__(self, allgather, barrier, world_size):
        self._allgather = allgather
        self._barrier = barrier
        self._world = world_size
        # Per thread: ranks of one process (several groups, or one group used
        # from several threads) must not see each other's failures.
        self._failures = threading.local()
        self._ag_fn = _lib.AllgatherFn(self._on_allgather)
        self.table = _lib.Bootstrap(ctypes.sizeof(_lib.Bootstrap), None, self._ag_fn)
        if barrier is not None:  # else NULL: symm builds its barrier from allgather
            self._barrier_fn = _lib.BarrierFn(self._on_barrier)
            self.table.barrier = self._barrier_fn

    def take_failure(self):
        """The exception a callback raised during the last symm call on this thread, if any."""
        exc = getattr(self._failures, "exc", None)
        self._failures.exc = None
        return exc

    def _guard(self, fn):
        try:
            fn()
            return 0
        except BaseException as e:  # noqa: BLE001 -- nothing may unwind into C, not even KeyboardInterrupt
            self._failures.exc = e
            return 1

    def _on_allgather(self, _ctx, send, recv, nbytes):
        def run():
            data = ctypes.string_at(send, nbytes) if nbytes else b""
            parts = list(self._allgather(data))
            if len(parts) != self._world:
                raise ValueError(f"allgather callback returned {len(parts)} parts for a world of {self._world}")
            for r, part in enumerate(parts):
                part = bytes(part)
                if len(part) != nbytes:
                    raise ValueError(f"allgather callback returned {len(part)} bytes for rank {r}, expected {nbytes}")
                ctypes.memmove(recv + r * nbytes, part, nbytes)

        return self._guard(run)

    def _on_barrier(self, _ctx):
        return self._guard(self._barrier)
