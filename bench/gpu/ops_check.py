"""The three operations at world N, one process per rank, against float64
references (correctness only: nothing here is timed).

    python3 bench/gpu/ops_check.py [--world 4] [--gpus 1]

With --gpus 1 (the default) every rank shares device 0, so world 4 runs on a
one-GPU machine (contexts time-slice); with --gpus G rank r uses device r % G.

Every rank builds every rank's inputs from one seed, so each checks its own
outputs against a float64 reference on the CPU; outputs are poisoned (NaN)
first. Exits non-zero if any rank fails."""
import argparse
import os
import subprocess
import sys

import torch

import symm

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 5e-3}


def inputs(seed, world, shape, dtype):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g).to(dtype) for _ in range(world)]


def rel(got, ref):
    return ((got.double().cpu() - ref).norm() / ref.norm()).item()


def rank_main(rank, world, gpus, uid):
    device = rank % gpus
    torch.cuda.set_device(device)
    g = symm.Group.from_unique_id(uid, world, rank, device=device, backend="cuda", timeout_ms=120000,
                                  allow_shared_device=gpus < world)
    failures = []
    for dtype in TOL:
        for dim in (0, 1):
            # ag_mm: shards [4, 6, 32] gathered along `dim`, two Bs.
            shards = inputs(1, world, (4, 6, 32), dtype)
            bs = inputs(2, 2, (32, 24), dtype)
            gathered = torch.cat([s.double() for s in shards], dim=dim)
            outs = symm.fused_ag_mm(g, shards[rank].cuda(), [b.cuda() for b in bs], dim)
            for o, b in zip(outs, bs):
                e = rel(o, gathered @ b.double())
                if not e < TOL[dtype]:
                    failures.append(f"ag_mm {dtype} dim {dim}: {e}")
            # mm_rs: a [8, 12, 32] @ [32, 16], scattered along `dim`, avg.
            a = inputs(3, world, (8, 12, 32), dtype)
            b = inputs(4, world, (32, 16), dtype)
            total = sum(x.double() @ y.double() for x, y in zip(a, b)) / world
            got = symm.mm_rs(g, a[rank].cuda(), b[rank].cuda(), dim, op="avg")
            e = rel(got, torch.chunk(total, world, dim=dim)[rank])
            if not e < TOL[dtype]:
                failures.append(f"mm_rs {dtype} dim {dim}: {e}")
        xs = inputs(5, world, (16, 40), dtype)
        out = torch.full((16 * world, 40), float("nan"), dtype=dtype, device="cuda")
        symm.lc_allgather(g, xs[rank].cuda(), out=out)
        if not torch.equal(out.cpu(), torch.cat(xs)):
            failures.append(f"lc_allgather {dtype}")
    torch.cuda.synchronize()
    g.check_async_error()
    g.close()
    for f in failures:
        print(f"rank {rank}: FAIL {f}", flush=True)
    return 1 if failures else 0


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--gpus", type=int, default=1, help="rank r runs on device r %% gpus")
    args = p.parse_args()
    if "SYMM_TEST_RANK" in os.environ:
        rank = int(os.environ["SYMM_TEST_RANK"])
        sys.exit(rank_main(rank, args.world, args.gpus, bytes.fromhex(os.environ["SYMM_TEST_UID"])))
    uid = symm.get_unique_id()
    env = dict(os.environ, SYMM_TEST_UID=uid.hex())
    procs = [subprocess.Popen([sys.executable, __file__, "--world", str(args.world), "--gpus", str(args.gpus)],
                              env=dict(env, SYMM_TEST_RANK=str(r))) for r in range(args.world)]
    codes = [p.wait(timeout=600) for p in procs]
    ok = all(c == 0 for c in codes)
    print(f"{'PASS' if ok else 'FAIL'} ops_check world={args.world} gpus={args.gpus} (fused_ag_mm, mm_rs, lc_allgather; f32/bf16/f16)")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
