"""Running one function per rank: on threads (local groups, callback
groups) or as separate processes (rank_worker.py), with deadlines so a
broken test fails instead of hanging."""

import os
import subprocess
import sys
import threading
from pathlib import Path

import symm

# The repository's python/ (tests, and ../include, ../bench).
PYTHON_DIR = Path(__file__).resolve().parent.parent
# Where the `symm` under test was imported from: python/ for an editable
# install, site-packages for a wheel. Subprocesses get it as PYTHONPATH, so
# they import the same package.
SYMM_PARENT = Path(symm.__file__).resolve().parent.parent
# The world of the GPU tests: one rank per GPU, two unless SYMM_TEST_WORLD
# says more (a four-GPU machine runs them at world 4).
GPU_TEST_WORLD = max(2, int(os.environ.get("SYMM_TEST_WORLD", "2")))


def on_threads(fn, args, deadline_s=30):
    """Calls ``fn(arg)`` for every arg at once, one thread each; returns the
    results in order, or raises naming every rank that failed."""
    results, errors = [None] * len(args), [None] * len(args)

    def run(i):
        try:
            results[i] = fn(args[i])
        except BaseException as e:  # noqa: BLE001 -- re-raised on the main thread
            errors[i] = e

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(args))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(deadline_s)
        if t.is_alive():
            raise TimeoutError(f"a rank thread is still running after {deadline_s}s")
    failed = [(i, e) for i, e in enumerate(errors) if e is not None]
    if failed:
        # All ranks' errors: the first rank's is often only the timeout that
        # another rank's real failure caused.
        detail = "\n".join(f"rank {i}: {e!r}" for i, e in failed)
        raise AssertionError(f"{len(failed)} rank(s) failed:\n{detail}") from failed[-1][1]
    return results


def in_processes(scenario, world, env, deadline_s=30, rank_env=None):
    """Runs ``rank_worker.py scenario`` as ``world`` processes with RANK and
    WORLD_SIZE set, plus ``env`` and ``rank_env[rank]`` (a dict per rank;
    a None value unsets the variable); fails with every failing rank's
    output."""
    procs = []
    for rank in range(world):
        penv = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), PYTHONPATH=str(SYMM_PARENT), **env)
        for k, v in (rank_env[rank] if rank_env else {}).items():
            if v is None:
                penv.pop(k, None)
            else:
                penv[k] = v
        cmd = [sys.executable, str(Path(__file__).with_name("rank_worker.py")), scenario]
        procs.append(subprocess.Popen(cmd, env=penv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    wait_for_ranks(procs, deadline_s)


def wait_for_ranks(procs, deadline_s):
    """Waits for the rank processes ``procs`` (output piped, text); kills
    them all when one outlives ``deadline_s``; fails with every failing
    rank's output."""
    failures = []
    for rank, p in enumerate(procs):
        try:
            out, _ = p.communicate(timeout=deadline_s)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            out, _ = p.communicate()
            failures.append(f"rank {rank} still running after {deadline_s}s:\n{out}")
            continue
        if p.returncode != 0:
            failures.append(f"rank {rank} exited {p.returncode}:\n{out}")
    assert not failures, "\n".join(failures)
