"""What the call tags cost the LL kernels: graph-replayed all_reduce
(one-shot 8 KB and 64 KB, two-shot 1 MB, bf16) and lc_allgather (64 KB per
rank), per call, for two libraries in alternating rounds (a process
each), every rank a thread of it (rank r on GPU r % gpus; ranks may share
a GPU: their kernels then run side by side, as separate processes' would
not).

    python3 bench/probes/tag_cost_probe.py \\
        --lib base=bundle/base/libsymm.so:bundle/base/python --lib head=bundle/libsymm.so:python \\
        [--world 2] [--gpus 1] [--rounds 3]

(each --lib NAME=LIBRARY:PYTHONPATH, the package that goes with it).

Prints one JSON line per (round, library, case): the median over 30
replays of a graph of 20 calls, rank 0's time.
"""
import argparse
import json
import os
import subprocess
import sys

REPS = 20
CASES = [("all_reduce", "one_shot", 8 << 10), ("all_reduce", "one_shot", 64 << 10),
         ("all_reduce", "two_shot", 1 << 20), ("lc_allgather", None, 64 << 10)]


def run_ranks(args):
    """Every rank on a thread of this process (one CUDA context per GPU, so
    ranks sharing a GPU run their kernels side by side; processes sharing a
    GPU take turns in time slices of milliseconds)."""
    import threading

    import torch

    import symm

    devices = [r % args.gpus for r in range(args.world)]
    groups = symm.local_groups(args.world, devices=devices, backend="cuda", allow_shared_device=args.gpus < args.world)
    meet = threading.Barrier(args.world)
    out = [None] * args.world

    def rank(g):
        torch.cuda.set_device(devices[g.rank])
        stream = torch.cuda.Stream()
        rows = []
        with torch.cuda.stream(stream):
            for op, algorithm, nbytes in CASES:
                x = torch.randn(nbytes // 2, device="cuda", dtype=torch.bfloat16)
                if op == "all_reduce":
                    def fn():
                        symm.all_reduce(g, x, algorithm=algorithm)
                else:
                    def fn():
                        symm.lc_allgather(g, x)
                fn()
                stream.synchronize()
                meet.wait()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"):
                    for _ in range(REPS):
                        fn()
                meet.wait()
                for _ in range(5):
                    graph.replay()
                stream.synchronize()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                times = []
                for _ in range(30):
                    meet.wait()
                    start.record(stream)
                    graph.replay()
                    end.record(stream)
                    end.synchronize()
                    times.append(start.elapsed_time(end) * 1000 / REPS)
                times.sort()
                rows.append({"op": op, "algorithm": algorithm, "bytes": nbytes, "us": round(times[len(times) // 2], 2)})
                meet.wait()
                del graph
        out[g.rank] = rows

    threads = [threading.Thread(target=rank, args=(g,)) for g in groups]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for g in groups:
        g.close()
    print(json.dumps(out[0]), flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lib", action="append", required=True, help="NAME=LIBRARY:PYTHONPATH")
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--gpus", type=int, default=1)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    if "PROBE_CHILD" in os.environ:
        return run_ranks(args)
    libs = [(name, *where.split(":", 1)) for name, where in (kv.split("=", 1) for kv in args.lib)]
    for rnd in range(args.rounds):
        for name, lib, path in libs:
            env = dict(os.environ, SYMM_LIBRARY=lib, PYTHONPATH=path, PROBE_CHILD="1", CUDA_MODULE_LOADING="EAGER")
            run = subprocess.run([sys.executable, __file__, *sys.argv[1:]], env=env, stdout=subprocess.PIPE, text=True,
                                 timeout=240)
            text = run.stdout.strip()
            if run.returncode or not text:
                print(json.dumps({"round": rnd, "lib": name, "failed": run.returncode}), flush=True)
                continue
            for row in json.loads(text.splitlines()[-1]):
                print(json.dumps({"round": rnd, "lib": name, **row}), flush=True)


if __name__ == "__main__":
    main()
