"""scripts/results_table.py: README's results table is generated from the
newest complete results file, and the README's copy is that table."""
import importlib.util
import json
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "results_table.py"


@pytest.fixture(scope="module")
def rt():
    spec = importlib.util.spec_from_file_location("results_table", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def record(op, impl, ms, shape=(512, 8192, 14336), dtype="bf16"):
    return {"op": op, "shape": list(shape), "dtype": dtype, "impl": impl, "ms": ms, "iters": 30}


def results(date, commit, records):
    return {"device": "NVIDIA H200", "device_count": 2, "world_size": 2, "date": date, "commit": commit,
            "records": records}


def complete_records(symm=0.21):
    rows = []
    for op in ("ag_mm", "mm_rs"):
        rows += [record(op, "mm_only", 0.2), record(op, "comm_only", 0.05), record(op, "symm", symm + 0.04),
                 record(op, "symm_bound", symm), record(op, "torch_fused", 0.4), record(op, "nccl_cublas", 0.25)]
    return rows


def test_table_takes_the_bound_call_over_the_floor(rt, tmp_path):
    path = tmp_path / "run.json"
    table = rt.render(path, results("2026-11-27", "abc1234", complete_records()))
    assert "| ag_mm | 512 x 8192 x 14336 | bf16 | 0.200 | 0.210 | 1.050 | 2.000 | 1.250 |" in table
    assert "| mm_rs | 512 x 8192 x 14336 | bf16 | 0.200 | 0.210 | 1.050 | 2.000 | 1.250 |" in table
    assert "commit abc1234, 2026-11-27" in table


def test_matmul_line_ranges_per_dtype(rt):
    recs = [record("matmul", "symm_sm90", 1.0, (1, 2, 3)), record("matmul", "cublaslt", 1.0, (1, 2, 3)),
            record("matmul", "symm_sm90", 1.1, (4, 5, 6)), record("matmul", "cublaslt", 1.0, (4, 5, 6)),
            record("matmul", "symm_sm90", 1.5, (1, 2, 3), "fp8_e4m3"),
            record("matmul", "cublaslt", 1.0, (1, 2, 3), "fp8_e4m3")]
    line = rt.matmul_line(results("d", "c", recs))
    assert "bf16 1.000-1.100 x on 2 shapes" in line
    assert "fp8_e4m3 (exact accumulation) 1.500-1.500 x on 1 shapes" in line


def test_newest_complete_skips_incomplete_and_older_files(rt, tmp_path):
    (tmp_path / "old.json").write_text(json.dumps(results("2026-11-20", "aaaaaaa", complete_records(0.3))))
    (tmp_path / "new.json").write_text(json.dumps(results("2026-11-27", "bbbbbbb", complete_records(0.2))))
    # Newer but without mm_rs: not complete.
    partial = [r for r in complete_records() if r["op"] == "ag_mm"]
    (tmp_path / "partial.json").write_text(json.dumps(results("2026-11-28", "ccccccc", partial)))
    (tmp_path / "broken.json").write_text("{")
    path, chosen = rt.newest_complete(tmp_path)
    assert path.name == "new.json" and chosen["commit"] == "bbbbbbb"


def test_check_fails_on_a_stale_table_and_write_fixes_it(rt, tmp_path):
    res = tmp_path / "results"
    res.mkdir()
    (res / "run.json").write_text(json.dumps(results("2026-11-27", "abc1234", complete_records())))
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n\n{rt.BEGIN}\nold\n{rt.END}\n\nafter\n")
    args = ["--results", str(res), "--readme", str(readme)]
    assert rt.main(args + ["--check"]) == 1
    assert rt.main(args) == 0
    text = readme.read_text()
    assert "old" not in text and text.endswith(f"{rt.END}\n\nafter\n") and "| ag_mm |" in text
    assert rt.main(args + ["--check"]) == 0


def test_readme_table_is_up_to_date(rt):
    assert rt.main(["--check"]) == 0, "run python3 scripts/results_table.py"
