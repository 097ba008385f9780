"""A CUDA group whose ranks announce different hosts (SYMM_HOST_ID), as
processes on two GPUs of one machine: it forms through NCCL (torch's wheel
or the system's), runs fused_ag_mm and mm_rs across its hosts (also with
NCCL kept to its network transport), all_reduce, lc_allgather and
all_reduce_rmsnorm (likewise), and rendezvouses a symmetric buffer (only
the ranks of one host map each other's memory).
Skipped unless torch sees two GPUs and NCCL is found."""

import ctypes
import os

import pytest
from ranks import in_processes

import symm
from symm import _loader

torch = pytest.importorskip("torch")
if torch.cuda.device_count() < 2:
    pytest.skip(f"needs two CUDA devices, torch sees {torch.cuda.device_count()}", allow_module_level=True)


def _nccl():
    path = os.environ.get("SYMM_NCCL_LIBRARY") or _loader.nccl_from_wheel() or "libnccl.so.2"
    try:
        ctypes.CDLL(path)
    except OSError:
        pytest.skip(f"no NCCL ({path})")
    return path


def on_two_hosts(scenario, deadline_s, nccl=None, transport="default", **extra):
    """``scenarios.<scenario>`` in two processes, each its own pretend host;
    "network": NCCL with P2P and shared memory off, so the ranks' data goes
    through sockets."""
    env = {
        "SYMM_TEST_BOOTSTRAP": "uid",
        "SYMM_TEST_UID": symm.get_unique_id().hex(),
        "SYMM_TEST_BACKEND": "cuda",
        "SYMM_NCCL_LIBRARY": nccl or _nccl(),
        **extra,
    }
    if transport == "network":
        env.update(NCCL_P2P_DISABLE="1", NCCL_SHM_DISABLE="1", NCCL_SOCKET_IFNAME="lo")
    in_processes(scenario, 2, env, deadline_s=deadline_s, rank_env=[{"SYMM_HOST_ID": h} for h in ("a", "b")])


def test_group_spanning_hosts_forms_and_rendezvouses_within_each_host():
    on_two_hosts("across_hosts", 120)


def test_group_spanning_hosts_without_nccl_fails_every_rank():
    on_two_hosts(
        "exchange",
        60,
        nccl="/nonexistent/libnccl.so.2",
        SYMM_TEST_FORM_ERROR="SymmUnsupported",
        SYMM_TEST_FORM_FAILS="a group spanning hosts needs NCCL",
        SYMM_TEST_FORM_WITHIN="30",
    )


@pytest.mark.parametrize("transport", ["default", "network"])
def test_matmuls_across_pretend_hosts(transport):
    """fused_ag_mm and mm_rs with each rank its own host, against float64
    math (scenarios.across_hosts_matmuls)."""
    on_two_hosts("across_hosts_matmuls", 300, transport=transport)


@pytest.mark.parametrize("transport", ["default", "network"])
def test_collectives_across_pretend_hosts(transport):
    """all_reduce (sum/avg; bf16, f32, int32; in place, out of place,
    strided), lc_allgather and all_reduce_rmsnorm with each rank its own
    host, against float64 math (scenarios.across_hosts_collectives)."""
    on_two_hosts("across_hosts_collectives", 300, transport=transport)
