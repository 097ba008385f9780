"""fp8 fused_ag_mm / mm_rs (bf16 outputs, tensor-wise scales) at a given
world, each of symm's algorithms, with and without a bias: relative error
against float64, which found ops_check's fp8 failures at world 4 (and 2) to
be its own: outputs allocated without out_dtype are fp8, as torch's. Processes as ops_check.py runs them:

    python3 bench/probes/fp8_world_probe.py --world 4 --gpus 4
"""
import os
import subprocess
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "gpu"))
from ops_check import inputs, rel  # noqa: E402

import symm  # noqa: E402


def rank_main(rank, world, gpus, uid):
    torch.cuda.set_device(rank % gpus)
    g = symm.Group.from_unique_id(uid, world, rank, device=rank % gpus, backend="cuda", timeout_ms=60000)
    e4m3 = torch.float8_e4m3fn
    fp8 = lambda seed, n, shape: [(x * 2).to(e4m3) for x in inputs(seed, n, shape, torch.float32)]  # noqa: E731
    lines = []
    for algorithm in (None, "sequential", "pipelined", "fused"):
        for with_bias in (False, True):
            shards = fp8(6, world, (4, 6, 32))
            (w,) = fp8(7, 1, (48, 32))
            sa = torch.tensor([0.75])
            sb = torch.tensor([1.25])
            (bias,) = inputs(10, 1, (48,), torch.bfloat16)
            kw = dict(a_scale=sa.cuda(), b_scales=sb.cuda(), algorithm=algorithm, out_dtype=torch.bfloat16)
            if with_bias:
                kw["biases"] = bias.cuda()
            try:
                out = symm.fused_ag_mm(g, shards[rank].cuda(), w.cuda().t(), 0, **kw)
                gathered = torch.cat([s.double() * sa.double() for s in shards], dim=0)
                want = gathered @ (w.double().t() * sb.double()) + (bias.double() if with_bias else 0)
                lines.append(f"ag_mm alg {algorithm} bias {with_bias}: {rel(out, want):.3e}")
            except Exception as e:  # noqa: BLE001
                lines.append(f"ag_mm alg {algorithm} bias {with_bias}: {type(e).__name__} {e}")
            a = fp8(11, world, (8, 12, 32))
            w2 = fp8(12, world, (16 * world, 32))
            bias2 = inputs(15, world, (16 * world,), torch.bfloat16)
            kw = dict(a_scale=sa.cuda(), b_scale=sb.cuda(), algorithm=algorithm, out_dtype=torch.bfloat16)
            if with_bias:
                kw["bias"] = bias2[rank].cuda()
            try:
                got = symm.mm_rs(g, a[rank].cuda(), w2[rank].cuda().t(), 0, **kw)
                total = sum((x.double() * sa.double()) @ (y.double().t() * sb.double())
                            + (c.double() if with_bias else 0) for x, y, c in zip(a, w2, bias2))
                lines.append(f"mm_rs alg {algorithm} bias {with_bias}: "
                             f"{rel(got, torch.chunk(total, world, dim=0)[rank]):.3e}")
            except Exception as e:  # noqa: BLE001
                lines.append(f"mm_rs alg {algorithm} bias {with_bias}: {type(e).__name__} {e}")
    torch.cuda.synchronize()
    g.close()
    for line in lines:
        print(f"w{world} rank {rank}: {line}", flush=True)
    return 0


def main():
    import argparse

    p = argparse.ArgumentParser()
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--gpus", type=int, default=4)
    args = p.parse_args()
    if "SYMM_TEST_RANK" in os.environ:
        sys.exit(rank_main(int(os.environ["SYMM_TEST_RANK"]), args.world, args.gpus,
                           bytes.fromhex(os.environ["SYMM_TEST_UID"])))
    env = dict(os.environ, SYMM_TEST_UID=symm.get_unique_id().hex())
    procs = [subprocess.Popen([sys.executable, __file__, "--world", str(args.world), "--gpus", str(args.gpus)],
                              env=dict(env, SYMM_TEST_RANK=str(r))) for r in range(args.world)]
    sys.exit(max(p.wait(timeout=300) for p in procs))


if __name__ == "__main__":
    main()
