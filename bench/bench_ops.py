"""symm's operations beside what users would pick instead, in one run.

Launch on the GPU machine with one process per GPU:
    torchrun --nproc-per-node 2 bench/bench_ops.py --out DIR [--quick]

At more than 2 ranks the shapes are divided as tensor parallelism does
(`tp_shapes`).

For every shape it times, with CUDA events (median of --iters after
--warmup, maximum over ranks): symm's op; PyTorch's fused symmetric-memory op;
NCCL then cuBLAS; the matmul alone and the communication alone (the floor is
their max). lc_allgather is timed against NCCL's all-gather and PyTorch's
low-contention all-gather, and `contention` is the time of four 8192^3 GEMMs
alone and beside each all-gather. Every symm result is checked against the
NCCL-then-cuBLAS result (relative error) before it is timed. Shapes with
M <= --graph-max-m are timed a second way too (impl names ending in
`_graph`): every implementation captured in a CUDA graph of 10 calls and
replayed, which leaves the host's issue time out, as in an inference
engine that captures its decode step.

Writes DIR/records.jsonl (one JSON record per line, DESIGN.md's fields) and
prints a table of ratios to the floor.
"""
import argparse
import json
import os
import statistics

import torch
import torch.distributed as dist

for var, value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
    assert os.environ.get(var) == value, f"{var} must be {value}: NVLink multicast is forbidden on these machines"

import symm  # noqa: E402  (after the environment check)

AG_MM_SHAPES = [(16384, 8192, 8192), (8192, 8192, 14336), (2048, 8192, 14336), (512, 8192, 14336)]
MM_RS_SHAPES = [(16384, 4096, 8192), (8192, 14336, 8192), (2048, 14336, 8192), (512, 14336, 8192)]
LC_SIZES_MB = [1, 16, 64, 256]


class Bench:
    def __init__(self, args):
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.iters, self.warmup = args.iters, args.warmup
        self.graph_max_m = args.graph_max_m
        self.stream = torch.cuda.current_stream()
        self.records = []
        self.group_name = dist.group.WORLD.group_name

    def time(self, fn, iters=None):
        """Median ms of `fn` over iterations, each started with all ranks
        aligned, then the maximum over ranks."""
        for _ in range(self.warmup):
            fn()
        return self.median_ms(fn, iters or self.iters)

    def median_ms(self, fn, iters, calls_per_fn=1):
        """Median over `iters` runs of `fn` (each started with all ranks
        aligned) of ms per call, then the maximum over ranks."""
        times = []
        for _ in range(iters):
            torch.cuda.synchronize()
            dist.barrier()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / calls_per_fn)
        t = torch.tensor([statistics.median(times)], device="cuda")
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.item()

    def time_graph(self, fn, reps=10):
        """Median ms of one `fn`, replayed from a CUDA graph that captured
        `reps` calls (so the host's issue time is out of the measurement,
        as in an inference engine that captures its decode step), then the
        maximum over ranks; None where some rank could not capture it."""
        ok = torch.ones(1, device="cuda")
        graph = torch.cuda.CUDAGraph()
        try:
            fn()  # outside the capture: workspaces, plans, communicators
            torch.cuda.synchronize()
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                for _ in range(reps):
                    fn()
        except Exception as e:  # noqa: BLE001 - any failure to capture is reported, not fatal
            print(f"rank {self.rank}: capture failed: {type(e).__name__}: {e}", flush=True)
            ok.zero_()
        torch.cuda.synchronize()
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        if ok.item() == 0:
            return None
        for _ in range(self.warmup):
            graph.replay()
        return self.median_ms(graph.replay, self.iters, calls_per_fn=reps)

    def record_graph(self, op, shape, impl, fn):
        try:
            ms = self.time_graph(fn)
        except Exception as e:  # noqa: BLE001 - a graph row is extra; the run goes on without it
            print(f"rank {self.rank}: {op} {shape} {impl} from a graph: {type(e).__name__}: {e}", flush=True)
            torch.cuda.synchronize()
            return
        if ms is not None:
            self.record(op, shape, impl + "_graph", ms)

    def record(self, op, shape, impl, ms, **extra):
        rec = {"op": op, "shape": list(shape), "dtype": "bf16", "impl": impl, "ms": round(ms, 4), "iters": self.iters,
               "world": self.world}
        rec.update(extra)
        self.records.append(rec)
        if self.rank == 0:
            print(json.dumps(rec), flush=True)


def rel_err(x, ref):
    return ((x.float() - ref.float()).norm() / ref.float().norm()).item()


def time_symm_algorithms(b, op, shape, ours, out, ref, tolerance):
    """symm's own choice, then each algorithm forced (SYMM_ALGO); every one
    is checked against `ref` (outputs poisoned first) before it is timed."""
    for algo in (None, "sequential", "pipelined", "fused"):
        if algo:
            os.environ["SYMM_ALGO"] = algo
        out.fill_(float("nan"))
        ours()
        err = rel_err(out, ref)
        assert err < tolerance, f"{op} {shape} ({algo or 'auto'}): relative error {err}"
        ms = b.time(ours)
        # Timed calls repeat one call, which symm replays as a graph: check
        # a replay too.
        out.fill_(float("nan"))
        ours()
        replay_err = rel_err(out, ref)
        assert replay_err < tolerance, f"{op} {shape} ({algo or 'auto'}) replayed: relative error {replay_err}"
        b.record(op, shape, f"symm_{algo}" if algo else "symm", ms, relerr=max(err, replay_err))
        os.environ.pop("SYMM_ALGO", None)


def linear_weight(k, n):
    """B as tensor parallelism has it: an nn.Linear weight [n, k] used as
    `x @ weight.t()`, i.e. a K-major [k, n] (every implementation gets the
    same tensor)."""
    return (torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5).t()


def bench_ag_mm(b, g, shapes):
    import torch.distributed._symmetric_memory as symm_mem

    symm_mem.enable_symm_mem_for_group(b.group_name)
    for m, k, n in shapes:
        a_shard = torch.randn(m // b.world, k, device="cuda", dtype=torch.bfloat16)
        w = linear_weight(k, n)
        gathered = torch.empty(m, k, device="cuda", dtype=torch.bfloat16)
        out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        ref = torch.empty_like(out)

        def nccl_cublas():
            dist.all_gather_into_tensor(gathered, a_shard)
            torch.matmul(gathered, w, out=ref)

        def ours():
            symm.fused_ag_mm(g, a_shard, [w], gather_dim=0, out=[out], stream=torch.cuda.current_stream().cuda_stream)

        nccl_cublas()
        shape = (m, k, n)
        time_symm_algorithms(b, "ag_mm", shape, ours, out, ref, 1e-2)
        b.record("ag_mm", shape, "torch_fused", b.time(
            lambda: torch.ops.symm_mem.fused_all_gather_matmul(a_shard, [w], 0, b.group_name)))
        b.record("ag_mm", shape, "nccl_cublas", b.time(nccl_cublas))
        b.record("ag_mm", shape, "mm_only", b.time(lambda: torch.matmul(gathered, w, out=ref)))
        b.record("ag_mm", shape, "comm_only", b.time(lambda: dist.all_gather_into_tensor(gathered, a_shard)))
        if m <= b.graph_max_m:
            b.record_graph("ag_mm", shape, "symm", ours)
            b.record_graph("ag_mm", shape, "torch_fused",
                           lambda: torch.ops.symm_mem.fused_all_gather_matmul(a_shard, [w], 0, b.group_name))
            b.record_graph("ag_mm", shape, "nccl_cublas", nccl_cublas)
            b.record_graph("ag_mm", shape, "mm_only", lambda: torch.matmul(gathered, w, out=ref))


def bench_mm_rs(b, g, shapes):
    for m, k, n in shapes:
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = linear_weight(k, n)
        c = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        out = torch.empty(m // b.world, n, device="cuda", dtype=torch.bfloat16)
        ref = torch.empty_like(out)

        def nccl_cublas():
            torch.matmul(a, w, out=c)
            dist.reduce_scatter_tensor(ref, c)

        def ours():
            symm.mm_rs(g, a, w, scatter_dim=0, op="sum", out=out, stream=torch.cuda.current_stream().cuda_stream)

        nccl_cublas()
        shape = (m, k, n)
        time_symm_algorithms(b, "mm_rs", shape, ours, out, ref, 2e-2)
        b.record("mm_rs", shape, "torch_fused", b.time(
            lambda: torch.ops.symm_mem.fused_matmul_reduce_scatter(a, w, "sum", 0, b.group_name)))
        b.record("mm_rs", shape, "nccl_cublas", b.time(nccl_cublas))
        b.record("mm_rs", shape, "mm_only", b.time(lambda: torch.matmul(a, w, out=c)))
        b.record("mm_rs", shape, "comm_only", b.time(lambda: dist.reduce_scatter_tensor(ref, c)))
        if m <= b.graph_max_m:
            b.record_graph("mm_rs", shape, "symm", ours)
            b.record_graph("mm_rs", shape, "torch_fused",
                           lambda: torch.ops.symm_mem.fused_matmul_reduce_scatter(a, w, "sum", 0, b.group_name))
            b.record_graph("mm_rs", shape, "nccl_cublas", nccl_cublas)
            b.record_graph("mm_rs", shape, "mm_only", lambda: torch.matmul(a, w, out=c))


def symmetric_tensor(g, numel):
    """A bf16 tensor of `numel` elements in a rendezvoused symmetric buffer
    (the buffer and handle stay alive with the returned tuple)."""
    buf = g.create(numel * 2)
    handle = buf.rendezvous()
    return torch.as_tensor(buf.cuda_bytes(), device="cuda").view(torch.bfloat16), (buf, handle)


def completed(fn):
    """`fn` whose work on other streams is waited for (a device-wide
    synchronize), so the end event marks completion, not enqueue: PyTorch's
    low-contention all-gather copies on its own side stream."""
    def run():
        fn()
        torch.cuda.synchronize()
    return run


def bench_lc_allgather(b, g, sizes_mb):
    """symm from an ordinary tensor (staged in the workspace) and from a
    symmetric buffer (`symm_inplace`, peers read it where it is), NCCL, and
    PyTorch's low-contention all-gather (input in its symmetric memory)."""
    import torch.distributed._symmetric_memory as symm_mem

    for mb in sizes_mb:
        n = mb * (1 << 20) // 2
        x = torch.randn(n, device="cuda", dtype=torch.bfloat16)
        xs, keep = symmetric_tensor(g, n)
        xs.copy_(x)
        xt = symm_mem.empty(n, device="cuda", dtype=torch.bfloat16).copy_(x)
        symm_mem.rendezvous(xt, b.group_name)
        out = torch.empty(b.world * n, device="cuda", dtype=torch.bfloat16)
        ref = torch.empty_like(out)
        dist.all_gather_into_tensor(ref, x)
        shape = (mb << 20,)
        for impl, src in (("symm", x), ("symm_inplace", xs)):
            out.fill_(float("nan"))
            symm.lc_allgather(g, src, out=out, stream=b.stream.cuda_stream)
            assert torch.equal(out, ref), f"lc_allgather {mb} MB ({impl}) differs from NCCL"
            b.record("lc_allgather", shape, impl, b.time(
                lambda: symm.lc_allgather(g, src, out=out, stream=b.stream.cuda_stream)))
            out.fill_(float("nan"))
            symm.lc_allgather(g, src, out=out, stream=b.stream.cuda_stream)
            assert torch.equal(out, ref), f"lc_allgather {mb} MB ({impl}) replayed differs from NCCL"
        b.record("lc_allgather", shape, "nccl", b.time(lambda: dist.all_gather_into_tensor(ref, x)))
        b.record("lc_allgather", shape, "torch_lc", b.time(
            completed(lambda: torch.ops.symm_mem._low_contention_all_gather(xt, b.group_name))))
        del keep


def bench_contention(b, g):
    """Four 8192^3 GEMMs on the main stream; an all-gather of 256 MB per rank
    loops on a side stream meanwhile. `ms` is the GEMMs' time."""
    n = 8192
    mats = [torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    x = torch.randn(128 << 20, device="cuda", dtype=torch.bfloat16)
    xs, keep = symmetric_tensor(g, x.numel())
    xs.copy_(x)
    out = torch.empty(b.world * x.numel(), device="cuda", dtype=torch.bfloat16)
    side = torch.cuda.Stream()
    comms = {
        "none": None,
        "nccl": lambda: dist.all_gather_into_tensor(out, x),
        "symm": lambda: symm.lc_allgather(g, x, out=out, stream=side.cuda_stream),
        "symm_inplace": lambda: symm.lc_allgather(g, xs, out=out, stream=side.cuda_stream),
    }
    for impl, comm in comms.items():
        def gemms():
            if comm is not None:
                side.wait_stream(b.stream)
                with torch.cuda.stream(side):
                    for _ in range(3):
                        comm()
            for _ in range(4):
                torch.matmul(mats[0], mats[1], out=mats[2])
            b.stream.wait_stream(side)

        b.record("contention", (256 << 20,), impl, b.time(gemms, iters=max(5, b.iters // 3)))
    del keep


def table(records):
    rows = {}
    for r in records:
        rows.setdefault((r["op"], tuple(r["shape"])), {})[r["impl"]] = r["ms"]
    print(f"\n{'op':<14}{'shape':<22}{'symm':>8}{'torch':>8}{'nccl+mm':>9}{'floor':>8}{'symm/floor':>11}{'torch/floor':>12}")
    for (op, shape), t in rows.items():
        if op not in ("ag_mm", "mm_rs"):
            continue
        floor = max(t.get("mm_only", 0), t.get("comm_only", 0))
        print(f"{op:<14}{'x'.join(map(str, shape)):<22}{t.get('symm', 0):8.3f}{t.get('torch_fused', 0):8.3f}"
              f"{t.get('nccl_cublas', 0):9.3f}{floor:8.3f}{t.get('symm', 0) / floor:11.3f}{t.get('torch_fused', 0) / floor:12.3f}")
    graphs = [(k, t) for k, t in rows.items() if "symm_graph" in t]
    if graphs:
        print(f"\nreplayed from CUDA graphs (ms per call)\n{'op':<14}{'shape':<22}{'symm':>8}{'torch':>8}"
              f"{'nccl+mm':>9}{'mm':>8}")
        for (op, shape), t in graphs:
            print(f"{op:<14}{'x'.join(map(str, shape)):<22}" + "".join(
                f"{t.get(i + '_graph', float('nan')):{w}.3f}"
                for i, w in (("symm", 8), ("torch_fused", 8), ("nccl_cublas", 9), ("mm_only", 8))))
    for (op, shape), t in rows.items():
        if op == "lc_allgather":
            print(f"{op:<14}{shape[0] >> 20:>5} MB/rank   symm {t.get('symm', 0):.3f}  "
                  f"symm_inplace {t.get('symm_inplace', 0):.3f}  nccl {t.get('nccl', 0):.3f}  "
                  f"torch_lc {t.get('torch_lc', 0):.3f} ms")
        if op == "contention":
            print(f"{op:<14}4 GEMMs: {t}")


def tp_shapes(shapes, world, sharded):
    """The anchor shapes are for 2 GPUs. Tensor parallelism over more ranks
    divides the sharded dimension (N of the column-parallel ag_mm, K of the
    row-parallel mm_rs; index 2 or 1 of M x K x N) by the world size."""
    if world <= 2:
        return shapes
    return [tuple(d // world if i == sharded else d for i, d in enumerate(s)) for s in shapes]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--quick", action="store_true", help="one shape per op, for a smoke test")
    p.add_argument("--graph-max-m", type=int, default=2048,
                   help="also time shapes up to this M replayed from CUDA graphs (0: none)")
    p.add_argument("--only", default="ag_mm,mm_rs,lc_allgather,contention")
    args = p.parse_args()
    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    b = Bench(args)
    torch.manual_seed(1234 + b.rank)
    g = symm.Group.from_env(backend="cuda", timeout_ms=60000)
    only = args.only.split(",")
    if "ag_mm" in only:
        shapes = tp_shapes(AG_MM_SHAPES, b.world, sharded=2)
        bench_ag_mm(b, g, shapes[-1:] if args.quick else shapes)
    if "mm_rs" in only:
        shapes = tp_shapes(MM_RS_SHAPES, b.world, sharded=1)
        bench_mm_rs(b, g, shapes[-1:] if args.quick else shapes)
    if "lc_allgather" in only:
        bench_lc_allgather(b, g, LC_SIZES_MB[:2] if args.quick else LC_SIZES_MB)
    if "contention" in only and not args.quick:
        bench_contention(b, g)
    g.check_async_error()
    if b.rank == 0:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "records.jsonl"), "w") as f:
            for r in b.records:
                f.write(json.dumps(r) + "\n")
        table(b.records)
    g.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
