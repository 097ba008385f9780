"""Process-group names -> symm groups, formed through the process group's
own c10d store: no launcher variables and no adapter to write.

A group forms from its ProcessGroup's store (set/get, under a prefix of
the group's name and ranks): all ranks on one host exchange symm's unique
id through it (rank 0 starts symm's bootstrap store; later collectives of
the group go through that, not Python); ranks on several hosts, or
``bootstrap="store"``, use the c10d store itself as symm's allgather
callback, for formation and every later bootstrap round."""

import socket
import threading
import weakref

import torch
import torch.distributed as dist

import symm

_GROUPS = {}  # group name -> (weak reference to its ProcessGroup, symm.Group)
_FORMED = {}  # group name -> how many times formed here (keys of each formation apart)
_LOCK = threading.Lock()
BOOTSTRAPS = ("auto", "unique_id", "store")


class StoreAllgather:
    """``allgather(data) -> [bytes] * world`` over a c10d store, one round
    of keys per call. Every rank calls it in the same order (symm's
    collectives are ordered), so rounds line up by count."""

    def __init__(self, store, rank, world_size):
        self.store, self.rank, self.world_size = store, rank, world_size
        self.round = 0

    def __call__(self, data):
        n = self.round
        self.round += 1
        self.store.set(f"ag/{n}/{self.rank}", bytes(data))
        parts = [bytes(data) if r == self.rank else self.store.get(f"ag/{n}/{r}") for r in range(self.world_size)]
        # Every rank set its round-n key, so every rank has read round n-1.
        if n:
            try:
                self.store.delete_key(f"ag/{n - 1}/{self.rank}")
            except (RuntimeError, NotImplementedError):
                pass  # stores without delete keep the few bytes
        return parts


def _process_group(group):
    """The ProcessGroup of a name or ProcessGroup (None: the default group)."""
    from torch.distributed import distributed_c10d as c10d

    if group is None:
        return c10d._get_default_group()
    if isinstance(group, str):
        return c10d._resolve_process_group(group)
    return group


def _name_of(group):
    """The name of a group given as ``enable_symm_mem_for_group`` takes it."""
    return group if isinstance(group, str) else _process_group(group).group_name


def _registered(pg):
    """Whether ``pg`` is still one of torch's process groups (not destroyed
    by ``destroy_process_group``)."""
    from torch.distributed import distributed_c10d as c10d

    try:
        return pg in c10d._world.pg_map
    except (AttributeError, TypeError):
        return True  # a torch without the registry: trust the name


def _cached(name):
    """The symm group formed for the process group named ``name``, or
    None. A name whose process group was destroyed (and perhaps made again
    under the same name, with other ranks) has its old symm group dropped:
    the next use forms one for the new process group."""
    entry = _GROUPS.get(name)
    if entry is None:
        return None
    pg, g = entry[0](), entry[1]
    if pg is not None and _registered(pg):
        return g
    with _LOCK:
        if _GROUPS.get(name) is entry:
            del _GROUPS[name]
    g.close()
    return None


def _store_of(pg, name, generation):
    """The ProcessGroup's store under a prefix of its name, global ranks
    (subgroups of one name on different ranks stay apart, as torch's) and
    the formation's number (a group formed again uses fresh keys)."""
    from torch.distributed import distributed_c10d as c10d

    ranks = "_".join(map(str, sorted(dist.get_process_group_ranks(pg))))
    return c10d.PrefixStore(f"symm/{name}/{ranks}/{generation}/", c10d._get_process_group_store(pg))


def enable_symm_mem_for_group(group_name, *, backend=None, device=None, bootstrap="auto", timeout_ms=None):
    """Collective over the process group ``group_name`` (a name as torch's
    ops take, a ProcessGroup, or None for the default group): forms the
    symm group that ``torch.ops.symm.*`` calls with that name use.
    Idempotent. Operations form it on first use too, but forming it first
    keeps formation out of CUDA graph capture and out of timing.

    ``backend``: "cuda" (default where torch sees CUDA; ``device`` defaults
    to the current CUDA device) or "host" (CPU tensors; the default
    without CUDA). ``bootstrap``: "auto" (symm's unique id through the
    store when every rank is on one host, else "store"), "unique_id" or
    "store" (the c10d store as symm's allgather). ``timeout_ms`` as
    ``symm.Group``'s. Returns the ``symm.Group``."""
    if bootstrap not in BOOTSTRAPS:
        raise ValueError(f"bootstrap is {bootstrap!r}; expected one of {BOOTSTRAPS}")
    pg = _process_group(group_name)
    name = pg.group_name
    _cached(name)  # drops the symm group of a destroyed process group of this name
    with _LOCK:
        entry = _GROUPS.get(name)
        if entry is not None:
            return entry[1]
        rank, world = pg.rank(), pg.size()
        if backend is None:
            backend = "cuda" if torch.cuda.is_available() else "host"
        if device is None:
            device = torch.cuda.current_device() if backend == "cuda" else rank
        generation = _FORMED[name] = _FORMED.get(name, 0) + 1
        store = _store_of(pg, name, generation)
        allgather = StoreAllgather(store, rank, world)
        if bootstrap == "auto":
            hosts = allgather(socket.gethostname().encode())
            bootstrap = "unique_id" if len(set(hosts)) == 1 else "store"
        common = {"device": device, "backend": backend, "timeout_ms": timeout_ms}
        if bootstrap == "unique_id":
            if rank == 0:
                store.set("unique_id", symm.get_unique_id())
            uid = store.get("unique_id")
            g = symm.Group.from_unique_id(uid, world, rank, **common)
        else:
            g = symm.Group.from_callback(allgather, world_size=world, rank=rank, **common)
        _GROUPS[name] = (weakref.ref(pg), g)
        return g


def is_symm_mem_enabled_for_group(group_name):
    """Whether ``enable_symm_mem_for_group`` (or a first operation) formed
    the symm group of ``group_name`` (a name, ProcessGroup or None, as
    there), and its process group still exists."""
    if group_name is None and not dist.is_initialized():
        return False
    return _cached(_name_of(group_name)) is not None


def get_group(group_name):
    """The symm group of ``group_name``, formed now (collectively) if needed."""
    g = _cached(group_name) if isinstance(group_name, str) else None
    return g if g is not None else enable_symm_mem_for_group(group_name)


def world_size(group_name):
    """The size of ``group_name``'s group, without forming anything (the
    fake kernels' question at trace time)."""
    g = _cached(group_name)
    if g is not None:
        return g.world_size
    from torch.distributed import distributed_c10d as c10d

    return c10d._get_group_size_by_name(group_name)


def disable_symm_mem_for_group(group_name):
    """Forgets (and closes this rank's reference to) the symm group of
    ``group_name`` (a name, ProcessGroup or None, as
    ``enable_symm_mem_for_group``); the next use forms a new one,
    collectively."""
    if group_name is None and not dist.is_initialized():
        return
    with _LOCK:
        entry = _GROUPS.pop(_name_of(group_name), None)
    if entry is not None:
        entry[1].close()
