"""Where symm's all-gather across pretend hosts loses to NCCL alone on
NCCL's network transport (bench_hosts.py: 1 MB per rank 591 against 439 us
on two H200s, one NCCL all-gather either way). Times, back to back (events
around --calls calls, median of --samples, max over ranks), each of: torch's
dist.all_gather_into_tensor; symm.lc_allgather on the current (legacy
default) stream; the same under a torch.cuda.Stream of its own; and the
host time of one symm call (perf_counter, the GPU busy). Per size in
--sizes (bytes per rank).

    torchrun --nproc-per-node 2 bench/probes/hosts_gap_probe.py [--transport network|default]
"""
import argparse
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "gpu"))
import bench_hosts  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--transport", default="network", choices=bench_hosts.TRANSPORTS)
    p.add_argument("--sizes", default="65536,1048576,16777216")
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--samples", type=int, default=7)
    args = p.parse_args()
    rank, world, local = (int(os.environ[v]) for v in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
    bench_hosts.set_transport(os.environ, args.transport)
    os.environ["SYMM_HOST_ID"] = bench_hosts.host_id(rank, world)
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    import symm

    g = symm.Group.from_env(backend="cuda", timeout_ms=60000)
    side = torch.cuda.Stream()

    def timed(fn, stream=None):
        stream = stream or torch.cuda.current_stream()
        out = []
        for _ in range(args.samples):
            torch.cuda.synchronize()
            dist.barrier()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(stream):
                start.record()
                for _ in range(args.calls):
                    fn()
                end.record()
            end.synchronize()
            out.append(start.elapsed_time(end) / args.calls * 1000)
        t = torch.tensor([statistics.median(out)], device="cuda")
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.item()

    for nbytes in map(int, args.sizes.split(",")):
        x = torch.randn(nbytes // 2, device="cuda", dtype=torch.bfloat16)
        out = torch.empty(world * x.numel(), device="cuda", dtype=torch.bfloat16)
        ref = torch.empty_like(out)
        nccl = lambda: dist.all_gather_into_tensor(ref, x)  # noqa: E731
        mine = lambda: symm.lc_allgather(g, x, out=out)  # noqa: E731
        for f in (nccl, mine):
            f()
        torch.cuda.synchronize()
        assert torch.equal(out, ref)
        rows = {"nccl": timed(nccl), "symm": timed(mine), "symm_side_stream": timed(mine, side),
                "nccl_side_stream": timed(nccl, side)}
        # Host time of one call while the GPU is busy with the others.
        torch.cuda.synchronize()
        host = []
        for _ in range(args.calls):
            t0 = time.perf_counter()
            mine()
            host.append((time.perf_counter() - t0) * 1e6)
        torch.cuda.synchronize()
        rows["symm_host_us"] = statistics.median(host)
        if rank == 0:
            print(f"{args.transport} {nbytes} B/rank: " + ", ".join(f"{k} {v:.1f}" for k, v in rows.items())
                  + " (us per call)", flush=True)
    g.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
