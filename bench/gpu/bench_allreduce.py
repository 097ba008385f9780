"""symm's all-reduce beside NCCL's and PyTorch's symmetric-memory one-shot
and two-shot, in one run; and the fused all-reduce + RMSNorm beside the
all-reduce followed by torch's RMSNorm.

Launch on the GPU machine with one process per GPU:
    torchrun --nproc-per-node 2 bench/gpu/bench_allreduce.py --out DIR [--quick]

Sizes 4 KB to 256 MB per rank, bf16. Every implementation is checked
against NCCL's result first, then timed two ways, in round-robin contests
(bench_ops.Bench: median of --iters samples, maximum over ranks):
eager (one call per sample; `_bound` for symm's pre-bound call) and
replayed from a CUDA graph of GRAPH_REPS calls (`_graph`: per-call time, the
host's issue time left out, as an inference engine's captured decode step).

Implementations (DESIGN.md's `impl` names): `symm` (the cost model's
choice), `symm_one_shot` and `symm_two_shot` (forced), `nccl`
(dist.all_reduce), `torch_one_shot` (torch.ops.symm_mem.one_shot_all_reduce)
and `torch_two_shot` (two_shot_all_reduce_, in place), their inputs in
PyTorch's symmetric memory. op `allreduce`, shape `[bytes_per_rank]`.

The fused form (op `allreduce_rmsnorm`, shape `[tokens, hidden]`, hidden
4096 and 8192, 1 to 512 tokens): `symm` (symm.all_reduce_rmsnorm),
`comm_only` (symm's all-reduce alone, the bar: at most 1 us more),
`unfused` (symm's all-reduce, then residual add and torch's rms_norm) and
`nccl_unfused` (the same after NCCL's all-reduce).

Writes DIR/records.jsonl and prints each record (run.sh's collect.py turns
the log into the results JSON; bench/plot_allreduce.py draws its PNG).
"""
import argparse
import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from bench_ops import Bench, rel_err  # noqa: E402  (checks the multicast environment too)

import symm  # noqa: E402

SIZES = [4 << 10, 8 << 10, 16 << 10, 32 << 10, 64 << 10, 128 << 10, 256 << 10, 512 << 10, 1 << 20, 2 << 20,
         4 << 20, 8 << 20, 16 << 20, 32 << 20, 64 << 20, 128 << 20, 256 << 20]
QUICK_SIZES = [8 << 10, 64 << 10, 1 << 20, 16 << 20]
# Forced one-shot up to this size (its scratch is 8 x the message at world 2).
ONE_SHOT_MAX = 64 << 20
TOKENS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
HIDDEN = [4096, 8192]


def bench_all_reduce(b, g, sizes):
    import torch.distributed._symmetric_memory as symm_mem

    for nbytes in sizes:
        n = nbytes // 2
        x = torch.randn(n, device="cuda", dtype=torch.bfloat16)
        out = torch.empty_like(x)
        ref = x.clone()
        dist.all_reduce(ref)
        xt = symm_mem.empty(n, device="cuda", dtype=torch.bfloat16).copy_(x)
        symm_mem.rendezvous(xt, b.group_name)
        work = symm_mem.empty(n, device="cuda", dtype=torch.bfloat16)
        symm_mem.rendezvous(work, b.group_name)
        nccl_buf = x.clone()

        # No stream given: each call runs on torch's current stream (the
        # capture's, inside a graph).
        fns = {"symm": lambda: symm.all_reduce(g, x, out=out)}
        fns["symm_bound"] = symm.bind(symm.all_reduce, g, x, out=out)
        for algo in ("one_shot", "two_shot"):
            if algo == "one_shot" and nbytes > ONE_SHOT_MAX:
                continue
            fns[f"symm_{algo}"] = lambda algo=algo: symm.all_reduce(g, x, out=out, algorithm=algo)
        # Correct before timing: twice each (the second is symm's graph replay).
        for impl, fn in fns.items():
            for attempt in ("eager", "replayed"):
                out.fill_(float("nan"))
                fn()
                err = rel_err(out, ref)
                assert err < 1e-2, f"allreduce {nbytes} B ({impl}, {attempt}): relative error {err}"
        torch.cuda.synchronize()
        dist.barrier()
        got = torch.ops.symm_mem.one_shot_all_reduce(xt, "sum", b.group_name)
        assert rel_err(got, ref) < 1e-2, "PyTorch's one-shot differs from NCCL"

        def torch_two_shot():
            work.copy_(x)
            torch.ops.symm_mem.two_shot_all_reduce_(work, "sum", b.group_name)

        torch_two_shot()
        assert rel_err(work, ref) < 1e-2, "PyTorch's two-shot differs from NCCL"
        fns.update({
            "nccl": lambda: dist.all_reduce(nccl_buf),
            "torch_one_shot": lambda: torch.ops.symm_mem.one_shot_all_reduce(xt, "sum", b.group_name),
            # In place, on its own buffer (the values grow from call to call,
            # which does not change the time).
            "torch_two_shot": lambda: torch.ops.symm_mem.two_shot_all_reduce_(work, "sum", b.group_name),
        })
        shape = (nbytes,)
        for impl, ms in b.contest(fns).items():
            b.record("allreduce", shape, impl, ms)
        graphable = {k: v for k, v in fns.items() if k != "symm_bound"}
        b.record_graphs("allreduce", shape, graphable)
        out.fill_(float("nan"))
        fns["symm"]()
        assert rel_err(out, ref) < 1e-2, f"allreduce {nbytes} B after timing"


def bench_rmsnorm(b, g, tokens_list, hiddens):
    eps = 1e-6
    for hidden in hiddens:
        for tokens in tokens_list:
            x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
            residual = torch.randn_like(x)
            weight = torch.randn(hidden, device="cuda", dtype=torch.bfloat16)
            out, res_out, summed = torch.empty_like(x), torch.empty_like(x), torch.empty_like(x)
            ref_sum = x.clone()
            dist.all_reduce(ref_sum)
            ref_r = ref_sum + residual
            ref = torch.nn.functional.rms_norm(ref_r.float(), (hidden,), weight.float(), eps)

            def fused():
                symm.all_reduce_rmsnorm(g, x, residual, weight, eps, out=out, residual_out=res_out)

            def unfused():
                symm.all_reduce(g, x, out=summed)
                r = summed + residual
                return torch.nn.functional.rms_norm(r, (hidden,), weight, eps)

            nccl_buf = x.clone()

            def nccl_unfused():
                dist.all_reduce(nccl_buf)
                r = nccl_buf + residual
                return torch.nn.functional.rms_norm(r, (hidden,), weight, eps)

            for attempt in ("eager", "replayed"):
                out.fill_(float("nan"))
                fused()
                err = max(rel_err(out, ref), rel_err(res_out, ref_r))
                assert err < 2e-2, f"allreduce_rmsnorm {tokens}x{hidden} ({attempt}): relative error {err}"
            fns = {
                "symm": fused,
                "comm_only": lambda: symm.all_reduce(g, x, out=summed),
                "unfused": unfused,
                "nccl_unfused": nccl_unfused,
            }
            shape = (tokens, hidden)
            for impl, ms in b.contest(fns).items():
                b.record("allreduce_rmsnorm", shape, impl, ms)
            b.record_graphs("allreduce_rmsnorm", shape, fns)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--iters", type=int, default=40)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--quick", action="store_true", help="a few sizes, for a smoke test")
    p.add_argument("--only", default="allreduce,allreduce_rmsnorm")
    args = p.parse_args()
    args.graph_max_m = 0
    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    b = Bench(args)
    torch.manual_seed(4321 + b.rank)
    g = symm.Group.from_env(backend="cuda", timeout_ms=60000)
    only = args.only.split(",")
    if "allreduce" in only:
        bench_all_reduce(b, g, QUICK_SIZES if args.quick else SIZES)
    if "allreduce_rmsnorm" in only:
        bench_rmsnorm(b, g, [1, 64] if args.quick else TOKENS, HIDDEN[:1] if args.quick else HIDDEN)
    g.check_async_error()
    if b.rank == 0:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"allreduce-w{b.world}-records.jsonl"), "w") as f:
            for r in b.records:
                f.write(json.dumps(r) + "\n")
        summary(b.records)
    g.close()
    dist.destroy_process_group()


def summary(records):
    """The graph-replayed per-call times in us, per size, and the targets."""
    t = {}
    for r in records:
        t.setdefault((r["op"], tuple(r["shape"])), {})[r["impl"]] = r["ms"] * 1e3
    cols = ("symm_graph", "symm_one_shot_graph", "symm_two_shot_graph", "nccl_graph", "torch_one_shot_graph",
            "torch_two_shot_graph", "symm", "nccl")
    print("allreduce, us per call:", " ".join(f"{c:>20}" for c in cols))
    for (op, shape), row in sorted(t.items()):
        if op != "allreduce":
            continue
        print(f"{shape[0]:>12} B", " ".join(f"{row.get(c, float('nan')):20.2f}" for c in cols))
    for (op, shape), row in sorted(t.items()):
        if op == "allreduce_rmsnorm":
            print(f"rmsnorm {shape}: fused {row.get('symm_graph', 0):.2f} us, all-reduce alone "
                  f"{row.get('comm_only_graph', 0):.2f} us, unfused {row.get('unfused_graph', 0):.2f} us (graphs)")


if __name__ == "__main__":
    main()
