"""bench/gpu/bench_hosts.py runs on two GPUs or more only: here, without
torch, its arguments, pretend hosts and NCCL transports, its shapes, and
the table, ratios, targets and records (through collect.py) on synthetic
records, so that a broken script shows before a GPU run."""

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH / "gpu"))

import bench_hosts  # noqa: E402
import collect  # noqa: E402


def run_python(code):
    return subprocess.run([sys.executable, "-c", code], cwd=BENCH / "gpu", capture_output=True, text=True)


def test_imports_and_helps_without_torch():
    # Its own process: another test may have imported torch into this one.
    got = run_python("import sys, bench_hosts; assert not {'torch', 'symm'} & set(sys.modules), sys.modules")
    assert got.returncode == 0, got.stderr
    got = subprocess.run([sys.executable, str(BENCH / "gpu" / "bench_hosts.py"), "--help"], capture_output=True,
                         text=True)
    assert got.returncode == 0, got.stderr
    for flag in ("--out", "--transport", "--hosts", "--quick", "--only"):
        assert flag in got.stdout


def test_arguments():
    args = bench_hosts.parse_args(["--out", "d"])
    assert (args.transport, args.hosts, args.quick, args.iters, args.only) == (
        "network", None, False, 20, "allgather,allreduce,mm_rs,ag_mm,host_time")
    # The ranks align on a communicator that no timed call uses, so torch's
    # default one (the `nccl` rows') is not the only one just used.
    assert args.barrier == "separate"
    assert bench_hosts.parse_args(["--out", "d", "--barrier", "default"]).barrier == "default"
    args = bench_hosts.parse_args(["--out", "d", "--quick", "--transport", "default", "--hosts", "2", "--only", "ag_mm"])
    assert (args.transport, args.hosts, args.iters, args.only) == ("default", 2, 10, "ag_mm")
    for bad in (["--out", "d", "--only", "allgather,gemm"], ["--out", "d", "--transport", "ib"],
                ["--out", "d", "--barrier", "mpi"], []):
        with pytest.raises(SystemExit):
            bench_hosts.parse_args(bad)


def test_every_rank_its_own_host_or_pairs():
    assert len({bench_hosts.host_id(r, 2) for r in range(2)}) == 2
    assert len({bench_hosts.host_id(r, 4) for r in range(4)}) == 4
    pairs = [bench_hosts.host_id(r, 4, 2) for r in range(4)]
    assert pairs[0] == pairs[1] != pairs[2] == pairs[3]
    for world, hosts in ((4, 3), (2, 1), (4, 1), (3, 2)):
        with pytest.raises(ValueError, match="--hosts"):
            bench_hosts.host_id(0, world, hosts)


def test_bad_hosts_fail_before_anything_is_touched(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.delenv("NCCL_P2P_DISABLE", raising=False)
    with pytest.raises(ValueError, match="--hosts 3"):
        bench_hosts.main(["--out", "d", "--hosts", "3"])
    import os

    assert "NCCL_P2P_DISABLE" not in os.environ


def test_transports():
    env = {"NCCL_SOCKET_IFNAME": "eth0"}
    bench_hosts.set_transport(env, "network")
    assert env == {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1", "NCCL_SOCKET_IFNAME": "eth0"}
    env = {}
    bench_hosts.set_transport(env, "network")
    assert env["NCCL_SOCKET_IFNAME"] == "lo"
    bench_hosts.set_transport(env, "default")
    assert env == {"NCCL_SOCKET_IFNAME": "lo"}


def bench_ops_shapes(name):
    tree = ast.parse((BENCH / "bench_ops.py").read_text())
    node = next(n for n in tree.body if isinstance(n, ast.Assign) and n.targets[0].id == name)
    return [list(s) for s in ast.literal_eval(node.value)]


def test_shapes_are_bench_ops_at_world_2_and_shard_as_tensor_parallelism():
    full, quick = bench_hosts.cases(2, False), bench_hosts.cases(2, True)
    assert full["ag_mm"] == bench_ops_shapes("AG_MM_SHAPES")[:3]
    assert full["mm_rs"] == bench_ops_shapes("MM_RS_SHAPES")[:3]
    assert quick == {op: shapes[-1:] for op, shapes in full.items()}
    for world in (2, 4, 8):
        for op, shapes in bench_hosts.cases(world, False).items():
            for m, k, n in shapes:
                assert m % world == 0 and k % 16 == 0 and n % 16 == 0, (op, world, m, k, n)
    assert bench_hosts.QUICK_SIZES == bench_hosts.SIZES[:2]
    assert min(bench_hosts.SIZES) == 64 << 10 and max(bench_hosts.SIZES) == 256 << 20


def test_imports_what_bench_ops_defines():
    """The GPU half imports from bench_ops.py (torch) inside its functions:
    checked by name."""
    ops = ast.parse((BENCH / "bench_ops.py").read_text())
    defined = {n.name for n in ops.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    tree = ast.parse((BENCH / "gpu" / "bench_hosts.py").read_text())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module == "bench_ops"
                for a in n.names}
    assert imported >= {"Bench", "rel_err", "linear_weight"} and imported <= defined, imported - defined


def synthetic_records(world=2, slow=1.0, slow_comm=1.0):
    """The records rank 0 prints in two runs (network, then default), each
    op at every size or shape: symm at `slow` x NCCL for the collectives,
    its communication at `slow_comm` x NCCL's alone for the matmuls."""
    out = []
    for transport in bench_hosts.TRANSPORTS:
        extra = {"dtype": "bf16", "iters": 20, "world": world, "transport": transport, "hosts": world}
        for nbytes in bench_hosts.SIZES:
            for op in ("hosts_allgather", "hosts_allreduce"):
                nccl = nbytes / 2**30 * 100
                times = {"symm": slow * nccl, "nccl": nccl, "symm_one_host": 0.1 * nccl, "nccl_again": 0.95 * nccl}
                out += [{"op": op, "shape": [nbytes], "impl": i, "ms": ms, **extra} for i, ms in times.items()]
        for op, shapes in bench_hosts.cases(world, False).items():
            for shape in shapes:
                mm, comm = 2.0, 8.0
                times = {"symm": mm + slow_comm * comm, "nccl": mm + comm, "symm_one_host": 2.5,
                         "comm_only": comm, "mm_only": mm}
                out += [{"op": f"hosts_{op}", "shape": shape, "impl": i, "ms": ms, **extra} for i, ms in times.items()]
    for r in out:
        if r["impl"].startswith("symm"):
            r["relerr"] = 0.004
    return out


def test_ratios_and_targets():
    rows = bench_hosts.rows(synthetic_records(slow=1.05, slow_comm=1.12))
    assert len(rows) == 2 * (2 * len(bench_hosts.SIZES) + 6)
    key = ("hosts_allgather", (16 << 20,), "network", 2, 2)
    assert bench_hosts.ratios(rows[key]) == {"symm": pytest.approx(1.05), "symm_one_host": pytest.approx(0.1),
                                             "nccl_again": pytest.approx(0.95)}
    key = ("hosts_mm_rs", tuple(bench_hosts.cases(2, False)["mm_rs"][0]), "default", 2, 2)
    r = bench_hosts.ratios(rows[key])
    assert r["symm"] == pytest.approx((2 + 1.12 * 8) / 10) and r["comm"] == pytest.approx(1.12)
    verdicts = bench_hosts.verdicts(synthetic_records(slow=1.05, slow_comm=1.12))
    missed = {(k[0], target) for k, target, _, met in verdicts if not met}
    # Only the matmuls' communication (1.12 x NCCL's) misses; the whole op (10.96 / 10) is under its bar.
    assert missed == {("hosts_mm_rs", "symm - mm_only <= 1.10 x comm_only"),
                      ("hosts_ag_mm", "symm - mm_only <= 1.10 x comm_only")}
    assert all(met for *_, met in bench_hosts.verdicts(synthetic_records()))
    slow = bench_hosts.verdicts(synthetic_records(slow=1.2))
    assert {k[0] for k, target, _, met in slow if not met} == {"hosts_allgather", "hosts_allreduce"}


def test_a_missing_time_is_a_missed_target_not_a_crash():
    records = [r for r in synthetic_records() if not (r["impl"] == "nccl" and r["shape"] == [1 << 20])]
    lines = bench_hosts.table(records)
    assert any(line.startswith("MISSED hosts_allgather 1 MB/rank") and "no time" in line for line in lines)


def test_table():
    lines = bench_hosts.table(synthetic_records(slow=1.2))
    text = "\n".join(lines)
    assert "across 2 pretend hosts, world 2, NCCL transport network" in text
    assert "across 2 pretend hosts, world 2, NCCL transport default" in text
    assert "hosts_allgather 256 MB/rank" in text
    assert "hosts_ag_mm     16384x8192x8192" in text
    total = 2 * (2 * len(bench_hosts.SIZES) + 2 * 6)
    assert f"targets: {total - 2 * 2 * len(bench_hosts.SIZES)} of {total} met" in text
    assert "MISSED hosts_allreduce 16 MB/rank (default, 2 hosts): symm <= 1.10 x nccl: 1.200" in text
    line = next(ln for ln in lines if ln.startswith("hosts_allgather 1 MB/rank"))
    assert line.split()[-4:] == ["1.200", "0.100", "0.950", "-"]
    line = next(ln for ln in lines if ln.startswith("hosts_ag_mm"))
    assert line.split()[-2:] == ["-", "1.00"]


def test_records_keep_transport_and_hosts_through_collect(tmp_path):
    records = synthetic_records()
    lines = ["NVIDIA H200, 580.159.04, 143771 MiB", "NVIDIA H200, 580.159.04, 143771 MiB"]
    lines += [json.dumps(r) for r in records]
    log = tmp_path / "hosts.txt"
    log.write_text("\n".join(lines) + "\n")
    assert collect.main(str(log), str(tmp_path), "abc1234", "2026-12-02") == 0
    (path,) = tmp_path.glob("*.json")
    assert path.name == "2026-12-02-h200-x2-w2-abc1234-hosts.json"
    got = json.loads(path.read_text())["records"]
    # Nothing merged across transports: one record per printed one.
    assert len(got) == len(records)
    assert {(r["transport"], r["hosts"]) for r in got} == {("network", 2), ("default", 2)}
    assert all(r["relerr"] == 0.004 for r in got if r["impl"].startswith("symm"))
    assert Path(bench_hosts.records_path("d", 4, 2, "network")).name == "hosts-w4-h2-network-records.jsonl"


def test_collect_reads_the_gpus_of_checks_sh(tmp_path):
    """checks.sh's gpus.txt names the commit on a line of its own, which is
    no GPU."""
    (tmp_path / "gpus.txt").write_text("NVIDIA H200, 580.159.04\nNVIDIA H200, 580.159.04\ncommit abc1234\n")
    log = tmp_path / "hosts.txt"
    log.write_text("\n".join(json.dumps(r) for r in synthetic_records(world=2)[:3]) + "\n")
    assert collect.main(str(log), str(tmp_path), "abc1234", "2026-12-02") == 0
    (path,) = tmp_path.glob("*.json")
    data = json.loads(path.read_text())
    assert (data["device"], data["device_count"], data["driver"]) == ("NVIDIA H200", 2, "580.159.04")
    assert path.name == "2026-12-02-h200-x2-w2-abc1234-hosts.json"
