"""symm.torch on GPUs: torch_scenarios.py under torchrun, one process per
GPU (2, or SYMM_TEST_WORLD), with SYMM_TEST_DEVICE=cuda: every operator
against float64 math and against torch.ops.symm_mem on the same inputs
(multicast off), fp8, autograd, fake kernels, the tensor-parallel MLP under
torch.compile(fullgraph=True) (inductor) against eager, groups formed
through the store, and capture in a CUDA graph. Skipped with fewer GPUs.

    PYTHONPATH=python SYMM_LIBRARY=bundle/libsymm.so python3 -m pytest -q python/tests/test_torch_cuda.py
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from ranks import GPU_TEST_WORLD, SYMM_PARENT

torch = pytest.importorskip("torch")
WORLD = GPU_TEST_WORLD
if torch.cuda.device_count() < WORLD:
    pytest.skip(f"needs {WORLD} CUDA devices, torch sees {torch.cuda.device_count()}", allow_module_level=True)

SCRIPT = Path(__file__).with_name("torch_scenarios.py")


@pytest.mark.parametrize("scenario", ["ops", "scaled", "autograd", "fake", "compiled", "bootstrap", "graphs"])
def test_scenario_on_two_gpus(scenario, tmp_path):
    env = dict(
        os.environ,
        SYMM_TEST_DEVICE="cuda",
        TORCH_SYMM_MEM_DISABLE_MULTICAST="1",
        NCCL_NVLS_ENABLE="0",
        PYTHONPATH=os.pathsep.join([str(SYMM_PARENT), str(SCRIPT.parent)]),
    )
    launcher = [sys.executable, "-m", "torch.distributed.run"]
    cmd = [*launcher, "--standalone", "--nproc-per-node", str(WORLD), str(SCRIPT), scenario]
    p = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=900)
    assert p.returncode == 0, failure(p.stdout)
    for r in range(WORLD):
        assert f"rank {r}: {scenario} ok" in p.stdout, failure(p.stdout)


def failure(out):
    """The ranks' own errors first (torchrun's summary, which ends the
    output, names no cause), then the output's end."""
    lines = out.splitlines()
    errors = [ln for ln in lines if "Error" in ln or "assert" in ln or "Traceback" in ln]
    return "\n".join(["ranks' errors:", *errors[:40], "", "output's end:", out[-8000:]])
