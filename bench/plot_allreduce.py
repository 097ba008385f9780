"""Draws the all-reduce records of a results file (bench/results/*.json, op
`allreduce` and `allreduce_rmsnorm`, from bench/gpu/bench_allreduce.py) as
a PNG: per-call time against the message size for every implementation,
graph-replayed (solid) and eager (dotted), with the targets marked; and the
fused all-reduce + RMSNorm against the all-reduce alone and unfused.

    python3 bench/plot_allreduce.py bench/results/<file>.json [out.png]

Needs matplotlib (not a dependency of symm: `pip install matplotlib`).
"""
import json
import sys

IMPLS = ("symm", "symm_one_shot", "symm_two_shot", "nccl", "torch_one_shot", "torch_two_shot")
NORM_IMPLS = ("symm", "comm_only", "unfused", "nccl_unfused")
# (bytes, us): the targets for symm's graph-replayed calls.
TARGETS = [(8 << 10, 4.0), (64 << 10, 5.0), (16 << 20, 55.0)]


def series(records, op, impl):
    pts = sorted((r["shape"], r["ms"] * 1e3) for r in records if r["op"] == op and r["impl"] == impl and "ms" in r)
    return [p[0] for p in pts], [p[1] for p in pts]


def main(path, png=None):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = json.load(open(path))
    records = data["records"]
    png = png or path.rsplit(".", 1)[0] + "-allreduce.png"
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(15, 6))
    for i, impl in enumerate(IMPLS):
        color = f"C{i}"
        for suffix, style in (("_graph", "-"), ("", ":")):
            shapes, us = series(records, "allreduce", impl + suffix)
            if shapes:
                ax.plot([s[0] for s in shapes], us, style, marker="o", ms=3, color=color, label=impl + suffix)
    for b, us in TARGETS:
        ax.plot([b], [us], "k*", ms=10)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("bytes per rank (bf16)")
    ax.set_ylabel("us per call (median, max over ranks)")
    ax.set_title(f"all-reduce, {data.get('device', '?')} x {data.get('world_size', '?')} ({data.get('commit', '')})")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    for hidden, marker in ((4096, "o"), (8192, "s")):
        for i, impl in enumerate(NORM_IMPLS):
            pts = sorted((r["shape"][0], r["ms"] * 1e3) for r in records
                         if r["op"] == "allreduce_rmsnorm" and r["impl"] == impl + "_graph" and r["shape"][1] == hidden)
            if pts:
                bx.plot([p[0] for p in pts], [p[1] for p in pts], "-", marker=marker, ms=3, color=f"C{i}",
                        label=f"{impl}_graph h={hidden}")
    bx.set_xscale("log", base=2)
    bx.set_xlabel("tokens")
    bx.set_ylabel("us per call (graph-replayed)")
    bx.set_title("all-reduce + RMSNorm (fused: symm; bar: comm_only + 1 us)")
    bx.grid(True, which="both", alpha=0.3)
    bx.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    print("chart:", png)


if __name__ == "__main__":
    main(*sys.argv[1:])
