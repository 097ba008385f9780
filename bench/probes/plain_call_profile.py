"""Where a plain (not bound) eager call's host time goes on CUDA, world 2:
for lc_allgather (64 KB per rank) and fused_ag_mm / mm_rs at M = 512, the
wall time per call of plain and bound calls issued back to back (the GPU
kept busy enough not to throttle the host: a synchronize per batch only),
then cProfile of the plain calls on rank 0 (the Python frames' own time
and the library call's).

    torchrun --nproc-per-node 2 bench/probes/plain_call_profile.py
"""
import cProfile
import io
import os
import pstats
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import bench_ops  # noqa: E402,F401  (checks the multicast environment)

import symm  # noqa: E402

CALLS = 200


def per_call_us(fn):
    fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(5):
        dist.barrier()
        t = time.perf_counter()
        for _ in range(CALLS):
            fn()
        host = (time.perf_counter() - t) / CALLS * 1e6
        torch.cuda.synchronize()
        best = min(best, host)
    return best


def event_us(fn, calls=5, samples=30):
    """Median per-call time of `calls` calls between CUDA events after a
    barrier and a synchronize, as bench_ops.Bench times a sample."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(samples):
        torch.cuda.synchronize()
        dist.barrier()
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls * 1e3)
    times.sort()
    return times[len(times) // 2]


def main():
    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    rank = dist.get_rank()
    g = symm.Group.from_env(backend="cuda", timeout_ms=60000)
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    x = torch.randn(32 * 1024, **bf16)
    gathered = torch.empty(2 * x.numel(), **bf16)
    a, b = torch.randn(256, 4096, **bf16), torch.randn(4096, 7168, **bf16)
    out = torch.empty(512, 7168, **bf16)
    ar, br = torch.randn(512, 4096, **bf16), torch.randn(4096, 8192, **bf16)
    rs_out = torch.empty(256, 8192, **bf16)
    cases = {
        "lc_allgather 64KB": ((symm.lc_allgather, g, x), {"out": gathered}),
        "fused_ag_mm 512x4096x7168": ((symm.fused_ag_mm, g, a, b, 0), {"out": out}),
        "mm_rs 512x4096x8192": ((symm.mm_rs, g, ar, br, 0), {"out": rs_out}),
    }
    for name, ((op, *args), kwargs) in cases.items():
        plain = lambda op=op, args=args, kwargs=kwargs: op(*args, **kwargs)  # noqa: E731
        bound = symm.bind(op, *args, **kwargs)
        p, bd = per_call_us(plain), per_call_us(bound)
        # As bench_ops.py's plain call: the current stream read per call and
        # passed, and the algorithm keyword.
        bench_kwargs = dict(kwargs, algorithm=None) if op is not symm.lc_allgather else dict(kwargs)

        def as_bench(op=op, args=args, bench_kwargs=bench_kwargs):
            return op(*args, **bench_kwargs, stream=torch.cuda.current_stream().cuda_stream)

        times = {k: event_us(f) for k, f in (("plain", plain), ("bound", bound), ("as bench", as_bench))}
        if rank == 0:
            print(f"{name:28s} host us/call: plain {p:6.1f}  bound {bd:6.1f};  per call between events: "
                  + "  ".join(f"{k} {v:6.1f}" for k, v in times.items()), flush=True)
        prof = cProfile.Profile()
        dist.barrier()
        prof.enable()
        for _ in range(CALLS):
            plain()
        prof.disable()
        torch.cuda.synchronize()
        if rank == 0:
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(12)
            print(s.getvalue(), flush=True)
    dist.barrier()
    g.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
