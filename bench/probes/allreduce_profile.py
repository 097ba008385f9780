"""Where an all-reduce call's time goes, 8 KB to 16 MB, bf16, world 2:
symm's all-reduce with an ordinary input (staged into its workspace, as
bench_allreduce.py measures it) and with its input in a symmetric buffer
(read by the peer in place), forced one-shot and two-shot, beside
PyTorch's two_shot_all_reduce_ and one_shot_all_reduce (inputs in
PyTorch's symmetric memory) and NCCL. For each: the per-call time replayed
from a CUDA graph of REPS calls, and from torch.profiler (CUPTI) the GPU
kernels and copies of one replay: their count, summed duration per call,
and the idle time between them (the replay's span minus its busy time).

    torchrun --nproc-per-node 2 bench/probes/allreduce_profile.py [--sizes 8K,2M,16M]
"""
import argparse
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from bench_ops import rel_err, symmetric_tensor  # noqa: E402  (checks the multicast environment too)

import symm  # noqa: E402

REPS = 20


def parse_size(s):
    mult = {"K": 1 << 10, "M": 1 << 20}
    return int(s[:-1]) * mult[s[-1]] if s[-1] in mult else int(s)


def replay_ms(graph, rounds=30):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(rounds):
        dist.barrier()
        torch.cuda.synchronize()
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / REPS)
    times.sort()
    return times[len(times) // 2]


def gpu_activity(graph):
    """(kernels and copies per call, busy us per call, idle us per call,
    names) of one replay, from CUPTI."""
    from torch.profiler import ProfilerActivity, profile

    dist.barrier()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    if not events:
        return 0, float("nan"), float("nan"), ""
    spans = sorted((e.time_range.start, e.time_range.end) for e in events)
    busy, cursor = 0.0, spans[0][0]
    for s, e in spans:
        busy += max(0.0, e - max(s, cursor))
        cursor = max(cursor, e)
    span = spans[-1][1] - spans[0][0]
    names = sorted({e.name[:40] for e in events})
    return len(events) / REPS, busy / REPS, (span - busy) / REPS, "; ".join(names)


def capture(fn):
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(REPS):
            fn()
    torch.cuda.synchronize()
    return g


def report(rank, case, impl, fn):
    """Times `fn` replayed from a graph and prints its line (rank 0)."""
    graph = capture(fn)
    ms = replay_ms(graph)
    count, busy, idle, names = gpu_activity(graph)
    if rank == 0:
        print(f"{case}  {impl:18s} {ms * 1e3:7.1f} us/call  gpu ops/call {count:3.1f}  "
              f"busy {busy:7.1f} us  idle {idle:6.1f} us  [{names}]", flush=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--sizes", default="8K,64K,1M,2M,4M,8M,16M")
    p.add_argument("--rows", default="1x4096,16x8192,64x8192,512x8192",
                   help="[tokens]x[hidden] of the fused all-reduce + RMSNorm, beside the all-reduce alone")
    args = p.parse_args()
    import torch.distributed._symmetric_memory as symm_mem

    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    rank = dist.get_rank()
    name = dist.group.WORLD.group_name
    g = symm.Group.from_env(backend="cuda", timeout_ms=60000)
    for size in [parse_size(s) for s in args.sizes.split(",")]:
        n = size // 2
        x = torch.randn(n, device="cuda", dtype=torch.bfloat16)
        ref = x.clone()
        dist.all_reduce(ref)
        out = torch.empty_like(x)
        sx, keep = symmetric_tensor(g, n)
        sx.copy_(x)
        tx = symm_mem.empty(n, device="cuda", dtype=torch.bfloat16).copy_(x)
        symm_mem.rendezvous(tx, name)
        work = symm_mem.empty(n, device="cuda", dtype=torch.bfloat16)
        symm_mem.rendezvous(work, name)
        nccl_buf = x.clone()
        fns = {
            "symm ordinary": lambda: symm.all_reduce(g, x, out=out),
            "symm symmetric": lambda: symm.all_reduce(g, sx, out=out),
            "symm symm. 1-shot": lambda: symm.all_reduce(g, sx, out=out, algorithm="one_shot"),
            "symm symm. 2-shot": lambda: symm.all_reduce(g, sx, out=out, algorithm="two_shot"),
            "symm ord. 2-shot": lambda: symm.all_reduce(g, x, out=out, algorithm="two_shot"),
            "torch 2-shot": lambda: torch.ops.symm_mem.two_shot_all_reduce_(work, "sum", name),
            "torch 1-shot": lambda: torch.ops.symm_mem.one_shot_all_reduce(tx, "sum", name),
            "nccl": lambda: dist.all_reduce(nccl_buf),
        }
        for impl in [k for k in fns if k.startswith("symm")]:
            out.fill_(float("nan"))
            fns[impl]()
            assert rel_err(out, ref) < 1e-2, f"{impl} at {size} B"
        for impl, fn in fns.items():
            if impl == "torch 2-shot":
                work.copy_(x)
            report(rank, f"{size:>9} B", impl, fn)
        del keep
    for rows in args.rows.split(","):
        tokens, hidden = map(int, rows.split("x"))
        x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
        res, w = torch.randn_like(x), torch.randn(hidden, device="cuda", dtype=torch.bfloat16)
        out, res_out, summed = torch.empty_like(x), torch.empty_like(x), torch.empty_like(x)
        fns = {
            "all-reduce alone": lambda: symm.all_reduce(g, x, out=summed),
            "fused rmsnorm": lambda: symm.all_reduce_rmsnorm(g, x, res, w, out=out, residual_out=res_out),
        }
        for impl, fn in fns.items():
            report(rank, f"{rows:>9}  ", impl, fn)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
