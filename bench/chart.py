"""Draws a results file of bench_ops.py (bench/results/*.json) as a PNG:
for each fused-op shape, every implementation's time as a ratio to the
floor (max of the matmul alone and NCCL's communication alone, both from
the same run), with the 1.05 and 1.10 targets marked; and lc_allgather's
times against NCCL's per size. The `_graph` implementations (CUDA graph
replays, timed for small M, where host issue time dominates) are drawn
against the floor of the matmul replayed from a graph too.

    python3 bench/chart.py bench/results/<file>.json [out.png]

Needs matplotlib (not a dependency of symm: `pip install matplotlib`).
"""
import json
import sys

IMPLS = ("symm", "symm_bound", "symm_sequential", "symm_pipelined", "symm_fused", "torch_fused", "nccl_cublas",
         "symm_graph", "torch_fused_graph", "nccl_cublas_graph")
LC_IMPLS = ("symm", "symm_inplace", "nccl", "torch_lc")


def ratios(records):
    """{(op, shape): {impl: ms / floor}} for ag_mm and mm_rs."""
    by_case = {}
    for r in records:
        if r["op"] in ("ag_mm", "mm_rs") and "ms" in r and "family" not in r:  # families: plot_families.py
            by_case.setdefault((r["op"], tuple(r["shape"])), {})[r["impl"]] = r["ms"]
    out = {}
    for case, t in by_case.items():
        floor = max(t.get("mm_only", 0), t.get("comm_only", 0))
        graph_floor = max(t.get("mm_only_graph", 0), t.get("comm_only", 0))
        if floor > 0:
            out[case] = {i: t[i] / (graph_floor if i.endswith("_graph") else floor)
                         for i in IMPLS if i in t and (graph_floor > 0 or not i.endswith("_graph"))}
    return out


def main(path, png=None):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    result = json.load(open(path))
    png = png or path.rsplit(".", 1)[0] + ".png"
    cases = ratios(result["records"])
    lc = {}
    for r in result["records"]:
        if r["op"] == "lc_allgather" and "ms" in r and "family" not in r:
            lc.setdefault(r["shape"][0] >> 20, {})[r["impl"]] = r["ms"]

    fig, (ax, ax_lc) = plt.subplots(1, 2, figsize=(16, 6), gridspec_kw={"width_ratios": [3, 1]})
    labels = [f"{op}\n{'x'.join(map(str, shape))}" for op, shape in cases]
    width = 0.8 / len(IMPLS)
    for j, impl in enumerate(IMPLS):
        xs = [i + (j - len(IMPLS) / 2 + 0.5) * width for i in range(len(cases))]
        ys = [t.get(impl, float("nan")) for t in cases.values()]
        ax.bar(xs, ys, width, label=impl, hatch="//" if impl.endswith("_graph") else None)
    for target, style in ((1.05, "--"), (1.10, ":")):
        ax.axhline(target, color="black", linestyle=style, linewidth=1, label=f"{target:.2f} x floor")
    ax.axhline(1.0, color="gray", linewidth=0.8)
    ax.set_xticks(range(len(cases)), labels, fontsize=8)
    ax.set_ylabel("time / floor (lower is better)")
    values = [v for t in cases.values() for v in t.values()]
    ax.set_ylim(min(0.8, min(values, default=1.0) - 0.05), min(3.0, max(values, default=2.0) + 0.1))
    ax.legend(fontsize=8, ncol=2)
    ax.set_title(f"{result['device']} x{result['device_count']}, world {result['world_size']}, "
                 f"commit {result['commit']}, {result['date']}")

    sizes = sorted(lc)
    width = 0.8 / len(LC_IMPLS)
    for j, impl in enumerate(LC_IMPLS):
        xs = [i + (j - len(LC_IMPLS) / 2 + 0.5) * width for i in range(len(sizes))]
        ax_lc.bar(xs, [lc[s].get(impl, float("nan")) for s in sizes], width, label=impl)
    ax_lc.set_xticks(range(len(sizes)), [f"{s} MB" for s in sizes])
    ax_lc.set_yscale("log")
    ax_lc.set_ylabel("lc_allgather ms per call (log)")
    ax_lc.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    print("chart:", png)


if __name__ == "__main__":
    main(*sys.argv[1:3])
