"""Forms the groups that serve JAX devices and binds each device to its
rank, so that a handler, which XLA calls once per device, finds its group
from the device it runs on (``symm_xla_bind_device``).

Rank r is ``devices[r]``: the order of the mesh axis the operations run
over. One process driving all devices (JAX's default on one host) gets
in-process groups; with ``jax.distributed`` (one process per GPU), the
processes meet through a bootstrap store whose id travels through JAX's
key-value store.
"""

import threading

import jax

from .. import _lib
from .._lib import lib
from ..errors import check
from ..group import Group, get_unique_id, local_groups
from . import _order, _targets


class _State:
    def __init__(self, devices, platform, groups):
        self.devices = devices  # rank order
        self.platform = platform  # SYMM_XLA_PLATFORM_*
        self.groups = groups  # this process's: device -> Group
        # Every call carries these (its program's `groups` attribute): a
        # device bound to another group since refuses the call.
        self.handles = tuple(int(g.raw) for g in groups.values())


_state = None
_generation = 0  # distinguishes the key-value entries of successive inits


def _platform(devices):
    kinds = {d.platform for d in devices}
    if len(kinds) != 1:
        raise ValueError(f"devices of several platforms ({sorted(kinds)}); symm groups one platform")
    kind = kinds.pop()
    if kind == "cpu":
        return _lib.XLA_PLATFORM_CPU, "host"
    # JAX calls CUDA and ROCm GPUs both "gpu"; only the version text tells
    # them apart (its CUDA wording varies between plugins, ROCm's does not).
    if kind == "gpu" and "rocm" not in devices[0].client.platform_version.lower():
        return _lib.XLA_PLATFORM_CUDA, "cuda"
    raise ValueError(f"symm serves JAX's CPU and CUDA devices, not {kind} ({devices[0].client.platform_version})")


def _ordinal(device, platform):
    """What XLA_FFI_DeviceOrdinal_Get reports for calls on ``device``: the
    global id on XLA's CPU client, the CUDA ordinal on the GPU client."""
    return device.id if platform == _lib.XLA_PLATFORM_CPU else device.local_hardware_id


def init(devices=None, *, timeout_ms=None, check_args_always=False):
    """Forms a symm group over ``devices`` (default ``jax.devices()``), rank
    r on ``devices[r]``, and registers the operations with JAX. Use the same
    order for the mesh axis the operations run over (``mesh()`` makes one).
    Programs traced under an earlier init are traced again (JAX's caches
    are cleared): a program is bound to the groups it was traced for.

    With devices of several processes (``jax.distributed``), every process
    calls this with the same list. ``timeout_ms`` bounds how long a device's
    call waits for the others (default: env ``SYMM_TIMEOUT_MS`` or 300 s);
    a call that does not meet its peers in time fails with
    ``SYMM_ERROR_TIMEOUT`` in the error text instead of hanging.
    """
    global _state, _generation
    if _state is not None:
        raise RuntimeError("symm.jax is initialized already; call symm.jax.shutdown() first")
    devices = list(jax.devices() if devices is None else devices)
    if not devices:
        raise ValueError("no devices")
    if len(set(devices)) != len(devices):
        raise ValueError("a device is listed twice")
    platform, backend = _platform(devices)
    me = jax.process_index()
    local = [d for d in devices if d.process_index == me]
    if not local:
        raise ValueError(f"none of the devices belongs to this process ({me})")
    _targets.register()
    if _generation:
        jax.clear_caches()  # programs of the earlier init name its groups
    _generation += 1
    if len(local) == len(devices):
        hw = None if backend == "host" else [d.local_hardware_id for d in devices]
        formed = local_groups(
            len(devices), devices=hw, backend=backend, timeout_ms=timeout_ms, check_args_always=check_args_always
        )
    else:
        if platform == _lib.XLA_PLATFORM_CPU:
            raise ValueError("CPU devices of several processes are not supported; use one process")
        formed = _distributed_groups(devices, local, backend, timeout_ms, check_args_always)
    groups = dict(zip(local, formed))
    try:
        for d, g in groups.items():
            check(lib.symm_xla_bind_device(platform, _ordinal(d, platform), g.raw))
    except BaseException:
        _unbind(platform, groups)
        raise
    _state = _State(devices, platform, groups)
    return [groups[d] for d in local]


def _distributed_groups(devices, local, backend, timeout_ms, check_args_always):
    from jax._src import distributed  # the only way to JAX's key-value store

    client = distributed.global_state.client
    if client is None:
        raise RuntimeError("the devices span processes: call jax.distributed.initialize() first")
    key = f"symm_jax_unique_id_{_generation}"
    if jax.process_index() == devices[0].process_index:
        uid = get_unique_id()
        client.key_value_set_bytes(key, uid)
    else:
        uid = client.blocking_key_value_get_bytes(key, timeout_ms or 300_000)
    results, errors = {}, []

    def join(d):
        try:
            results[d] = Group.from_unique_id(
                uid,
                len(devices),
                devices.index(d),
                device=d.local_hardware_id,
                backend=backend,
                timeout_ms=timeout_ms,
                check_args_always=check_args_always,
            )
        except BaseException as e:  # reported on the calling thread below
            errors.append(e)

    threads = [threading.Thread(target=join, args=(d,)) for d in local]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return [results[d] for d in local]


def _unbind(platform, groups):
    for d in groups:
        lib.symm_xla_bind_device(platform, _ordinal(d, platform), None)


def shutdown():
    """Waits for the calls of programs already dispatched on XLA's CPU
    platform (which runs them asynchronously), then unbinds the devices and
    releases the groups. A program that runs after this fails: it was
    traced for groups that are gone. Idempotent."""
    global _state
    if _state is None:
        return
    if _state.platform == _lib.XLA_PLATFORM_CPU:
        _order.wait_for_calls()
    _unbind(_state.platform, _state.groups)
    for g in _state.groups.values():
        g.close()
    _state = None


def state():
    """The current initialization (raises when there is none)."""
    if _state is None:
        raise RuntimeError("symm.jax is not initialized; call symm.jax.init() first")
    return _state


def mesh(axis_name="x"):
    """A one-axis ``jax.sharding.Mesh`` over the devices in rank order."""
    import numpy as np

    return jax.sharding.Mesh(np.array(state().devices), (axis_name,))
