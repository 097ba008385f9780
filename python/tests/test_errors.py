"""Status codes become exceptions carrying the status, its name and the
library's message; misuse is reported, never a crash."""

import pytest
from ranks import on_threads

import symm
from symm import _lib, errors

CLASSES = {
    _lib.ERROR_INVALID_ARGUMENT: (symm.SymmInvalidArgument, ValueError),
    _lib.ERROR_INVALID_HANDLE: (symm.SymmInvalidHandle, ValueError),
    _lib.ERROR_UNSUPPORTED: (symm.SymmUnsupported, NotImplementedError),
    _lib.ERROR_TIMEOUT: (symm.SymmTimeoutError, TimeoutError),
    _lib.ERROR_BOOTSTRAP: (symm.SymmBootstrapError, ConnectionError),
    _lib.ERROR_MISMATCH: (symm.SymmMismatchError, ValueError),
    _lib.ERROR_OUT_OF_MEMORY: (symm.SymmOutOfMemoryError, MemoryError),
    _lib.ERROR_CUDA: (symm.SymmCudaError, symm.SymmError),
    _lib.ERROR_NO_DEVICE: (symm.SymmNoDeviceError, symm.SymmError),
    _lib.ERROR_SYSTEM: (symm.SymmSystemError, OSError),
    _lib.ERROR_REMOTE: (symm.SymmRemoteError, symm.SymmError),
    _lib.ERROR_INTERNAL: (symm.SymmInternalError, symm.SymmError),
    _lib.ERROR_ABORTED: (symm.SymmAbortedError, symm.SymmError),
}


@pytest.mark.parametrize("status", sorted(CLASSES))
def test_every_status_has_its_class(status):
    cls, builtin = CLASSES[status]
    e = errors.error(status, "what happened")
    assert type(e) is cls and isinstance(e, symm.SymmError) and isinstance(e, builtin)
    assert e.status == status and e.message == "what happened"
    assert e.status_name == _lib.lib.symm_status_string(status).decode()
    assert e.status_name.startswith("SYMM_ERROR_") and e.status_name in str(e)


def test_unknown_status_is_the_base_class():
    e = errors.error(999, "?")
    assert type(e) is symm.SymmError and e.status_name == "SYMM_ERROR_UNKNOWN_STATUS"


@pytest.fixture
def group():
    (g,) = symm.local_groups(1, backend="host")
    with g:
        yield g


def test_library_messages_reach_the_exception(group):
    with pytest.raises(symm.SymmInvalidArgument, match=r"^symm_create: .*0") as e:
        group.create(0)
    assert e.value.status == _lib.ERROR_INVALID_ARGUMENT and e.value.status_name == "SYMM_ERROR_INVALID_ARGUMENT"
    with pytest.raises(symm.SymmInvalidArgument, match="symm_group_set_timeout"):
        group.set_timeout(-1)


def test_out_of_range_ranks_and_channels(group):
    with group.create(64) as buf, buf.rendezvous() as h:
        with pytest.raises(symm.SymmInvalidArgument, match="rank"):
            h.peer_ptr(1)
        with pytest.raises(symm.SymmInvalidArgument, match="rank"):
            h.peer_ptr(-1)
        with pytest.raises(symm.SymmInvalidArgument, match="channel"):
            h.barrier(channel=symm.SIGNAL_CHANNELS)
        with pytest.raises(symm.SymmInvalidArgument, match="not another rank"):
            h.put_signal(0)


def test_closed_objects_raise_invalid_handle(group):
    buf = group.create(64)
    buf.close()
    buf.close()
    with pytest.raises(symm.SymmInvalidHandle, match="closed"):
        buf.rendezvous()
    group.close()
    with pytest.raises(symm.SymmInvalidHandle, match="closed"):
        group.create(64)
    # Cached properties stay readable for messages and logs.
    assert group.rank == 0 and "closed" in repr(group)


def test_a_forged_handle_is_reported_by_the_library(group):
    # symm.Buffer wrapping a handle value symm never returned.
    with pytest.raises(symm.SymmInvalidHandle, match="not a live symm_buffer_t"):
        symm.Buffer(group, 0x12340)


def test_group_formation_arguments():
    with pytest.raises(symm.SymmInvalidArgument, match="local"):
        symm.local_groups(0)
    with pytest.raises(symm.SymmInvalidArgument, match="timeout_ms"):
        symm.local_groups(1, timeout_ms=-5)
    # Past the config's int32: refused, not wrapped (2**32 + 1500 was 1.5 s).
    for t in (2**31, 2**32 + 1500):
        with pytest.raises(ValueError, match=f"timeout_ms is {t}; expected 1 to 2147483647"):
            symm.local_groups(1, timeout_ms=t)
    with pytest.raises(TypeError, match="timeout_ms must be an int"):
        symm.local_groups(1, timeout_ms=True)
    # A world past the largest group: the library's message, not a MemoryError.
    with pytest.raises(symm.SymmInvalidArgument, match="n is 1073741824; expected 1 to"):
        symm.local_groups(2**30)
    with pytest.raises(ValueError, match="backend 'gpu'"):
        symm.local_groups(1, backend="gpu")
    with pytest.raises(ValueError, match="2 devices given for 3 ranks"):
        symm.local_groups(3, devices=[0, 1])
    with pytest.raises(symm.SymmInvalidArgument):
        symm.Group.from_unique_id(b"\xab" * 128, 2, 0)
    uid = symm.get_unique_id()
    with pytest.raises(symm.SymmInvalidArgument, match="rank 2 is not in"):
        symm.Group.from_unique_id(uid, 2, 2)
    with pytest.raises(ValueError, match="uid has 3 bytes"):
        symm.Group.from_unique_id(b"abc", 2, 0)
    with pytest.raises(symm.SymmInvalidArgument, match="listen_addr|address"):
        symm.get_unique_id("not an address")


def test_group_formation_timeout_names_the_missing_rank():
    uid = symm.get_unique_id()
    with pytest.raises(symm.SymmTimeoutError, match="rank 1"):
        symm.Group.from_unique_id(uid, 2, 0, backend="host", timeout_ms=300)


def test_errors_are_per_thread():
    """Each thread's exception carries its own call's message, even when
    several threads fail at once."""

    def fail(n):
        (g,) = symm.local_groups(1, backend="host")
        for _ in range(50):
            with pytest.raises(symm.SymmInvalidArgument, match=f"channel {n} "):
                g.create(64).rendezvous().barrier(channel=n)

    on_threads(fail, [16, 17, 18, 19])


def test_plan_query_predicts_and_validates():
    import symm

    (g,) = symm.local_groups(1, backend="host")
    with g:
        p = g.plan("ag_mm", 16384, 8192, 8192)
        assert p["algorithm"] == "sequential"  # one rank: nothing to overlap
        assert 2.0 < p["compute_ms"] < 4.0 and p["total_ms"] >= p["compute_ms"]
        with pytest.raises(symm.SymmInvalidArgument, match="m is 0"):
            g.plan("mm_rs", 0, 8, 8)
        with pytest.raises(TypeError, match="k must be an int for 'ag_mm', got None"):
            g.plan("ag_mm", 64)


FORK_SCENARIO = """
import os, sys
import numpy as np
import symm

(g,) = symm.local_groups(1, backend="host")
with g, g.create(64) as buf:
    h = buf.rendezvous()
    pid = os.fork()
    if pid == 0:  # the child: its exit code says which use went wrong, and how
        code = 0
        uses = [
            lambda: symm.all_reduce(g, np.ones(4, np.float32)),
            lambda: g.plan("all_reduce", 4),
            lambda: buf.array(),
            lambda: h.peer_ptr(0),
        ]
        for i, use in enumerate(uses):
            try:
                use()
                code = code or 10 + i
            except symm.SymmInvalidHandle as e:
                code = code or (0 if "forked from" in str(e) else 20 + i)
            except BaseException:
                code = code or 30 + i
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.WEXITSTATUS(status) == 0, os.WEXITSTATUS(status)
    np.testing.assert_array_equal(symm.all_reduce(g, np.ones(4, np.float32)), np.ones(4))
    h.close()
print("ok")
"""


def test_a_forked_child_cannot_use_the_parents_objects():
    """A child inherits the group's memory, not its place in the group: its
    uses raise at once (the parent's peers never hear of them), and the
    parent's group goes on. (In a process of its own: this one may have
    threads, JAX's, that a fork does not take along.)"""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", FORK_SCENARIO], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stdout + done.stderr


def test_objects_are_not_pickled_or_deep_copied():
    import copy
    import pickle

    (g,) = symm.local_groups(1, backend="host")
    with g, g.create(64) as buf:
        for obj in (g, buf):
            for how in (pickle.dumps, copy.deepcopy):
                with pytest.raises(TypeError, match="cannot be pickled or deep-copied"):
                    how(obj)


def test_ints_out_of_a_c_type_are_refused_not_wrapped():
    """ctypes keeps an int's low bits: rank 2**32 + 1 would be rank 1, a
    value 2**32 + 7 would be 7. symm refuses them."""
    import ctypes

    import numpy as np

    (g,) = symm.local_groups(1, backend="host")
    with g, g.create(64) as buf:
        h = buf.rendezvous()
        calls = [
            lambda: h.peer_ptr(2**32),
            lambda: h.put_signal(2**32 + 1),
            lambda: h.write_value(0, 0, 2**32 + 7),
            lambda: h.write_value(0, -8, 1),
            lambda: g.create(2**64 + 16),
            lambda: g.set_timeout(2**32 + 500),
        ]
        for call in calls:
            with pytest.raises(ctypes.ArgumentError, match="out of range"):
                call()
        h.write_value(0, 0, 2**32 - 1)  # the largest uint32 is one
        assert buf.array(np.uint32)[0] == 2**32 - 1


def test_abort_ends_a_blocked_call_and_fails_every_rank():
    """A call blocked waiting for a peer that never comes ends promptly when
    another thread aborts the group; the peer then finds the group failed,
    naming the aborting rank, and refuses; a new group works."""
    import threading
    import time

    import numpy as np

    g0, g1 = symm.local_groups(2, backend="host", timeout_ms=60000)
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    on_threads(lambda g: symm.lc_allgather(g, x), [g0, g1])
    assert g0.health() is None and g1.health() is None
    outcome = {}

    def blocked():
        start = time.monotonic()
        try:
            symm.lc_allgather(g0, x)
        except symm.SymmError as e:
            outcome["error"] = e
        outcome["waited"] = time.monotonic() - start

    t = threading.Thread(target=blocked, daemon=True)
    t.start()
    time.sleep(0.2)
    g0.abort()
    t.join(10)
    assert not t.is_alive(), "the aborted call is still blocked"
    assert isinstance(outcome["error"], symm.SymmAbortedError)
    assert outcome["waited"] < 5
    assert isinstance(g0.health(), symm.SymmAbortedError)
    seen = g1.health()
    assert isinstance(seen, symm.SymmRemoteError) and "rank 0 failed" in seen.message
    with pytest.raises(symm.SymmAbortedError, match="no longer usable"):
        symm.lc_allgather(g1, x)
    g0.close()
    g1.close()
    fresh = symm.local_groups(2, backend="host")
    outs = on_threads(lambda g: symm.lc_allgather(g, x), fresh)
    assert np.array_equal(outs[0], np.concatenate([x, x]))
    for g in fresh:
        assert g.health() is None
        g.close()
