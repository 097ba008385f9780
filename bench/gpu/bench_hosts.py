"""symm across (pretend) hosts against NCCL alone on the same transport,
and the same symm operations on one host, in one run (issue 43's target:
the cross-host all-gather and reduce-scatter within 10% of NCCL alone).

Launch on the GPU machine with one process per GPU:
    torchrun --nproc-per-node 2 bench/gpu/bench_hosts.py --out DIR [--transport network|default] [--quick]
    torchrun --nproc-per-node 4 bench/gpu/bench_hosts.py --out DIR [--hosts 2]  (pairs of ranks share a host)
(`bash bench/gpu/checks.sh hosts_bench` runs it at world 2 over both
transports, then collect.py; NCCL_NVLS_ENABLE=0 and the other variables
bench_ops.py checks must be set.)

Every rank announces its own pretend host (SYMM_HOST_ID; with --hosts H,
world / H consecutive ranks share one) when symm's group forms, so symm
moves the data through NCCL (two communicators of its own, across hosts
and inside a host). --transport network (the default) keeps NCCL off
NVLink and shared memory (NCCL_P2P_DISABLE=1, NCCL_SHM_DISABLE=1,
NCCL_SOCKET_IFNAME=lo unless set): the ranks' data goes through NCCL's
network transport, as between hosts; `default` leaves NCCL its own choice
(the two variables removed). Either is set before torch.distributed's
NCCL and symm's communicators exist, so NCCL alone (torch's) and symm run
on the same transport. A second symm group, formed without SYMM_HOST_ID
(one host, symmetric memory), runs the same calls: `symm_one_host`, the
reference for "nothing changes for single-host groups" (compare it with
bench_ops.py's and bench_allreduce.py's records of the same shapes).

Timed as bench_ops.py times (its Bench: CUDA events, the median of --iters
after --warmup in round-robin rounds, the maximum over ranks), eagerly
(a repeated call is kept after its first agreement, as on one host, and
runs under the group's NCCL watchdog; calls across hosts are not replayed
as graphs). The barrier before each timed run goes through a torch NCCL
communicator of its own, which no timed call uses, so every timed
communicator starts its call equally idle. (Through torch's default
communicator, --barrier default, the one `nccl` times would have just
been used and is favoured: on the network transport its 64 KB calls ran
1.1-1.4 x faster than the same calls on another torch communicator. --barrier gloo: a gloo
group, whose looser alignment adds its skew to every time.)
bf16. Ops (records' `op`, `shape` as DESIGN.md's format names them):
- hosts_allgather [bytes per rank]: symm.lc_allgather; `nccl`
  dist.all_gather_into_tensor.
- hosts_allreduce [bytes per rank]: symm.all_reduce; `nccl` dist.all_reduce.
  Both also as `nccl_again`: the same call on a second torch communicator
  over the same ranks (`dist.new_group`), the control for how much two
  communicators of one NCCL differ on this transport (symm's is a third).
- hosts_mm_rs [M rows of A per rank, K per rank, N]: symm.mm_rs; `nccl`
  torch.matmul then dist.reduce_scatter_tensor; `comm_only` that
  reduce-scatter alone, `mm_only` the matmul alone.
- hosts_ag_mm [M gathered rows, K, N per rank]: symm.fused_ag_mm; `nccl`
  dist.all_gather_into_tensor then torch.matmul; `comm_only`, `mm_only`.
- host_time_allgather, host_time_allreduce [bytes per rank]: the host's
  time to enqueue one small call (`host_us`; symm's split into
  `library_us` and `python_us`), not timed on the GPU (`host_time`).
Every record carries `transport` and `hosts` (the pretend hosts of the
run). Before timing and after it, every symm output (poisoned with NaN
first) is checked: gathers bit for bit against NCCL's, sums and products
by relative error against a float32 reference (NCCL's baseline checked
the same way).

Writes DIR/hosts-w<world>-h<hosts>-<transport>-records.jsonl, prints
each record (for collect.py) and a table of symm / NCCL with the targets
met or missed (`table`). The table, ratios and records are plain
functions, importable without torch (python/tests/test_bench_hosts.py).
"""
import argparse
import faulthandler
import functools
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
import families  # noqa: E402  (standard library only)

SIZES = [64 << 10, 1 << 20, 16 << 20, 64 << 20, 256 << 20]
QUICK_SIZES = [64 << 10, 1 << 20]
# The model's dimensions (families.per_rank shards them as tensor
# parallelism does); at world 2 these are bench_ops.py's first three shapes.
AG_MM = [families.Case("ag_mm", 16384, 8192, 16384), families.Case("ag_mm", 8192, 8192, 28672),
         families.Case("ag_mm", 2048, 8192, 28672)]
MM_RS = [families.Case("mm_rs", 16384, 8192, 8192), families.Case("mm_rs", 8192, 28672, 8192),
         families.Case("mm_rs", 2048, 28672, 8192)]
OPS = ("allgather", "allreduce", "mm_rs", "ag_mm", "host_time")
# Bytes per rank of the small calls whose host time `host_time` measures.
HOST_TIME_BYTES = 64 << 10
TRANSPORTS = ("network", "default")
# NCCL kept to its network transport.
NETWORK_ENV = {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1"}
# The bar: symm across hosts at most this x NCCL alone.
BAR = 1.10
# Relative error allowed against the float32 reference (bf16 results).
TOLERANCE = {"hosts_allreduce": 1e-2, "hosts_ag_mm": 1e-2, "hosts_mm_rs": 2e-2}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="folder for the records file")
    p.add_argument("--transport", choices=TRANSPORTS, default="network",
                   help="network: NCCL without P2P and shared memory (as between hosts); default: NCCL's choice")
    p.add_argument("--hosts", type=int, default=None,
                   help="pretend hosts (default: every rank its own); world / HOSTS consecutive ranks share one")
    p.add_argument("--quick", action="store_true", help="two sizes and one shape per op, for a smoke test")
    p.add_argument("--iters", type=int, default=None, help="timed runs per implementation (default 20, quick 10)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--symm-first", action="store_true",
                   help="make symm's groups (their NCCL communicators) before torch's process group")
    p.add_argument("--barrier", choices=("separate", "default", "gloo"), default="separate",
                   help="what aligns the ranks before each timed run: a torch NCCL communicator that no timed "
                        "call uses (separate), torch's default one, which `nccl` times (default), or gloo")
    p.add_argument("--only", default=",".join(OPS), help=f"comma-separated, of {', '.join(OPS)}")
    args = p.parse_args(argv)
    unknown = set(args.only.split(",")) - set(OPS)
    if unknown:
        p.error(f"--only: unknown {sorted(unknown)}; choose from {', '.join(OPS)}")
    if args.iters is None:
        args.iters = 10 if args.quick else 20
    return args


def host_id(rank, world, hosts=None):
    """The SYMM_HOST_ID of `rank`: `hosts` pretend hosts (None: `world`),
    each of world / hosts consecutive ranks."""
    hosts = hosts or world
    if hosts < 2 or world % hosts:
        raise ValueError(f"--hosts {hosts}: need at least 2 hosts of equally many ranks, and world {world}")
    return f"symm-bench-host-{rank // (world // hosts)}"


def set_transport(env, transport):
    """NCCL's variables in `env` (os.environ) for `transport`, before any
    NCCL communicator exists."""
    if transport == "network":
        env.update(NETWORK_ENV)
        # The interface of NCCL's sockets between the ranks of this machine
        # (test_cuda_hosts.py's); NCCL takes InfiniBand instead where it has it.
        env.setdefault("NCCL_SOCKET_IFNAME", "lo")
    else:
        for var in NETWORK_ENV:
            env.pop(var, None)


def cases(world, quick):
    """{op: [record shape]} of the matmuls at `world` ranks (quick: the
    smallest)."""
    pick = (lambda cs: cs[-1:]) if quick else (lambda cs: cs)
    return {"ag_mm": [families.per_rank(c, world) for c in pick(AG_MM)],
            "mm_rs": [families.per_rank(c, world) for c in pick(MM_RS)]}


def rows(records):
    """{(op, shape, transport, hosts, world): {impl: ms}} of the records
    of this benchmark's ops."""
    out = {}
    for r in records:
        if r["op"].startswith("hosts_"):
            key = (r["op"], tuple(r["shape"]), r.get("transport"), r.get("hosts"), r.get("world"))
            out.setdefault(key, {})[r["impl"]] = r["ms"]
    return out


def ratios(t):
    """One row's ratios: `symm` and `symm_one_host` over `nccl` (and
    `nccl_again` where timed); for the matmuls `comm` too, symm's time
    beyond the matmul alone over NCCL's collective alone (None where a
    time is missing)."""
    nccl = t.get("nccl")
    out = {"symm": t["symm"] / nccl if nccl and "symm" in t else None,
           "symm_one_host": t["symm_one_host"] / nccl if nccl and "symm_one_host" in t else None}
    if "nccl_again" in t:
        out["nccl_again"] = t["nccl_again"] / nccl if nccl else None
    if "comm_only" in t:
        ok = t.get("comm_only") and "symm" in t and "mm_only" in t
        out["comm"] = (t["symm"] - t["mm_only"]) / t["comm_only"] if ok else None
    return out


def verdicts(records):
    """[(row key, target, value, met)]: symm across hosts at most BAR x NCCL
    (the whole op), and for the matmuls its communication (its time beyond
    the matmul alone) at most BAR x NCCL's collective alone."""
    out = []
    for key, t in rows(records).items():
        r = ratios(t)
        out.append((key, f"symm <= {BAR:.2f} x nccl", r["symm"], r["symm"] is not None and r["symm"] <= BAR))
        if "comm" in r:
            out.append((key, f"symm - mm_only <= {BAR:.2f} x comm_only", r["comm"],
                        r["comm"] is not None and r["comm"] <= BAR))
    return out


def describe(op, shape):
    if op in ("hosts_allgather", "hosts_allreduce"):
        return f"{shape[0] / 2**20:g} MB/rank"
    return "x".join(map(str, shape))


def table(records):
    """The lines of the table: per row, ms of each implementation and the
    ratios; then every target met or MISSED."""
    fmt = lambda v, w, p=3: f"{v:{w}.{p}f}" if v is not None else f"{'-':>{w}}"  # noqa: E731
    out, setting = [], None
    for (op, shape, transport, hosts, world), t in rows(records).items():
        if (transport, hosts, world) != setting:
            setting = (transport, hosts, world)
            out.append(f"\nacross {hosts} pretend hosts, world {world}, NCCL transport {transport} "
                       "(ms per call; ratios to nccl; again: a second torch communicator; "
                       "comm: (symm - mm_only) / comm_only)")
            out.append(f"{'op':<16}{'shape':<20}{'symm':>9}{'nccl':>9}{'one_host':>9}{'comm_only':>10}{'mm_only':>9}"
                       f"{'symm/nccl':>10}{'1host/nccl':>11}{'again/nccl':>11}{'comm':>7}")
        r = ratios(t)
        out.append(f"{op:<16}{describe(op, shape):<20}{fmt(t.get('symm'), 9)}{fmt(t.get('nccl'), 9)}"
                   f"{fmt(t.get('symm_one_host'), 9)}{fmt(t.get('comm_only'), 10)}{fmt(t.get('mm_only'), 9)}"
                   f"{fmt(r['symm'], 10)}{fmt(r['symm_one_host'], 11)}{fmt(r.get('nccl_again'), 11)}"
                   f"{fmt(r.get('comm'), 7, 2)}")
    v = verdicts(records)
    missed = [x for x in v if not x[3]]
    out.append(f"\ntargets: {len(v) - len(missed)} of {len(v)} met")
    for (op, shape, transport, hosts, _), target, value, _ in missed:
        shown = "no time" if value is None else f"{value:.3f}"
        out.append(f"MISSED {op} {describe(op, shape)} ({transport}, {hosts} hosts): {target}: {shown}")
    return out


def records_path(out, world, hosts, transport):
    return os.path.join(out, f"hosts-w{world}-h{hosts}-{transport}-records.jsonl")


# --- on the GPUs (torch, symm and bench_ops imported by main) -------------------


def spans_hosts(g):
    """Whether symm's group `g` spans hosts: a symmetric buffer maps the
    ranks of this rank's host only, and a pointer to another is refused."""
    import symm

    with g.create(4096) as buf, buf.rendezvous() as h:
        for r in range(g.world_size):
            try:
                h.peer_ptr(r)
            except symm.SymmUnsupported:
                return True
    return False


def nccl_versions():
    """(torch's NCCL, symm's NCCL library and its version), as text."""
    import ctypes

    import torch

    path = os.environ.get("SYMM_NCCL_LIBRARY") or "libnccl.so.2"
    try:
        v = ctypes.c_int()
        ctypes.CDLL(path).ncclGetVersion(ctypes.byref(v))
        mine = f"{v.value // 10000}.{v.value // 100 % 100}.{v.value % 100}"
    except (OSError, AttributeError) as e:
        mine = f"not loadable ({e})"
    theirs = torch.cuda.nccl.version()  # (major, minor, patch); an int on old torch
    return ".".join(map(str, theirs)) if isinstance(theirs, tuple) else str(theirs), path, mine


def checked(what, fn, out, ref, tolerance=None):
    """Runs `fn` twice into `out`, poisoned first, and checks `out` against
    `ref`: bit for bit (`tolerance` None) or by relative error. Returns the
    largest relative error."""
    import torch
    from bench_ops import rel_err

    worst = 0.0
    for attempt in ("first", "repeated"):
        out.fill_(float("nan"))
        fn()
        if tolerance is None:
            assert torch.equal(out, ref), f"{what} ({attempt}) differs from NCCL's"
            continue
        err = rel_err(out, ref)
        assert err < tolerance, f"{what} ({attempt}): relative error {err} (tolerance {tolerance})"
        worst = max(worst, err)
    return worst


def time_case(b, op, shape, fns, checks, extra):
    """One contest of `fns`, recorded; `checks` {impl: (fn, out, ref,
    tolerance)} run before (their relative errors recorded) and after."""
    errs = {impl: checked(f"{op} {shape} {impl}", *c) for impl, c in checks.items()}
    for impl, ms in b.contest(fns).items():
        err = {"relerr": errs[impl]} if impl in errs and checks[impl][3] is not None else {}
        b.record(op, shape, impl, ms, **err, **extra)
    for impl, c in checks.items():
        checked(f"{op} {shape} {impl} after timing", *c)


def bench_allgather(b, groups, again, sizes, extra):
    """`again`: the second torch communicator (`nccl_again`)."""
    import symm
    import torch
    import torch.distributed as dist

    for nbytes in sizes:
        x = torch.randn(nbytes // 2, device="cuda", dtype=torch.bfloat16)
        ref = torch.empty(b.world * x.numel(), device="cuda", dtype=torch.bfloat16)
        nccl = lambda: dist.all_gather_into_tensor(ref, x)  # noqa: E731
        nccl()
        fns, checks = {}, {}
        for impl, g in groups.items():
            out = torch.empty_like(ref)
            fns[impl] = lambda g=g, out=out: symm.lc_allgather(g, x, out=out)
            checks[impl] = (fns[impl], out, ref, None)
        out = torch.empty_like(ref)
        fns["nccl_again"] = lambda out=out: dist.all_gather_into_tensor(out, x, group=again)
        checks["nccl_again"] = (fns["nccl_again"], out, ref, None)
        time_case(b, "hosts_allgather", (nbytes,), {**fns, "nccl": nccl}, checks, extra)


def bench_allreduce(b, groups, again, sizes, extra):
    """`again`: the second torch communicator (`nccl_again`)."""
    import symm
    import torch
    import torch.distributed as dist
    from bench_ops import rel_err

    tol = TOLERANCE["hosts_allreduce"]
    for nbytes in sizes:
        x = torch.randn(nbytes // 2, device="cuda", dtype=torch.bfloat16)
        ref = x.float()
        dist.all_reduce(ref)
        nccl_buf = x.clone()
        dist.all_reduce(nccl_buf)
        err = rel_err(nccl_buf, ref)
        assert err < tol, f"hosts_allreduce {nbytes} B: NCCL's relative error {err}"
        fns, checks = {}, {}
        for impl, g in groups.items():
            out = torch.empty_like(x)
            fns[impl] = lambda g=g, out=out: symm.all_reduce(g, x, out=out)
            checks[impl] = (fns[impl], out, ref, tol)
        # In place on its own buffer: the values grow from call to call,
        # which does not change the time.
        fns["nccl"] = lambda: dist.all_reduce(nccl_buf)
        again_buf = x.clone()
        fns["nccl_again"] = lambda: dist.all_reduce(again_buf, group=again)
        time_case(b, "hosts_allreduce", (nbytes,), fns, checks, extra)


def bench_mm_rs(b, groups, shapes, extra):
    import symm
    import torch
    import torch.distributed as dist
    from bench_ops import linear_weight

    tol = TOLERANCE["hosts_mm_rs"]
    for m, k, n in shapes:
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = linear_weight(k, n)
        c = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        out_nccl = torch.empty(m // b.world, n, device="cuda", dtype=torch.bfloat16)
        ref = torch.empty(m // b.world, n, device="cuda", dtype=torch.float32)
        dist.reduce_scatter_tensor(ref, a.float() @ w.float())

        def nccl():
            torch.matmul(a, w, out=c)
            dist.reduce_scatter_tensor(out_nccl, c)

        fns, checks = {}, {}
        for impl, g in groups.items():
            out = torch.empty_like(out_nccl)
            fns[impl] = lambda g=g, out=out: symm.mm_rs(g, a, w, scatter_dim=0, op="sum", out=out)
            checks[impl] = (fns[impl], out, ref, tol)
        checked("hosts_mm_rs nccl", nccl, out_nccl, ref, tol)
        fns.update({"nccl": nccl, "comm_only": lambda: dist.reduce_scatter_tensor(out_nccl, c),
                    "mm_only": lambda: torch.matmul(a, w, out=c)})
        time_case(b, "hosts_mm_rs", (m, k, n), fns, checks, extra)


def bench_ag_mm(b, groups, shapes, extra):
    import symm
    import torch
    import torch.distributed as dist
    from bench_ops import linear_weight

    tol = TOLERANCE["hosts_ag_mm"]
    for m, k, n in shapes:
        a_shard = torch.randn(m // b.world, k, device="cuda", dtype=torch.bfloat16)
        w = linear_weight(k, n)
        gathered = torch.empty(m, k, device="cuda", dtype=torch.bfloat16)
        out_nccl = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        dist.all_gather_into_tensor(gathered, a_shard)
        ref = gathered.float() @ w.float()

        def nccl():
            dist.all_gather_into_tensor(gathered, a_shard)
            torch.matmul(gathered, w, out=out_nccl)

        fns, checks = {}, {}
        for impl, g in groups.items():
            out = torch.empty_like(out_nccl)
            fns[impl] = lambda g=g, out=out: symm.fused_ag_mm(g, a_shard, [w], gather_dim=0, out=[out])
            checks[impl] = (fns[impl], out, ref, tol)
        checked("hosts_ag_mm nccl", nccl, out_nccl, ref, tol)
        fns.update({"nccl": nccl, "comm_only": lambda: dist.all_gather_into_tensor(gathered, a_shard),
                    "mm_only": lambda: torch.matmul(gathered, w, out=out_nccl)})
        time_case(b, "hosts_ag_mm", (m, k, n), fns, checks, extra)


def kernel_times(fn, sync):
    """[(kernel name, GPU us)] of one call of `fn` (torch.profiler's CUDA
    records) after a first, unprofiled one: the device's part of a call,
    without the host's."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    fn()
    sync()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        sync()
    return [(e.name, e.device_time_total) for e in prof.events()
            if e.device_type == torch.autograd.DeviceType.CUDA and e.device_time_total > 0]


def bench_host_time(b, groups, extra):
    """The CPU's time per call (us) to enqueue the small all-gather and
    all-reduce (HOST_TIME_BYTES per rank), symm's split into its Python
    wrapper and the library, next to NCCL's through torch.distributed, with
    the CUDA driver and runtime calls one call makes and its kernels' GPU
    time at this size and at 16 MB (rank 0 prints them), and a profile of
    symm's Python wrapper across hosts. At this size the
    host's time is most of what `hosts_allgather` times."""
    import symm
    import symm.ops
    import torch
    import torch.distributed as dist
    from host_overhead import Timed, driver_calls, host_times, python_profile

    real, timed = symm.ops.lib, Timed(symm.ops.lib)

    def sync():
        torch.cuda.synchronize()
        dist.barrier()

    # The small size, and a large one for the GPU's part alone.
    inputs = {n: torch.randn(n, device="cuda", dtype=torch.bfloat16) for n in (HOST_TIME_BYTES // 2, 8 << 20)}
    outputs = {n: (torch.empty(b.world * n, device="cuda", dtype=torch.bfloat16),
                   torch.empty(n, device="cuda", dtype=torch.bfloat16)) for n in inputs}
    x, large = inputs.values()

    def calls(op, impl, n):
        """The call of `impl` (a symm group's name, or nccl) on n elements."""
        x, (gathered, summed) = inputs[n], outputs[n]
        g = groups.get(impl)
        if op == "allgather":
            return (lambda: symm.lc_allgather(g, x, out=gathered)) if g else \
                (lambda: dist.all_gather_into_tensor(gathered, x))
        return (lambda: symm.all_reduce(g, x, out=summed)) if g else (lambda: dist.all_reduce(summed))

    try:
        for op in ("allgather", "allreduce"):
            for impl in (*groups, "nccl"):
                fn = calls(op, impl, x.numel())
                fn_of = functools.partial(calls, op, impl)
                lib = {}
                if impl != "nccl":
                    # The library's share, under the timing wrapper (whose
                    # calls never take the C path's `native`), kept apart.
                    symm.ops.lib = timed
                    groups[impl]._calls.clear()
                    for _ in range(3):
                        fn()
                    _, lib_us = host_times(fn, 20, 30, sync, timed)
                    symm.ops.lib = real
                    groups[impl]._calls.clear()
                for _ in range(3):
                    fn()
                host_us, _ = host_times(fn, 20, 30, sync)
                if impl != "nccl":
                    lib = {"library_us": round(lib_us, 1), "python_us": round(host_us - lib_us, 1)}
                api = driver_calls(fn, sync)
                rec = {"op": f"host_time_{op}", "shape": [HOST_TIME_BYTES], "dtype": "bf16", "impl": impl,
                       "host_us": round(host_us, 1), **lib, "world": b.world, **extra}
                b.records.append(rec)
                kernels = {n: kernel_times(fn_of(n), sync) for n in (x.numel(), large.numel())}
                if b.rank == 0:
                    print(json.dumps(rec), flush=True)
                    for name, (count, us) in sorted(api.items(), key=lambda kv: -kv[1][1])[:10]:
                        print(f"    {name:40s} x{count:3d} {us:8.1f} us", flush=True)
                    for n, ks in kernels.items():
                        shown = ", ".join(f"{k[:48]} {us:.1f} us" for k, us in ks)
                        print(f"    GPU at {2 * n >> 10} KB per rank: {shown}", flush=True)
            report = python_profile(calls(op, "symm", x.numel()), sync)
            if b.rank == 0:
                print(f"profile of symm's {op} across hosts (Python):\n{report}", flush=True)
    finally:
        symm.ops.lib = real


def main(argv=None):
    args = parse_args(argv)
    rank, world, local = (int(os.environ[v]) for v in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
    hosts = args.hosts or world
    mine = host_id(rank, world, hosts)
    # Before torch's NCCL and symm's communicators exist.
    set_transport(os.environ, args.transport)
    if os.environ.get("SYMM_BENCH_WATCHDOG_S"):
        # As bench_ops.py: a run that takes longer prints every thread's stack.
        faulthandler.dump_traceback_later(float(os.environ["SYMM_BENCH_WATCHDOG_S"]), exit=False)

    import torch
    import torch.distributed as dist
    from bench_ops import Bench  # checks the multicast environment

    import symm

    torch.cuda.set_device(local)

    def symm_groups():
        os.environ["SYMM_HOST_ID"] = mine
        across = symm.Group.from_env(backend="cuda", timeout_ms=60000)
        # The reference group: this machine's own host identity.
        del os.environ["SYMM_HOST_ID"]
        return across, symm.Group.from_env(backend="cuda", timeout_ms=60000)

    # (Communicators made in another order: which one NCCL makes first.)
    if args.symm_first:
        across, one_host = symm_groups()
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    if not args.symm_first:
        across, one_host = symm_groups()
    args.graph_max_m = 0
    b = Bench(args)
    torch.manual_seed(2468 + rank)
    assert spans_hosts(across), f"rank {rank}: the group with SYMM_HOST_ID={mine} is on one host"
    assert not spans_hosts(one_host), f"rank {rank}: the group without SYMM_HOST_ID spans hosts"
    if rank == 0:
        torch_nccl, path, version = nccl_versions()
        print(f"bench_hosts: world {world}, {hosts} pretend hosts, NCCL transport {args.transport} "
              f"(NCCL_P2P_DISABLE={os.environ.get('NCCL_P2P_DISABLE')}, NCCL_SHM_DISABLE="
              f"{os.environ.get('NCCL_SHM_DISABLE')}, NCCL_SOCKET_IFNAME={os.environ.get('NCCL_SOCKET_IFNAME')}); "
              f"torch's NCCL {torch_nccl}, symm's {version} from {path}; "
              f"{'symm' if args.symm_first else 'torch'}'s communicators made first", flush=True)
    groups = {"symm": across, "symm_one_host": one_host}
    extra = {"transport": args.transport, "hosts": hosts, "barrier": args.barrier,
             **({"symm_first": True} if args.symm_first else {})}
    only = args.only.split(",")
    sizes = QUICK_SIZES if args.quick else SIZES
    shapes = cases(world, args.quick)
    again = dist.new_group(list(range(world)), backend="nccl")
    if "allgather" in only:
        bench_allgather(b, groups, again, sizes, extra)
    if "allreduce" in only:
        bench_allreduce(b, groups, again, sizes, extra)
    if "mm_rs" in only:
        bench_mm_rs(b, groups, shapes["mm_rs"], extra)
    if "ag_mm" in only:
        bench_ag_mm(b, groups, shapes["ag_mm"], extra)
    if "host_time" in only:
        bench_host_time(b, groups, extra)
    for g in groups.values():
        g.check_async_error()
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        with open(records_path(args.out, world, hosts, args.transport), "w") as f:
            for r in b.records:
                f.write(json.dumps(r) + "\n")
        print("\n".join(table(b.records)), flush=True)
    for g in groups.values():
        g.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
