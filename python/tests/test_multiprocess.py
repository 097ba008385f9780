"""Ranks as separate processes over the unique-id and torchrun bootstraps."""

import os
import socket

import pytest
from ranks import in_processes

import symm


@pytest.mark.parametrize("world", [2, 3, 4])
def test_unique_id_bootstrap(world):
    uid = symm.get_unique_id()
    assert isinstance(uid, bytes) and len(uid) == 128
    in_processes("all_scenarios", world, {"SYMM_TEST_BOOTSTRAP": "uid", "SYMM_TEST_UID": uid.hex()})


def _free_port_pair():
    """A port p with p + 1 free too (the env bootstrap's store uses
    MASTER_PORT + 1). Searched below Linux's ephemeral range (32768 up), so
    that no outgoing connection takes the port before the store binds it."""
    start = 20000 + os.getpid() % 10000  # spreads concurrent test runs apart
    for port in range(start, start + 2000, 2):
        try:
            for p in (port, port + 1):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
        except OSError:
            continue
        return port
    raise RuntimeError(f"no free port pair in {start}..{start + 2000}")


def test_env_bootstrap():
    env = {"SYMM_TEST_BOOTSTRAP": "env", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port_pair())}
    in_processes("exchange", 2, env)


@pytest.mark.parametrize(
    "algos, fails",
    [
        (("sequential", "pipelined"), "SYMM_ALGO is sequential on rank 0 but pipelined on rank 1"),
        ((None, "pipelined"), "SYMM_ALGO is auto on rank 0 but pipelined on rank 1"),
        (("fused", None), "SYMM_ALGO is fused on rank 0 but auto on rank 1"),
        (("pipelined", "pipelined"), None),
        ((None, None), None),
    ],
)
def test_ranks_with_different_symm_algo_fail_fast_or_agree(algos, fails):
    """SYMM_ALGO is agreed when the group forms: ranks started with different
    values (or one without) all fail at once with a mismatch naming it, well
    within the 10 s timeout; alike, they run the same algorithm."""
    uid = symm.get_unique_id()
    env = {"SYMM_TEST_BOOTSTRAP": "uid", "SYMM_TEST_UID": uid.hex()}
    rank_env = [{"SYMM_ALGO": a} for a in algos]
    if fails:
        env["SYMM_TEST_FORM_FAILS"] = fails
    else:
        env["SYMM_TEST_ALGO"] = algos[0] or ""
    in_processes("agreed_algorithm", 2, env, rank_env=rank_env)


def test_ranks_with_different_check_args_fail_fast():
    uid = symm.get_unique_id()
    env = {
        "SYMM_TEST_BOOTSTRAP": "uid",
        "SYMM_TEST_UID": uid.hex(),
        "SYMM_TEST_FORM_FAILS": "SYMM_CHECK_ARGS (or SYMM_GROUP_CHECK_ARGS_ALWAYS) is cached on rank 0 but always on rank 1",
    }
    in_processes("exchange", 2, env, rank_env=[{"SYMM_CHECK_ARGS": None}, {"SYMM_CHECK_ARGS": "always"}])


@pytest.mark.parametrize("hosts", [("a", "b"), ("a", "a", "b"), ("a", "b", "c")])
def test_host_backend_refuses_ranks_on_different_hosts(hosts):
    """Ranks announcing different hosts (SYMM_HOST_ID) cannot share host
    memory: every rank fails at once saying a group spanning hosts needs
    the CUDA backend and NCCL, instead of waiting for the others."""
    uid = symm.get_unique_id()
    env = {
        "SYMM_TEST_BOOTSTRAP": "uid",
        "SYMM_TEST_UID": uid.hex(),
        "SYMM_BACKEND": "host",
        "SYMM_TEST_FORM_ERROR": "SymmUnsupported",
        "SYMM_TEST_FORM_FAILS": "the host backend shares memory within one host",
    }
    in_processes("exchange", len(hosts), env, rank_env=[{"SYMM_HOST_ID": h} for h in hosts])


def test_ranks_naming_one_host_form_a_group():
    uid = symm.get_unique_id()
    env = {"SYMM_TEST_BOOTSTRAP": "uid", "SYMM_TEST_UID": uid.hex(), "SYMM_HOST_ID": "one"}
    in_processes("exchange", 2, env)
