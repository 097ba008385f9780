"""What the call tags cost the LL kernels: graph-replayed all_reduce
(one-shot 8 KB and 64 KB, two-shot 1 MB, bf16) and lc_allgather (64 KB per
rank), per call, for two libraries in alternating rounds, every rank a
process (rank r on GPU r % gpus; ranks may share a GPU).

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
import tempfile

REPS = 20
CASES = [("all_reduce", "one_shot", 8 << 10), ("all_reduce", "one_shot", 64 << 10),
         ("all_reduce", "two_shot", 1 << 20), ("lc_allgather", None, 64 << 10)]


def rank_main(args):
    import torch

    import symm

    rank = int(os.environ["PROBE_RANK"])
    device = rank % args.gpus
    torch.cuda.set_device(device)
    g = symm.Group.from_unique_id(bytes.fromhex(os.environ["PROBE_UID"]), args.world, rank, device=device,
                                  backend="cuda", allow_shared_device=args.gpus < args.world)
    out = []
    for op, algorithm, nbytes in CASES:
        x = torch.randn(nbytes // 2, device="cuda", dtype=torch.bfloat16)
        if op == "all_reduce":
            def fn():
                symm.all_reduce(g, x, algorithm=algorithm)
        else:
            def fn():
                symm.lc_allgather(g, x)
        fn()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(REPS):
                fn()
        for _ in range(5):
            graph.replay()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        times = []
        for _ in range(30):
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1000 / REPS)
        times.sort()
        out.append({"op": op, "algorithm": algorithm, "bytes": nbytes, "us": round(times[len(times) // 2], 2)})
    torch.cuda.synchronize()
    g.close()
    if rank == 0:
        print(json.dumps(out), flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lib", action="append", required=True, help="NAME=LIBRARY:PYTHONPATH")
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--gpus", type=int, default=1)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    if "PROBE_RANK" in os.environ:
        return rank_main(args)
    import symm  # this process only makes the groups' unique ids

    libs = [(name, *where.split(":", 1)) for name, where in (kv.split("=", 1) for kv in args.lib)]
    for rnd in range(args.rounds):
        for name, lib, path in libs:
            uid = symm.get_unique_id().hex()
            env = dict(os.environ, SYMM_LIBRARY=lib, PYTHONPATH=path, PROBE_UID=uid, CUDA_MODULE_LOADING="EAGER")
            with tempfile.TemporaryFile("w+") as f:
                procs = [subprocess.Popen([sys.executable, __file__, *sys.argv[1:]], env=dict(env, PROBE_RANK=str(r)),
                                          stdout=f if r == 0 else subprocess.DEVNULL) for r in range(args.world)]
                codes = [q.wait() for q in procs]
                f.seek(0)
                text = f.read().strip()
            if any(codes) or not text:
                print(json.dumps({"round": rnd, "lib": name, "failed": codes}), flush=True)
                continue
            for row in json.loads(text.splitlines()[-1]):
                print(json.dumps({"round": rnd, "lib": name, **row}), flush=True)


if __name__ == "__main__":
    main()
