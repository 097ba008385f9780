"""ops_fuzz.py's randomly drawn calls on the host backend: fixed seeds, so a
failure here names a case that fails again (the GPU machines run the same
fuzzer on CUDA with fresh seeds, bench/gpu/checks.sh fuzz)."""

import pytest
from ops_fuzz import run_threads


@pytest.mark.parametrize(("world", "seed"), [(2, 1), (2, 2), (3, 3), (4, 4)])
def test_random_calls_match_float64_references(world, seed):
    lines = []
    failures, results = run_threads(world, seed, cases=80, log=lines.append)
    assert not failures, "\n".join(failures + lines[-20:])
    assert all(done == 80 for _, _, done in results)


def test_a_wrong_element_or_a_written_gap_fails(monkeypatch):
    """The checks can fail: one element off by a little, in one output of
    every all-reduce and reduce-scatter, is reported with its case."""
    import numpy as np

    import symm

    def corrupt(fn):
        def wrapped(*args, **kwargs):
            out = fn(*args, **kwargs)
            flat = np.asarray(out).reshape(-1)
            if flat.size and np.issubdtype(flat.dtype, np.integer):
                flat[-1] ^= 1
            elif flat.size:
                flat[-1] = flat[-1] * 1.0625 + 0.0625
            return out

        return wrapped

    monkeypatch.setattr(symm, "all_reduce", corrupt(symm.all_reduce))
    monkeypatch.setattr(symm, "mm_rs", corrupt(symm.mm_rs))
    failures, _ = run_threads(2, 5, cases=40, log=lambda _: None)
    assert failures and all(("all_reduce" in f or "mm_rs" in f) and ("off" in f or "differ" in f) for f in failures)


def test_random_calls_on_torch_tensors():
    """The same with torch CPU tensors (the C hit path's torch keys)."""
    pytest.importorskip("torch")
    failures, _ = run_threads(2, 6, cases=40, log=lambda _: None, arrays="torch")
    assert not failures, "\n".join(failures)
