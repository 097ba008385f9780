#!/usr/bin/env python3
"""Writes README.md's results table from the newest complete results file.

    python3 scripts/results_table.py            # rewrite the table in README.md
    python3 scripts/results_table.py --check    # exit 1 if README.md's table is stale
    python3 scripts/results_table.py --print    # print the table only

The table sits between `<!-- results:begin -->` and `<!-- results:end -->`
in README.md and is generated, so it cannot drift from bench/results/.
"Complete" means a file (DESIGN.md's "Benchmark results format") with
ag_mm and mm_rs rows that carry symm's time and both halves of the floor
(mm_only and comm_only); "newest" is the latest `date`, then the later
commit in git, then the file name. Standard library only: CI runs it.
"""
import argparse
import json
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"
FUSED_OPS = ("ag_mm", "mm_rs")
# symm's pre-bound call (symm.bind: no Python argument reading) where the
# run has it, else the plain call.
SYMM_IMPLS = ("symm_bound", "symm")
OTHERS = (("torch_fused", "PyTorch fused / floor"), ("nccl_cublas", "NCCL + cuBLAS / floor"))


def fused_rows(results):
    """{(op, shape, dtype): {impl: ms}} of the fused operations."""
    rows = {}
    for r in results["records"]:
        # bench_families.py's records (a `family`) are other shapes.
        if r.get("op") in FUSED_OPS and "ms" in r and "family" not in r:
            rows.setdefault((r["op"], tuple(r["shape"]), r.get("dtype", "")), {})[r["impl"]] = r["ms"]
    return rows


def symm_ms(impls):
    return next((impls[i] for i in SYMM_IMPLS if i in impls), None)


def is_complete(results):
    """Every fused operation has at least one shape with symm's time and
    the floor's two halves."""
    have = {op for (op, _, _), impls in fused_rows(results).items()
            if symm_ms(impls) is not None and "mm_only" in impls and "comm_only" in impls}
    return have == set(FUSED_OPS)


def commit_time(commit, cwd=ROOT):
    """The commit's time in git, or 0 where git or the commit is missing."""
    try:
        out = subprocess.run(["git", "log", "-1", "--format=%ct", f"{commit}^{{commit}}", "--"],
                             cwd=cwd, capture_output=True, text=True, timeout=30)
        return int(out.stdout.strip() or 0) if out.returncode == 0 else 0
    except (OSError, ValueError, subprocess.SubprocessError):
        return 0


def newest_complete(results_dir):
    """(path, results) of the newest complete file under results_dir."""
    found = []
    for path in sorted(pathlib.Path(results_dir).glob("*.json")):
        try:
            results = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(results, dict) and isinstance(results.get("records"), list) and is_complete(results):
            found.append(((results.get("date", ""), commit_time(results.get("commit", "")), path.name),
                          path, results))
    if not found:
        raise SystemExit(f"no complete results file under {results_dir}")
    _, path, results = max(found, key=lambda f: f[0])
    return path, results


def ratio(num, den):
    return f"{num / den:.3f}" if num is not None and den else "-"


def ms(value):
    return f"{value:.3f}" if value is not None else "-"


def matmul_line(results):
    """symm's sm90 matmul alone over cuBLASLt, as a range per dtype."""
    by_dtype = {}
    times = {}
    for r in results["records"]:
        if r.get("op") == "matmul" and r.get("impl") in ("symm_sm90", "cublaslt") and "ms" in r:
            times.setdefault((tuple(r["shape"]), r.get("dtype", "")), {})[r["impl"]] = r["ms"]
    for (_, dtype), t in times.items():
        if "symm_sm90" in t and t.get("cublaslt"):
            by_dtype.setdefault(dtype, []).append(t["symm_sm90"] / t["cublaslt"])
    if not by_dtype:
        return None
    # fp8 rows without a suffix use exact accumulation, torch's default.
    note = lambda dtype: f"{dtype} (exact accumulation)" if dtype.startswith("fp8") else dtype
    parts = [f"{note(dtype)} {min(r):.3f}-{max(r):.3f} x on {len(r)} shapes" for dtype, r in sorted(by_dtype.items())]
    return "symm's sm90 matmul alone (one GPU) over cuBLASLt's time: " + "; ".join(parts) + "."


def render(path, results):
    """The table's markdown (without the markers)."""
    rel = path.relative_to(ROOT).as_posix() if path.is_absolute() and ROOT in path.parents else path.as_posix()
    count = results.get("device_count")
    device = f"{count} x {results.get('device', '?')}" if count else results.get("device", "?")
    lines = [
        f"From `{rel}`: {device}, world {results.get('world_size', '?')}, "
        f"commit {results.get('commit', '?')}, {results.get('date', '?')}. "
        "Milliseconds per call (median, slowest rank); the floor is max(matmul alone, "
        "communication alone); symm is the pre-bound call (`symm.bind`); M is the gathered rows "
        "for ag_mm and each rank's rows of A for mm_rs.",
        "",
        "| op | M x K x N | dtype | floor ms | symm ms | symm / floor | "
        + " | ".join(title for _, title in OTHERS) + " |",
        "| --- | --- | --- | ---: | ---: | ---: | " + " | ".join("---:" for _ in OTHERS) + " |",
    ]
    rows = fused_rows(results)
    for (op, shape, dtype) in sorted(rows, key=lambda k: (FUSED_OPS.index(k[0]), -k[1][0], k[1], k[2])):
        impls = rows[(op, shape, dtype)]
        if "mm_only" not in impls or "comm_only" not in impls:
            continue
        floor = max(impls["mm_only"], impls["comm_only"])
        cells = [op, " x ".join(map(str, shape)), dtype, ms(floor), ms(symm_ms(impls)), ratio(symm_ms(impls), floor)]
        cells += [ratio(impls.get(impl), floor) for impl, _ in OTHERS]
        lines.append("| " + " | ".join(cells) + " |")
    extra = matmul_line(results)
    if extra:
        lines += ["", extra]
    return "\n".join(lines)


def splice(text, table):
    """text with everything between the markers replaced by table."""
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        raise SystemExit(f"README has no {BEGIN} ... {END} block")
    return text[:start + len(BEGIN)] + "\n" + table + "\n" + text[end:]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--results", default=ROOT / "bench" / "results", type=pathlib.Path)
    p.add_argument("--readme", default=ROOT / "README.md", type=pathlib.Path)
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true", help="fail if the README's table is out of date")
    mode.add_argument("--print", action="store_true", help="print the table, change nothing")
    args = p.parse_args(argv)

    table = render(*newest_complete(args.results))
    if args.print:
        print(table)
        return 0
    text = args.readme.read_text()
    updated = splice(text, table)
    if args.check:
        if updated != text:
            print(f"{args.readme}: the results table is out of date; run python3 scripts/results_table.py",
                  file=sys.stderr)
            return 1
        return 0
    if updated != text:
        args.readme.write_text(updated)
    return 0


if __name__ == "__main__":
    sys.exit(main())
