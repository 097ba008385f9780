"""Groups formed over a Python allgather (Group.from_callback)."""

import gc
import threading

import pytest
import scenarios
from ranks import on_threads

import symm


class ThreadAllgather:
    """An allgather among threads of this process, standing in for MPI or a
    framework's store. Counts its calls per rank."""

    def __init__(self, world):
        self.world = world
        self.slots = [None] * world
        self.meet = threading.Barrier(world)
        self.calls = [0] * world

    def for_rank(self, rank):
        def allgather(data):
            self.calls[rank] += 1
            self.slots[rank] = data
            self.meet.wait(10)
            parts = list(self.slots)
            self.meet.wait(10)  # nobody overwrites a slot before all have read
            return parts

        return allgather


@pytest.mark.parametrize("world", [2, 3])
def test_callback_group_runs_the_scenarios(world):
    ag = ThreadAllgather(world)

    def rank_main(rank):
        def barrier():
            ag.meet.wait(10)

        g = symm.Group.from_callback(
            ag.for_rank(rank), barrier, world_size=world, rank=rank, backend="host", timeout_ms=10000
        )
        with g:
            assert (g.rank, g.world_size) == (rank, world)
            scenarios.exchange(g)
            scenarios.tensor_ops(g)
            scenarios.mismatched_sizes(g)

    on_threads(rank_main, list(range(world)))
    assert all(c > 0 for c in ag.calls)


def test_callbacks_outlive_the_group_object():
    """Rendezvous calls back into Python after the Group was closed and its
    last reference dropped: the buffer keeps the callbacks alive."""
    ag = ThreadAllgather(2)

    def rank_main(rank):
        g = symm.Group.from_callback(ag.for_rank(rank), world_size=2, rank=rank, backend="host", timeout_ms=10000)
        buf = g.create(4096)
        g.close()
        del g
        gc.collect()
        before = ag.calls[rank]
        with buf.rendezvous() as h:
            h.barrier()
        assert ag.calls[rank] > before

    on_threads(rank_main, [0, 1])


def test_exception_in_allgather_becomes_the_cause():
    def allgather(data):
        raise KeyError("store unreachable")

    with pytest.raises(symm.SymmBootstrapError, match="allgather callback") as e:
        symm.Group.from_callback(allgather, world_size=1, rank=0, backend="host")
    assert isinstance(e.value.__cause__, KeyError)


def test_malformed_allgather_results_are_rejected():
    with pytest.raises(symm.SymmBootstrapError) as e:
        symm.Group.from_callback(lambda data: [data, data], world_size=1, rank=0, backend="host")
    assert "2 parts for a world of 1" in str(e.value.__cause__)
    with pytest.raises(symm.SymmBootstrapError) as e:
        symm.Group.from_callback(lambda data: [data + b"x"], world_size=1, rank=0, backend="host")
    assert "expected" in str(e.value.__cause__)
