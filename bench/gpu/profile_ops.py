"""Where the time of one symm operation goes: torch.profiler (CUPTI) over a
few calls of fused_ag_mm / mm_rs with one algorithm forced, per rank, on
the GPU machine. Prints, per rank, every kernel and copy of the last call
with its start (relative to the call's first activity) and duration, so a
wait (a kernel spinning on a flag, a copy that starts late) shows. Every
rank prints its own timeline, rank 0 first (a wait on one rank is often
explained by the other's).

    torchrun --nproc-per-node 2 bench/gpu/profile_ops.py [--cases ag_mm:512:8192:14336:fused,...]

With --back-to-back the profiled calls follow one another with nothing
between them (as in a decode loop or a graph replay), and every call is
printed: how long each takes in lock step with the other rank. With
--graph N each profiled call is a replay of a CUDA graph of N calls, as
bench_ops.py's `_graph` rows time them. Op `mm` is the floor: the local
matmul of all m rows (algorithm ignored), e.g. `mm:512:14336:8192:-`.
"""
import argparse
import os

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

import symm

DEFAULT_CASES = ("ag_mm:512:8192:14336:fused,ag_mm:512:8192:14336:pipelined,"
                 "mm_rs:512:14336:8192:fused,mm_rs:512:14336:8192:pipelined,"
                 "mm_rs:16384:4096:8192:fused,mm_rs:16384:4096:8192:pipelined")


def current_stream():
    """The stream current at the call (a graph's capture stream while capturing)."""
    return torch.cuda.current_stream().cuda_stream


def case_fn(g, op, m, k, n, world):
    w = (torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5).t()
    if op == "mm":
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        c = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        return lambda: torch.matmul(a, w, out=c)
    if op == "ag_mm":
        a = torch.randn(m // world, k, device="cuda", dtype=torch.bfloat16)
        out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        return lambda: symm.fused_ag_mm(g, a, [w], gather_dim=0, out=[out], stream=current_stream())
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(m // world, n, device="cuda", dtype=torch.bfloat16)
    return lambda: symm.mm_rs(g, a, w, scatter_dim=0, op="sum", out=out, stream=current_stream())


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--cases", default=DEFAULT_CASES)
    p.add_argument("--calls", type=int, default=3)
    p.add_argument("--back-to-back", action="store_true", help="no synchronize or barrier between the calls")
    p.add_argument("--graph", type=int, default=0, help="each call a replay of a CUDA graph of this many calls")
    args = p.parse_args()
    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    rank, world = dist.get_rank(), dist.get_world_size()
    g = symm.Group.from_env(backend="cuda", timeout_ms=60000)
    for case in args.cases.split(","):
        op, m, k, n, algo = case.split(":")
        os.environ["SYMM_ALGO"] = algo
        fn = case_fn(g, op, int(m), int(k), int(n), world)
        for _ in range(5):
            fn()
        if args.graph:
            graph = torch.cuda.CUDAGraph()
            torch.cuda.synchronize()
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                for _ in range(args.graph):
                    fn()
            fn = graph.replay
            for _ in range(3):
                fn()
        torch.cuda.synchronize()
        dist.barrier()
        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            for i in range(args.calls):
                if i == 0 or not args.back_to_back:
                    torch.cuda.synchronize()
                    dist.barrier()
                fn()
            torch.cuda.synchronize()
        os.environ.pop("SYMM_ALGO")
        gpu = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        gpu.sort(key=lambda e: e.time_range.start)
        # The last call: everything after the last gap of more than 1 ms
        # (the host synchronizes and barriers between calls); back to back,
        # every call.
        last = 0
        for i in range(1, len(gpu)):
            if gpu[i].time_range.start - max(e.time_range.end for e in gpu[:i]) > 1000:
                last = i
        t0 = gpu[last].time_range.start
        end = max(e.time_range.end for e in gpu[last:])
        what = f"{args.calls} calls back to back" if args.back_to_back else "last call"
        if args.graph:
            what += f" (each a graph of {args.graph})"
        lines = [f"== {case} rank {rank}: {what} {(end - t0) / 1000:.3f} ms on the GPU"]
        lines += [f"  +{(e.time_range.start - t0) / 1000:7.3f} ms {e.time_range.elapsed_us() / 1000:7.3f} ms  "
                  f"{e.name[:90]}" for e in gpu[last:]]
        for r in range(world):
            if r == rank:
                print("\n".join(lines), flush=True)
            dist.barrier()
    g.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
