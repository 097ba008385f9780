"""Distribution of the ratios in repeated quick benchmark rounds.

Reads the records that `bench_ops.py --quick` rounds appended to one JSONL
file (each round's records.jsonl, concatenated in order) and prints, per
op and shape, the median, range and count at or under the target of:
symm's bound call over the floor (max of the matmul alone and the
communication alone), and symm's call replayed from CUDA graphs over the
matmul alone replayed (GPU time, no host issue time).
    python3 bench/gpu/rounds_summary.py records-all.jsonl [--target 1.05]
"""
import argparse
import json
import statistics
from collections import defaultdict


def rounds(path):
    """Yields {(op, shape): {impl: ms}} per round: a round ends where an
    (op, shape, impl) seen in it comes again."""
    current = defaultdict(dict)
    for line in open(path):
        r = json.loads(line)
        key = (r["op"], "x".join(map(str, r["shape"])))
        if r["impl"] in current[key]:
            yield current
            current = defaultdict(dict)
        current[key][r["impl"]] = r["ms"]
    if current:
        yield current


def main():
    p = argparse.ArgumentParser()
    p.add_argument("records")
    p.add_argument("--target", type=float, default=1.05)
    args = p.parse_args()
    ratios = defaultdict(lambda: defaultdict(list))
    for rnd in rounds(args.records):
        for key, t in rnd.items():
            if "symm_bound" in t and "mm_only" in t:
                floor = max(t["mm_only"], t.get("comm_only", 0))
                ratios[key]["bound / floor"].append(t["symm_bound"] / floor)
            if "symm_graph" in t and "mm_only_graph" in t:
                ratios[key]["replayed / matmul replayed"].append(t["symm_graph"] / t["mm_only_graph"])
    for (op, shape), by_kind in ratios.items():
        for kind, xs in by_kind.items():
            ok = sum(x <= args.target for x in xs)
            print(f"{op} {shape} {kind}: n {len(xs)}, median {statistics.median(xs):.3f}, "
                  f"min {min(xs):.3f}, max {max(xs):.3f}, <= {args.target}: {ok} of {len(xs)}")


if __name__ == "__main__":
    main()
