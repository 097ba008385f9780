"""Groups of ranks: the four ways to form one, and their properties."""

import ctypes
import operator

from . import _lib
from ._callback import CallbackBootstrap
from ._lib import lib
from ._owned import Owned, raw_of
from .errors import check, error
from .memory import Buffer

BACKENDS = {"auto": _lib.BACKEND_AUTO, "cuda": _lib.BACKEND_CUDA, "host": _lib.BACKEND_HOST}
_BACKEND_NAMES = {v: k for k, v in BACKENDS.items()}
UNIQUE_ID_BYTES = ctypes.sizeof(_lib.UniqueId)


def _config(backend, timeout_ms, allow_shared_device, check_args_always):
    if backend not in BACKENDS:
        raise ValueError(f"backend {backend!r} is not one of {sorted(BACKENDS)}")
    flags = (_lib.GROUP_ALLOW_SHARED_DEVICE if allow_shared_device else 0) | (
        _lib.GROUP_CHECK_ARGS_ALWAYS if check_args_always else 0
    )
    # timeout_ms None -> 0, which the library reads as env SYMM_TIMEOUT_MS or
    # its default; other values go through unchanged so it validates them,
    # once known to fit the struct's int32 (ctypes would keep the low bits).
    if timeout_ms is not None:
        if isinstance(timeout_ms, bool):
            raise TypeError(f"timeout_ms must be an int, got {timeout_ms!r}")
        timeout_ms = operator.index(timeout_ms)
        if not -(1 << 31) <= timeout_ms < 1 << 31:
            raise ValueError(f"timeout_ms is {timeout_ms}; expected 1 to {(1 << 31) - 1} ms, or None")
    return _lib.GroupConfig(ctypes.sizeof(_lib.GroupConfig), BACKENDS[backend], timeout_ms or 0, flags)


def get_unique_id(listen_addr=None):
    """Starts a bootstrap store in this process and returns its 128-byte id.

    Pass the bytes to every rank (this one included) for
    ``Group.from_unique_id``. ``listen_addr`` ("host:port", "ip:port" or
    "ip") defaults to env ``SYMM_BOOTSTRAP_ADDR``, else loopback.
    """
    uid = _lib.UniqueId()
    if listen_addr is None:
        check(lib.symm_get_unique_id(ctypes.byref(uid)))
    else:
        check(lib.symm_get_unique_id_at(listen_addr.encode(), ctypes.byref(uid)))
    return ctypes.string_at(ctypes.addressof(uid), UNIQUE_ID_BYTES)


class Group:
    """One rank's membership of a group. Form it with a ``from_*`` method
    or ``local_groups``; ``close()`` (or a ``with`` block) releases it.
    Buffers and handles of the group stay valid after it is closed.

    Every way of forming a group takes ``backend`` ("auto", "cuda",
    "host"), ``timeout_ms`` (None: env ``SYMM_TIMEOUT_MS`` or 300000),
    ``allow_shared_device`` (several ranks on one GPU) and
    ``check_args_always`` (the ranks compare an operation's arguments on
    every call, not only the first time they see them).

    A group's collectives pair up across ranks in the order each rank
    makes them, so every rank makes them in the same order (as NCCL's). A
    rank may call from several threads, one call running at a time, but
    keeping their order the same on every rank is the caller's part: two
    threads calling at once may exchange each other's data."""

    def __init__(self, raw, bootstrap=None):
        """Wraps a ``symm_group_t`` the caller owns (internal)."""
        # The C group, and every buffer and handle made from it, may call the
        # bootstrap back in later collectives: each of their owners keeps it.
        self._owned = Owned(raw, lib.symm_group_destroy, keep=bootstrap)
        self._bootstrap = bootstrap
        self._calls = {}  # operation -> its kept calls (symm._fastcall)
        # Immutable for the group's life; cached so they stay readable after close().
        self.rank = self._query(lib.symm_group_rank, ctypes.c_int)
        self.world_size = self._query(lib.symm_group_world_size, ctypes.c_int)
        self.device = self._query(lib.symm_group_device, ctypes.c_int)
        self.backend = _BACKEND_NAMES[self._query(lib.symm_group_backend, _lib.backend_t)]

    # --- formation ------------------------------------------------------------
    @classmethod
    def from_unique_id(
        cls,
        uid,
        world_size,
        rank,
        device=None,
        backend="auto",
        timeout_ms=None,
        allow_shared_device=False,
        check_args_always=False,
    ):
        """Collective: joins the group whose store ``get_unique_id`` started.
        ``device`` defaults to ``rank``."""
        if len(uid) != UNIQUE_ID_BYTES:
            raise ValueError(f"uid has {len(uid)} bytes; a unique id has {UNIQUE_ID_BYTES}")
        cuid = _lib.UniqueId.from_buffer_copy(bytes(uid))
        cfg = _config(backend, timeout_ms, allow_shared_device, check_args_always)
        raw = _lib.handle_t()
        dev = rank if device is None else device
        check(lib.symm_group_init(ctypes.byref(raw), world_size, rank, dev, ctypes.byref(cuid), ctypes.byref(cfg)))
        return cls(raw.value)

    @classmethod
    def from_env(cls, backend="auto", timeout_ms=None, allow_shared_device=False, check_args_always=False):
        """Collective: forms the group torchrun describes (``RANK``,
        ``WORLD_SIZE``, ``LOCAL_RANK`` = device, ``MASTER_ADDR``,
        ``MASTER_PORT``). Ranks spanning hosts need ``SYMM_BOOTSTRAP_SECRET``
        (see the README's environment table)."""
        cfg = _config(backend, timeout_ms, allow_shared_device, check_args_always)
        raw = _lib.handle_t()
        check(lib.symm_group_init_env(ctypes.byref(raw), ctypes.byref(cfg)))
        return cls(raw.value)

    @classmethod
    def from_callback(
        cls,
        allgather,
        barrier=None,
        *,
        world_size,
        rank,
        device=None,
        backend="auto",
        timeout_ms=None,
        allow_shared_device=False,
        check_args_always=False,
    ):
        """Collective: forms the group over your own communication.

        ``allgather(data: bytes)`` must return ``world_size`` bytes-like
        objects, every rank's ``data`` in rank order (``mpi4py``'s
        ``comm.allgather`` does). ``barrier()`` is optional and not called at
        present (every collective symm runs carries data, so it uses
        ``allgather``). Both are called
        on the calling thread during this and later collective calls of the
        group; they should raise rather than wait forever. An exception they
        raise fails the symm call with ``SymmBootstrapError`` whose
        ``__cause__`` is that exception.
        """
        bs = CallbackBootstrap(allgather, barrier, world_size)
        cfg = _config(backend, timeout_ms, allow_shared_device, check_args_always)
        raw = _lib.handle_t()
        dev = rank if device is None else device
        status = lib.symm_group_init_bootstrap(
            ctypes.byref(raw), world_size, rank, dev, ctypes.byref(bs.table), ctypes.byref(cfg)
        )
        check(status, cause=bs.take_failure())
        return cls(raw.value, bootstrap=bs)

    # --- use ------------------------------------------------------------------
    @property
    def closed(self):
        return self._owned is None

    @property
    def raw(self):
        """The ``symm_group_t`` value, for passing to other C code."""
        owned = self._owned
        if owned is not None and owned.raw is not None:
            return owned.raw
        return raw_of(owned, repr(self))

    def _check(self, status):
        """Raises for a failed call on this group, chaining a bootstrap callback's exception."""
        cause = self._bootstrap.take_failure() if self._bootstrap is not None else None
        check(status, cause=cause)

    def _query(self, fn, ctype):
        out = ctype()
        self._check(fn(self.raw, ctypes.byref(out)))
        return out.value

    def set_timeout(self, timeout_ms):
        """How long this rank waits for its peers from now on (ms, > 0)."""
        self._check(lib.symm_group_set_timeout(self.raw, timeout_ms))

    def check_async_error(self):
        """Raises ``SymmTimeoutError`` if a device-side signal wait timed out."""
        self._check(lib.symm_group_check_async_error(self.raw))

    def abort(self):
        """Fails the group on purpose, at once (``symm_group_abort``): calls of
        this group blocked in a wait on any thread end with
        ``SymmAbortedError``, the peers' with ``SymmRemoteError`` naming this
        rank, and every later operation on every rank is refused. Safe from
        another thread while a call of this group is blocked. Close the group
        afterwards."""
        self._check(lib.symm_group_abort(self.raw))

    def health(self):
        """``None`` while the group works, else the exception (not raised)
        that describes its first failure, here or on a peer
        (``symm_group_health``): ``SymmTimeoutError``, ``SymmRemoteError``
        naming the failed rank, ``SymmAbortedError`` after ``abort()``... A
        failed group refuses every operation with ``SymmAbortedError``."""
        status = _lib.status_t()
        self._check(lib.symm_group_health(self.raw, ctypes.byref(status)))
        if status.value == _lib.SUCCESS:
            return None
        return error(status.value, lib.symm_last_error().decode(errors="replace"))

    def reserve_workspace(self, nbytes):
        """Collective: grows the operations' workspace to ``nbytes`` now (same
        on every rank), so later operations up to that size need no growth
        (on CUDA, growth is not allowed during graph capture; buffers a
        captured graph uses are kept when a later call grows them)."""
        self._check(lib.symm_group_reserve_workspace(self.raw, nbytes))

    def plan(self, op, m, k=None, n=None, dtype="bf16"):
        """What symm predicts ``op`` ("ag_mm": ``m`` all ranks' rows; "mm_rs":
        this rank's rows; "all_reduce": ``m`` elements per rank, no ``k``,
        ``n``) costs on this group, without running it: a dict of the
        algorithm it would choose and compute / comm / exposed / total ms."""
        fns = {"ag_mm": lib.symm_plan_ag_mm, "mm_rs": lib.symm_plan_mm_rs, "all_reduce": lib.symm_plan_all_reduce}
        dtypes = {
            "f32": _lib.DTYPE_F32,
            "bf16": _lib.DTYPE_BF16,
            "f16": _lib.DTYPE_F16,
            "int8": _lib.DTYPE_INT8,
            "uint8": _lib.DTYPE_UINT8,
            "int32": _lib.DTYPE_INT32,
            "int64": _lib.DTYPE_INT64,
        }
        if op not in fns or dtype not in dtypes:
            raise ValueError(f"op must be one of {sorted(fns)} and dtype one of {sorted(dtypes)}")
        sizes = [m] if op == "all_reduce" else [m, k, n]
        for i, (name, v) in enumerate(zip("mkn", sizes)):
            try:
                sizes[i] = operator.index(v)
            except TypeError:
                raise TypeError(f"{name} must be an int for {op!r}, got {v!r}") from None
        p = _lib.Plan(struct_size=ctypes.sizeof(_lib.Plan))
        self._check(fns[op](self.raw, *sizes, dtypes[dtype], ctypes.byref(p)))
        names = {_lib.ALGORITHM_SEQUENTIAL: "sequential", _lib.ALGORITHM_PIPELINED: "pipelined",
                 _lib.ALGORITHM_FUSED: "fused", _lib.ALGORITHM_ONE_SHOT: "one_shot",
                 _lib.ALGORITHM_TWO_SHOT: "two_shot"}
        return {"algorithm": names[p.algorithm], "compute_ms": p.compute_ms, "comm_ms": p.comm_ms,
                "exposed_ms": p.exposed_ms, "total_ms": p.total_ms}

    def create(self, nbytes):
        """Allocates ``nbytes`` of zeroed symmetric memory on this rank (not
        collective; every rank allocates the same size, then rendezvous)."""
        raw = _lib.handle_t()
        self._check(lib.symm_create(self.raw, nbytes, ctypes.byref(raw)))
        return Buffer(self, raw.value)

    def close(self):
        """Releases this rank's reference. Idempotent."""
        self._owned = None
        self._calls.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        state = " closed" if self.closed else ""
        return f"<symm.Group rank {self.rank}/{self.world_size} {self.backend} device {self.device}{state}>"


def local_groups(n, devices=None, backend="auto", timeout_ms=None, allow_shared_device=False, check_args_always=False):
    """Forms ``n`` groups in this process, one per rank (rank i on
    ``devices[i]``, default device i). Collectives of these groups must then
    be called from ``n`` threads at once, one per rank."""
    if devices is not None and len(devices) != n:
        raise ValueError(f"{len(devices)} devices given for {n} ranks")
    cfg = _config(backend, timeout_ms, allow_shared_device, check_args_always)
    # The library refuses n <= 0 and n past its largest group before it
    # writes a handle, so a huge n needs no array of its size.
    raws = (_lib.handle_t * (n if 0 < n <= 4096 else 0))()
    devs = None if devices is None else (ctypes.c_int * n)(*devices)
    check(lib.symm_group_init_local(raws, n, devs, ctypes.byref(cfg)))
    return [Group(raw) for raw in raws]
