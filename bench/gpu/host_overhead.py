"""Host time of one symm call: how long the CPU takes to enqueue an
operation, split into the Python wrapper and the library call, next to a
torch.matmul of the same shape (plain calls on the compiled C path where
`symm._fastcall_ext` is built, and on the Python path: `_python`), and the driver calls the library makes
(torch.profiler's CUPTI driver/runtime records) with their host durations;
each symm call plain and bound once (`symm.bind`, impl `..._bound`).

At small M the GPU finishes an operation in less time than the host takes
to enqueue it, so this time is what the benchmark measures there.

Two ranks as two processes sharing GPU 0 (one GPU is enough: nothing here
waits for the GPU inside a timed batch), or `--gpus 2` for one GPU each
(which adds the fused algorithm: its kernel needs a GPU per rank).

    python3 bench/gpu/host_overhead.py [--gpus 1|2] [--calls 20] [--batches 30]
"""
import argparse
import functools
import collections
import json
import multiprocessing as mp
import os
import statistics
import time

CASES = (("ag_mm", 512, 8192, 14336), ("mm_rs", 512, 14336, 8192), ("ag_mm", 16384, 8192, 8192))
ALGOS = ("sequential", "pipelined")
# The fused kernel needs a GPU per rank.
FUSED_ALGOS = ALGOS + ("fused",)


class Timed:
    """The library object with each symm_* function timed on the host."""

    def __init__(self, lib):
        self.lib, self.spent = lib, 0.0

    def __getattr__(self, name):
        fn = getattr(self.lib, name)
        if not name.startswith("symm_") or name.startswith("symm_group"):
            return fn

        def timed(*args):
            t = time.perf_counter()
            try:
                return fn(*args)
            finally:
                self.spent += time.perf_counter() - t

        timed.__name__ = name
        return timed


def host_times(fn, calls, batches, sync, timed=None):
    """Median over batches of (host us per call, library us per call)."""
    per_call, in_lib = [], []
    for _ in range(batches):
        sync()
        if timed:
            timed.spent = 0.0
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        per_call.append((time.perf_counter() - t) / calls * 1e6)
        in_lib.append(timed.spent / calls * 1e6 if timed else 0.0)
    return statistics.median(per_call), statistics.median(in_lib)


def cold_host_us(fn, samples, sync):
    """Median host us of one call made right after the ranks met (`sync`),
    as the benchmark's samples make theirs: caches cold after the wait."""
    times = []
    for _ in range(samples):
        sync()
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e6)
    return statistics.median(times)


def driver_calls(fn, sync):
    """(name -> [count, total host us]) of CUDA API records during one call."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    sync()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        sync()
    calls = collections.defaultdict(lambda: [0, 0.0])
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CPU:
            continue
        if e.name.startswith(("cu", "cuda")) and "Synchronize" not in e.name:
            calls[e.name][0] += 1
            calls[e.name][1] += e.time_range.elapsed_us()
    return calls


def python_profile(fn, sync, calls=200):
    """cProfile of `calls` calls: where the Python wrapper's time goes."""
    import cProfile
    import io
    import pstats

    sync()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(18)
    return text.getvalue()


def rank_main(rank, world, uid, device, args, queue):
    os.environ.update(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")
    import torch

    import symm
    import symm.ops

    torch.cuda.set_device(device)
    g = symm.Group.from_unique_id(uid, world, rank, device=device, backend="cuda", timeout_ms=120000,
                                  allow_shared_device=True)
    from symm import _fastcall

    real, timed, ext = symm.ops.lib, Timed(symm.ops.lib), _fastcall._ext
    if ext is not None and rank == 0:  # which reader of tensors the C path uses with this torch
        ext.key_of((), {})
        print(json.dumps({"torch": torch.__version__, "dlpack_exchange": ext.use_exchange(True)}), flush=True)
    stream = torch.cuda.current_stream()

    def sync():
        # Both ranks drain their work and start the batch together.
        torch.cuda.synchronize()
        symm.lc_allgather(g, flag, out=flags, stream=stream.cuda_stream)
        torch.cuda.synchronize()

    flag = torch.ones(1, device="cuda")
    flags = torch.empty(world, device="cuda")
    out = []
    for op, m, k, n in CASES:
        w = (torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5).t()
        if op == "ag_mm":
            a = torch.randn(m // world, k, device="cuda", dtype=torch.bfloat16)
            c = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
            full = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)

            def call(algo):
                symm.fused_ag_mm(g, a, [w], gather_dim=0, out=[c], stream=stream.cuda_stream, algorithm=algo)

            def bind(algo):
                return symm.bind(
                    symm.fused_ag_mm, g, a, [w], gather_dim=0, out=[c], stream=stream.cuda_stream, algorithm=algo
                )
        else:
            a = full = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            c = torch.empty(m // world, n, device="cuda", dtype=torch.bfloat16)

            def call(algo):
                symm.mm_rs(g, a, w, scatter_dim=0, op="sum", out=c, stream=stream.cuda_stream, algorithm=algo)

            def bind(algo):
                return symm.bind(
                    symm.mm_rs, g, a, w, scatter_dim=0, op="sum", out=c, stream=stream.cuda_stream, algorithm=algo
                )
        mm_out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        matmul = lambda: torch.matmul(full, w, out=mm_out)  # noqa: E731
        matmul_us, _ = host_times(matmul, args.calls, args.batches, sync)
        matmul_cold_us = cold_host_us(matmul, args.batches, sync)
        for algo in FUSED_ALGOS if args.gpus >= world else ALGOS:
            # The plain call (on the C path where _fastcall_ext is built, and
            # on Python's: `_python`), then the same call bound once (symm.bind).
            plain = functools.partial(call, algo)
            paths = [(f"symm_{algo}", lambda: plain, ext), (f"symm_{algo}_bound", functools.partial(bind, algo), ext)]
            if ext is not None:
                paths.insert(1, (f"symm_{algo}_python", lambda: plain, None))
            for impl, make, path in paths:
                # Host time with the library as it is, then the library's
                # share of it under the timing wrapper (no ctypes function:
                # wrapped calls never take the C path's `native`).
                for lib in (timed, real):
                    symm.ops.lib, _fastcall._ext = lib, path
                    g._calls.clear()
                    fn = make()
                    c.fill_(float("nan"))
                    fn()  # eager: the reference for the replays below
                    eager = c.clone()
                    for _ in range(3):
                        fn()
                    if lib is timed:
                        _, lib_us = host_times(fn, args.calls, args.batches, sync, timed)
                        continue
                    host_us, _ = host_times(fn, args.calls, args.batches, sync)
                    cold_us = cold_host_us(fn, args.batches, sync)
                    break
                api = driver_calls(fn, sync)
                c.fill_(float("nan"))
                fn()
                torch.cuda.synchronize()
                assert torch.equal(c, eager), f"{op} {m}x{k}x{n} {impl}: a repeated call differs from the first"
                if args.profile and (op, m, impl) == ("ag_mm", 512, "symm_pipelined"):
                    report = python_profile(fn, sync)  # every rank calls: the op is collective
                    if rank == 0:
                        print(report, flush=True)
                out.append({"op": op, "shape": [m, k, n], "impl": impl, "rank": rank, "world": world,
                            "host_us": round(host_us, 1), "library_us": round(lib_us, 1),
                            "python_us": round(host_us - lib_us, 1), "torch_matmul_host_us": round(matmul_us, 1),
                            "cold_host_us": round(cold_us, 1), "torch_matmul_cold_us": round(matmul_cold_us, 1),
                            "api": {k: [v[0], round(v[1], 1)] for k, v in sorted(api.items(), key=lambda x: -x[1][1])}})
    g.close()
    queue.put(out)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--gpus", type=int, default=1)
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--batches", type=int, default=30)
    p.add_argument("--profile", action="store_true", help="also cProfile rank 0's ag_mm 512 pipelined calls")
    args = p.parse_args()
    import symm

    uid, world = symm.get_unique_id(), 2
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=rank_main, args=(r, world, uid, r % args.gpus, args, queue)) for r in range(world)]
    for p_ in procs:
        p_.start()
    results = [queue.get(timeout=600) for _ in procs]
    for p_ in procs:
        p_.join()
    for rec in sorted((r for rs in results for r in rs), key=lambda r: (r["op"], r["shape"], r["impl"], r["rank"])):
        api = rec.pop("api")
        print(json.dumps(rec), flush=True)
        if rec["rank"] == 0:
            for name, (count, us) in list(api.items())[:12]:
                print(f"    {name:40s} x{count:3d} {us:8.1f} us", flush=True)
    return 0 if all(p_.exitcode == 0 for p_ in procs) else 1


if __name__ == "__main__":
    raise SystemExit(main())
