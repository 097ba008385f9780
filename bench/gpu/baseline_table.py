"""The `baseline` check's comparison: symm's timings (every `symm*` record
of bench_ops.py or bench_families.py) of the baseline and of this tree, each the median over
the rounds, and their ratio (head / base), with each side's range. With
--all, every implementation's (for an A/B of the benchmark itself, e.g.
its --barrier, where the references' times are the question).

    python3 bench/gpu/baseline_table.py DIR [--all]   (DIR holds base-<i>/ and head-<i>/)
"""
import collections
import glob
import json
import os
import statistics
import sys


def load(dir, side, every=False):
    times = collections.defaultdict(list)
    for path in sorted(glob.glob(os.path.join(dir, f"{side}-*", "*records.jsonl"))):
        for line in open(path):
            r = json.loads(line)
            if (every or r.get("impl", "").startswith("symm")) and "ms" in r:
                times[(r["op"], tuple(r.get("shape", [])), r.get("dtype"), r["impl"])].append(r["ms"])
    return times


def main(dir, every=False):
    base, head = load(dir, "base", every), load(dir, "head", every)
    print(f"{'op':13s} {'shape':22s} {'impl':22s} {'base ms':>8s} {'range':>15s} {'head ms':>8s} {'range':>15s} head/base")
    ratios = []
    for k in sorted(set(base) & set(head)):
        b, h = statistics.median(base[k]), statistics.median(head[k])
        ratios.append(h / b)
        print(f"{k[0]:13s} {str(list(k[1])):22s} {k[3]:22s} {b:8.4f} {min(base[k]):7.4f}-{max(base[k]):7.4f} "
              f"{h:8.4f} {min(head[k]):7.4f}-{max(head[k]):7.4f} {h / b:8.3f}")
    if ratios:
        print(f"{len(ratios)} timings: head/base {min(ratios):.3f}-{max(ratios):.3f}, median {statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main(sys.argv[1], "--all" in sys.argv[2:])
