"""What a 4-byte all-gather in the same NCCL group costs a data collective
on NCCL's network transport: symm's steps across hosts gather every
rank's call tag that way (`NcclTransport::tagged`). Torch's calls alone:
all_gather_into_tensor of 64 KB and 1 MB per rank (bf16), alone and
coalesced with an all-gather of 4 bytes per rank (two bf16: torch
coalesces only collectives of one kind and dtype;
`dist._coalescing_manager`: one ncclGroupStart / ncclGroupEnd), timed as
bench_ops.py times (its Bench: CUDA events, a sync and barrier before each
call, the median of --iters in round-robin rounds, the maximum over ranks).
(Answered: +27-33 us, torch's coalescing path's: symm's tags carried in
the data gained nothing, bench/results/.)

    NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_SOCKET_IFNAME=lo \\
        torchrun --nproc-per-node 2 bench/probes/grouped_tag_probe.py [--iters 100]

Prints one JSON line per case.
"""
import argparse
import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from bench_ops import Bench  # noqa: E402  (checks the multicast environment)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--iters", type=int, default=100)
    args = p.parse_args()
    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    world, rank = dist.get_world_size(), dist.get_rank()
    tag = torch.full((2,), rank + 7, dtype=torch.bfloat16, device="cuda")
    tags = torch.empty(2 * world, dtype=torch.bfloat16, device="cuda")
    for nbytes in (64 << 10, 1 << 20):
        x = torch.randn(nbytes // 2, dtype=torch.bfloat16, device="cuda")
        out = torch.empty(world * x.numel(), dtype=x.dtype, device="cuda")

        def gather_tagged():
            with dist._coalescing_manager(async_ops=False):
                dist.all_gather_into_tensor(out, x)
                dist.all_gather_into_tensor(tags, tag)

        fns = {"all_gather": lambda: dist.all_gather_into_tensor(out, x), "all_gather_tagged": gather_tagged}
        gather_tagged()
        torch.cuda.synchronize()
        assert tags.tolist() == [float(r + 7) for r in range(world) for _ in range(2)], tags.tolist()
        bench = Bench(argparse.Namespace(iters=args.iters, warmup=3, graph_max_m=0))
        for name, ms in bench.contest(fns).items():
            if rank == 0:
                print(json.dumps({"probe": "grouped_tag", "case": name, "bytes_per_rank": nbytes, "ms": ms,
                                  "iters": args.iters, "world": world,
                                  "p2p_disabled": os.environ.get("NCCL_P2P_DISABLE")}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
