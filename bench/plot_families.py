"""Draws bench_families.py's records as one PNG per family: each case's
implementations as bars of time over the case's reference (families.py:
the floor for ag_mm and mm_rs, the time to read the decode layer's weights
from HBM, NCCL's all-gather), `_graph` bars hatched and divided by the
reference replayed from graphs, with the issue's bars drawn across.

    python3 bench/plot_families.py FILE [OUT_PREFIX]

FILE is a results file (bench/results/*.json) or a families-records.jsonl;
the PNGs are OUT_PREFIX-<family>.png (by default FILE without its
extension, "-families" added where its name lacks it). Needs matplotlib (not a dependency of symm).
"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import families  # noqa: E402

# Lines across each family's chart: (value, what).
BARS = {
    "decode": [(1.0, "floor")],
    "decode_layer": [(families.LAYER_BAR, f"{families.LAYER_BAR} x weights read")],
    "small_allgather": [(1.0, "NCCL")],
}
DEFAULT_BARS = [(1.0, "floor"), (families.FLOOR_BAR, f"{families.FLOOR_BAR} x floor")]


def load(path):
    """(records, title) of a results file or a JSONL of records."""
    if path.endswith(".jsonl"):
        return [json.loads(line) for line in open(path) if line.strip()], os.path.basename(path)
    data = json.load(open(path))
    title = f"{data.get('device', '?')} x{data.get('device_count', '?')}, world {data.get('world_size', '?')}, " \
            f"commit {data.get('commit', '?')}, {data.get('date', '')}"
    return data["records"], title


def main(path, prefix=None):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records, title = load(path)
    if prefix is None:
        prefix = path.rsplit(".", 1)[0]
        prefix += "" if prefix.endswith("-families") else "-families"
    by_family = {}
    for case, row in families.ratios(records).items():
        by_family.setdefault(case[0], []).append((case, row))
    written = []
    for family, rows in by_family.items():
        impls = list(dict.fromkeys(i for _, row in rows for i in row))
        fig, ax = plt.subplots(figsize=(max(9, 1.5 * len(rows) + 4), 6))
        width = 0.8 / max(1, len(impls))
        for j, impl in enumerate(impls):
            xs = [i + (j - len(impls) / 2 + 0.5) * width for i in range(len(rows))]
            ys = [row.get(impl, float("nan")) for _, row in rows]
            ax.bar(xs, ys, width, label=impl, color=f"C{j % 10}", hatch="//" if impl.endswith("_graph") else None)
        for value, what in BARS.get(family, DEFAULT_BARS):
            ax.axhline(value, color="black", linestyle="--" if value != 1.0 else "-", linewidth=1, label=what)
        ax.set_xticks(range(len(rows)), [families.describe(case).replace(" ", "\n", 2) for case, _ in rows],
                      fontsize=7)
        values = [v for _, row in rows for v in row.values()]
        ax.set_ylim(max(0.0, min(values, default=1.0) - 0.15), min(4.0, max(values, default=2.0) + 0.1))
        kind = families.REFERENCE[rows[0][0][1]]
        ax.set_ylabel(f"time / {kind} (lower is better)")
        ax.set_title(f"{family}: {title}", fontsize=9)
        ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))
        fig.tight_layout()
        png = f"{prefix}-{family}.png"
        fig.savefig(png, dpi=100)
        plt.close(fig)
        written.append(png)
        print("chart:", png)
    return written


if __name__ == "__main__":
    main(*sys.argv[1:3])
