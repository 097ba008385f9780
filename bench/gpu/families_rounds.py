"""Every target of the families over repeated runs: one families-records.jsonl
per run (bench_families.py), each judged as families.table judges one run;
per target its value in each run, the median and how many runs met it.
Targets met in every run are counted, not listed (--all lists them).
    python3 bench/gpu/families_rounds.py r1/families-records.jsonl r2/... [--all]
"""
import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import families  # noqa: E402  (bench/families.py, standard library only)


def judged(runs):
    """{(case, target): (bar, [(value, met) per run that judged it])} of
    every run's records (a list of record lists)."""
    out = {}
    for records in runs:
        for case, target, value, bar, met in families.verdicts(records):
            out.setdefault((case, target), (bar, []))[1].append((value, met))
    return out


def lines(runs, every=False):
    """The table's lines: a row per target missed in some run (every: per
    target), then the count of those met in all runs."""
    rows = judged(runs)
    width = 6 * len(runs) + 1  # the per-run column: "1.234 " each
    out = [f"{'target':<86}{'bar':>6}  {'per run':<{width}}median  met"]
    always = 0
    for (case, target), (bar, results) in rows.items():
        values, met = [v for v, _ in results], sum(m for _, m in results)
        if met == len(results) == len(runs):
            always += 1
            if not every:
                continue
        what = f"{case[0]}: {families.describe(case)}: {target}"
        per_run = " ".join(f"{v:.3f}" for v in values)
        out.append(f"{what:<86}{bar:>6}  {per_run:<{width}}{statistics.median(values):.3f}  {met}/{len(results)}")
    out.append(f"{always} of {len(rows)} targets met in all {len(runs)} runs")
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("records", nargs="+", help="one families-records.jsonl per run")
    p.add_argument("--all", action="store_true", help="list the targets met in every run too")
    args = p.parse_args()
    runs = [[json.loads(line) for line in open(path)] for path in args.records]
    print("\n".join(lines(runs, args.all)))


if __name__ == "__main__":
    main()
