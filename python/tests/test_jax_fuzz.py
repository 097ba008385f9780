"""symm.jax's operations on randomly drawn calls under jit + shard_map (JAX's
CPU platform, the host backend), as ops_fuzz.py draws them for the Python
API: sizes off every tile, 2-D and 3-D operands, every gather and scatter
dimension, f32/bf16/f16, one or two Bs, sum and avg, worlds of 2, 3 and 4
devices; each device's every output element against float64 within
ops_fuzz's bounds. Fixed seeds. Needs jax (as test_jax_cpu.py)."""

import os

import numpy as np
import pytest

if os.environ.get("SYMM_REQUIRE_JAX") != "1":
    pytest.importorskip("jax")
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
from ops_fuzz import EPS, check_close, f64, size, values  # noqa: E402

import symm.jax as sj  # noqa: E402

DEVICES = 4
jax.config.update("jax_num_cpu_devices", DEVICES)
jax.config.update("jax_platforms", "cpu")
JNP = {"f32": jnp.float32, "bf16": jnp.bfloat16, "f16": jnp.float16}
CASES = 24  # per world


@pytest.fixture(params=[2, 3, 4], ids=lambda w: f"world{w}")
def world(request):
    assert len(jax.devices()) == DEVICES, "JAX made its CPU client before this module configured it"
    sj.init(jax.devices()[: request.param], timeout_ms=60_000)
    yield request.param
    sj.shutdown()


def run(world, body, in_specs, *args):
    """`body` on every device (inputs split by `in_specs`), each device's
    outputs (every result stacked along dimension 0) split back per device."""
    f = jax.jit(jax.shard_map(body, mesh=sj.mesh("x"), in_specs=in_specs, out_specs=P("x")))
    outs = f(*args)
    outs = outs if isinstance(outs, (list, tuple)) else [outs]
    return [[np.asarray(x) for x in np.split(np.asarray(o), world)] for o in outs]


def spec(ndim, dim):
    return P(*[("x" if i == dim else None) for i in range(ndim)])


def lead(rng, ndim):
    return [size(rng, 1, 24)] if ndim == 2 else [size(rng, 1, 4), size(rng, 1, 6)]


def ag_mm_case(world, rng):
    dt = str(rng.choice(list(JNP)))
    ndim = int(rng.choice([2, 3]))
    dim = int(rng.integers(0, ndim))
    k = size(rng, 1, 48)
    shards = [values(rng, (*lead_, k), dt) for lead_ in [lead(rng, ndim)] * world]
    gathered = np.concatenate(shards, axis=dim)
    ns = [size(rng, 1, 40) for _ in range(int(rng.integers(1, 3)))]
    bs = [values(rng, (gathered.shape[-1], n), dt) for n in ns]
    return_ag = bool(rng.random() < 0.5)

    def body(a, *bs):
        out = sj.fused_ag_mm(a, list(bs), dim, return_ag=return_ag, axis_name="x")
        return [out[0], *out[1]] if return_ag else list(out)

    got = run(world, body, (spec(ndim, dim),) + (P(),) * len(bs), jnp.asarray(gathered, JNP[dt]),
              *[jnp.asarray(b, JNP[dt]) for b in bs])
    what = f"ag_mm {dt} shard {list(shards[0].shape)} dim {dim} ns {ns} world {world}"
    if return_ag:
        for r in range(world):
            np.testing.assert_array_equal(f64(got[0][r]), f64(gathered), err_msg=what)
        got = got[1:]
    for o, b in zip(got, bs):
        ref, mag = f64(gathered) @ f64(b), np.abs(f64(gathered)) @ np.abs(f64(b))
        for r in range(world):
            check_close(f"{what} (device {r})", o[r], ref, EPS[dt] * (np.abs(ref) + mag))


def mm_rs_case(world, rng):
    dt = str(rng.choice(list(JNP)))
    ndim = int(rng.choice([2, 3]))
    dim = int(rng.integers(0, ndim))
    k, n = size(rng, 1, 48), size(rng, 1, 40)
    shape = [*lead(rng, ndim), n]
    shape[dim] = max(1, shape[dim] // world) * world
    n = shape[-1]
    op = str(rng.choice(["sum", "avg"]))
    a = [values(rng, (*shape[:-1], k), dt) for _ in range(world)]
    b = [values(rng, (k, n), dt) for _ in range(world)]
    # Device r's `a` and `b`: rows r of the stacked operands (split along dimension 0).
    got = run(world, lambda x, y: sj.mm_rs(x, y, dim, op, axis_name="x"), (P("x"), P("x")),
              jnp.asarray(np.concatenate(a), JNP[dt]), jnp.asarray(np.concatenate(b), JNP[dt]))[0]
    total = sum(f64(x) @ f64(y) for x, y in zip(a, b))
    mag = sum(np.abs(f64(x)) @ np.abs(f64(y)) for x, y in zip(a, b))
    if op == "avg":
        total, mag = total / world, mag / world
    what = f"mm_rs {dt} a {list(a[0].shape)} n {n} dim {dim} {op} world {world}"
    for r, (ref, m) in enumerate(zip(np.split(total, world, axis=dim), np.split(mag, world, axis=dim))):
        check_close(f"{what} (device {r})", got[r], ref, 2 * EPS[dt] * (np.abs(ref) + m))


def all_reduce_case(world, rng):
    dt = str(rng.choice(list(JNP)))
    shape = [size(rng, 1, 40), size(rng, 1, 300)]
    op = str(rng.choice(["sum", "avg"]))
    xs = [values(rng, shape, dt) for _ in range(world)]
    got = run(world, lambda x: sj.all_reduce(x, op, axis_name="x"), (P("x"),), jnp.asarray(np.concatenate(xs), JNP[dt]))[0]
    total, mag = sum(f64(x) for x in xs), sum(np.abs(f64(x)) for x in xs)
    if op == "avg":
        total, mag = total / world, mag / world
    for r in range(world):
        check_close(f"all_reduce {dt} {shape} {op} world {world} (device {r})", got[r], total,
                    EPS[dt] * (np.abs(total) + mag))


def lc_allgather_case(world, rng):
    dt = str(rng.choice(list(JNP)))
    shape = [size(rng, 1, 30), size(rng, 1, 50)]
    xs = [values(rng, shape, dt) for _ in range(world)]
    got = run(world, lambda x: sj.lc_allgather(x, axis_name="x"), (P("x"),), jnp.asarray(np.concatenate(xs), JNP[dt]))[0]
    for r in range(world):
        np.testing.assert_array_equal(f64(got[r]), f64(np.concatenate(xs)), err_msg=f"lc_allgather {shape} {dt}")


CASE_KINDS = [ag_mm_case, mm_rs_case, all_reduce_case, lc_allgather_case]


def test_random_calls_match_float64_references(world):
    rng = np.random.default_rng(100 + world)
    for _ in range(CASES):
        CASE_KINDS[int(rng.choice(len(CASE_KINDS), p=[0.35, 0.35, 0.15, 0.15]))](world, rng)
