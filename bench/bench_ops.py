"""symm's operations beside what users would pick instead, in one run.

Launch on the GPU machine with one process per GPU:
    torchrun --nproc-per-node 2 bench/bench_ops.py --out DIR [--quick]

At more than 2 ranks the shapes are divided as tensor parallelism does
(`tp_shapes`).

For every shape it times, with CUDA events (median of --iters after
--warmup, maximum over ranks), every implementation of the shape in
round-robin rounds of a few calls each (the GPU's clock drifts as it heats,
which would favour whichever implementation ran first): symm's op; PyTorch's fused symmetric-memory op;
NCCL then cuBLAS; the matmul alone and the communication alone (the floor is
their max). lc_allgather is timed against NCCL's all-gather and PyTorch's
low-contention all-gather, and `contention` is the time of four 8192^3 GEMMs
alone and beside each all-gather. Every symm result is checked against the
NCCL-then-cuBLAS result (relative error) before it is timed. Shapes with
M <= --graph-max-m are timed a second way too (impl names ending in
`_graph`): every implementation (symm's own choice and, forced, its
pipelined and fused algorithms) captured in a CUDA graph of 10 calls and
replayed, which leaves the host's issue time out, as in an inference
engine that captures its decode step.

Writes DIR/records.jsonl (one JSON record per line, DESIGN.md's fields) and
prints a table of ratios to the floor. Each timed run starts after a
synchronize and a barrier on torch's default communicator (--barrier
separate: on one that no timed call uses; see BARRIERS).
"""
import argparse
import faulthandler
import functools
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
LC_SIZES = [1 << 20, 16 << 20, 64 << 20, 256 << 20]
# symm's own choice, each algorithm forced, and the bound calls (symm_algorithms).
ALGOS = (None, "sequential", "pipelined", "fused", "bound", "pipelined_bound", "fused_bound")
# The records' names of torch's dtypes.
DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "f16", torch.float8_e4m3fn: "fp8_e4m3"}
# Runs of each implementation per round-robin round (Bench.contest).
ROUND_ITERS = 5
# Calls captured per CUDA graph in the graph-replayed rows.
GRAPH_REPS = 10
# What aligns the ranks before each timed run (--barrier): torch's default
# NCCL communicator, which NCCL's own rows then use just after it; a torch
# NCCL communicator that no timed call uses; or gloo (looser: its skew adds
# to every time).
BARRIERS = ("default", "separate", "gloo")


class Bench:
    def __init__(self, args):
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.iters, self.warmup = args.iters, args.warmup
        self.graph_max_m = args.graph_max_m
        self.stream = torch.cuda.current_stream()
        self.records = []
        self.group_name = dist.group.WORLD.group_name
        # What aligns the ranks before each timed run (BARRIERS).
        barrier = getattr(args, "barrier", "default")
        self.barrier_group = None if barrier == "default" else dist.new_group(
            list(range(self.world)), backend="gloo" if barrier == "gloo" else "nccl")

    def samples(self, fn, iters, calls_per_fn=1):
        """ms per call of `iters` runs of `fn`, each started with all ranks
        aligned."""
        times = []
        for _ in range(iters):
            torch.cuda.synchronize()
            dist.barrier(group=self.barrier_group)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / calls_per_fn)
        return times

    def contest(self, fns, iters=None, calls_per_fn=1):
        """{name: median ms per call, maximum over ranks} of every function
        in `fns`, timed in round-robin rounds of ROUND_ITERS runs, each
        round starting one function later, after --warmup runs of each."""
        iters = iters or self.iters
        names = list(fns)
        trace = os.environ.get("SYMM_BENCH_TRACE") == "1"
        overlap = os.environ.get("SYMM_BENCH_OVERLAP_WARMUPS") == "1"
        for name, fn in fns.items():
            for _ in range(self.warmup):
                fn()
            if trace:
                print(f"rank {self.rank}: {name} warmed up", flush=True)
            # Each implementation's warmup ends on a quiet GPU, as every
            # timed sample does. (The hang once seen with back-to-back
            # warmups was PyTorch's first call racing its own workspace's
            # zeroing, see torch_fused_checked, which now makes that call
            # first; SYMM_BENCH_OVERLAP_WARMUPS=1 keeps warmups back to back.)
            if not overlap:
                torch.cuda.synchronize()
                if trace:
                    print(f"rank {self.rank}: {name} done on the GPU", flush=True)
        times = {name: [] for name in names}
        for r in range(max(1, -(-iters // ROUND_ITERS))):
            for i in range(len(names)):
                name = names[(i + r) % len(names)]
                times[name] += self.samples(fns[name], ROUND_ITERS, calls_per_fn)
        t = torch.tensor([statistics.median(times[n]) for n in names], device="cuda")
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return dict(zip(names, t.tolist()))

    def graph_replay(self, fn, reps=GRAPH_REPS):
        """A function that replays a CUDA graph of `reps` calls of `fn` (so
        the host's issue time is out of the measurement, as in an inference
        engine that captures its decode step), or None where some rank
        could not capture it (reported)."""
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
        return graph.replay if ok.item() else None

    def record_graphs(self, op, shape, fns, **extra):
        """Times `fns` replayed from CUDA graphs, in one contest; records
        them as `<name>_graph` (with the record fields `extra`)."""
        replays = {name: self.graph_replay(fn) for name, fn in fns.items()}
        replays = {name: r for name, r in replays.items() if r is not None}
        if replays:
            for name, ms in self.contest(replays, calls_per_fn=GRAPH_REPS).items():
                self.record(op, shape, name + "_graph", ms, **extra)

    def record(self, op, shape, impl, ms, **extra):
        """One record (DESIGN.md's fields; `extra` adds or overrides fields,
        `dtype` among them)."""
        rec = {"op": op, "shape": list(shape), "dtype": "bf16", "impl": impl, "ms": round(ms, 4), "iters": self.iters,
               "world": self.world}
        rec.update(extra)
        self.records.append(rec)
        if self.rank == 0:
            print(json.dumps(rec), flush=True)


def rel_err(x, ref):
    return ((x.float() - ref.float()).norm() / ref.float().norm()).item()


def symm_algorithms(op, shape, ours, bind, out, ref, tolerance, algos=ALGOS):
    """{impl: fn} of symm's own choice, each algorithm forced (the
    `algorithm=` keyword: `ours(algorithm)`), and the call bound once
    (`bind(algorithm)`: symm's choice, pipelined and fused forced), those
    of `algos` (ALGOS' names), and {impl: relative error}:
    every one checked against `ref` (outputs poisoned first) twice, since
    timed calls repeat one call, which symm replays as a graph from its
    second occurrence."""
    fns, errs = {}, {}
    for algo in algos:
        impl = f"symm_{algo}" if algo else "symm"
        if algo and algo.endswith("bound"):
            # The bound call, with symm's choice or an algorithm forced: each
            # algorithm without the Python wrapper's time.
            forced = algo.removesuffix("bound").rstrip("_") or None
            fn = bind(forced)
        else:
            fn = functools.partial(ours, algo)
        out.fill_(float("nan"))
        try:
            fn()
        except symm.SymmUnsupported as e:
            if algo is None:
                raise
            # A forced algorithm the library refuses here (the fused kernel
            # on shared GPUs, say) is left out, said why.
            print(f"{op} {shape}: {impl} not timed: {e}", flush=True)
            continue
        fns[impl], errs[impl] = fn, 0.0
        for attempt in ("eager", "replayed"):
            out.fill_(float("nan"))
            fns[impl]()
            err = rel_err(out, ref)
            assert err < tolerance, f"{op} {shape} ({algo or 'auto'}, {attempt}): relative error {err}"
            errs[impl] = max(errs[impl], err)
    return fns, errs


def torch_fused_checked(op, shape, fn, ref, tolerance):
    """PyTorch's fused op's relative error to `ref`, from its first call.

    That call allocates and rendezvouses its symmetric workspace, whose
    signal pads it zeroes with a cudaMemset queued behind this rank's
    earlier GPU work, while the peers, rendezvoused over the store, may
    already be signalling into them: a rank still busy then erases its
    peers' barrier signals and both hang
    (bench/gpu/first_use_race.py reproduces it). So the GPU is idle first.
    """
    torch.cuda.synchronize()
    dist.barrier()
    got = fn()
    err = rel_err(got, ref)
    assert err < tolerance, f"{op} {shape} (PyTorch's fused op): relative error {err}"
    return err


def time_matmul_op(b, op, shape, fns, errs, out, ref, tolerance, graph_fns, **extra):
    """One contest of every implementation of a shape; symm's results are
    checked again after timing (the timed calls were graph replays).
    `errs` holds every checked implementation's relative error; symm's
    (those that write `out`) are checked again. `extra`: record fields."""
    for impl, ms in b.contest(fns).items():
        err = {"relerr": errs[impl]} if impl in errs else {}
        b.record(op, shape, impl, ms, **err, **extra)
    for impl in (i for i in errs if i.startswith("symm")):
        out.fill_(float("nan"))
        fns[impl]()
        err = rel_err(out, ref)
        assert err < tolerance, f"{op} {shape} ({impl}) after timing: relative error {err}"
    if shape[0] <= b.graph_max_m:
        b.record_graphs(op, shape, graph_fns, **extra)


def graphed(fns, ours):
    """symm's calls to replay from CUDA graphs: its own choice, and each
    algorithm forced that runs here (a call with `algorithm=`, which the
    capture records like any other)."""
    forced = ("symm_sequential", "symm_pipelined", "symm_fused")
    return {"symm": ours, **{impl: fns[impl] for impl in forced if impl in fns}}


def linear_weight(k, n, dtype=torch.bfloat16):
    """B as tensor parallelism has it: an nn.Linear weight [n, k] used as
    `x @ weight.t()`, i.e. a K-major [k, n] (every implementation gets the
    same tensor)."""
    return (torch.randn(n, k, device="cuda", dtype=dtype) / k**0.5).t()


def bench_ag_mm(b, g, shapes):
    for m, k, n in shapes:
        ag_mm_case(b, g, m, k, n)


def ag_mm_case(b, g, m, k, n, dtype=torch.bfloat16, batch=1, algos=ALGOS, **extra):
    """Times every implementation of ag_mm at M x K x N (M gathered rows),
    records carrying the fields `extra`. With `batch` > 1, A is
    [batch, M / batch, K] gathered along dim 1 (sequence parallelism): NCCL
    gathers rank-major, then the rows are reordered before cuBLAS."""
    import torch.distributed._symmetric_memory as symm_mem

    symm_mem.enable_symm_mem_for_group(b.group_name)
    extra = {"dtype": DTYPE_NAMES[dtype], **extra}
    seq, dim = m // batch, 0 if batch == 1 else 1
    shard = (m // b.world, k) if batch == 1 else (batch, seq // b.world, k)
    a_shard = torch.randn(shard, device="cuda", dtype=dtype)
    w = linear_weight(k, n, dtype)
    if batch == 1:
        gathered = chunks = torch.empty(m, k, device="cuda", dtype=dtype)
    else:
        gathered = torch.empty(batch, seq, k, device="cuda", dtype=dtype)
        chunks = torch.empty(b.world, *shard, device="cuda", dtype=dtype)
    out = torch.empty(*gathered.shape[:-1], n, device="cuda", dtype=dtype)
    ref = torch.empty_like(out)

    def gather():
        dist.all_gather_into_tensor(chunks, a_shard)
        if batch > 1:  # [world, batch, seq / world, K] -> [batch, seq, K]
            gathered.view(batch, b.world, seq // b.world, k).copy_(chunks.transpose(0, 1))

    def nccl_cublas():
        gather()
        torch.matmul(gathered, w, out=ref)

    def ours(algorithm=None):
        # As a user calls it: no stream given, symm takes torch's current one.
        symm.fused_ag_mm(g, a_shard, [w], gather_dim=dim, out=[out], algorithm=algorithm)

    def bind(algorithm):
        stream = torch.cuda.current_stream().cuda_stream
        return symm.bind(
            symm.fused_ag_mm, g, a_shard, [w], gather_dim=dim, out=[out], stream=stream, algorithm=algorithm
        )
    nccl_cublas()
    shape = (m, k, n)
    torch_fused = lambda: torch.ops.symm_mem.fused_all_gather_matmul(a_shard, [w], dim, b.group_name)
    torch_err = torch_fused_checked("ag_mm", shape, lambda: torch_fused()[1][0], ref, 1e-2)
    fns, errs = symm_algorithms("ag_mm", shape, ours, bind, out, ref, 1e-2, algos)
    errs["torch_fused"] = torch_err
    # The shard already in symmetric memory, as a tensor-parallel program
    # may keep its activations: the peers pull it in place, unstaged.
    a_sym, keep = symmetric_tensor(g, a_shard.numel(), dtype)
    a_sym = a_sym.view(shard)
    a_sym.copy_(a_shard)

    def ours_symmetric():
        symm.fused_ag_mm(g, a_sym, [w], gather_dim=dim, out=[out])

    for attempt in ("eager", "replayed"):
        out.fill_(float("nan"))
        ours_symmetric()
        errs["symm_symmetric_in"] = max(errs.get("symm_symmetric_in", 0.0), rel_err(out, ref))
        assert errs["symm_symmetric_in"] < 1e-2, f"ag_mm {shape} (symm_symmetric_in, {attempt}): {errs}"
    fns["symm_symmetric_in"] = ours_symmetric
    others = {
        "torch_fused": torch_fused,
        "nccl_cublas": nccl_cublas,
        "mm_only": lambda: torch.matmul(gathered, w, out=ref),
        "comm_only": lambda: dist.all_gather_into_tensor(chunks, a_shard),
    }
    fns.update(others)
    graphs = {**graphed(fns, ours), "symm_symmetric_in": ours_symmetric, **others}
    time_matmul_op(b, "ag_mm", shape, fns, errs, out, ref, 1e-2, graphs, **extra)
    del keep


def bench_mm_rs(b, g, shapes, symmetric_out):
    for m, k, n in shapes:
        mm_rs_case(b, g, m, k, n, symmetric_out)


def mm_rs_case(b, g, m, k, n, symmetric_out, dtype=torch.bfloat16, batch=1, algos=ALGOS, **extra):
    """Times every implementation of mm_rs at M x K x N (M rows of A per
    rank), records carrying the fields `extra`. With `symmetric_out`, symm's
    `out` lies in a rendezvoused symmetric buffer (as a tensor-parallel
    program would keep its activations), where the fused kernel at world 2
    lets the peer write its partial into it. With `batch` > 1, A is
    [batch, M / batch, K] scattered along dim 1 (sequence parallelism): the
    product is reordered rank-major before NCCL's reduce-scatter."""
    # Registers torch.ops.symm_mem (bench_ag_mm may not have run: --only).
    import torch.distributed._symmetric_memory as symm_mem

    symm_mem.enable_symm_mem_for_group(b.group_name)
    extra = {"dtype": DTYPE_NAMES[dtype], **extra}
    seq, dim = m // batch, 0 if batch == 1 else 1
    lead = (m,) if batch == 1 else (batch, seq)
    part = (m // b.world, n) if batch == 1 else (batch, seq // b.world, n)
    a = torch.randn(*lead, k, device="cuda", dtype=dtype)
    w = linear_weight(k, n, dtype)
    c = torch.empty(*lead, n, device="cuda", dtype=dtype)
    chunks = c if batch == 1 else torch.empty(b.world, *part, device="cuda", dtype=dtype)
    if symmetric_out:
        out, keep = symmetric_tensor(g, m // b.world * n, dtype)
        out = out.view(part)
    else:
        out, keep = torch.empty(part, device="cuda", dtype=dtype), None
    ref = torch.empty(part, device="cuda", dtype=dtype)

    def nccl_cublas():
        torch.matmul(a, w, out=c)
        if batch > 1:  # [batch, seq, N] -> [world, batch, seq / world, N]
            chunks.copy_(c.view(batch, b.world, seq // b.world, n).transpose(0, 1))
        dist.reduce_scatter_tensor(ref, chunks)

    def ours(algorithm=None):
        symm.mm_rs(g, a, w, scatter_dim=dim, op="sum", out=out, algorithm=algorithm)

    def bind(algorithm):
        stream = torch.cuda.current_stream().cuda_stream
        return symm.bind(symm.mm_rs, g, a, w, scatter_dim=dim, op="sum", out=out, stream=stream, algorithm=algorithm)
    nccl_cublas()
    shape = (m, k, n)
    torch_fused = lambda: torch.ops.symm_mem.fused_matmul_reduce_scatter(a, w, "sum", dim, b.group_name)
    torch_err = torch_fused_checked("mm_rs", shape, torch_fused, ref, 2e-2)
    fns, errs = symm_algorithms("mm_rs", shape, ours, bind, out, ref, 2e-2, algos)
    errs["torch_fused"] = torch_err
    others = {
        "torch_fused": torch_fused,
        "nccl_cublas": nccl_cublas,
        "mm_only": lambda: torch.matmul(a, w, out=c),
        "comm_only": lambda: dist.reduce_scatter_tensor(ref, chunks),
    }
    fns.update(others)
    time_matmul_op(b, "mm_rs", shape, fns, errs, out, ref, 2e-2, {**graphed(fns, ours), **others}, **extra)
    del keep


def symmetric_tensor(g, numel, dtype=torch.bfloat16):
    """A tensor of `numel` elements of `dtype` in a rendezvoused symmetric
    buffer (the buffer and handle stay alive with the returned tuple)."""
    buf = g.create(numel * dtype.itemsize)
    handle = buf.rendezvous()
    return torch.as_tensor(buf.cuda_bytes(), device="cuda").view(dtype), (buf, handle)


def completed(fn):
    """`fn` whose work on other streams is waited for (a device-wide
    synchronize), so the end event marks completion, not enqueue: PyTorch's
    low-contention all-gather copies on its own side stream."""
    def run():
        fn()
        torch.cuda.synchronize()
    return run


def bench_lc_allgather(b, g, sizes, graphs=False, **extra):
    """symm from an ordinary tensor (staged in the workspace), bound once
    (`symm_bound`) and from a symmetric buffer (`symm_inplace`, peers read
    it where it is), NCCL, and PyTorch's low-contention all-gather (input
    in its symmetric memory), at each of `sizes` bytes per rank; with
    `graphs`, symm's and NCCL's calls replayed from CUDA graphs too.
    Records carry the fields `extra`."""
    import torch.distributed._symmetric_memory as symm_mem

    for nbytes in sizes:
        n = nbytes // 2
        x = torch.randn(n, device="cuda", dtype=torch.bfloat16)
        xs, keep = symmetric_tensor(g, n)
        xs.copy_(x)
        xt = symm_mem.empty(n, device="cuda", dtype=torch.bfloat16).copy_(x)
        symm_mem.rendezvous(xt, b.group_name)
        out = torch.empty(b.world * n, device="cuda", dtype=torch.bfloat16)
        ref = torch.empty_like(out)
        dist.all_gather_into_tensor(ref, x)
        shape = (nbytes,)
        # No stream given: torch's current stream (the capture's, in a graph).
        ours = {impl: (lambda src=src: symm.lc_allgather(g, src, out=out))
                for impl, src in (("symm", x), ("symm_inplace", xs))}
        ours["symm_bound"] = symm.bind(symm.lc_allgather, g, x, out=out)

        def check(when):
            # Twice: the second call of a repeated call is a graph replay.
            for impl, fn in ours.items():
                for _ in range(2):
                    out.fill_(float("nan"))
                    fn()
                    assert torch.equal(out, ref), f"lc_allgather {nbytes} B ({impl}, {when}) differs from NCCL"

        check("before timing")
        nccl = lambda: dist.all_gather_into_tensor(ref, x)
        times = b.contest({
            **ours,
            "nccl": nccl,
            "torch_lc": completed(lambda: torch.ops.symm_mem._low_contention_all_gather(xt, b.group_name)),
        })
        check("after timing")
        for impl, ms in times.items():
            b.record("lc_allgather", shape, impl, ms, **extra)
        if graphs:
            replayed = {"symm": ours["symm"], "symm_inplace": ours["symm_inplace"], "nccl": nccl}
            b.record_graphs("lc_allgather", shape, replayed, **extra)
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
    def gemms_beside(comm):
        def run():
            if comm is not None:
                side.wait_stream(b.stream)
                with torch.cuda.stream(side):
                    for _ in range(3):
                        comm()
            for _ in range(4):
                torch.matmul(mats[0], mats[1], out=mats[2])
            b.stream.wait_stream(side)
        return run

    times = b.contest({impl: gemms_beside(comm) for impl, comm in comms.items()}, iters=max(5, b.iters // 3))
    for impl, ms in times.items():
        b.record("contention", (256 << 20,), impl, ms)
    del keep


def table(records):
    rows = {}
    for r in records:
        rows.setdefault((r["op"], tuple(r["shape"])), {})[r["impl"]] = r["ms"]
    print(f"\n{'op':<14}{'shape':<22}{'symm':>8}{'bound':>8}{'torch':>8}{'nccl+mm':>9}{'floor':>8}{'symm/floor':>11}"
          f"{'bound/floor':>12}{'torch/floor':>12}")
    for (op, shape), t in rows.items():
        if op not in ("ag_mm", "mm_rs"):
            continue
        floor = max(t.get("mm_only", 0), t.get("comm_only", 0))
        print(f"{op:<14}{'x'.join(map(str, shape)):<22}{t.get('symm', 0):8.3f}{t.get('symm_bound', 0):8.3f}"
              f"{t.get('torch_fused', 0):8.3f}{t.get('nccl_cublas', 0):9.3f}{floor:8.3f}{t.get('symm', 0) / floor:11.3f}"
              f"{t.get('symm_bound', 0) / floor:12.3f}{t.get('torch_fused', 0) / floor:12.3f}")
    graphs = [(k, t) for k, t in rows.items() if "symm_graph" in t]
    if graphs:
        print(f"\nreplayed from CUDA graphs (ms per call)\n{'op':<14}{'shape':<22}{'symm':>8}{'pipelined':>10}"
              f"{'fused':>8}{'torch':>8}{'nccl+mm':>9}{'mm':>8}")
        for (op, shape), t in graphs:
            print(f"{op:<14}{'x'.join(map(str, shape)):<22}" + "".join(
                f"{t.get(i + '_graph', float('nan')):{w}.3f}"
                for i, w in (("symm", 8), ("symm_pipelined", 10), ("symm_fused", 8), ("torch_fused", 8),
                             ("nccl_cublas", 9), ("mm_only", 8))))
    for (op, shape), t in rows.items():
        if op == "lc_allgather":
            print(f"{op:<14}{shape[0] / 2**20:>7g} MB/rank   symm {t.get('symm', 0):.3f}  "
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
    p.add_argument("--barrier", choices=BARRIERS, default="default", help="what aligns the ranks before each timed run")
    p.add_argument("--mm-rs-out", choices=("symmetric", "ordinary"), default="symmetric",
                   help="where symm's mm_rs output lies (symmetric: the fused kernel's peer writes into it)")
    args = p.parse_args()
    if os.environ.get("SYMM_BENCH_WATCHDOG_S"):
        # A run that takes longer prints every thread's stack (and
        # SYMM_BENCH_TRACE=1 says which implementations warmed up).
        # Not exiting: every rank prints its stack, then an outer timeout ends the run.
        faulthandler.dump_traceback_later(float(os.environ["SYMM_BENCH_WATCHDOG_S"]), exit=False)
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
        bench_mm_rs(b, g, shapes[-1:] if args.quick else shapes, args.mm_rs_out == "symmetric")
    if "lc_allgather" in only:
        bench_lc_allgather(b, g, LC_SIZES[:2] if args.quick else LC_SIZES)
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
