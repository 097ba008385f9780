"""Two ranks of one process (threads) on one GPU: do the plain signal
primitives work there? Barriers on a symmetric buffer on each rank's own
stream; both ranks' views of rank 0's signal pad read back; a write through
the peer mapping read back through the owner's; then ag_mm and mm_rs
(sequential and pipelined), also with one rank entering 0.3 s late.
Diagnoses the ag_mm failures of shared_gpu_threads_probe.py (see
docs/history/NOTES.md for what it found).
    SYMM_LIBRARY=bundle/libsymm.so python3 bench/probes/shared_gpu_signals_probe.py
"""
import os
import sys
import threading
import time

sys.path.insert(0, "python")
sys.path.insert(0, "python/tests")
import torch  # noqa: E402

import symm  # noqa: E402
from ranks import on_threads  # noqa: E402

W = 2


def groups():
    return symm.local_groups(W, devices=[0] * W, backend="cuda", timeout_ms=5000, allow_shared_device=True)


def step(name, fn):
    try:
        for r, out in enumerate(on_threads(fn, groups(), deadline_s=60)):
            print(f"{name}: rank {r}: {out}", flush=True)
    except Exception as e:  # noqa: BLE001 -- a diagnostic: report and go on
        print(f"{name}: FAILED {e!r}"[:700], flush=True)


def barriers(g):
    torch.cuda.set_device(0)
    s = torch.cuda.Stream()
    with g.create(1 << 20) as buf, buf.rendezvous() as h:
        ptrs = [hex(h.peer_ptr(r)) for r in range(W)] + [hex(h.signal_pad_ptr(r)) for r in range(W)]
        for _ in range(20):
            h.barrier(0, stream=s.cuda_stream)
        s.synchronize()
        # Rank 1 writes a value into rank 0's buffer through its mapping;
        # after a barrier rank 0 reads its own.
        if g.rank == 1:
            h.write_value(0, 64, 1234, stream=s.cuda_stream)
        h.barrier(0, stream=s.cuda_stream)
        s.synchronize()
        if g.rank == 0:
            h.wait_value(0, 64, 1234, stream=s.cuda_stream)
        s.synchronize()
        g.check_async_error()
        return f"20 barriers and a value through the peer mapping: ok; mappings {ptrs}"


def op(algo, name):
    def run(g):
        os.environ["SYMM_ALGO"] = algo
        torch.cuda.set_device(0)
        with torch.cuda.stream(torch.cuda.Stream()):
            a = torch.full((64, 128), 1.0 + g.rank, dtype=torch.bfloat16, device="cuda")
            w = torch.eye(128, dtype=torch.bfloat16, device="cuda")
            if name == "ag_mm":
                ag, out = symm.fused_ag_mm(g, a, w, 0, return_ag=True)
                torch.cuda.synchronize()
                return f"ag rows per shard {[ag[i * 64:(i + 1) * 64].float().mean().item() for i in range(W)]}"
            out = symm.mm_rs(g, a, w, 0)
            torch.cuda.synchronize()
            return f"mm_rs mean {out.float().mean().item()} (want {sum(1.0 + r for r in range(W))})"
    return run


step("barriers", barriers)
for algo in ("sequential", "pipelined"):
    step(f"mm_rs {algo}", op(algo, "mm_rs"))
    step(f"ag_mm {algo}", op(algo, "ag_mm"))


class Raw:
    """A float32 vector at a raw device address, for torch.as_tensor."""

    def __init__(self, ptr, n):
        self.__cuda_array_interface__ = {"shape": (n,), "typestr": "<f4", "data": (ptr, False), "version": 3,
                                         "strides": None}


OWNER = {}
OWNER_SET = threading.Event()


def alias_reads(g):
    """Rank 0 fills its buffer with a kernel; after a barrier rank 1 reads it
    through its own mapping (alias) and through rank 0's address (owner),
    each by cudaMemcpy (torch copy_) and by a kernel (torch mul)."""
    torch.cuda.set_device(0)
    n = 1 << 18
    s = torch.cuda.Stream()
    with torch.cuda.stream(s), g.create(4 * n) as buf, buf.rendezvous() as h:
        if g.rank == 0:
            OWNER["ptr"] = h.peer_ptr(0)
            OWNER_SET.set()
            torch.as_tensor(Raw(h.peer_ptr(0), n), device="cuda").fill_(7.0)
        h.barrier(0, stream=s.cuda_stream)
        out = "wrote"
        if g.rank == 1:
            OWNER_SET.wait(30)
            got = {}
            for name, ptr in (("alias", h.peer_ptr(0)), ("owner", OWNER["ptr"])):
                src = torch.as_tensor(Raw(ptr, n), device="cuda")
                got[f"{name} memcpy"] = torch.empty(n, device="cuda").copy_(src).mean().item()
                got[f"{name} kernel"] = (src * 1.0).mean().item()
            out = str(got)
        h.barrier(0, stream=s.cuda_stream)
        s.synchronize()
        return out


step("alias reads", alias_reads)


def late(rank_late, algo, name):
    """The same call with one rank entering it 0.3 s after the other."""
    inner = op(algo, name)

    def run(g):
        if g.rank == rank_late:
            time.sleep(0.3)
        return inner(g)

    return run


for rank_late in (0, 1):
    step(f"ag_mm sequential, rank {rank_late} late", late(rank_late, "sequential", "ag_mm"))
    step(f"mm_rs pipelined, rank {rank_late} late", late(rank_late, "pipelined", "mm_rs"))


def twice(g):
    """ag_mm sequential twice on one group, rank 1 late only for the first
    call: wrong on the second too means a wrong mapping, not an order."""
    os.environ["SYMM_ALGO"] = "sequential"
    torch.cuda.set_device(0)
    out = []
    with torch.cuda.stream(torch.cuda.Stream()):
        a = torch.full((64, 128), 1.0 + g.rank, dtype=torch.bfloat16, device="cuda")
        w = torch.eye(128, dtype=torch.bfloat16, device="cuda")
        for call in range(2):
            if g.rank == 1 and call == 0:
                time.sleep(0.3)
            ag, _ = symm.fused_ag_mm(g, a, w, 0, return_ag=True)
            torch.cuda.synchronize()
            out.append([ag[i * 64:(i + 1) * 64].float().mean().item() for i in range(W)])
    return f"ag rows per shard, call 1 {out[0]}, call 2 {out[1]}"


step("ag_mm sequential twice", twice)
