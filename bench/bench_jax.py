"""symm's operations from JAX beside what XLA does on its own, in one run:
one process driving the GPUs (JAX's default on one host).

    XLA_PYTHON_CLIENT_MEM_FRACTION=0.6 python3 bench/bench_jax.py [--quick]

Per shape of bench_ops.py (ag_mm: M total rows, each device's B [K, N];
mm_rs: M rows of A per device, K per device):
- jax_symm: ``symm.jax`` under jit + shard_map;
- jax_xla: the same product written for XLA's SPMD partitioner (operands
  sharded, jit), compiled as is: an all-gather then one dot (or one dot then
  a reduce-scatter);
- jax_windowed: the same program compiled with XLA's collective-matmul
  decomposition forced on (``xla_gpu_threshold_for_windowed_einsum_mib=0``,
  ``xla_gpu_multi_streamed_windowed_einsum=true``), passed per compilation
  so that all three run in one process;
- jax_mm_only / jax_comm_only: the local matmul alone and the collective alone
  (named apart from bench_ops.py's torch floors, which share the results file).
lc_allgather is timed against ``jax.lax.all_gather``. Every result is
checked against jax_xla's before it is timed. Times: wall clock around a
call and ``block_until_ready`` (the GPU's work included), median of
--iters after --warmup. Records (DESIGN.md's fields) are printed as JSON
lines for bench/gpu/collect.py.
"""
import argparse
import json
import os
import statistics
import time

for var, value in (("NCCL_NVLS_ENABLE", "0"), ("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.6")):
    os.environ.setdefault(var, value)
assert os.environ["NCCL_NVLS_ENABLE"] == "0", "NVLink multicast is forbidden on these machines"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import symm.jax as sj  # noqa: E402

AG_MM_SHAPES = [(16384, 8192, 8192), (8192, 8192, 14336), (2048, 8192, 14336), (512, 8192, 14336)]
MM_RS_SHAPES = [(16384, 4096, 8192), (8192, 14336, 8192), (2048, 14336, 8192), (512, 14336, 8192)]
LC_SIZES_MB = [1, 16, 64, 256]
WINDOWED = {"xla_gpu_threshold_for_windowed_einsum_mib": 0, "xla_gpu_multi_streamed_windowed_einsum": True}
DTYPE = jnp.bfloat16


class Bench:
    def __init__(self, args, mesh):
        self.iters, self.warmup, self.mesh = args.iters, args.warmup, mesh
        self.world = mesh.devices.size

    def time(self, fn, *args):
        for _ in range(self.warmup):
            jax.block_until_ready(fn(*args))
        times = []
        for _ in range(self.iters):
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)

    def record(self, op, shape, impl, ms, **extra):
        rec = {"op": op, "shape": list(shape), "dtype": "bf16" if op != "lc_allgather" else "bytes", "impl": impl,
               "ms": round(ms, 4), "iters": self.iters, "world": self.world}
        rec.update(extra)
        print(json.dumps(rec), flush=True)

    def put(self, x, spec):
        return jax.device_put(x, NamedSharding(self.mesh, spec))

    def smap(self, body, in_specs, out_specs):
        return jax.jit(jax.shard_map(body, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs))

    def spmd(self, body, in_specs, out_spec, args, options=None):
        """`body` on globally shaped arrays, partitioned by XLA, compiled
        with `options` (XLA debug options) or the defaults."""
        out = NamedSharding(self.mesh, out_spec)
        ins = tuple(NamedSharding(self.mesh, s) for s in in_specs)
        lowered = jax.jit(body, in_shardings=ins, out_shardings=out).lower(*args)
        return lowered.compile(compiler_options=options) if options else lowered.compile()


def rel_err(x, ref):
    x, ref = np.asarray(x, np.float32), np.asarray(ref, np.float32)
    return float(np.linalg.norm(x - ref) / np.linalg.norm(ref))


def random(key, shape):
    return jax.random.normal(jax.random.key(key), shape, jnp.float32).astype(DTYPE)


def matmul(a, b):
    return jnp.matmul(a, b, preferred_element_type=jnp.float32).astype(DTYPE)


def bench_ag_mm(b, shapes):
    w = b.world
    for m, k, n in shapes:
        shape = (m, k, n)
        # Global view: A [M, K] row-sharded; W [K, world*N], device r's B = columns r*N..
        a, wt = b.put(random(1, (m, k)), P("x")), b.put(random(2, (k, w * n)), P(None, "x"))
        ours = b.smap(lambda a, bb: sj.fused_ag_mm(a, bb, 0, axis_name="x"), (P("x"), P(None, "x")), P(None, "x"))
        xla = b.spmd(matmul, (P("x"), P(None, "x")), P(None, "x"), (a, wt))
        windowed = b.spmd(matmul, (P("x"), P(None, "x")), P(None, "x"), (a, wt), WINDOWED)
        ref = xla(a, wt)
        for impl, fn in (("jax_symm", ours), ("jax_windowed", windowed)):
            err = rel_err(fn(a, wt), ref)
            assert err < 1e-2, f"ag_mm {shape} {impl}: relative error {err}"
            b.record("ag_mm", shape, impl, b.time(fn, a, wt), relerr=err)
        b.record("ag_mm", shape, "jax_xla", b.time(xla, a, wt))
        full_a = b.put(random(1, (m, k)), P())  # every device's gathered A
        b.record("ag_mm", shape, "jax_mm_only", b.time(b.smap(matmul, (P(), P(None, "x")), P(None, "x")), full_a, wt))
        gather = b.smap(lambda a: jax.lax.all_gather(a, "x", axis=0, tiled=True), P("x"), P("x"))
        b.record("ag_mm", shape, "jax_comm_only", b.time(gather, a))


def bench_mm_rs(b, shapes):
    w = b.world
    for m, k, n in shapes:
        shape = (m, k, n)
        # Global view: A [M, world*K] sharded on K; W [world*K, N] sharded on rows.
        a, wt = b.put(random(3, (m, w * k)), P(None, "x")), b.put(random(4, (w * k, n)), P("x"))
        ours = b.smap(lambda a, bb: sj.mm_rs(a, bb, 0, axis_name="x"), (P(None, "x"), P("x")), P("x"))
        xla = b.spmd(matmul, (P(None, "x"), P("x")), P("x"), (a, wt))
        windowed = b.spmd(matmul, (P(None, "x"), P("x")), P("x"), (a, wt), WINDOWED)
        ref = xla(a, wt)
        for impl, fn in (("jax_symm", ours), ("jax_windowed", windowed)):
            err = rel_err(fn(a, wt), ref)
            assert err < 2e-2, f"mm_rs {shape} {impl}: relative error {err}"
            b.record("mm_rs", shape, impl, b.time(fn, a, wt), relerr=err)
        b.record("mm_rs", shape, "jax_xla", b.time(xla, a, wt))
        local = b.smap(matmul, (P(None, "x"), P("x")), P("x"))  # each device's partial product, no reduction
        b.record("mm_rs", shape, "jax_mm_only", b.time(local, a, wt))
        partial = b.put(random(5, (w * m, n)), P("x"))
        scatter = b.smap(lambda p: jax.lax.psum_scatter(p, "x", scatter_dimension=0, tiled=True), P("x"), P("x"))
        b.record("mm_rs", shape, "jax_comm_only", b.time(scatter, partial))


def bench_lc_allgather(b, sizes_mb):
    for mb in sizes_mb:
        rows = mb * (1 << 20) // (2 * 4096)  # bf16 rows of 4096 per device
        x = b.put(random(6, (b.world * rows, 4096)), P("x"))
        ours = b.smap(lambda x: sj.lc_allgather(x, axis_name="x"), P("x"), P("x"))
        xla = b.smap(lambda x: jax.lax.all_gather(x, "x", axis=0, tiled=True), P("x"), P("x"))
        np.testing.assert_array_equal(np.asarray(ours(x), np.float32), np.asarray(xla(x), np.float32))
        shape = (mb << 20,)
        b.record("lc_allgather", shape, "jax_symm", b.time(ours, x))
        b.record("lc_allgather", shape, "jax_xla", b.time(xla, x))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--quick", action="store_true", help="the smallest shapes only")
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on JAX's CPU devices: checks this script only")
    args = p.parse_args()
    global AG_MM_SHAPES, MM_RS_SHAPES, LC_SIZES_MB
    if args.cpu_smoke:
        jax.config.update("jax_num_cpu_devices", args.world)
        AG_MM_SHAPES, MM_RS_SHAPES, LC_SIZES_MB = [(64, 32, 48)], [(64, 32, 48)], [1]
    gpus = jax.devices("cpu" if args.cpu_smoke else "gpu")[: args.world]
    assert len(gpus) == args.world, f"needs {args.world} GPUs, JAX sees {len(gpus)}"
    sj.init(gpus, timeout_ms=120_000)
    b = Bench(args, sj.mesh("x"))
    print(json.dumps({"jax": jax.__version__, "devices": [str(d) for d in gpus]}), flush=True)
    pick = (lambda s: s[-1:]) if args.quick else (lambda s: s)
    bench_ag_mm(b, pick(AG_MM_SHAPES))
    bench_mm_rs(b, pick(MM_RS_SHAPES))
    bench_lc_allgather(b, pick(LC_SIZES_MB[:2]) if args.quick else LC_SIZES_MB)
    sj.shutdown()


if __name__ == "__main__":
    main()
