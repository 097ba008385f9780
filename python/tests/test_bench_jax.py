"""bench/bench_jax.py runs the GPU machine's JAX benchmark, which no CI
machine can: its --cpu-smoke mode runs the same code on two CPU devices with
tiny shapes, so that a broken script shows here and not on a GPU run."""

import json
import os
import subprocess
import sys

import pytest
from ranks import PYTHON_DIR, SYMM_PARENT

if os.environ.get("SYMM_REQUIRE_JAX") != "1":
    pytest.importorskip("jax")


def test_bench_jax_runs_and_prints_every_record():
    script = PYTHON_DIR.parent / "bench" / "bench_jax.py"
    env = dict(os.environ, PYTHONPATH=str(SYMM_PARENT), JAX_PLATFORMS="cpu")
    run = subprocess.run(
        [sys.executable, str(script), "--cpu-smoke", "--iters", "2", "--warmup", "1"],
        env=env, capture_output=True, text=True, timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    records = [json.loads(line) for line in run.stdout.splitlines() if line.startswith('{"op"')]
    impls = {(r["op"], r["impl"]) for r in records}
    for op in ("ag_mm", "mm_rs"):
        assert {(op, i) for i in ("jax_symm", "jax_xla", "jax_windowed", "jax_mm_only", "jax_comm_only")} <= impls
    assert {("lc_allgather", "jax_symm"), ("lc_allgather", "jax_xla")} <= impls
    assert all(r["ms"] > 0 and r["world"] == 2 for r in records)
    assert all(r["relerr"] < 2e-2 for r in records if "relerr" in r)
