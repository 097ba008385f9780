"""The operations at world N, one process per rank, against float64
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


def fp8_checks(g, rank, world):
    """fp8 (torch._scaled_mm semantics, cuBLASLt): ag_mm along dims 0 and 1
    and mm_rs along dims 0 and 2, tensor-wise and row-wise scales, bf16
    outputs with a bias, against float64 references of the decoded values."""
    failures = []
    e4m3, bf16 = torch.float8_e4m3fn, torch.bfloat16
    fp8 = lambda seed, n, shape: [(x * 2).to(e4m3) for x in inputs(seed, n, shape, torch.float32)]  # noqa: E731
    for row_wise in (False, True):
        for dim in (0, 1):
            shards = fp8(6, world, (4, 6, 32))
            (w,) = fp8(7, 1, (48, 32))  # B = w.t(): column-major [32, 48]
            sa = [s.abs() + 0.25 for s in inputs(8, world, (4, 6, 1) if row_wise else (1,), torch.float32)]
            sa = sa if row_wise else [sa[0]] * world
            (sb,) = [s.abs() + 0.25 for s in inputs(9, 1, (1, 48) if row_wise else (1,), torch.float32)]
            (bias,) = inputs(10, 1, (48,), bf16)
            out = symm.fused_ag_mm(g, shards[rank].cuda(), w.cuda().t(), dim, a_scale=sa[rank].cuda(),
                                   b_scales=sb.cuda(), biases=bias.cuda(), out_dtype=bf16)
            gathered = torch.cat([s.double() * t.double() for s, t in zip(shards, sa)], dim=dim)
            e = rel(out, gathered @ (w.double().t() * sb.double()) + bias.double())
            if not e < TOL[bf16]:
                failures.append(f"ag_mm fp8 row_wise {row_wise} dim {dim}: {e}")
        for dim in (0, 2):
            a = fp8(11, world, (2 * world, 12, 32))
            w = fp8(12, world, (16 * world, 32))
            sa = [s.abs() + 0.25 for s in inputs(13, world, (2 * world, 12, 1) if row_wise else (1,), torch.float32)]
            sb = [s.abs() + 0.25 for s in inputs(14, world, (1, 16 * world) if row_wise else (1,), torch.float32)]
            bias = inputs(15, world, (16 * world,), bf16)
            got = symm.mm_rs(g, a[rank].cuda(), w[rank].cuda().t(), dim, a_scale=sa[rank].cuda(),
                             b_scale=sb[rank].cuda(), bias=bias[rank].cuda(), out_dtype=bf16)
            total = sum((x.double() * s.double()) @ (y.double().t() * t.double()) + c.double()
                        for x, y, s, t, c in zip(a, w, sa, sb, bias))
            e = rel(got, torch.chunk(total, world, dim=dim)[rank])
            if not e < TOL[bf16]:
                failures.append(f"mm_rs fp8 row_wise {row_wise} dim {dim}: {e}")
    return failures


def repeated_checks(g, rank, world):
    """Calls repeated on the same arrays, plain and bound (symm.bind), with
    the inputs changed in place between calls: the library reuses the first
    call's preparation and replays it as a graph, so each result is checked
    against its own reference (bf16, outputs poisoned first)."""
    failures = []
    dtype = torch.bfloat16
    shard = inputs(16, world, (64, 32), dtype)[rank].cuda()
    (b,) = inputs(17, 1, (32, 48), dtype)
    a = inputs(18, world, (64 * world, 32), dtype)[rank].cuda()
    (w,) = inputs(19, 1, (32, 40), dtype)
    b, w = b.cuda(), w.cuda()
    ag_out = torch.empty(64 * world, 48, dtype=dtype, device="cuda")
    rs_out = torch.empty(64, 40, dtype=dtype, device="cuda")
    bound_ag = symm.bind(symm.fused_ag_mm, g, shard, b, 0, out=ag_out)
    bound_rs = symm.bind(symm.mm_rs, g, a, w, 0, out=rs_out)
    for step in range(4):
        for x in (shard, a):
            x[0, 0] = float(step)  # every rank's row 0 of its part, the same new value
        for bound in (False, True):
            ag_out.fill_(float("nan"))
            rs_out.fill_(float("nan"))
            if bound:
                bound_ag()
                bound_rs()
            else:
                symm.fused_ag_mm(g, shard, b, 0, out=ag_out)
                symm.mm_rs(g, a, w, 0, out=rs_out)
            shards = [s.double() for s in inputs(16, world, (64, 32), dtype)]
            parts = [x.double() for x in inputs(18, world, (64 * world, 32), dtype)]
            for x in shards + parts:
                x[0, 0] = float(step)
            e_ag = rel(ag_out, torch.cat(shards) @ b.double().cpu())
            total = sum(parts) @ w.double().cpu()
            e_rs = rel(rs_out, torch.chunk(total, world)[rank])
            if not (e_ag < TOL[dtype] and e_rs < TOL[dtype]):
                failures.append(f"repeated call {step} bound {bound}: ag_mm {e_ag}, mm_rs {e_rs}")
    return failures


def all_reduce_checks(g, rank, world):
    """all_reduce (sum, avg; one-shot, two-shot; sizes that leave partial
    chunks and chunk groups) and all_reduce_rmsnorm (rows fused in the
    one-shot, in registers or not; after the two-shot), poisoned outputs."""
    failures = []
    for dtype in TOL:
        for numel in (3, 4097, 600_001, 3 << 20):
            xs = inputs(6, world, (numel,), dtype)
            total = sum(x.double() for x in xs)
            for algorithm in ("one_shot", "two_shot"):
                for op, want in (("sum", total), ("avg", total / world)):
                    out = torch.full((numel,), float("nan"), dtype=dtype, device="cuda")
                    for _ in range(2):  # the second call is a kept (replayed) one
                        symm.all_reduce(g, xs[rank].cuda(), op=op, out=out, algorithm=algorithm)
                    e = rel(out, want)
                    if not e < TOL[dtype] * 2:
                        failures.append(f"all_reduce {dtype} {numel} {algorithm} {op}: {e}")
    eps = 1e-6
    for tokens, hidden in ((1, 4096), (7, 8192), (3, 20480), (5, 36)):
        xs = inputs(7, world, (tokens, hidden), torch.bfloat16)
        res, w = inputs(8, 2, (tokens, hidden), torch.bfloat16)[0], inputs(9, 1, (hidden,), torch.bfloat16)[0]
        r = (sum(x.double() for x in xs).to(torch.bfloat16).double() + res.double()).to(torch.bfloat16).double()
        want = r / torch.sqrt((r * r).mean(-1, keepdim=True) + eps) * w.double()
        for algorithm in ("one_shot", "two_shot"):
            out, ro = symm.all_reduce_rmsnorm(g, xs[rank].cuda(), res.cuda(), w.cuda(), eps, algorithm=algorithm)
            e1, e2 = rel(ro, r), rel(out, want)
            if not (e1 < 2e-2 and e2 < 2e-2):
                failures.append(f"all_reduce_rmsnorm {tokens}x{hidden} {algorithm}: {e1} {e2}")
    return failures


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
            # mm_rs: a [2 world, 3 world, 32] @ [32, 16], scattered along `dim`, avg.
            a = inputs(3, world, (2 * world, 3 * world, 32), dtype)
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
    failures += all_reduce_checks(g, rank, world)
    failures += fp8_checks(g, rank, world)
    failures += repeated_checks(g, rank, world)
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
    print(f"{'PASS' if ok else 'FAIL'} ops_check world={args.world} gpus={args.gpus} "
          "(fused_ag_mm, mm_rs, lc_allgather, all_reduce, all_reduce_rmsnorm; f32/bf16/f16; fp8; repeated and bound calls)")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
