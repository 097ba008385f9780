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


def test_ranks_out_of_step_between_kept_calls_fail_at_once():
    """Every rank makes calls X and Y (both kept: later ones skip the
    agreement); then rank 0 makes X while rank 1 makes Y. Each operation's
    first meeting carries its call's tag, so a rank fails with
    SymmMismatchError well before the timeout, and neither returns the
    other call's data as its result: the other rank finds the mismatch
    too, or the group its peer failed (SymmRemoteError, or SymmAbortedError
    where its next step finds the group failed)."""
    import time

    import numpy as np
    from ranks import on_threads

    import symm

    rng = np.random.default_rng(3)

    def arrays(shape):
        return [rng.standard_normal(shape).astype(np.float32) for _ in range(2)]

    shard = {v: arrays((4 * (v + 1), 16)) for v in (0, 1)}
    b = rng.standard_normal((16, 8)).astype(np.float32)
    a = {v: arrays((4, 16 + 8 * v)) for v in (0, 1)}
    bk = {v: rng.standard_normal((16 + 8 * v, 8)).astype(np.float32) for v in (0, 1)}
    x = {v: arrays((64 * (v + 1),)) for v in (0, 1)}
    calls = {f"fused_ag_mm {algo}": lambda g, v, algo=algo: symm.fused_ag_mm(g, shard[v][g.rank], b, 0, algorithm=algo)
             for algo in ("sequential", "pipelined")}
    calls.update({f"mm_rs {algo}": lambda g, v, algo=algo: symm.mm_rs(g, a[v][g.rank], bk[v], 0, "sum", algorithm=algo)
                  for algo in ("sequential", "pipelined")})
    calls.update({f"all_reduce {algo}": lambda g, v, algo=algo: symm.all_reduce(g, x[v][g.rank], algorithm=algo)
                  for algo in ("one_shot", "two_shot")})
    calls["lc_allgather"] = lambda g, v: symm.lc_allgather(g, x[v][g.rank])
    timeout_s = 20.0
    for name, call in calls.items():

        def rank_main(g, call=call):
            call(g, 0)
            call(g, 1)
            start = time.monotonic()
            try:
                call(g, g.rank)
                return "returned", time.monotonic() - start
            except symm.SymmError as e:
                return type(e).__name__, time.monotonic() - start

        outcomes = on_threads(rank_main, symm.local_groups(2, backend="host", timeout_ms=int(timeout_s * 1000)))
        ends = [ended for ended, _ in outcomes]
        assert "SymmMismatchError" in ends, f"{name}: {ends}"
        for r, (ended, seconds) in enumerate(outcomes):
            assert ended in ("SymmMismatchError", "SymmRemoteError", "SymmAbortedError"), f"{name}: rank {r} {ended}"
            assert seconds < timeout_s / 4, f"{name}: rank {r} took {seconds:.1f} s"
