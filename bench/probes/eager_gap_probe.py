"""Why an eager call times 0.07 ms slower than the same call bound
(`bench_ops.py`, ag_mm 512 on two H100s) when `host_overhead.py` measures
only ~20 us more host time per call in a loop. Times, per sample, as
bench_ops.py does (GPU idle, ranks aligned, then one call between two
events): the host time from the start event to the call's return
(perf_counter) and the GPU time between the events, for the eager call,
the bound call (symm's choice, and each algorithm of --algos forced), the
eager call on the Python path (`eager_python`, where the compiled one is
built) and torch.matmul of the whole local problem (the benchmark's
floor); then the host time of the same calls back to back (warm). Medians
over samples, max over ranks.

    torchrun --nproc-per-node 2 bench/probes/eager_gap_probe.py [--op mm_rs --shape 512:14336:8192 --algos fused]

(`--nproc-per-node 1` on one GPU: world 1, no communication, the host's
part alone.)
"""
import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

# profile_ops.py (the ranks' start) is a runner in bench/gpu/.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "gpu"))
import symm  # noqa: E402
from symm import _fastcall  # noqa: E402
from profile_ops import start_ranks  # noqa: E402

SAMPLES = 40
# The compiled hit path of plain calls (None where it is not built).
EXT = _fastcall._ext


def set_algorithm(name):
    """SYMM_ALGO (read by symm on every call) for the function `name`:
    `bound_<algo>` forces <algo>; and the plain calls' path: `eager_python`
    takes Python's, every other the compiled one where it is built. Set
    outside the timed region."""
    if name.startswith("bound_"):
        os.environ["SYMM_ALGO"] = name.removeprefix("bound_")
    else:
        os.environ.pop("SYMM_ALGO", None)
    _fastcall._ext = None if name == "eager_python" else EXT


def main():
    rank, world, g = start_ranks()
    stream = torch.cuda.current_stream().cuda_stream
    p = argparse.ArgumentParser()
    p.add_argument("--op", choices=("ag_mm", "mm_rs"), default="ag_mm")
    # One option, not --m/--k/--n: torchrun's own parser takes those for abbreviations of its options.
    p.add_argument("--shape", default="512:8192:14336", help="M:K:N")
    p.add_argument("--algos", default="", help="comma-separated algorithms to force on the bound call too")
    args = p.parse_args()
    M, K, N = (int(x) for x in args.shape.split(":"))
    w = (torch.randn(N, K, device="cuda", dtype=torch.bfloat16) / K**0.5).t()
    whole = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    ref = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
    if args.op == "ag_mm":
        a = torch.randn(M // world, K, device="cuda", dtype=torch.bfloat16)
        out = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
        op, kwargs = symm.fused_ag_mm, {"gather_dim": 0, "out": [out], "stream": stream}
        args_ = (g, a, [w])
    else:
        out = torch.empty(M // world, N, device="cuda", dtype=torch.bfloat16)
        op, kwargs = symm.mm_rs, {"scatter_dim": 0, "op": "sum", "out": out, "stream": stream}
        args_ = (g, whole, w)
    bound = symm.bind(op, *args_, **kwargs)
    fns = {"eager": lambda: op(*args_, **kwargs), "bound": bound}
    if EXT is not None:
        # Its own kind of call (no stream given: the same current stream),
        # so that it keeps a call of its own, made in Python.
        fns["eager_python"] = lambda: op(*args_, **{**kwargs, "stream": None})
    for algo in filter(None, args.algos.split(",")):
        fns[f"bound_{algo}"] = bound
    fns["torch_matmul"] = lambda: torch.matmul(whole, w, out=ref)
    for name, fn in fns.items():
        set_algorithm(name)
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
    cold = {name: ([], []) for name in fns}
    for _ in range(SAMPLES):
        for name, fn in fns.items():
            set_algorithm(name)
            torch.cuda.synchronize()
            dist.barrier()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            t0 = time.perf_counter()
            fn()
            host = time.perf_counter() - t0
            end.record()
            end.synchronize()
            cold[name][0].append(host * 1e6)
            cold[name][1].append(start.elapsed_time(end) * 1e3)
    warm = {}
    for name, fn in fns.items():
        set_algorithm(name)
        torch.cuda.synchronize()
        dist.barrier()
        per = []
        for _ in range(SAMPLES):
            t0 = time.perf_counter()
            for _ in range(10):
                fn()
            per.append((time.perf_counter() - t0) * 1e5)  # us per call
            torch.cuda.synchronize()
        warm[name] = statistics.median(per)
    rows = []
    for name in fns:
        vals = torch.tensor([statistics.median(cold[name][0]), statistics.median(cold[name][1]), warm[name]],
                            device="cuda", dtype=torch.float64)
        dist.all_reduce(vals, op=dist.ReduceOp.MAX)
        rows.append({"impl": name, "shape": [M, K, N], "cold_host_us": round(vals[0].item(), 1),
                     "cold_gpu_us": round(vals[1].item(), 1), "warm_host_us": round(vals[2].item(), 1)})
    if rank == 0:
        for r in rows:
            print(json.dumps(r), flush=True)
    g.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
