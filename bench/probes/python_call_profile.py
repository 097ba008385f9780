"""Where the Python wrapper's time per call goes: cProfile over many
`symm.bind` calls (which read every argument as a call does, and make no
call), for fused_ag_mm and mm_rs on torch CUDA tensors, world 1, one GPU.

    python3 bench/probes/python_call_profile.py [--calls 3000] [--top 25]

Prints the wall time per bind without the profiler, then the profile's top
functions by their own time."""
import argparse
import cProfile
import os
import pstats
import time

import torch

for var, value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(var, value)
for var, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"), ("MASTER_ADDR", "127.0.0.1"),
                   ("MASTER_PORT", "29511")):
    os.environ.setdefault(var, value)

import symm  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--calls", type=int, default=3000)
    p.add_argument("--top", type=int, default=25)
    args = p.parse_args()
    g = symm.Group.from_env(backend="cuda")
    s = torch.cuda.current_stream().cuda_stream
    bf16 = torch.bfloat16
    a_shard = torch.randn(512, 8192, device="cuda", dtype=bf16)
    w = torch.randn(14336, 8192, device="cuda", dtype=bf16).t()
    out = torch.empty(512, 14336, device="cuda", dtype=bf16)
    a = torch.randn(512, 14336, device="cuda", dtype=bf16)
    w2 = torch.randn(8192, 14336, device="cuda", dtype=bf16).t()
    out2 = torch.empty(512, 8192, device="cuda", dtype=bf16)
    cases = {
        "fused_ag_mm": lambda: symm.bind(symm.fused_ag_mm, g, a_shard, [w], 0, out=[out], stream=s),
        "mm_rs": lambda: symm.bind(symm.mm_rs, g, a, w2, 0, op="sum", out=out2, stream=s),
    }
    for name, fn in cases.items():
        for _ in range(200):
            fn()
        t = time.perf_counter()
        for _ in range(args.calls):
            fn()
        us = (time.perf_counter() - t) / args.calls * 1e6
        print(f"{name}: {us:.1f} us per bind (arguments read, no call)", flush=True)
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.calls):
            fn()
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(args.top)
    g.close()


if __name__ == "__main__":
    main()
