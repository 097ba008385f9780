"""Sustained replays and the GPU's clock: whether symm's fused kernel runs at
the clock the matmul alone runs at, when each is replayed back to back for
a second or more (as bench_ops.py's `_graph` rows, longer). On the GPU
machine, one rank per GPU:

    torchrun --nproc-per-node 2 bench/probes/clock_probe.py [--cases mm:512:14336:8192:-,...] [--seconds 1.5]

For each case (op:m:k:n:algorithm, as profile_ops.py's; `mm` is the local
matmul of all m rows), every rank captures a CUDA graph of --reps calls,
replays it for about --warm seconds, then about --seconds more (the same
count on every rank) while a thread
samples its GPU's SM clock and power draw with nvidia-smi every ~50 ms.
Prints per rank and case: ms per call over the sampled part, and the SM
clock (MHz) and power (W) as min / median / max of the samples. The cases
run in the order given; repeat the first at the end to see drift.
"""
import argparse
import os
import statistics
import subprocess
import sys
import threading
import time

import torch
import torch.distributed as dist

# profile_ops.py (the cases and the ranks' start) is a runner in bench/gpu/.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "gpu"))
from profile_ops import case_fn, start_ranks  # noqa: E402

DEFAULT_CASES = "mm:512:14336:8192:-,mm_rs:512:14336:8192:fused,mm_rs:512:14336:8192:pipelined,mm:512:14336:8192:-"


def spread(values):
    """min / median / max of the values that are not None, or "-"."""
    values = [v for v in values if v is not None]
    if not values:
        return "-"
    return f"{min(values):7.1f} {statistics.median(values):7.1f} {max(values):7.1f}"


def sample(gpu, stop, out):
    """Appends (sm MHz, W) of GPU `gpu` to `out` until `stop` is set."""
    query = ["nvidia-smi", "-i", str(gpu), "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits"]
    while not stop.is_set():
        line = subprocess.run(query, capture_output=True, text=True).stdout.strip()
        try:
            mhz, watts = (float(x) for x in line.split(","))
            out.append((mhz, watts))
        except ValueError:
            pass
        time.sleep(0.05)


def replay_n(replay, count):
    """Replays `count` times back to back; returns the GPU's ms for them."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for i in range(count):
        replay()
        if i % 10 == 9:
            # Keep the host at most ~10 replays ahead (a host far ahead
            # would only queue up).
            torch.cuda.current_stream().synchronize()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def agreed_count(ms_per_replay, seconds):
    """Replays that take `seconds`, the same on every rank (a collective
    replayed a different number of times would leave its peer waiting)."""
    count = torch.tensor([max(10, int(seconds * 1e3 / ms_per_replay))], device="cuda")
    dist.all_reduce(count, op=dist.ReduceOp.MAX)
    return int(count.item())


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--cases", default=DEFAULT_CASES)
    p.add_argument("--reps", type=int, default=20, help="calls per captured graph")
    p.add_argument("--warm", type=float, default=0.5)
    p.add_argument("--seconds", type=float, default=1.5)
    args = p.parse_args()
    rank, world, g = start_ranks()
    gpu = int(os.environ["LOCAL_RANK"])
    lines = []
    for case in args.cases.split(","):
        op, m, k, n, algo = case.split(":")
        if algo == "-":
            os.environ.pop("SYMM_ALGO", None)
        else:
            os.environ["SYMM_ALGO"] = algo
        # A plain call (not bound): it issues on the stream current at the
        # call, which the capture needs.
        fn = case_fn(g, op, int(m), int(k), int(n), world)
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            for _ in range(args.reps):
                fn()
        torch.cuda.synchronize()
        dist.barrier()
        per_replay = replay_n(graph.replay, 10) / 10
        replay_n(graph.replay, agreed_count(per_replay, args.warm))
        count = agreed_count(per_replay, args.seconds)
        samples, stop = [], threading.Event()
        sampler = threading.Thread(target=sample, args=(gpu, stop, samples))
        sampler.start()
        ms = replay_n(graph.replay, count)
        stop.set()
        sampler.join()
        dist.barrier()
        lines.append(f"rank {rank} {case:32} {ms / (count * args.reps):.4f} ms per call ({count * args.reps} calls); "
                     f"SM MHz {spread([s[0] for s in samples])}; W {spread([s[1] for s in samples])}")
        del graph
    os.environ.pop("SYMM_ALGO", None)
    everyone = [None] * world
    dist.all_gather_object(everyone, lines)
    if rank == 0:
        print(f"# {world} x {torch.cuda.get_device_name()}; ms per call and nvidia-smi's SM clock / power "
              f"(min median max) over {args.seconds} s of back-to-back replays of {args.reps}-call graphs")
        for r_lines in everyone:
            print("\n".join(r_lines))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
