"""Two ranks of one process (threads) on one GPU, symm_fused_ag_mm with
return_ag, three calls per algorithm: which gathered shards come back
wrong, and the product's error. Found on one H100 (a112b38): every call
timed out in the side stream's barrier (a signal the waiting rank never
saw), while the same operations pass with the ranks in separate processes
on one GPU (ops_check.py --gpus 1) and on threads with a GPU each
(test_cuda.py on two GPUs). Not yet understood; see docs/history/NOTES.md.
    SYMM_LIBRARY=bundle/libsymm.so python3 bench/probes/shared_gpu_threads_probe.py
"""
import os, sys, threading
sys.path.insert(0, "python"); sys.path.insert(0, "python/tests")
import torch, symm
from ranks import on_threads
W = 2
shards = [torch.randn(64, 128).to(torch.bfloat16) for _ in range(W)]
b = torch.randn(128, 96).to(torch.bfloat16)
gathered = torch.cat(shards).double()
for mode in ["default", "sequential", "pipelined"]:
    if mode != "default": os.environ["SYMM_ALGO"] = mode
    groups = symm.local_groups(W, devices=[0, 0], backend="cuda", timeout_ms=20000, allow_shared_device=True)
    def rank_main(g):
        torch.cuda.set_device(0)
        with torch.cuda.stream(torch.cuda.Stream()):
            a, w = shards[g.rank].cuda(), b.cuda()
            res = []
            for it in range(3):
                ag, out = symm.fused_ag_mm(g, a, w, 0, return_ag=True)
                torch.cuda.synchronize()
                res.append((ag.double().cpu(), out.double().cpu()))
            return res
    try:
        for r, res in enumerate(on_threads(rank_main, groups, deadline_s=60)):
            for it, (ag, out) in enumerate(res):
                bad = [i for i in range(W) if not torch.equal(ag[i*64:(i+1)*64], gathered[i*64:(i+1)*64])]
                zero = [i for i in range(W) if ag[i*64:(i+1)*64].abs().max() == 0]
                e = ((out - gathered @ b.double()).abs().max() / (gathered @ b.double()).abs().max()).item()
                print(f"{mode} rank {r} call {it}: ag shards wrong {bad} (all-zero {zero}), out rel err {e:.2e}", flush=True)
    except Exception as ex:
        print(f"{mode}: {ex!r}"[:600], flush=True)
