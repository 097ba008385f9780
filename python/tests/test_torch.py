"""symm.torch on the CPU (the host backend): ``torch.ops.symm.*`` against
float64 math, their fake kernels and opcheck, autograd against float64
gradients, a tensor-parallel MLP under ``torch.compile(fullgraph=True)``
against eager, groups formed through the process group's store (and
formed again for a process group made again), and one rank's bad argument
failing every rank's call. Each
test runs torch_scenarios.py as 2 or 3 processes over a gloo process
group. Skipped without torch (CI installs none)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from ranks import SYMM_PARENT, wait_for_ranks

torch = pytest.importorskip("torch")
if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
    pytest.skip("needs torch.distributed with gloo", allow_module_level=True)

import symm.torch as st  # noqa: E402 -- after the skip

SCRIPT = Path(__file__).with_name("torch_scenarios.py")


def run_ranks(tmp_path, world, *scenarios, deadline_s=600):
    """The scenarios on ``world`` rank processes; fails with every failing rank's output."""
    env = dict(
        os.environ,
        WORLD_SIZE=str(world),
        SYMM_TEST_INIT_FILE=str(tmp_path / "pg"),
        PYTHONPATH=os.pathsep.join([str(SYMM_PARENT), str(SCRIPT.parent)]),
        OMP_NUM_THREADS="1",
    )
    procs = [
        subprocess.Popen(
            [sys.executable, str(SCRIPT), *scenarios],
            env=dict(env, RANK=str(r)),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(world)
    ]
    wait_for_ranks(procs, deadline_s)


def test_schemas_are_torch_symm_mems():
    """Each operator's schema is torch.ops.symm_mem's, but for the namespace."""
    if not hasattr(torch.ops, "symm_mem") or not hasattr(torch.ops.symm_mem, "one_shot_all_reduce"):
        pytest.skip("this torch has no torch.ops.symm_mem")
    from torch.distributed import _symmetric_memory  # noqa: F401 -- defines the Python-side symm_mem operators

    for name in st.OPERATORS:
        ours = str(getattr(torch.ops.symm, name).default._schema)
        theirs = str(getattr(torch.ops.symm_mem, name).default._schema)
        assert ours == theirs.replace("symm_mem::", "symm::", 1), name


def test_symmetric_args_in_the_operators_names():
    assert st.symmetric_args("one_shot_all_reduce") == {"input": "read"}
    assert st.symmetric_args("two_shot_all_reduce_") == {"input": "read"}
    assert st.symmetric_args("_low_contention_all_gather") == {"tensor": "read"}
    assert st.symmetric_args("fused_all_gather_matmul") == {}
    assert st.symmetric_args("fused_matmul_reduce_scatter") == {}
    for name in st.OPERATORS:
        schema = getattr(torch.ops.symm, name).default._schema
        params = {a.name for a in schema.arguments}
        assert set(st.symmetric_args(name)) <= params, name
    with pytest.raises(ValueError, match="one_shot_all_reduce"):
        st.symmetric_args("all_reduce")
    # torch 2.11 has no registry; where one exists, the operators are in it.
    assert st.register_with_torch() == hasattr(torch.library.Library, "register_symm_mem_args")


@pytest.mark.parametrize("world", [2, 3])
def test_ops_against_float64(tmp_path, world):
    run_ranks(tmp_path, world, "ops")


@pytest.mark.parametrize("world", [1, 2, 4])
def test_scaled_fp8_ops(tmp_path, world):
    run_ranks(tmp_path, world, "scaled")


@pytest.mark.parametrize("world", [2, 3])
def test_autograd_against_float64_gradients(tmp_path, world):
    run_ranks(tmp_path, world, "autograd")


def test_fake_kernels_and_opcheck(tmp_path):
    run_ranks(tmp_path, 2, "fake")


def test_compiled_tensor_parallel_mlp_matches_eager(tmp_path):
    run_ranks(tmp_path, 2, "compiled")


def test_groups_form_through_the_process_groups_store(tmp_path):
    run_ranks(tmp_path, 3, "bootstrap")


@pytest.mark.parametrize("world", [2, 3])
def test_one_ranks_bad_argument_fails_every_rank(tmp_path, world):
    run_ranks(tmp_path, world, "refusals")


def test_a_process_group_made_again_gets_a_new_symm_group(tmp_path):
    run_ranks(tmp_path, 3, "reinit")
