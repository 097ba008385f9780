"""diverge_fuzz.py's ranks that disagree, on the host backend: fixed seeds,
so a failure here names a case that fails again (the GPU machines run the
same fuzzer on CUDA with fresh seeds, bench/gpu/checks.sh diverge)."""

import pytest

import diverge_fuzz


@pytest.mark.parametrize(("world", "seed"), [(2, 11), (3, 12)])
def test_every_rank_fails_cleanly_when_one_rank_differs(world, seed):
    lines = []
    failures, results = diverge_fuzz.run_threads(world, seed, cases=24, log=lines.append)
    assert not failures, "\n".join(failures + lines[-20:])
    assert all(done == 24 for _, done in results)


def test_a_call_that_does_not_differ_fails_the_check(monkeypatch):
    """The checks can fail: ranks making the same call succeed, which the
    fuzzer reports (an argument error was expected on every rank, or the
    group should have failed)."""
    monkeypatch.setattr(diverge_fuzz, "CHANGES", [lambda rng, c, world, backend: (c, dict(c))])
    for seed in (1, 2):
        failures, _ = diverge_fuzz.run_threads(2, seed, cases=1, log=lambda s: None)
        assert failures and ("expected an argument error" in failures[0] or "still works" in failures[0]), failures
