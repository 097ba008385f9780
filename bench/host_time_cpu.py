"""Host time of one eager symm call on CPU torch tensors and the host
backend (world 1): each operation plain, bound once (``symm.bind``), and
with its outputs allocated, next to a ``torch.matmul`` of the same shape.
No GPU needed; the numbers are the Python wrapper's and the library's host
CPU time, what bounds a small operation's rate.

With --evict MB each call is timed alone after reading MB megabytes
(the caches then hold none of the call's code or data, as after a wait
for the GPU or the peers): the median wall time of a call.

    SYMM_LIBRARY=target/release/libsymm.so PYTHONPATH=python \\
        python bench/host_time_cpu.py [--calls 200] [--batches 25] [--evict 64]
"""
import argparse
import time

import torch

import symm


def host_us(fn, calls, batches):
    """The host CPU microseconds per call of the fastest batch: process CPU
    time, not wall time, and the least disturbed batch, for numbers that
    hold on a shared machine."""
    for _ in range(calls):
        fn()
    times = []
    for _ in range(batches):
        t = time.process_time()
        for _ in range(calls):
            fn()
        times.append((time.process_time() - t) / calls * 1e6)
    return min(times)


def cold_us(fn, calls, evict_mb):
    """The median wall microseconds of one call made after reading
    `evict_mb` megabytes."""
    import numpy as np

    junk = np.ones((evict_mb << 20) // 8)
    fn()
    times = []
    for _ in range(calls):
        junk.sum()
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    times.sort()
    return times[len(times) // 2] * 1e6


def cases(g):
    a, b = torch.randn(16, 32), torch.randn(32, 16)
    o = torch.empty(16, 16)
    x, out = torch.randn(16, 64), torch.empty(16, 64)
    res, w = torch.randn(16, 64), torch.randn(64)
    ro = torch.empty(16, 64)
    gathered = torch.empty(16, 16)
    yield "torch.matmul(a, b, out=o)", lambda: torch.matmul(a, b, out=o), None
    yield "fused_ag_mm(out=o)", lambda: symm.fused_ag_mm(g, a, b, 0, out=o), (symm.fused_ag_mm, g, a, b, 0), {"out": o}
    yield "fused_ag_mm allocated", lambda: symm.fused_ag_mm(g, a, b, 0), None
    yield "mm_rs(out=o)", lambda: symm.mm_rs(g, a, b, 0, out=o), (symm.mm_rs, g, a, b, 0), {"out": o}
    yield "lc_allgather(out=)", lambda: symm.lc_allgather(g, o, out=gathered), (symm.lc_allgather, g, o), {
        "out": gathered
    }
    yield "all_reduce(out=)", lambda: symm.all_reduce(g, x, out=out), (symm.all_reduce, g, x), {"out": out}
    yield "all_reduce allocated", lambda: symm.all_reduce(g, x), None
    yield "all_reduce_rmsnorm(out=, residual_out=)", lambda: symm.all_reduce_rmsnorm(
        g, x, res, w, out=out, residual_out=ro
    ), (symm.all_reduce_rmsnorm, g, x, res, w), {"out": out, "residual_out": ro}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--batches", type=int, default=25)
    p.add_argument("--evict", type=int, default=0, help="MB read before each call: cold calls, timed one by one")
    args = p.parse_args()
    if args.evict:
        timed = lambda fn: cold_us(fn, args.calls, args.evict)  # noqa: E731
    else:
        timed = lambda fn: host_us(fn, args.calls, args.batches)  # noqa: E731
    torch.set_num_threads(1)
    (g,) = symm.local_groups(1, backend="host")
    for case in cases(g):
        name, fn, bound = case[0], case[1], case[2]
        line = f"{name:42s} plain {timed(fn):6.1f} us"
        if bound is not None:
            call = symm.bind(*bound, **case[3])
            line += f"   bound {timed(call):6.1f} us"
        print(line, flush=True)
    g.close()


if __name__ == "__main__":
    main()
