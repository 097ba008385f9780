"""The fused operations on every family of shapes (bench/families.py),
every implementation of a case in one run.

Launch on the GPU machine with one process per GPU (`bench/gpu/checks.sh
families` does):
    torchrun --nproc-per-node 2 bench/bench_families.py --out DIR [--quick] [--only FAMILIES]
        [--drawn N [--seed S]] [--case op:MxKxN[:dtype][:bBATCH] ...]

Timed as bench_ops.py times (its Bench: CUDA events, the median of --iters
after --warmup in round-robin rounds, the maximum over ranks), every symm
result first checked against NCCL-then-cuBLAS (relative error). Per case:
`symm`, the plain eager call as a user makes it (symm.fused_ag_mm /
symm.mm_rs on ordinary tensors); `symm_bound` (symm.bind); `torch_fused`
(torch.ops.symm_mem's fused op); `nccl_cublas`; `mm_only` and `comm_only`
(the floor is their max); each but the bound call replayed from CUDA
graphs too (`_graph`). The families:
- comm_heavy, seq3d (A [batch, seq, hidden] along dim 1), m512, decode:
  ag_mm and mm_rs in bf16 and f16 (bench_ops.ag_mm_case / mm_rs_case);
- fp8: e4m3 inputs, bf16 outputs, tensor-wise or row-wise scales, against
  torch's fused_all_gather_scaled_matmul / fused_scaled_matmul_reduce_scatter
  and NCCL then torch._scaled_mm;
- decode_layer: ag_mm then mm_rs (op `decode_layer`, shape [M, hidden, FFN
  per rank]), against `weights_read`, the time to read both weights from
  HBM at the bandwidth of a large device copy measured in the same run (op
  `hbm_copy`, `GBps` counting the bytes read and written);
- small_allgather: lc_allgather staged and in place against NCCL's
  all-gather and torch's low-contention one (bench_ops.bench_lc_allgather);
- given (`--case op:MxKxN[:dtype][:bBATCH]`, repeated): cases named on the
  command line;
- drawn (`--drawn N`): N ag_mm and mm_rs cases drawn at random from the
  layer sizes users run (families.drawn; the seed is printed, `--seed`
  draws the same again), judged by the same targets: shapes nobody chose.

Records (DESIGN.md's fields, `family` added; `batch` for 3-D activations,
`scales` for fp8) go to DIR/families-records.jsonl (beside bench_ops.py's
records.jsonl) and to stdout for collect.py; then a table of ratios and the
issue's targets met or missed (families.table). plot_families.py draws a
PNG per family.
"""
import argparse
import faulthandler
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import families  # noqa: E402  (standard library only)
from bench_ops import (  # noqa: E402  (checks the multicast environment first)
    ALGOS, BARRIERS, Bench, ag_mm_case, bench_lc_allgather, graphed, linear_weight, mm_rs_case, rel_err,
    symm_algorithms, time_matmul_op, torch_fused_checked,
)

import symm  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "f16": torch.float16}
# symm's own choice, plain and bound (--forced adds each algorithm forced).
PLAIN_AND_BOUND = (None, "bound")
HBM_COPY_BYTES = 2 << 30


def stream():
    return torch.cuda.current_stream().cuda_stream


def scaled_case(b, g, op, m, k, n, scales, algos, **extra):
    """fp8 (e4m3) ag_mm or mm_rs at the per-rank M x K x N with bf16
    outputs and `scales` ("tensor" or "row") scales."""
    # Registers torch.ops.symm_mem's fused ops (the other cases import it too).
    import torch.distributed._symmetric_memory as symm_mem

    symm_mem.enable_symm_mem_for_group(b.group_name)
    fp8, bf16, name, row = torch.float8_e4m3fn, torch.bfloat16, b.group_name, scales == "row"
    rows = m // b.world if op == "ag_mm" else m
    a = (torch.rand(rows, k, device="cuda") * 2 - 1).to(fp8)
    w = (torch.rand(n, k, device="cuda") * 2 - 1).to(fp8).t()  # column-major, as torch._scaled_mm wants B
    # A tensor-wise A scale scales the whole gathered A: the same on every rank.
    sa = torch.rand(rows, 1, device="cuda") + 0.5 if row else torch.full((1,), 0.75, device="cuda")
    sb = torch.rand(1, n, device="cuda") + 0.5 if row else torch.full((1,), 1.25, device="cuda")
    if op == "ag_mm":
        gathered = torch.empty(m, k, device="cuda", dtype=fp8)
        sa_all = torch.empty(m, 1, device="cuda") if row else sa
        out = torch.empty(m, n, device="cuda", dtype=bf16)
        ref = torch.empty_like(out)

        def comm():
            dist.all_gather_into_tensor(gathered.view(torch.uint8), a.view(torch.uint8))
            if row:
                dist.all_gather_into_tensor(sa_all, sa)

        mm = lambda: torch._scaled_mm(gathered, w, sa_all, sb, out_dtype=bf16, out=ref)
        symm_op, symm_args = symm.fused_ag_mm, dict(bs=[w], gather_dim=0, out=[out], a_scale=sa, b_scales=[sb])
        torch_fused = lambda: torch.ops.symm_mem.fused_all_gather_scaled_matmul(
            a, [w], sa, [sb], 0, name, [None], [None], [bf16], [False])
        torch_out = lambda: torch_fused()[1][0]
    else:
        c = torch.empty(m, n, device="cuda", dtype=bf16)
        out = torch.empty(m // b.world, n, device="cuda", dtype=bf16)
        ref = torch.empty_like(out)
        mm = lambda: torch._scaled_mm(a, w, sa, sb, out_dtype=bf16, out=c)
        comm = lambda: dist.reduce_scatter_tensor(ref, c)
        symm_op, symm_args = symm.mm_rs, dict(b=w, scatter_dim=0, out=out, a_scale=sa, b_scale=sb)
        torch_fused = torch_out = lambda: torch.ops.symm_mem.fused_scaled_matmul_reduce_scatter(
            a, w, sa, sb, "sum", 0, 0, name, [m, n], out_dtype=bf16)

    def ours(algorithm=None):
        # As a user calls it: no stream given, symm takes torch's current one.
        symm_op(g, a, **symm_args, algorithm=algorithm)

    def bind(algorithm):
        return symm.bind(symm_op, g, a, **symm_args, stream=stream(), algorithm=algorithm)

    def nccl_cublas():
        if op == "ag_mm":
            comm()
            mm()
        else:
            mm()
            comm()

    nccl_cublas()
    shape = (m, k, n)
    torch_err = torch_fused_checked(op, shape, torch_out, ref, 2e-2)
    fns, errs = symm_algorithms(op, shape, ours, bind, out, ref, 2e-2, algos)
    errs["torch_fused"] = torch_err
    others = {"torch_fused": torch_fused, "nccl_cublas": nccl_cublas, "mm_only": mm, "comm_only": comm}
    fns.update(others)
    time_matmul_op(b, op, shape, fns, errs, out, ref, 2e-2, {**graphed(fns, ours), **others},
                   dtype="fp8_e4m3", scales=scales, **extra)


def hbm_copy_gbps(b, **extra):
    """The GPU's memory bandwidth, bytes read and written per second of a
    large device copy (the slowest rank's), recorded as op `hbm_copy`."""
    src = torch.ones(HBM_COPY_BYTES // 2, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    ms = b.contest({"torch_copy": lambda: dst.copy_(src)})["torch_copy"]
    gbps = 2 * HBM_COPY_BYTES / (ms * 1e6)
    b.record("hbm_copy", (HBM_COPY_BYTES,), "torch_copy", ms, GBps=round(gbps, 1), **extra)
    return gbps


def decode_layer(b, g, m, hidden, ffn, gbps, **extra):
    """x [M / world, hidden] gathered and multiplied by W1 [hidden, ffn],
    then multiplied by W2 [ffn, hidden] and reduce-scattered (ffn per rank),
    bf16, ordinary tensors; `weights_read` is W1's and W2's bytes at `gbps`."""
    bf16, name = torch.bfloat16, b.group_name
    x = torch.randn(m // b.world, hidden, device="cuda", dtype=bf16)
    w1, w2 = linear_weight(hidden, ffn), linear_weight(ffn, hidden)
    h = torch.empty(m, ffn, device="cuda", dtype=bf16)
    out = torch.empty(m // b.world, hidden, device="cuda", dtype=bf16)
    gathered, h_ref = torch.empty(m, hidden, device="cuda", dtype=bf16), torch.empty_like(h)
    c, ref = torch.empty(m, hidden, device="cuda", dtype=bf16), torch.empty_like(out)

    def ours():
        symm.fused_ag_mm(g, x, [w1], 0, out=[h])
        symm.mm_rs(g, h, w2, 0, out=out)

    up, down = symm.bind(symm.fused_ag_mm, g, x, [w1], 0, out=[h]), symm.bind(symm.mm_rs, g, h, w2, 0, out=out)

    def mm_only():
        torch.matmul(gathered, w1, out=h_ref)
        torch.matmul(h_ref, w2, out=c)

    def nccl_cublas():
        dist.all_gather_into_tensor(gathered, x)
        mm_only()
        dist.reduce_scatter_tensor(ref, c)

    def torch_fused():
        _, (hidden_act,) = torch.ops.symm_mem.fused_all_gather_matmul(x, [w1], 0, name)
        return torch.ops.symm_mem.fused_matmul_reduce_scatter(hidden_act, w2, "sum", 0, name)

    nccl_cublas()
    shape = (m, hidden, ffn)
    errs = {"torch_fused": torch_fused_checked("decode_layer", shape, torch_fused, ref, 2e-2)}
    fns = {"symm": ours, "symm_bound": lambda: (up(), down())}
    for impl in fns:
        for attempt in ("eager", "replayed"):
            out.fill_(float("nan"))
            fns[impl]()
            errs[impl] = max(errs.get(impl, 0.0), rel_err(out, ref))
            assert errs[impl] < 2e-2, f"decode_layer {shape} ({impl}, {attempt}): relative error {errs[impl]}"
    others = {"torch_fused": torch_fused, "nccl_cublas": nccl_cublas, "mm_only": mm_only}
    fns.update(others)
    time_matmul_op(b, "decode_layer", shape, fns, errs, out, ref, 2e-2, {"symm": ours, **others}, **extra)
    nbytes = (w1.numel() + w2.numel()) * 2
    b.record("decode_layer", shape, "weights_read", nbytes / (gbps * 1e6), bytes=nbytes, **extra)


def run_case(b, g, family, case, args, state):
    shape = families.per_rank(case, b.world)
    algos = ALGOS if args.forced else PLAIN_AND_BOUND
    if case.op == "lc_allgather":
        bench_lc_allgather(b, g, shape, graphs=True, family=family)
    elif case.op == "decode_layer":
        if "gbps" not in state:
            state["gbps"] = hbm_copy_gbps(b, family=family)
        decode_layer(b, g, *shape, state["gbps"], family=family)
    elif case.dtype.startswith("fp8"):
        scaled_case(b, g, case.op, *shape, case.scales, algos, family=family)
    else:
        extra = {"family": family, **({"batch": case.batch} if case.batch > 1 else {})}
        kw = {"dtype": DTYPES[case.dtype], "batch": case.batch, "algos": algos, **extra}
        if case.op == "ag_mm":
            ag_mm_case(b, g, *shape, **kw)
        else:
            mm_rs_case(b, g, *shape, args.mm_rs_out == "symmetric", **kw)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--quick", action="store_true", help="one case per op of each family, for a smoke test")
    p.add_argument("--only", help="families, comma-separated (default: all, or none with --drawn)")
    p.add_argument("--drawn", type=int, default=0,
                   help="also time this many cases drawn at random (families.drawn), as family `drawn`")
    p.add_argument("--seed", type=int, help="the drawn cases' seed (default: from the clock, printed)")
    p.add_argument("--case", action="append", type=families.parse_case, default=[],
                   help="also time this case (op:MxKxN[:dtype][:bBATCH], model dimensions), as family `given`")
    p.add_argument("--graph-max-m", type=int, default=1 << 30,
                   help="replay from CUDA graphs the matmul cases up to this M (0: none)")
    p.add_argument("--mm-rs-out", choices=("symmetric", "ordinary"), default="ordinary",
                   help="where symm's mm_rs output lies (ordinary: as a user's tensor)")
    p.add_argument("--forced", action="store_true", help="also time each of symm's algorithms forced")
    p.add_argument("--barrier", choices=BARRIERS, default="default", help="what aligns the ranks before each timed run")
    args = p.parse_args()
    only = args.only.split(",") if args.only else [] if args.drawn or args.case else list(families.FAMILIES)
    unknown = set(only) - set(families.FAMILIES)
    assert not unknown, f"unknown families {sorted(unknown)}; expected some of {list(families.FAMILIES)}"
    runs = [(family, families.FAMILIES[family]) for family in only] + ([("given", args.case)] if args.case else [])
    if os.environ.get("SYMM_BENCH_WATCHDOG_S"):
        faulthandler.dump_traceback_later(float(os.environ["SYMM_BENCH_WATCHDOG_S"]), exit=False)
    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    b = Bench(args)
    torch.manual_seed(2468 + b.rank)
    g = symm.Group.from_env(backend="cuda", timeout_ms=60000)
    if args.drawn:
        # Every rank draws the same cases: from rank 0's seed.
        seed = torch.tensor([args.seed if args.seed is not None else time.time_ns() % (1 << 31)], device="cuda")
        dist.broadcast(seed, 0)
        runs.append(("drawn", families.drawn(int(seed[0]), args.drawn)))
        if b.rank == 0:
            print(f"families: {args.drawn} cases drawn with --seed {int(seed[0])}:", flush=True)
            print("\n".join(f"  {c}" for c in runs[-1][1]), flush=True)
    state, failed = {}, []
    for family, cases in runs:
        for case in families.quick(cases) if args.quick else cases:
            try:
                run_case(b, g, family, case, args, state)
            except (symm.SymmError, RuntimeError, ValueError, TypeError) as e:
                # Refused alike on every rank (by symm, or by PyTorch's
                # fused op: shapes and dtypes are the same everywhere): the
                # run goes on without the case. A wrong result
                # (AssertionError) stops the run.
                failed.append(f"{family} {case}: {type(e).__name__}: {e}")
                print(f"rank {b.rank}: families: FAILED {failed[-1]}", flush=True)
                torch.cuda.synchronize()
                dist.barrier()
    g.check_async_error()
    if b.rank == 0:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "families-records.jsonl"), "w") as f:
            for r in b.records:
                f.write(json.dumps(r) + "\n")
        print("\n".join(families.table(b.records)))
        print("\n".join(f"FAILED {f}" for f in failed))
    g.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
