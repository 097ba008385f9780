"""An operation's first call while one rank's GPU is still busy: does it
finish? One case per process (a hung case leaves kernels spinning; the
process's exit ends them).

    torchrun --nproc-per-node 2 bench/gpu/first_use_race.py --case CASE

Before each call every rank synchronizes and meets the others; then one rank
queues --busy-ms of GPU sleep on the stream the call will use, and all call
the operation at once. So the busy rank's GPU reaches the call --busy-ms
after its peers', as a rank still finishing earlier work would.

Cases:
  torch_cold  PyTorch's fused_all_gather_matmul, first call of the process.
              Its symmetric workspace is allocated then, and zeroed (signal
              pads included) by a cudaMemset queued behind the busy rank's
              work, while the peers, already rendezvoused over the store,
              signal into it; the zeroing then erases their barrier signals.
  torch_warm  The same call made once before (workspace allocated, GPUs
              idle), then timed with one rank busy.
  symm_cold   symm's mm_rs, fused_ag_mm and lc_allgather, each first call
              of a fresh group with a different rank busy, then again with
              each algorithm forced; every output poisoned (NaN) first and
              checked against NCCL + cuBLAS.

Prints one `RESULT case=... rank=... outcome=completed|hung ...` line per
rank and call; exits 3 if a call hung (after --wait-s) and 1 if a result
was wrong."""
import argparse
import functools
import os
import sys
import time

import torch
import torch.distributed as dist

for var, value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
    assert os.environ.get(var) == value, f"{var} must be {value}: NVLink multicast is forbidden on these machines"

M, K, N = 4096, 4096, 4096


def rel_err(x, ref):
    return ((x.float() - ref.float()).norm() / ref.float().norm()).item()


class Race:
    def __init__(self, args):
        self.args = args
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.failed = False

    def staggered(self, name, busy_rank, fn):
        """Runs `fn` on every rank with `busy_rank`'s GPU --busy-ms behind
        and reports whether it completed within --wait-s (a rank whose call
        hangs reports and exits: nothing else can run in this process)."""
        torch.cuda.synchronize()
        dist.barrier()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if self.rank == busy_rank:
            # torch.cuda._sleep spins for a number of clock cycles (~1.98 GHz).
            torch.cuda._sleep(int(self.args.busy_ms * 1.98e6))
        start.record()
        fn()
        end.record()
        deadline = time.monotonic() + self.args.wait_s
        while not end.query():
            if time.monotonic() > deadline:
                print(f"RESULT case={self.args.case} call={name} rank={self.rank} busy_rank={busy_rank} "
                      f"outcome=hung (not done after {self.args.wait_s} s)", flush=True)
                os._exit(3)
            time.sleep(0.01)
        print(f"RESULT case={self.args.case} call={name} rank={self.rank} busy_rank={busy_rank} "
              f"outcome=completed ms={start.elapsed_time(end):.3f}", flush=True)

    def check(self, name, got, ref, tol):
        err = rel_err(got, ref)
        ok = err < tol
        self.failed |= not ok
        print(f"CHECK case={self.args.case} call={name} rank={self.rank} relerr={err:.2e} "
              f"{'ok' if ok else 'WRONG'}", flush=True)


def torch_cases(r, warm):
    import torch.distributed._symmetric_memory as symm_mem

    group_name = dist.group.WORLD.group_name
    symm_mem.enable_symm_mem_for_group(group_name)
    a_shard = torch.randn(M // r.world, K, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(K, N, device="cuda", dtype=torch.bfloat16) / K**0.5
    gathered = torch.empty(M, K, device="cuda", dtype=torch.bfloat16)
    dist.all_gather_into_tensor(gathered, a_shard)
    ref = gathered @ w
    result = {}

    def call():
        result["ag"], (result["out"],) = torch.ops.symm_mem.fused_all_gather_matmul(a_shard, [w], 0, group_name)

    if warm:
        call()
        torch.cuda.synchronize()
        r.check("torch_fused_ag_mm (warming call)", result["out"], ref, 1e-2)
    r.staggered("torch_fused_ag_mm", 0, call)
    r.check("torch_fused_ag_mm", result["out"], ref, 1e-2)


def symm_cases(r):
    import symm

    g = symm.Group.from_env(backend="cuda", timeout_ms=int(r.args.wait_s * 1000 / 2))
    stream = torch.cuda.current_stream().cuda_stream
    bf16 = torch.bfloat16
    # B K-major (a Linear weight's transpose), as symm's fused kernel needs.
    w = (torch.randn(N, K, device="cuda", dtype=bf16) / K**0.5).t()
    # mm_rs: reduce_scatter(a @ w) along rows.
    a = torch.randn(M, K, device="cuda", dtype=bf16)
    partial = a @ w
    rs_ref = torch.empty(M // r.world, N, device="cuda", dtype=bf16)
    dist.reduce_scatter_tensor(rs_ref, partial)
    rs_out = torch.empty_like(rs_ref)
    # fused_ag_mm: all_gather(a_shard) @ w.
    a_shard = torch.randn(M // r.world, K, device="cuda", dtype=bf16)
    gathered = torch.empty(M, K, device="cuda", dtype=bf16)
    dist.all_gather_into_tensor(gathered, a_shard)
    ag_ref = gathered @ w
    ag_out = torch.empty_like(ag_ref)
    # lc_allgather: 64 MiB per rank.
    x = torch.randn(32 << 20, device="cuda", dtype=bf16)
    lc_ref = torch.empty(r.world * x.numel(), device="cuda", dtype=bf16)
    dist.all_gather_into_tensor(lc_ref, x)
    lc_out = torch.empty_like(lc_ref)
    calls = [
        ("mm_rs", rs_out, rs_ref, 2e-2,
         lambda algo: symm.mm_rs(g, a, w, 0, op="sum", out=rs_out, stream=stream, algorithm=algo)),
        ("fused_ag_mm", ag_out, ag_ref, 1e-2,
         lambda algo: symm.fused_ag_mm(g, a_shard, [w], 0, out=[ag_out], stream=stream, algorithm=algo)),
        ("lc_allgather", lc_out, lc_ref, 0.0, lambda algo: symm.lc_allgather(g, x, out=lc_out, stream=stream)),
    ]
    algos = (None, "sequential", "pipelined", "fused")
    for round_, algo in enumerate(algos):
        for i, (name, out, ref, tol, fn) in enumerate(calls):
            if algo and name == "lc_allgather":
                continue
            label = f"{name}[{algo or 'first call'}]"
            out.fill_(float("nan"))
            try:
                r.staggered(label, (i + round_) % r.world, functools.partial(fn, algo))
            except symm.SymmUnsupported as e:
                print(f"rank {r.rank}: {label} not run here: {e}", flush=True)
                continue
            if tol:
                r.check(label, out, ref, tol)
            else:
                ok = torch.equal(out, ref)
                r.failed |= not ok
                print(f"CHECK case={r.args.case} call={label} rank={r.rank} {'ok (equal)' if ok else 'WRONG'}",
                      flush=True)
    g.check_async_error()
    g.close()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--case", required=True, choices=("torch_cold", "torch_warm", "symm_cold"))
    p.add_argument("--busy-ms", type=float, default=500)
    p.add_argument("--wait-s", type=float, default=20)
    args = p.parse_args()
    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    torch.manual_seed(1234 + dist.get_rank())
    r = Race(args)
    if args.case == "symm_cold":
        symm_cases(r)
    else:
        torch_cases(r, warm=args.case == "torch_warm")
    torch.cuda.synchronize()
    dist.barrier()
    dist.destroy_process_group()
    sys.exit(1 if r.failed else 0)


if __name__ == "__main__":
    main()
