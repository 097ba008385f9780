"""mm_rs at world 2 with the peer's chunk written straight into the peer's
memory by the matmul itself (cuBLAS's D mapped over NVLink), then added
as C by this rank's own matmul: no copy, no pull, no final pass. Does the
matmul slow down when its D lies across NVLink, and what does the whole
path take against the matmul alone and symm's mm_rs of today?

Per shape (M x K x N, M rows of A per rank, bf16 unless named), in one
run, round-robin, eager (sync and barrier before each call, as the
families time plain calls) and replayed from CUDA graphs of 10 calls:
  whole      torch.mm of all M rows (the floor);
  halves     two torch.mm of M/2 rows into local memory;
  remote_d   torch.mm of the peer's M/2 rows with out= the peer's inbox;
  into_peer  barrier, remote_d, barrier, inbox.addmm_(own rows)
             (C = D = the inbox here; the library would write D to out);
  symm       symm.mm_rs of today, ordinary out.
into_peer's result is checked against symm's. The inbox and the barriers
are PyTorch's symmetric memory's (its peer views are tensors on this
device; a VMM mapping of a peer's memory is not one to torch.as_tensor).

    torchrun --nproc-per-node 2 bench/probes/remote_d_probe.py
"""
import os
import statistics

import torch
import torch.distributed as dist

for var, value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
    assert os.environ.get(var) == value, f"{var} must be {value}"

import torch.distributed._symmetric_memory as symm_mem  # noqa: E402

import symm  # noqa: E402

SHAPES = [
    (512, 4096, 8192, torch.bfloat16),
    (512, 7168, 4096, torch.bfloat16),
    (512, 14336, 8192, torch.float16),
    (1024, 4096, 8192, torch.bfloat16),
    (2048, 1536, 8192, torch.float16),
    (4096, 2048, 8192, torch.bfloat16),
    (8192, 14336, 8192, torch.bfloat16),
]
REPS = 10


def main():
    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    rank, peer = dist.get_rank(), 1 - dist.get_rank()
    g = symm.Group.from_env(backend="cuda", timeout_ms=60000)
    torch.manual_seed(11 + rank)
    for m, k, n, dtype in SHAPES:
        half = m // 2
        a = torch.randn(m, k, device="cuda", dtype=dtype)
        w = (torch.randn(n, k, device="cuda", dtype=dtype) / k**0.5).t()
        whole_out = torch.empty(m, n, device="cuda", dtype=dtype)
        halves = torch.empty(m, n, device="cuda", dtype=dtype)
        inbox = symm_mem.empty(half, n, dtype=dtype, device="cuda")
        handle = symm_mem.rendezvous(inbox, dist.group.WORLD.group_name)
        theirs = handle.get_buffer(peer, (half, n), dtype)
        out = torch.empty(half, n, device="cuda", dtype=dtype)
        own, other = a[rank * half:(rank + 1) * half], a[peer * half:(peer + 1) * half]

        def into_peer():
            handle.barrier(channel=1)
            torch.mm(other, w, out=theirs)
            handle.barrier(channel=2)
            inbox.addmm_(own, w)

        fns = {
            "whole": lambda: torch.mm(a, w, out=whole_out),
            "halves": lambda: (torch.mm(other, w, out=halves[:half]), torch.mm(own, w, out=halves[half:])),
            "remote_d": lambda: torch.mm(other, w, out=theirs),
            "into_peer": into_peer,
            "symm": lambda: symm.mm_rs(g, a, w, scatter_dim=0, op="sum", out=out),
        }
        # Check: into_peer's sum against symm's.
        symm.mm_rs(g, a, w, scatter_dim=0, op="sum", out=out)
        into_peer()
        torch.cuda.synchronize()
        ref = out.float()
        err = ((inbox.float() - ref).norm() / ref.norm()).item()
        graphs = {}
        for name, fn in fns.items():
            fn()
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for _ in range(REPS):
                    fn()
            graphs[name] = graph
        times = {(name, mode): [] for name in fns for mode in ("eager", "graph")}
        for r in range(6):
            names = list(fns)
            for i in range(len(names)):
                name = names[(i + r) % len(names)]
                for mode in ("eager", "graph"):
                    for _ in range(3):
                        torch.cuda.synchronize()
                        dist.barrier()
                        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                        s.record()
                        if mode == "eager":
                            fns[name]()
                        else:
                            graphs[name].replay()
                        e.record()
                        e.synchronize()
                        times[(name, mode)].append(s.elapsed_time(e) / (1 if mode == "eager" else REPS))
        med = torch.tensor([statistics.median(v) for v in times.values()], device="cuda")
        dist.all_reduce(med, op=dist.ReduceOp.MAX)
        if rank == 0:
            row = dict(zip(times, med.tolist()))
            name = f"{m}x{k}x{n} {str(dtype).split('.')[-1]}"
            for mode in ("eager", "graph"):
                cells = "  ".join(f"{k[0]} {v * 1e3:7.1f}" for k, v in row.items() if k[1] == mode)
                print(f"{name:26s} {mode:5s} us: {cells}", flush=True)
            print(f"{name:26s} into_peer vs symm relerr {err:.2e}", flush=True)
        del graphs
        torch.cuda.synchronize()
        dist.barrier()
        del handle, theirs, inbox
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
