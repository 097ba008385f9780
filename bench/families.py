"""The families of shapes (shapes a user runs beyond
bench_ops.py's eight), their targets, and the table of a run's records.
Standard library only: bench_families.py times these cases on GPUs, and
python/tests/test_bench_families.py and plot_families.py read them anywhere.

A case's dimensions are the model's, unsharded: tensor parallelism over
`world` ranks divides N of the column-parallel ag_mm, K of the row-parallel
mm_rs and the FFN size of the decode layer (`per_rank`). Records name the
per-rank shape as DESIGN.md's format does: ag_mm [M gathered rows, K, N of
each rank's B], mm_rs [M rows of A per rank, K per rank, N]. A `batch` > 1
makes A [batch, M / batch, K], gathered or scattered along dim 1 (sequence
parallelism); fp8 cases multiply by tensor-wise or row-wise `scales` and
write bf16.
"""
from collections import namedtuple

Case = namedtuple("Case", "op m k n dtype batch scales", defaults=("bf16", 1, None))

FAMILIES = {
    # The gather (reduce-scatter) takes 40-90% of the matmul's time on H200s:
    # large M with small N for ag_mm; for mm_rs, small K per rank.
    "comm_heavy": [
        Case("ag_mm", 16384, 4096, 2048), Case("ag_mm", 8192, 8192, 4096, "f16"), Case("ag_mm", 12000, 4096, 3072),
        Case("mm_rs", 4096, 4096, 8192), Case("mm_rs", 2048, 3072, 8192, "f16"), Case("mm_rs", 3000, 2048, 8192),
    ],
    # [batch, seq, hidden] along the sequence: Llama-8B-like layers.
    "seq3d": [
        Case("ag_mm", 8192, 4096, 14336, batch=4), Case("ag_mm", 8000, 8192, 8192, "f16", batch=2),
        Case("ag_mm", 8192, 4096, 4096, batch=8),
        Case("mm_rs", 8192, 14336, 4096, batch=4), Case("mm_rs", 8000, 8192, 8192, "f16", batch=2),
        Case("mm_rs", 8192, 4096, 4096, batch=8),
    ],
    # M = 512, ordinary (not symmetric) outputs.
    "m512": [
        Case("ag_mm", 512, 4096, 14336), Case("ag_mm", 512, 8192, 28672, "f16"), Case("ag_mm", 512, 8192, 8192),
        Case("mm_rs", 512, 14336, 4096), Case("mm_rs", 512, 28672, 8192, "f16"), Case("mm_rs", 512, 8192, 8192),
    ],
    # Decode steps of a Llama-70B-like MLP (hidden 8192, FFN 28672).
    "decode": [Case("ag_mm", m, 8192, 28672) for m in (16, 64, 128, 256)] + [Case("ag_mm", 64, 8192, 28672, "f16")]
    + [Case("mm_rs", m, 28672, 8192) for m in (16, 64, 128, 256)] + [Case("mm_rs", 64, 28672, 8192, "f16")],
    # ag_mm then mm_rs: k is the hidden size, n the FFN size.
    "decode_layer": [Case("decode_layer", m, 8192, 28672) for m in (64, 16, 256)],
    # op lc_allgather: m is the bytes per rank.
    "small_allgather": [Case("lc_allgather", kb << 10, 0, 0) for kb in (64, 256, 1024, 4096, 16384, 65536)],
    "fp8": [
        Case("ag_mm", m, k, n, "fp8_e4m3", 1, s)
        for s in ("tensor", "row") for m, k, n in ((2000, 8192, 28672), (8192, 8192, 14336), (64, 8192, 28672))
    ] + [
        Case("mm_rs", m, k, n, "fp8_e4m3", 1, s)
        for s in ("row", "tensor") for m, k, n in ((2000, 28672, 8192), (8192, 14336, 8192), (64, 28672, 8192))
    ] + [
        # Comm-heavy (2048 of K per rank at world 2): the fused kernel, as
        # for 16-bit calls, despite its exact accumulation's cost.
        Case("mm_rs", 4096, 4096, 8192, "fp8_e4m3", 1, "tensor"),
    ],
}

# Dimensions of transformer layers a user runs (Llama, Mistral, Qwen,
# DeepSeek-like): hidden sizes; FFN sizes, of one projection or of gate
# and up together; and the Q, K, V projection's width at each hidden size.
HIDDEN = (2048, 2560, 3072, 4096, 5120, 6144, 7168, 8192)
FFN = (5632, 8192, 11008, 13824, 14336, 18944, 22016, 28672, 29568)
QKV = {h: h + 2 * max(h // 8, 256) for h in HIDDEN}
# A drawn matmul's work per rank at most (2 * M * K * N flop): ~2.5 ms on
# an H200, so that a case's every implementation times in seconds.
DRAWN_MAX_FLOP = 2e12


def drawn(seed, count, world=2):
    """`count` cases drawn from `seed` as a user's layers would run them,
    beside the fixed families: ag_mm onto the FFN or the Q, K, V
    projection, mm_rs out of the FFN or the attention's output projection;
    tokens M log-uniform from 16 to 16384 (about a third at decode sizes,
    M <= 256; any multiple of the ranks, rarely of 128); bf16 or f16; a
    fifth of those above 1024 tokens as [batch, seq, hidden] along the
    sequence. The same seed draws the same cases (standard library only)."""
    import math
    import random

    rng = random.Random(seed)
    cases = []
    while len(cases) < count:
        op, hidden = rng.choice(("ag_mm", "mm_rs")), rng.choice(HIDDEN)
        if op == "ag_mm":
            k, n = hidden, rng.choice(FFN) if rng.random() < 0.7 else QKV[hidden]
        else:
            k, n = rng.choice(FFN) if rng.random() < 0.7 else hidden, hidden
        tokens = math.exp(rng.uniform(math.log(16), math.log(16384)))
        batch = rng.choice((2, 4, 8)) if tokens > 1024 and rng.random() < 0.2 else 1
        unit = batch * world
        m = max(unit, round(tokens / unit) * unit)
        dtype = "f16" if rng.random() < 0.2 else "bf16"
        case = Case(op, m, k, n, dtype, batch)
        mm, kk, nn = per_rank(case, world)
        if nn % 8 or kk % 8 or 2 * mm * kk * nn > DRAWN_MAX_FLOP:
            continue
        cases.append(case)
    return cases


def parse_case(text):
    """A case named on the command line: `op:MxKxN[:dtype][:bBATCH]` in
    the model's unsharded dimensions (as `Case`), e.g. `mm_rs:62x4096x4096`
    or `ag_mm:8192x4096x14336:f16:b4`."""
    op, dims, *rest = text.split(":")
    m, k, n = (int(x) for x in dims.split("x"))
    dtype = next((r for r in rest if not r.startswith("b")), "bf16")
    batch = next((int(r[1:]) for r in rest if r.startswith("b")), 1)
    if op not in ("ag_mm", "mm_rs") or dtype not in ("bf16", "f16"):
        raise ValueError(f"{text!r}: expected op:MxKxN[:dtype][:bBATCH], op ag_mm or mm_rs, dtype bf16 or f16")
    return Case(op, m, k, n, dtype, batch)


# The targets (world 2): the plain eager call at most 1.05 x the
# floor from M = 512 up; at M <= 256 no slower than NCCL-then-cuBLAS or
# PyTorch's fused op, eager and graph-replayed; fp8 faster than PyTorch's
# scaled fused ops; the graph-replayed decode layer within 1.15 x the time
# to read its weights from HBM; lc_allgather at least as fast as NCCL,
# staged or in place. (At M = 256 the layer's matmuls are compute-bound:
# 2 x 256 x 8192 x 14336 x 2 = 120 GFLOP per rank would take 0.12 ms even
# at an H200's 989 TFLOP/s peak, 1.09 x its weights' read of 0.11 ms, and
# cuBLAS's two matmuls alone take 1.6 x: the bar is out of reach there.)
FLOOR_BAR, LAYER_BAR = 1.05, 1.15
# What a case's times are divided by in the table and the charts (`_graph`
# implementations by the same replayed, where timed).
REFERENCE = {"ag_mm": "floor", "mm_rs": "floor", "decode_layer": "weights_read", "lc_allgather": "nccl"}
IMPLS = {
    "mm_rs": ("symm", "symm_bound", "symm_graph", "torch_fused", "torch_fused_graph", "nccl_cublas",
              "nccl_cublas_graph"),
    "decode_layer": ("symm", "symm_bound", "symm_graph", "torch_fused", "torch_fused_graph", "nccl_cublas",
                     "nccl_cublas_graph", "mm_only", "mm_only_graph"),
    "lc_allgather": ("symm", "symm_bound", "symm_inplace", "symm_graph", "symm_inplace_graph", "torch_lc"),
}
# ag_mm also with the shard already in symmetric memory (pulled in place).
IMPLS["ag_mm"] = IMPLS["mm_rs"] + ("symm_symmetric_in", "symm_symmetric_in_graph")


def per_rank(case, world):
    """The case's record shape at `world` ranks (see the module's doc)."""
    if case.op == "ag_mm":
        return [case.m, case.k, case.n // world]
    if case.op == "mm_rs":
        return [case.m, case.k // world, case.n]
    if case.op == "decode_layer":
        return [case.m, case.k, case.n // world]
    return [case.m]


def quick(cases):
    """--quick: the first case of each op."""
    seen = set()
    return [c for c in cases if not (c.op in seen or seen.add(c.op))]


def labels(r):
    """What tells a record's case apart from another of the same op and shape."""
    return tuple(r.get(f) for f in ("family", "dtype", "batch", "scales"))


def case_times(records):
    """{(family, op, shape, dtype, batch, scales): {impl: ms}} of the records
    that name a family."""
    cases = {}
    for r in records:
        if "family" in r and "ms" in r:
            family, dtype, batch, scales = labels(r)
            cases.setdefault((family, r["op"], tuple(r["shape"]), dtype, batch, scales), {})[r["impl"]] = r["ms"]
    return cases


def reference(op, t, graph):
    """The time a case's implementations are divided by (None where not
    timed): the floor, max(matmul alone, communication alone), replayed for
    `_graph` implementations where both halves were; the time to read the
    decode layer's weights; NCCL's all-gather (its replay for `_graph`)."""
    kind = REFERENCE[op]
    if kind == "floor":
        suffix = "_graph" if graph and "mm_only_graph" in t and "comm_only_graph" in t else ""
        halves = [t.get("mm_only" + suffix), t.get("comm_only" + suffix)]
        return max(halves) if None not in halves else None
    if kind == "nccl" and graph:
        return t.get("nccl_graph")
    return t.get(kind)


def ratios(records):
    """{case: {impl: ms / reference}} for IMPLS[op] (see `reference`), the
    cases in order of op, fp8 scales, dtype and shape."""
    out = {}
    order = lambda kv: (kv[0][1], kv[0][5] or "", kv[0][3] or "", kv[0][2])
    for case, t in sorted(case_times(records).items(), key=order):
        op = case[1]
        if op not in REFERENCE:  # hbm_copy: the decode layer's reference only
            continue
        row = {}
        for impl in IMPLS.get(op, ()):
            ref = reference(op, t, impl.endswith("_graph"))
            if impl in t and ref:
                row[impl] = t[impl] / ref
        out[case] = row
    return out


def verdicts(records):
    """[(case, target, value, bar, met)] of every target of the issue that a
    case's records allow to judge: met where value <= bar (value < bar
    where the target says faster)."""
    out = []
    for case, t in case_times(records).items():
        family, op, shape = case[:3]

        def vs(a, b, bar=1.0, name=None, strict=False):
            if t.get(a) and t.get(b):
                value = t[a] / t[b]
                out.append((case, name or f"{a} <= {b}", value, bar, value < bar if strict else value <= bar))

        if op in ("ag_mm", "mm_rs"):
            floor = reference(op, t, False)
            if shape[0] >= 512 and floor and "symm" in t:
                value = t["symm"] / floor
                out.append((case, f"symm <= {FLOOR_BAR} x floor", value, FLOOR_BAR, value <= FLOOR_BAR))
            if shape[0] <= 256:
                for mine, theirs in (("symm", "nccl_cublas"), ("symm", "torch_fused"),
                                     ("symm_graph", "nccl_cublas_graph"), ("symm_graph", "torch_fused_graph")):
                    vs(mine, theirs)
            if family == "fp8":
                vs("symm", "torch_fused", name="symm < torch_fused", strict=True)
        elif op == "decode_layer":
            vs("symm_graph", "weights_read", LAYER_BAR, f"symm_graph <= {LAYER_BAR} x weights_read")
        elif op == "lc_allgather":
            vs("symm", "nccl")
            vs("symm_inplace", "nccl")
    return out


def describe(case):
    family, op, shape, dtype, batch, scales = case
    what = "x".join(map(str, shape))
    if op == "lc_allgather":
        what = f"{shape[0] >> 20} MB/rank" if shape[0] >> 20 else f"{shape[0] >> 10} KB/rank"
    extra = "".join(f" {x}" for x in (dtype, f"batch {batch}" if batch else None, scales and f"{scales}-wise") if x)
    return f"{op} {what}{extra}"


def table(records):
    """The lines of the printed summary: per family, each case's reference
    (ms) and every implementation's time over it; then the targets."""
    lines = []
    by_family = {}
    for case, row in ratios(records).items():
        by_family.setdefault(case[0], []).append((case, row))
    t = case_times(records)
    for family, rows in by_family.items():
        impls = list(dict.fromkeys(i for _, row in rows for i in row))
        kind = REFERENCE[rows[0][0][1]]
        lines.append(f"\n{family}: time / {kind} (`_graph`: / the {kind} replayed from graphs, where timed)")
        widths = [max(8, len(i) + 2) for i in impls]
        lines.append(f"{'case':<46}{'ref ms':>9}" + "".join(f"{i:>{w}}" for i, w in zip(impls, widths)))
        for case, row in rows:
            ref = reference(case[1], t[case], False) or float("nan")
            lines.append(f"{describe(case):<46}{ref:9.4f}"
                         + "".join(f"{row.get(i, float('nan')):{w}.3f}" for i, w in zip(impls, widths)))
    judged = verdicts(records)
    missed = [v for v in judged if not v[4]]
    lines.append(f"\ntargets: {len(judged) - len(missed)} of {len(judged)} met")
    for case, target, value, bar, _ in missed:
        lines.append(f"  MISSED {case[0]}: {describe(case)}: {target}: {value:.3f} (bar {bar})")
    return lines
