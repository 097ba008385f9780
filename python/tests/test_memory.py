"""Symmetric memory across ranks on threads (local groups, host backend)."""

import numpy as np
import pytest
import scenarios
from ranks import on_threads

import symm


@pytest.fixture(params=[2, 3, 4])
def groups(request):
    gs = symm.local_groups(request.param, backend="host", timeout_ms=10000)
    yield gs
    for g in gs:
        g.close()


def test_properties(groups):
    world = len(groups)
    for r, g in enumerate(groups):
        assert (g.rank, g.world_size, g.backend, g.device) == (r, world, "host", -1)
        assert f"rank {r}/{world}" in repr(g)
        g.check_async_error()  # the host backend has no asynchronous failures


def test_exchange_through_peer_arrays(groups):
    on_threads(scenarios.exchange, groups)


def test_signals(groups):
    on_threads(scenarios.ring_signals, groups)


def test_progress_flags(groups):
    on_threads(scenarios.progress_flags, groups)


def test_tensor_ops(groups):
    on_threads(scenarios.tensor_ops, groups)


def test_mismatched_sizes_fail_on_every_rank(groups):
    on_threads(scenarios.mismatched_sizes, groups)


def test_wait_value_timeout_fails_the_group(groups):
    on_threads(scenarios.wait_value_timeout_fails_the_group, groups)


def test_barrier_timeout_names_the_absent_rank(groups):
    on_threads(scenarios.peer_skips_barrier, groups)


def test_wait_signal_timeout_names_the_silent_rank():
    (g0, g1) = symm.local_groups(2, backend="host")

    def body(g):
        with g.create(64) as buf, buf.rendezvous() as h:
            if g.rank == 0:
                g.set_timeout(200)
                with pytest.raises(symm.SymmTimeoutError, match="rank 1 did not signal channel 3"):
                    h.wait_signal(1, channel=3)

    on_threads(body, [g0, g1])


def test_views_keep_memory_alive_after_close():
    (g,) = symm.local_groups(1, backend="host")
    buf = g.create(1 << 16)
    h = buf.rendezvous()
    own, peer = buf.array(np.float32, (128, 128)), h.peer_array(0, np.float32, (128, 128))
    g.close()
    buf.close()
    h.close()
    h.close()  # idempotent
    # The buffer and the mapping are released only now that the views go;
    # until then both still address the same live memory.
    own[3, 4] = 7.0
    assert peer[3, 4] == 7.0
    with pytest.raises(symm.SymmInvalidHandle, match="closed"):
        h.barrier()
    # A closed buffer or handle makes no new views (nothing would keep
    # their memory mapped).
    for view in (buf.array, lambda: h.peer_array(0), lambda: h.signal_pad(0)):
        with pytest.raises(symm.SymmInvalidHandle, match="closed"):
            view()


def test_view_bounds_and_dtypes():
    (g,) = symm.local_groups(1, backend="host")
    with g.create(256) as buf:
        assert buf.nbytes == 256
        assert buf.array(np.float64).shape == (32,)
        assert buf.array(np.uint16, offset=6).shape == (125,)
        with pytest.raises(ValueError, match="do not fit"):
            buf.array(np.float32, (65,))
        with pytest.raises(ValueError, match="do not fit"):
            buf.array(np.uint8, 8, offset=250)


def test_cuda_bytes_needs_a_cuda_group():
    (g,) = symm.local_groups(1, backend="host")
    with g.create(256) as buf:
        with pytest.raises(symm.SymmUnsupported, match="needs a CUDA group; this one is host"):
            buf.cuda_bytes()
