"""Symmetric buffers, their rendezvoused handles, signals, and numpy views
of symmetric memory on the host backend."""

import ctypes
import math

import numpy as np

from . import _lib
from ._lib import lib
from ._owned import Owned, raw_of
from ._stream import as_stream
from .errors import SymmUnsupported


class _Memory:
    """Exposes raw memory as bytes through an array interface (numpy's
    ``__array_interface__``, or ``__cuda_array_interface__`` for CUDA
    memory) and keeps its owner alive for as long as any array made from it
    (array libraries keep this object as the arrays' base)."""

    def __init__(self, owned, ptr, nbytes, protocol="__array_interface__"):
        self._owned = owned
        setattr(self, protocol, {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 3})


def _check_fits(need, offset, nbytes):
    if offset < 0 or need < 0 or offset + need > nbytes:
        raise ValueError(f"{need} bytes at offset {offset} do not fit in {nbytes} bytes")


def _view(group, owned, ptr, nbytes, dtype, shape, offset):
    if group.backend != "host":
        raise SymmUnsupported(
            _lib.ERROR_UNSUPPORTED,
            f"numpy views need the host backend; this group's memory is {group.backend} memory (use the pointers)",
        )
    dtype = np.dtype(dtype)
    if shape is None:
        shape = ((nbytes - offset) // dtype.itemsize,)
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    need = math.prod(shape) * dtype.itemsize
    _check_fits(need, offset, nbytes)
    raw = np.asarray(_Memory(owned, ptr + offset, need))
    # Viewing bytes as the dtype (not a typestr) keeps dtypes such as
    # ml_dtypes.bfloat16, which have no array-interface spelling.
    return raw.view(dtype).reshape(shape)


class Buffer:
    """This rank's symmetric allocation (``Group.create``)."""

    def __init__(self, group, raw):
        self._owned = Owned(raw, lib.symm_buffer_destroy, keep=group._bootstrap)
        self.group = group
        self.ptr = self._out(lib.symm_buffer_ptr, ctypes.c_void_p) or 0
        self.nbytes = self._out(lib.symm_buffer_size, ctypes.c_size_t)

    @property
    def raw(self):
        """The ``symm_buffer_t`` value."""
        return self._alive().raw

    def _alive(self):
        """What keeps the memory mapped, while this buffer is open."""
        raw_of(self._owned, "the buffer")
        return self._owned

    def _out(self, fn, ctype):
        out = ctype()
        self.group._check(fn(self.raw, ctypes.byref(out)))
        return out.value

    def rendezvous(self):
        """Collective over the group: maps every rank's buffer here (in a
        group spanning hosts, those of the ranks on this host)."""
        raw = _lib.handle_t()
        self.group._check(lib.symm_rendezvous(self.raw, ctypes.byref(raw)))
        return Handle(self.group, raw.value, self.nbytes)

    def array(self, dtype=np.uint8, shape=None, offset=0):
        """A numpy view of this rank's buffer (host backend)."""
        return _view(self.group, self._alive(), self.ptr, self.nbytes, dtype, shape, offset)

    def cuda_bytes(self, offset=0, nbytes=None):
        """This rank's buffer on a CUDA group as bytes any CUDA array library
        can wrap without copying (``__cuda_array_interface__``), e.g.
        ``torch.as_tensor(buf.cuda_bytes(), device="cuda").view(torch.bfloat16)``.
        The object, and arrays made from it, keep the memory alive. An
        operation's input placed here is read by the peers in place."""
        if self.group.backend != "cuda":
            raise SymmUnsupported(_lib.ERROR_UNSUPPORTED, f"cuda_bytes needs a CUDA group; this one is {self.group.backend}")
        nbytes = self.nbytes - offset if nbytes is None else nbytes
        _check_fits(nbytes, offset, self.nbytes)
        return _Memory(self._alive(), self.ptr + offset, nbytes, "__cuda_array_interface__")

    def close(self):
        """Releases this reference; memory lives on while a handle or view of it does. Idempotent."""
        self._owned = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class Handle:
    """The rendezvoused view of every rank's copy of one buffer."""

    def __init__(self, group, raw, nbytes):
        self._owned = Owned(raw, lib.symm_handle_destroy, keep=group._bootstrap)
        self.group = group
        self.nbytes = nbytes

    @property
    def raw(self):
        """The ``symm_handle_t`` value."""
        return raw_of(self._owned, "the handle")

    def _ptr(self, fn, rank):
        out = ctypes.c_void_p()
        self.group._check(fn(self.raw, rank, ctypes.byref(out)))
        return out.value or 0

    def peer_ptr(self, rank):
        """Where ``rank``'s buffer is mapped in this process
        (``SymmUnsupported`` for a rank on another host)."""
        return self._ptr(lib.symm_handle_peer_ptr, rank)

    def signal_pad_ptr(self, rank):
        """Where ``rank``'s signal pad (``uint32 pad[16][world]``) is mapped."""
        return self._ptr(lib.symm_handle_signal_pad_ptr, rank)

    def peer_array(self, rank, dtype=np.uint8, shape=None, offset=0):
        """A numpy view of ``rank``'s buffer (host backend); writes go straight to the peer."""
        return _view(self.group, self._owned, self.peer_ptr(rank), self.nbytes, dtype, shape, offset)

    def signal_pad(self, rank):
        """``rank``'s signal pad as a ``uint32`` array ``[channel, source rank]`` (host backend)."""
        world = self.group.world_size
        nbytes = _lib.SIGNAL_CHANNELS * world * 4
        ptr = self.signal_pad_ptr(rank)
        return _view(self.group, self._owned, ptr, nbytes, np.uint32, (_lib.SIGNAL_CHANNELS, world), 0)

    def barrier(self, channel=0, stream=None):
        """Stream-ordered barrier of all ranks (in a group spanning hosts,
        those on this host): writes before it are visible to all after it."""
        self.group._check(lib.symm_barrier(self.raw, channel, as_stream(stream)))

    def put_signal(self, peer, channel=0, stream=None):
        """Signals ``peer`` on ``channel``, releasing this rank's earlier writes to it."""
        self.group._check(lib.symm_put_signal(self.raw, peer, channel, as_stream(stream)))

    def wait_signal(self, peer, channel=0, stream=None):
        """Waits for ``peer``'s signal on ``channel`` and consumes it."""
        self.group._check(lib.symm_wait_signal(self.raw, peer, channel, as_stream(stream)))

    def write_value(self, rank, offset, value, stream=None):
        """Stream-ordered: after the stream's earlier work, sets the ``uint32``
        at byte ``offset`` of ``rank``'s buffer to ``value`` (a progress flag)."""
        self.group._check(lib.symm_write_value(self.raw, rank, offset, value, as_stream(stream)))

    def wait_value(self, rank, offset, value, stream=None):
        """Stream-ordered: waits until the ``uint32`` at byte ``offset`` of
        ``rank``'s buffer is >= ``value``, within the group's timeout."""
        self.group._check(lib.symm_wait_value(self.raw, rank, offset, value, as_stream(stream)))

    def close(self):
        """Unmaps the peers' buffers once no numpy view needs them. Idempotent."""
        self._owned = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
