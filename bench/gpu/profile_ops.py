"""Where the time of one symm operation goes: torch.profiler (CUPTI) over a
few calls of fused_ag_mm / mm_rs with one algorithm forced, per rank, on
the GPU machine. Prints, per rank, every kernel and copy of the last call
with its start (relative to the call's first activity) and duration, so a
wait (a kernel spinning on a flag, a copy that starts late) shows. Every
rank prints its own timeline, rank 0 first (a wait on one rank is often
explained by the other's).

    torchrun --nproc-per-node 2 bench/gpu/profile_ops.py [--cases ag_mm:512:8192:14336:fused,...]

With --back-to-back the profiled calls follow one another with nothing
between them (as in a decode loop or a graph replay), and every call is
printed: how long each takes in lock step with the other rank. With
--graph N each profiled call is a replay of a CUDA graph of N calls, as
bench_ops.py's `_graph` rows time them (`graph_periods.py` turns that
output into each case's time per call in lock step). Op `mm` is the floor: the local
matmul of all m rows (algorithm ignored), e.g. `mm:512:14336:8192:-`;
ops `nccl_ag_mm` and `nccl_mm_rs` are NCCL-then-cuBLAS as bench_ops.py
times it (torch's all-gather then torch.matmul; torch.matmul then its
reduce-scatter), with ag_mm's and mm_rs's shapes. Op `ag_mm_sym` is ag_mm
with the shard in symmetric memory (the families' `symm_symmetric_in`). Op `layer` is the
families' decode layer (`layer:64:8192:14336:-`: M, hidden, FFN per rank):
ag_mm into H then mm_rs of H into an ordinary output; `nccl_layer` the same
through NCCL and cuBLAS.
A sixth field, a batch (`mm_rs:8192:7168:4096:-:4`), makes A
[batch, m / batch, k] gathered or scattered along dim 1, as the families'
seq3d cases.
mm_rs's output lies in symmetric memory, as bench_ops.py passes it
(SYMM_BENCH_MM_RS_OUT=ordinary: a plain tensor).
"""
import argparse
import os

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile, record_function

import symm

DEFAULT_CASES = ("ag_mm:512:8192:14336:fused,ag_mm:512:8192:14336:pipelined,"
                 "mm_rs:512:14336:8192:fused,mm_rs:512:14336:8192:pipelined,"
                 "mm_rs:16384:4096:8192:fused,mm_rs:16384:4096:8192:pipelined")


def current_stream():
    """The stream current at the call (a graph's capture stream while capturing)."""
    return torch.cuda.current_stream().cuda_stream


# Symmetric buffers (mm_rs outputs, ag_mm_sym shards), alive until the process ends.
_KEEP = []


def case_fn(g, op, m, k, n, world, bound=False, algorithm=None, batch=1):
    """The call of one case; `algorithm` forces symm's algorithm (None: its
    choice); `batch` > 1: A is [batch, m / batch, k] along dim 1."""
    w = (torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5).t()
    lead, dim = ((m,), 0) if batch == 1 else ((batch, m // batch), 1)
    part = tuple(n // world if i == dim else n for i, n in enumerate(lead))  # a rank's shard of the rows
    if op == "mm":
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        c = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        return lambda: torch.matmul(a, w, out=c)
    if op == "nccl_ag_mm":
        a = torch.randn(*part, k, device="cuda", dtype=torch.bfloat16)
        gathered = torch.empty(world * a.shape[0], *a.shape[1:], device="cuda", dtype=torch.bfloat16)
        c = torch.empty(*gathered.shape[:-1], n, device="cuda", dtype=torch.bfloat16)
        return lambda: (dist.all_gather_into_tensor(gathered, a), torch.matmul(gathered, w, out=c))
    if op == "nccl_mm_rs":
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        c = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        out = torch.empty(m // world, n, device="cuda", dtype=torch.bfloat16)
        return lambda: (torch.matmul(a, w, out=c), dist.reduce_scatter_tensor(out, c))
    if op in ("layer", "nccl_layer"):
        # The families' decode layer: k the hidden size, n the FFN's per rank.
        x = torch.randn(m // world, k, device="cuda", dtype=torch.bfloat16)
        w2 = (torch.randn(k, n, device="cuda", dtype=torch.bfloat16) / n**0.5).t()
        h = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        out = torch.empty(m // world, k, device="cuda", dtype=torch.bfloat16)
        if op == "nccl_layer":
            gathered = torch.empty(m, k, device="cuda", dtype=torch.bfloat16)
            c = torch.empty(m, k, device="cuda", dtype=torch.bfloat16)
            return lambda: (dist.all_gather_into_tensor(gathered, x), torch.matmul(gathered, w, out=h),
                            torch.matmul(h, w2, out=c), dist.reduce_scatter_tensor(out, c))
        if bound:
            up = symm.bind(symm.fused_ag_mm, g, x, [w], 0, out=[h], stream=current_stream(), algorithm=algorithm)
            down = symm.bind(symm.mm_rs, g, h, w2, 0, out=out, stream=current_stream(), algorithm=algorithm)
            return lambda: (up(), down())
        return lambda: (symm.fused_ag_mm(g, x, [w], 0, out=[h], stream=current_stream(), algorithm=algorithm),
                        symm.mm_rs(g, h, w2, 0, out=out, stream=current_stream(), algorithm=algorithm))
    if op in ("ag_mm", "ag_mm_sym"):
        a = torch.randn(*part, k, device="cuda", dtype=torch.bfloat16)
        if op == "ag_mm_sym":
            # The shard in a rendezvoused symmetric buffer, as the families'
            # symm_symmetric_in rows pass it.
            buf = g.create(a.numel() * a.element_size())
            _KEEP.append((buf, buf.rendezvous()))
            a = torch.as_tensor(buf.cuda_bytes(), device="cuda").view(torch.bfloat16).view(a.shape).copy_(a)
        out = torch.empty(*lead, n, device="cuda", dtype=torch.bfloat16)
        if bound:
            return symm.bind(symm.fused_ag_mm, g, a, [w], gather_dim=dim, out=[out], stream=current_stream(), algorithm=algorithm)
        return lambda: symm.fused_ag_mm(g, a, [w], gather_dim=dim, out=[out], stream=current_stream(), algorithm=algorithm)
    a = torch.randn(*lead, k, device="cuda", dtype=torch.bfloat16)
    if batch == 1 and os.environ.get("SYMM_BENCH_MM_RS_OUT", "symmetric") == "symmetric":
        # As bench_ops.py passes it by default: in a rendezvoused symmetric
        # buffer, where the fused kernel's peer writes into it.
        buf = g.create(m // world * n * 2)
        _KEEP.append((buf, buf.rendezvous()))
        out = torch.as_tensor(buf.cuda_bytes(), device="cuda").view(torch.bfloat16).view(m // world, n)
    else:
        out = torch.empty(*part, n, device="cuda", dtype=torch.bfloat16)
    if bound:
        return symm.bind(symm.mm_rs, g, a, w, scatter_dim=dim, op="sum", out=out, stream=current_stream(), algorithm=algorithm)
    return lambda: symm.mm_rs(g, a, w, scatter_dim=dim, op="sum", out=out, stream=current_stream(), algorithm=algorithm)


def start_ranks():
    """This torchrun process's GPU, NCCL process group and symm group:
    (rank, world, group)."""
    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    return dist.get_rank(), dist.get_world_size(), symm.Group.from_env(backend="cuda", timeout_ms=60000)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--cases", default=DEFAULT_CASES)
    p.add_argument("--calls", type=int, default=3)
    p.add_argument("--back-to-back", action="store_true", help="no synchronize or barrier between the calls")
    p.add_argument("--graph", type=int, default=0, help="each call a replay of a CUDA graph of this many calls")
    p.add_argument("--bound", action="store_true", help="symm's calls bound once (symm.bind)")
    args = p.parse_args()
    rank, world, g = start_ranks()
    for case in args.cases.split(","):
        op, m, k, n, algo, *batch = case.split(":")
        algo = None if algo in ("", "-") else algo
        fn = case_fn(g, op, int(m), int(k), int(n), world, args.bound, algo, int(batch[0]) if batch else 1)
        for _ in range(5):
            fn()
        if args.graph:
            graph = torch.cuda.CUDAGraph()
            torch.cuda.synchronize()
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                for _ in range(args.graph):
                    fn()
            fn = graph.replay
            for _ in range(3):
                fn()
        torch.cuda.synchronize()
        dist.barrier()
        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            for i in range(args.calls):
                if i == 0 or not args.back_to_back:
                    torch.cuda.synchronize()
                    dist.barrier()
                with record_function("profiled_call"):
                    fn()
            torch.cuda.synchronize()
        # (The annotation below shows on the GPU side too: left out.)
        gpu = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA and e.name != "profiled_call"]
        gpu.sort(key=lambda e: e.time_range.start)
        # The host's entry into each profiled call.
        calls = sorted((e for e in prof.events()
                        if e.name == "profiled_call" and e.device_type == torch.autograd.DeviceType.CPU),
                       key=lambda e: e.time_range.start)
        # What the GPU ran once the host had entered the last call (back to
        # back: the first, and so every call); before it, the barrier's
        # kernel and the synchronize.
        host = calls[0] if args.back_to_back else calls[-1]
        last = next(i for i, e in enumerate(gpu) if e.time_range.start >= host.time_range.start)
        t0 = gpu[last].time_range.start
        end = max(e.time_range.end for e in gpu[last:])
        what = f"{args.calls} calls back to back" if args.back_to_back else "last call"
        if args.graph:
            what += f" (each a graph of {args.graph})"
        if args.bound:
            what += " (bound)"
        head = (f"== {case} rank {rank}: {what} {(end - t0) / 1000:.3f} ms on the GPU, which started "
                f"{(t0 - host.time_range.start) / 1000:.3f} ms after the host entered the call (the host left it "
                f"after {host.time_range.elapsed_us() / 1000:.3f} ms)")
        lines = [head]
        lines += [f"  +{(e.time_range.start - t0) / 1000:7.3f} ms {e.time_range.elapsed_us() / 1000:7.3f} ms  "
                  f"{e.name[:90]}" for e in gpu[last:]]
        for r in range(world):
            if r == rank:
                print("\n".join(lines), flush=True)
            dist.barrier()
        # A graph holding NCCL's kernels kept to the end hung the teardown
        # below (torch 2.11): each case's graph goes with its case.
        fn = graph = None
        torch.cuda.synchronize()
    g.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
