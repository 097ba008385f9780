"""bench/bench_families.py runs on two GPUs only: here, its families of
shapes (bench/families.py), the records it prints through collect.py,
the table and targets, and the charts (where matplotlib is installed) on
synthetic records, so that a broken case list or format shows before a GPU
run."""

import ast
import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(BENCH / "gpu"))

import collect  # noqa: E402
import families  # noqa: E402
import families_rounds  # noqa: E402

MATMULS = ("ag_mm", "mm_rs")


def matmul_cases():
    return [c for cases in families.FAMILIES.values() for c in cases if c.op in MATMULS]


@pytest.mark.parametrize("world", [2, 4, 8])
def test_every_case_divides_as_tensor_parallelism_does(world):
    for family, cases in families.FAMILIES.items():
        for c in cases:
            what = f"{family} {c} at world {world}"
            if c.op == "lc_allgather":
                assert c.m % 1024 == 0, what
                continue
            m, k, n = families.per_rank(c, world)
            assert k % 16 == 0 and n % 16 == 0, what
            assert m % c.batch == 0 and (m // c.batch) % world == 0, what  # the gathered / scattered rows


def test_the_families_cover_what_the_issue_asks():
    assert all(families.FAMILIES.values()) and all(families.quick(c) for c in families.FAMILIES.values())
    assert set(families.FAMILIES) == {"comm_heavy", "seq3d", "m512", "decode", "decode_layer", "small_allgather",
                                      "fp8"}
    cases = matmul_cases()
    assert any(c.m % 128 for c in cases), "an M not a multiple of 128"
    assert {"bf16", "f16", "fp8_e4m3"} <= {c.dtype for c in cases}
    # The ops bench_families.run_case times.
    assert {c.op for cases in families.FAMILIES.values() for c in cases} == {*MATMULS, "decode_layer", "lc_allgather"}
    for family in ("comm_heavy", "seq3d", "m512", "decode"):
        assert {c.op for c in families.FAMILIES[family]} == set(MATMULS), family
        assert any(c.dtype == "f16" for c in families.FAMILIES[family]), family
    assert all(c.batch > 1 for c in families.FAMILIES["seq3d"])
    assert all(c.m == 512 for c in families.FAMILIES["m512"])
    for op in MATMULS:
        assert {16, 64, 128, 256} <= {c.m for c in families.FAMILIES["decode"] if c.op == op}
        assert {"tensor", "row"} == {c.scales for c in families.FAMILIES["fp8"] if c.op == op}
    assert families.per_rank(families.FAMILIES["decode_layer"][0], 2) == [64, 8192, 14336]
    sizes = [c.m for c in families.FAMILIES["small_allgather"]]
    assert min(sizes) == 64 << 10 and max(sizes) == 64 << 20


def test_the_runner_imports_what_bench_ops_defines():
    """bench_families.py needs torch and GPUs; its imports from bench_ops.py
    are checked by name."""
    tree = ast.parse((BENCH / "bench_families.py").read_text())
    ops = ast.parse((BENCH / "bench_ops.py").read_text())
    defined = {n.name for n in ops.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    defined |= {t.id for n in ops.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}
    imported = {a.name for n in tree.body if isinstance(n, ast.ImportFrom) and n.module == "bench_ops" for a in n.names}
    assert imported and imported <= defined, imported - defined


def synthetic_records(world=2, slow=1.0):
    """The records a run prints, each rank's own (bench_families.py's
    fields), with made-up times: symm at `slow` x the floor."""
    out = []
    for family, cases in families.FAMILIES.items():
        for c in cases:
            shape = families.per_rank(c, world)
            base = {"shape": shape, "iters": 30, "world": world, "family": family}
            if c.op == "lc_allgather":
                times = {"symm": 1.1, "symm_bound": 1.0, "symm_inplace": 0.9, "nccl": 1.0, "torch_lc": 1.5,
                         "symm_graph": 0.8, "symm_inplace_graph": 0.7, "nccl_graph": 0.9}
                base["dtype"] = "bf16"
            elif c.op == "decode_layer":
                times = {"symm": 0.2, "symm_bound": 0.15, "symm_graph": 0.12, "torch_fused": 0.4,
                         "torch_fused_graph": 0.3, "nccl_cublas": 0.3, "nccl_cublas_graph": 0.2, "mm_only": 0.12,
                         "mm_only_graph": 0.11, "weights_read": 0.11}
                base["dtype"] = "bf16"
                if c == cases[0]:  # measured once per run
                    out.append({"op": "hbm_copy", "shape": [2 << 30], "dtype": "bf16", "impl": "torch_copy", "ms": 1.0,
                                "iters": 30, "world": world, "family": family, "GBps": 4294.9})
            else:
                times = {"mm_only": 1.0, "comm_only": 0.6, "symm": slow, "symm_bound": 0.98 * slow,
                         "torch_fused": 1.3, "nccl_cublas": 1.6, "mm_only_graph": 0.95, "comm_only_graph": 0.6,
                         "symm_graph": 0.97, "torch_fused_graph": 1.2, "nccl_cublas_graph": 1.5}
                base["dtype"] = c.dtype
                if c.batch > 1:
                    base["batch"] = c.batch
                if c.scales:
                    base["scales"] = c.scales
            for impl, ms in times.items():
                rec = {"op": c.op, **base, "impl": impl, "ms": ms}
                if impl.startswith("symm") and not impl.endswith("_graph"):
                    rec["relerr"] = 0.004
                out.append(rec)
    return out


def collected(tmp_path, records):
    """The results file collect.py makes of a log in which two ranks
    printed `records` (rank 1 slower), interleaved on some lines."""
    lines = ["NVIDIA H200, 580.159.04, 143771 MiB", "NVIDIA H200, 580.159.04, 143771 MiB"]
    for r in records:
        slower = dict(r, ms=r["ms"] * 1.01)
        lines.append(json.dumps(r) + " " + json.dumps(slower))
    log = tmp_path / "log.txt"
    log.write_text("\n".join(lines) + "\n")
    assert collect.main(str(log), str(tmp_path), "abc1234", "2026-12-01") == 0
    (path,) = tmp_path.glob("*-families.json")
    assert path.name == "2026-12-01-h200-x2-w2-abc1234-families.json"
    return path


def test_records_keep_their_family_through_collect(tmp_path):
    records = synthetic_records()
    data = json.loads(collected(tmp_path, records).read_text())
    assert data["world_size"] == 2 and data["device"] == "NVIDIA H200"
    got = data["records"]
    # Nothing merged across families, batches or scales: one record per printed one.
    assert len(got) == len(records)
    for r in got:
        assert {"op", "shape", "dtype", "impl", "ms", "iters", "world", "family"} <= set(r), r
        assert r["ms"] == pytest.approx(max(r["ms_per_rank"])) and len(r["ms_per_rank"]) == 2
    assert {r["family"] for r in got} == set(families.FAMILIES)
    assert {r["scales"] for r in got if r["family"] == "fp8"} == {"tensor", "row"}
    assert all(r["batch"] > 1 for r in got if r["family"] == "seq3d")
    copy = next(r for r in got if r["op"] == "hbm_copy")
    assert copy["GBps"] == pytest.approx(4294.9)


def test_table_and_targets(tmp_path):
    on_bar = families.verdicts(synthetic_records(slow=1.0))
    kinds = {target for _, target, *_ in on_bar}
    assert "symm <= 1.05 x floor" in kinds and "symm_graph <= torch_fused_graph" in kinds
    assert "symm_graph <= 1.15 x weights_read" in kinds and "symm_inplace <= nccl" in kinds
    assert "symm < torch_fused" in kinds
    missed = [(case, target) for case, target, value, bar, met in on_bar if not met]
    # Only the staged all-gather (1.1 x NCCL) misses in the synthetic times.
    assert missed and all(case[1] == "lc_allgather" and target == "symm <= nccl" for case, target in missed)
    slow = families.verdicts(synthetic_records(slow=1.2))
    assert any(not met and target == "symm <= 1.05 x floor" for _, target, _, _, met in slow)
    lines = families.table(synthetic_records(slow=1.2))
    text = "\n".join(lines)
    for family in families.FAMILIES:
        assert f"\n{family}:" in text
    assert "MISSED comm_heavy" in text and "targets:" in text
    ratios = families.ratios(synthetic_records())
    case = next(c for c in ratios if c[0] == "m512")
    assert ratios[case]["symm"] == pytest.approx(1.0) and ratios[case]["symm_graph"] == pytest.approx(0.97 / 0.95)


def test_rounds_list_the_targets_missed_in_some_run():
    runs = [synthetic_records(slow=1.0), synthetic_records(slow=1.2), synthetic_records(slow=1.0)]
    rows = families_rounds.judged(runs)
    case = next(c for c, t in rows if c[0] == "m512" and t == "symm <= 1.05 x floor")
    bar, results = rows[(case, "symm <= 1.05 x floor")]
    assert bar == families.FLOOR_BAR and [met for _, met in results] == [True, False, True]
    assert results[1][0] == pytest.approx(1.2)
    text = families_rounds.lines(runs)
    assert any(line.startswith("m512: mm_rs") and line.endswith("2/3") for line in text)
    # The staged all-gather misses in every synthetic run; what never misses is only counted.
    missed_somewhere = {k for k, (_, r) in rows.items() if not all(m for _, m in r)}
    assert len(text) == len(missed_somewhere) + 2
    assert text[-1] == f"{len(rows) - len(missed_somewhere)} of {len(rows)} targets met in all 3 runs"
    assert len(families_rounds.lines(runs, every=True)) == len(rows) + 2


def test_plot_draws_a_png_per_family(tmp_path):
    pytest.importorskip("matplotlib")
    import plot_families

    path = collected(tmp_path, synthetic_records())
    written = plot_families.main(str(path))
    assert len(written) == len(families.FAMILIES)
    for png in written:
        assert Path(png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_drawn_cases_are_reproducible_and_divide_as_tensor_parallelism_does():
    cases = families.drawn(7, 200)
    assert cases == families.drawn(7, 200) and cases != families.drawn(8, 200)
    for c in cases:
        m, k, n = families.per_rank(c, 2)
        assert c.op in MATMULS and c.dtype in ("bf16", "f16") and c.scales is None, c
        assert k % 8 == 0 and n % 8 == 0 and 2 * m * k * n <= families.DRAWN_MAX_FLOP, c
        assert c.m % (2 * c.batch) == 0, c  # every rank's rows, of every sequence
    # What a user runs beyond the fixed families: both ops, both 16-bit
    # types, decode sizes and larger, sequences, M off the tile grid.
    assert {c.op for c in cases} == set(MATMULS) and {c.dtype for c in cases} == {"bf16", "f16"}
    assert 0.15 < sum(c.m <= 256 for c in cases) / len(cases) < 0.6
    assert any(c.batch > 1 for c in cases) and any(c.m >= 8192 for c in cases)
    assert sum(c.m % 128 != 0 for c in cases) > 0.8 * len(cases)


def test_a_case_named_on_the_command_line():
    assert families.parse_case("mm_rs:62x4096x4096") == families.Case("mm_rs", 62, 4096, 4096)
    assert families.parse_case("ag_mm:8192x4096x14336:f16:b4") == families.Case("ag_mm", 8192, 4096, 14336, "f16", 4)
    for bad in ("mm:1x2x3", "mm_rs:1x2", "ag_mm:8x8x8:fp8", "ag_mm:8x8x8:bx"):
        with pytest.raises(ValueError):
            families.parse_case(bad)
