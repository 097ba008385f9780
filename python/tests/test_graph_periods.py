"""bench/gpu/graph_periods.py reads profile_ops.py --graph output on the GPU
machine's results: here, on a made-up timeline, that it splits a replay
into its calls, leaves out the first and takes the slowest rank."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench" / "gpu"))

import graph_periods  # noqa: E402


def replay(case, rank, calls, first_wait_ms, kernels_ms):
    """profile_ops.py's lines for a replay of `calls` calls of the kernels
    `kernels_ms` long each, the first call `first_wait_ms` longer (the
    start skew, spent in its first kernel)."""
    lines = [f"== {case} rank {rank}: last call (each a graph of {calls}) 1.0 ms on the GPU, which started"]
    t = 0.0
    for i in range(calls):
        for j, length in enumerate(kernels_ms):
            length += first_wait_ms if i == 0 and j == 0 else 0.0
            lines.append(f"  + {t:7.3f} ms {length:7.3f} ms  kernel{j}")
            t += length
    return lines


def test_steady_calls_of_the_slowest_rank():
    lines = replay("mm_rs:64:64:8192:-", 0, 10, 0.2, [0.008, 0.004]) + replay("mm_rs:64:64:8192:-", 1, 10, 0.0, [0.009, 0.004])
    got = graph_periods.periods(lines)
    assert list(got) == ["mm_rs:64:64:8192:-"]
    assert got["mm_rs:64:64:8192:-"] == pytest.approx([12.0, 13.0])


def test_a_replay_that_does_not_split_into_its_calls_is_refused():
    lines = replay("mm:512:4096:4096:-", 0, 10, 0.0, [0.024])[:-1]
    with pytest.raises(ValueError, match="not 10 equal calls"):
        graph_periods.periods(lines)
