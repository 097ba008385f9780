"""symm.jax on JAX's CPU platform (host backend): the three operations under
jit + shard_map over 4 CPU devices of one process, against jnp references
in float64, plus the errors a user meets: bad shapes at trace time, bad
attributes and unbound devices at run time, and a collective whose peers
never come timing out instead of hanging.

XLA's CPU client runs the per-device programs of one multi-device
executable on its own thread pool, sized to at least the device count for
collectives, so the devices' calls meet. Needs jax (CI installs a pinned
one; set SYMM_REQUIRE_JAX=1 to fail rather than skip without it)."""

import os
import time
from functools import partial

import numpy as np
import pytest

if os.environ.get("SYMM_REQUIRE_JAX") != "1":
    pytest.importorskip("jax")
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import symm.jax as sj  # noqa: E402

WORLD = 4
# Before JAX makes its CPU client (no test before this one touches JAX).
jax.config.update("jax_num_cpu_devices", WORLD)
jax.config.update("jax_platforms", "cpu")

# Relative to the reference's largest magnitude: inputs are exact in the
# dtype, products summed in f32, outputs rounded once per partial sum.
TOLERANCE = {jnp.float32: 1e-5, jnp.float16: 2e-3, jnp.bfloat16: 1e-2}
DTYPES = list(TOLERANCE)


@pytest.fixture
def mesh():
    assert len(jax.devices()) == WORLD, "JAX made its CPU client before this module configured it"
    sj.init(timeout_ms=60_000)
    yield sj.mesh("x")
    sj.shutdown()


def random(rng, shape, dtype):
    # Non-zero everywhere, so an unwritten (zero) element cannot pass.
    x = rng.standard_normal(shape)
    x += np.where(x >= 0, 0.25, -0.25)
    return jnp.asarray(x, dtype)


def assert_close(got, ref, dtype):
    got = np.asarray(got, np.float64)
    assert got.shape == ref.shape
    err = np.abs(got - ref).max() / np.abs(ref).max()
    assert err <= TOLERANCE[dtype], f"relative error {err:.2e} > {TOLERANCE[dtype]:.0e} for {jnp.dtype(dtype).name}"


def f64(x):
    return np.asarray(x, np.float64)


def per_device(out):
    """The devices' results stacked along dimension 0 (out_specs P("x")),
    split back into one array per device."""
    return np.split(np.asarray(out), WORLD)


# --- fused all-gather + matmul ----------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
def test_ag_mm_rows_two_bs_and_gathered_a(mesh, dtype):
    rng = np.random.default_rng(1)
    a = random(rng, (WORLD * 8, 32), dtype)  # device r holds rows 8r..8r+7
    b0, b1 = random(rng, (32, 24), dtype), random(rng, (32, 8), dtype)

    def body(a_shard, b0, b1):
        ag, (o0, o1) = sj.fused_ag_mm(a_shard, [b0, b1], 0, return_ag=True, axis_name="x")
        return ag, o0, o1

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("x"), P(), P()), out_specs=P("x")))
    ag, o0, o1 = f(a, b0, b1)
    for r in range(WORLD):
        np.testing.assert_array_equal(per_device(ag)[r], np.asarray(a))
        assert_close(per_device(o0)[r], f64(a) @ f64(b0), dtype)
        assert_close(per_device(o1)[r], f64(a) @ f64(b1), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_ag_mm_last_dim_concatenates_k(mesh, dtype):
    rng = np.random.default_rng(2)
    a = random(rng, (16, WORLD * 8), dtype)  # device r holds columns 8r..8r+7
    b = random(rng, (WORLD * 8, 20), dtype)
    body = partial(sj.fused_ag_mm, gather_dim=-1, axis_name="x")
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(None, "x"), P()), out_specs=P("x")))
    out = f(a, b)
    for r in range(WORLD):
        assert_close(per_device(out)[r], f64(a) @ f64(b), dtype)


def test_ag_mm_3d_middle_dim(mesh):
    rng = np.random.default_rng(3)
    a = random(rng, (2, WORLD * 3, 16), jnp.float32)
    b = random(rng, (16, 12), jnp.float32)
    body = partial(sj.fused_ag_mm, gather_dim=1)
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(None, "x"), P()), out_specs=P("x")))
    out = f(a, b)
    for r in range(WORLD):
        assert_close(per_device(out)[r], np.einsum("ijk,kn->ijn", f64(a), f64(b)), jnp.float32)


# --- matmul + reduce-scatter ------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", ["sum", "avg"])
def test_mm_rs_rows(mesh, dtype, op):
    rng = np.random.default_rng(4)
    a = random(rng, (WORLD * 4, WORLD * 16), dtype)  # device r: all rows, K-slice r
    b = random(rng, (WORLD * 16, 24), dtype)  # device r: K-slice r
    body = partial(sj.mm_rs, scatter_dim=0, op=op, axis_name="x")
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(None, "x"), P("x")), out_specs=P("x")))
    ref = f64(a) @ f64(b) / (WORLD if op == "avg" else 1)
    assert_close(f(a, b), ref, dtype)  # device r's rows are chunk r of the sum


def test_mm_rs_last_dim(mesh):
    rng = np.random.default_rng(5)
    a = random(rng, (2, 6, WORLD * 8), jnp.float32)
    b = random(rng, (WORLD * 8, WORLD * 5), jnp.float32)
    body = partial(sj.mm_rs, scatter_dim=-1)
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(None, None, "x"), P("x")), out_specs=P(None, None, "x")))
    assert_close(f(a, b), np.einsum("ijk,kn->ijn", f64(a), f64(b)), jnp.float32)


# --- copy-engine all-gather -----------------------------------------------------
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float8_e4m3fn])
def test_lc_allgather(mesh, dtype):
    rng = np.random.default_rng(6)
    x = random(rng, (WORLD * 3, 5, 7), dtype)
    f = jax.jit(jax.shard_map(partial(sj.lc_allgather, axis_name="x"), mesh=mesh, in_specs=P("x"), out_specs=P("x")))
    out = f(x)
    for r in range(WORLD):
        np.testing.assert_array_equal(f64(per_device(out)[r]), f64(x))


def test_several_calls_in_one_program_and_repeated(mesh):
    """Calls that depend on each other and calls that do not, in one
    program, run many times: every device must run them in one order."""
    rng = np.random.default_rng(7)
    a = random(rng, (WORLD * 4, 16), jnp.float32)
    b = random(rng, (16, WORLD * 4), jnp.float32)
    c = random(rng, (WORLD * 2, 3), jnp.float32)

    def body(a, b, c):
        y = sj.fused_ag_mm(a, b)  # [WORLD*4, WORLD*4] on every device
        z = sj.mm_rs(y, b.T, scatter_dim=0)  # chunk of rows of sum over devices of y @ b.T
        g = sj.lc_allgather(c)  # independent of the others
        return z, g

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("x"), P(), P("x")), out_specs=P("x")))
    ref = WORLD * (f64(a) @ f64(b) @ f64(b).T)
    for _ in range(20):
        z, g = f(a, b, c)
        assert_close(z, ref, jnp.float32)
        for r in range(WORLD):
            np.testing.assert_array_equal(per_device(g)[r], np.asarray(c))


def test_independent_calls_of_one_shape_run_in_program_order(mesh):
    """Calls that neither depend on each other nor differ in their
    arguments, large enough that XLA's CPU runtime runs them concurrently:
    without the order token the devices ran them in different orders and
    exchanged each other's data (about one output in five wrong)."""
    x = random(np.random.default_rng(8), (32768, 16), jnp.float32)  # 2 MiB, replicated
    calls = 8

    def body(x):
        return tuple(sj.all_reduce(x * k) for k in range(1, calls + 1))

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(), out_specs=tuple(P("x") for _ in range(calls))))
    for _ in range(10):
        for k, out in enumerate(f(x), 1):
            for r in range(WORLD):
                assert_close(per_device(out)[r], WORLD * k * f64(x), jnp.float32)


def test_calls_in_scan_and_cond(mesh):
    """The order token runs through control flow: calls in a lax.scan's
    body, in the taken branch of a lax.cond, and under jax.checkpoint."""

    def body(x, flag):
        def step(c, _):
            return sj.all_reduce(c) / WORLD + 1, sj.lc_allgather(c[:1])

        c, rows = jax.lax.scan(step, x, None, length=5)
        z = jax.lax.cond(flag[0] > 0, lambda v: sj.all_reduce(v * 2), lambda v: sj.all_reduce(v * 3), x)
        w = jax.checkpoint(lambda v: sj.all_reduce(jnp.sin(v)))(x)
        return c, rows, z, w

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P()), out_specs=(P("x"),) * 4))
    x = random(np.random.default_rng(10), (4, 8), jnp.float32)
    for flag in (1, -1):
        c, rows, z, w = f(x, jnp.array([flag]))
        for r in range(WORLD):
            assert_close(per_device(c)[r], f64(x) + 5, jnp.float32)
            assert_close(per_device(z)[r], f64(x) * (2 if flag > 0 else 3) * WORLD, jnp.float32)
            assert_close(per_device(w)[r], np.sin(f64(x)) * WORLD, jnp.float32)
        # Step i gathered every device's first row of the carry then: x[0] + i.
        want = np.stack([np.tile(f64(x)[:1] + i, (WORLD, 1)) for i in range(5)])
        assert_close(per_device(rows)[0], want, jnp.float32)


def test_programs_dispatched_back_to_back_run_in_order(mesh):
    """Two programs of alike calls dispatched without waiting: each device
    runs them in the order they were dispatched."""
    x = random(np.random.default_rng(9), (32768, 16), jnp.float32)
    f = jax.jit(jax.shard_map(lambda x: sj.all_reduce(x), mesh=mesh, in_specs=P(), out_specs=P("x")))
    g = jax.jit(jax.shard_map(lambda x: sj.all_reduce(x * 3), mesh=mesh, in_specs=P(), out_specs=P("x")))
    outs = [h(x) for _ in range(8) for h in (f, g)]
    for i, out in enumerate(outs):
        for r in range(WORLD):
            assert_close(per_device(out)[r], WORLD * (1 + 2 * (i % 2)) * f64(x), jnp.float32)


# --- errors ---------------------------------------------------------------------------
def test_trace_time_checks(mesh):
    def traced(body, *args, specs):
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=P("x"))).trace(*args)

    a, b = jnp.ones((WORLD * 4, 8)), jnp.ones((9, 3))
    with pytest.raises(ValueError, match=r"bs\[0\] has 9 rows; the gathered a_shard has 8 columns"):
        traced(sj.fused_ag_mm, a, b, specs=(P("x"), P()))
    with pytest.raises(TypeError, match="bs\\[0\\] has dtype bfloat16; a_shard has float32"):
        traced(sj.fused_ag_mm, a, jnp.ones((8, 3), jnp.bfloat16), specs=(P("x"), P()))
    with pytest.raises(ValueError, match=r"does not divide by the world size \(4\)"):
        traced(partial(sj.mm_rs, scatter_dim=1), a, jnp.ones((WORLD * 2, 6)), specs=(P(None, "x"), P("x")))
    with pytest.raises(TypeError, match="expected one of"):
        traced(sj.lc_allgather, jnp.ones((WORLD, 2), jnp.int16), specs=(P("x"),))
    for dim in (None, 0.0, "0", True):
        with pytest.raises(TypeError, match=f"gather_dim must be an int, got {dim!r}"):
            traced(partial(sj.fused_ag_mm, gather_dim=dim), a, jnp.ones((8, 3)), specs=(P("x"), P()))
    with pytest.raises(TypeError, match="scatter_dim must be an int, got None"):
        traced(partial(sj.mm_rs, scatter_dim=None), a, jnp.ones((8, 3)), specs=(P("x"), P()))


def test_handler_rejects_bad_attributes_on_every_device(mesh):
    """A call the handlers cannot read fails on every device with our
    message (the devices still meet, so none hangs)."""

    def body(a, b):
        result = jax.ShapeDtypeStruct((WORLD * 4, 3), a.dtype)
        return jax.ffi.ffi_call("symm_fused_ag_mm", result)(a, b, dim=np.int64(0))

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("x"), P()), out_specs=P("x")))
    with pytest.raises(Exception, match="symm_fused_ag_mm.*attribute gather_dim is missing") as e:
        f(jnp.ones((WORLD * 4, 8)), jnp.ones((8, 3))).block_until_ready()
    assert "rank" in str(e.value)


def test_a_failed_call_does_not_fail_the_next_program(mesh):
    """A call every device refuses fails its program, the order token it
    hands on among its outputs; the next program still runs (its calls get
    a fresh token), and nothing of the failure is left for JAX's exit."""
    from symm.jax import _calls

    # An algorithm the wrappers would refuse while tracing, so it reaches the handlers.
    bad = jax.jit(
        jax.shard_map(
            _calls.all_reduce("sum", "nonsense", ("x",), ("x",)), mesh=mesh, in_specs=P("x"), out_specs=P("x")
        )
    )
    good = jax.jit(jax.shard_map(sj.all_reduce, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
    x = jnp.ones((WORLD * 2, 3))
    with pytest.raises(Exception, match='attribute algorithm is "nonsense"'):
        bad(x).block_until_ready()
    for _ in range(2):
        np.testing.assert_array_equal(np.asarray(good(x)), np.full((WORLD * 2, 3), WORLD))
    jax.effects_barrier()


def test_a_failure_leaves_no_failed_token_behind(mesh):
    """A program whose symm call fails fails its other ordered effects'
    tokens too (an ordered io_callback's): the next program with only such
    a callback runs, and jax.effects_barrier reports the failure at most
    once."""
    from symm.jax import _calls

    seen = []

    def note(v):
        seen.append(float(v))
        return v

    def bad_body(x):
        jax.experimental.io_callback(note, jax.ShapeDtypeStruct((), x.dtype), x.sum(), ordered=True)
        return _calls.all_reduce("sum", "nonsense", ("x",), ("x",))(x)

    def callback_only(x):
        return jax.experimental.io_callback(note, jax.ShapeDtypeStruct((), x.dtype), x.sum() + 1, ordered=True)

    bad = jax.jit(bad_body)
    x = jnp.ones((3,))
    mapped_bad = jax.jit(jax.shard_map(bad, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
    with pytest.raises(Exception, match='attribute algorithm is "nonsense"'):
        mapped_bad(jnp.ones((WORLD * 3,))).block_until_ready()
    np.testing.assert_array_equal(float(jax.jit(callback_only)(x)), 4.0)
    jax.effects_barrier()
    jax.effects_barrier()
    # Straight to the barrier after a failure: it raises it once.
    with pytest.raises(Exception):
        mapped_bad(jnp.ones((WORLD * 3,)))
        jax.effects_barrier()
    jax.effects_barrier()
    np.testing.assert_array_equal(float(jax.jit(callback_only)(x)), 4.0)


def test_a_users_failing_callback_is_still_reported(mesh):
    """A failure of the user's own ordered io_callback in a program with a
    symm call stays JAX's to report: the next ordered program and the
    barrier raise it, as without symm."""
    from jax._src import dispatch

    def fail(v):
        raise RuntimeError("the user's callback failed")

    def body(x):
        jax.experimental.io_callback(fail, jax.ShapeDtypeStruct((), x.dtype), x.sum(), ordered=True)
        return sj.all_reduce(x)

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
    g = jax.jit(lambda v: jax.experimental.io_callback(lambda t: t, jax.ShapeDtypeStruct((), v.dtype), v, ordered=True))
    try:
        f(jnp.ones((WORLD * 3,)))  # its output is never read
        with pytest.raises(Exception, match="the user's callback failed"):
            g(jnp.float32(3)).block_until_ready()
        with pytest.raises(Exception, match="the user's callback failed"):
            jax.effects_barrier()
    finally:
        dispatch.runtime_tokens.clear()  # JAX keeps the failure for ever; later tests start clean


def test_an_ahead_of_time_program_runs_again():
    """A .lower().compile() program called again: JAX's fast path for a
    second call would leave out the order token (the program has an
    unordered effect too, which keeps it off that path)."""
    sj.init(timeout_ms=60_000)
    try:
        f = jax.jit(jax.shard_map(sj.lc_allgather, mesh=sj.mesh("x"), in_specs=P("x"), out_specs=P("x")))
        x = random(np.random.default_rng(13), (WORLD * 2, 3), jnp.float32)
        compiled = f.lower(x).compile()
        for _ in range(3):
            np.testing.assert_array_equal(per_device(compiled(x))[WORLD - 1], np.asarray(x))
    finally:
        sj.shutdown()


def test_shutdown_waits_for_dispatched_programs():
    """XLA's CPU runtime runs a program after its dispatch returns;
    shutdown waits for it rather than unbinding the devices under it."""
    sj.init(timeout_ms=60_000)
    m = sj.mesh("x")
    x = random(np.random.default_rng(11), (65536, 16), jnp.float32)

    def body(x):
        for _ in range(4):
            x = sj.all_reduce(x) / WORLD
        return x

    f = jax.jit(jax.shard_map(body, mesh=m, in_specs=P(), out_specs=P("x")))
    f(x).block_until_ready()  # compiled
    out = f(x)
    sj.shutdown()
    for r in range(WORLD):
        assert_close(per_device(out)[r], f64(x), jnp.float32)


def test_a_program_traced_under_an_earlier_init_is_refused():
    """A compiled program names the groups it was traced for: after
    shutdown and an init over the devices in another order (other ranks),
    it fails on every device instead of running on the new groups; jitted
    functions are traced again (init clears JAX's caches) and run right."""
    x = random(np.random.default_rng(12), (WORLD * 2, 3), jnp.float32)
    sj.init(timeout_ms=60_000)
    try:
        m = sj.mesh("x")
        f = jax.jit(jax.shard_map(sj.lc_allgather, mesh=m, in_specs=P("x"), out_specs=P("x")))
        compiled = f.lower(x).compile()
        np.testing.assert_array_equal(per_device(compiled(x))[0], np.asarray(x))
        sj.shutdown()
        sj.init(list(reversed(jax.devices())), timeout_ms=60_000)
        with pytest.raises(Exception, match="traced for other symm groups"):
            compiled(x).block_until_ready()
        g = jax.jit(jax.shard_map(sj.lc_allgather, mesh=sj.mesh("x"), in_specs=P("x"), out_specs=P("x")))
        for r in range(WORLD):
            np.testing.assert_array_equal(per_device(g(x))[r], np.asarray(x))
        # f is traced again, over its mesh of the devices in the old order.
        with pytest.raises(ValueError, match="the mesh lists the devices .* in the order symm.jax.init"):
            f(x)
        # An abstract mesh does not show its devices' order: refused.
        abstract = jax.jit(
            jax.shard_map(sj.lc_allgather, mesh=sj.mesh("x").abstract_mesh, in_specs=P("x"), out_specs=P("x"))
        )
        with pytest.raises(ValueError, match="concrete mesh"):
            abstract(jax.device_put(x, jax.sharding.NamedSharding(sj.mesh("x"), P("x"))))
    finally:
        sj.shutdown()


def test_unbound_device_is_reported():
    sj.init(timeout_ms=60_000)
    m = sj.mesh("x")
    sj.shutdown()  # unbinds every device
    f = jax.jit(jax.shard_map(sj.lc_allgather, mesh=m, in_specs=P("x"), out_specs=P("x")))
    with pytest.raises(RuntimeError, match="not initialized"):
        f(jnp.ones((WORLD, 2)))  # traced after shutdown: the wrapper knows
    sj.init(timeout_ms=60_000)
    g = jax.jit(jax.shard_map(sj.lc_allgather, mesh=m, in_specs=P("x"), out_specs=P("x")))
    g(jnp.ones((WORLD, 2))).block_until_ready()  # traced while bound
    sj.shutdown()
    # Every device's call fails; which one XLA reports first is a race
    # between its CPU threads (device 3 in one CI run).
    with pytest.raises(Exception, match=r"cpu device \d+ is bound to no symm group"):
        g(jnp.ones((WORLD, 2))).block_until_ready()


def test_a_call_without_its_peers_times_out():
    """A custom call under plain jit (one device; symm.jax's wrappers refuse
    this at trace time, see below): its peers never come, so it fails after
    the group's timeout, naming it, instead of hanging."""
    sj.init(timeout_ms=1500)
    try:
        x = jax.device_put(jnp.ones((2, 3)), jax.devices()[0])
        raw = jax.ffi.ffi_call("symm_lc_allgather", jax.ShapeDtypeStruct((WORLD * 2, 3), x.dtype))
        with pytest.raises(Exception, match="DEADLINE_EXCEEDED.*rank 0 of 4.*did not arrive within 1500 ms"):
            jax.jit(raw)(x).block_until_ready()
    finally:
        sj.shutdown()


def test_outside_shard_map_fails_at_trace_time():
    """Under plain jit, eagerly, or over an axis the group does not span,
    every operation fails while tracing, saying what to do, in well under
    the group's timeout (60 s here)."""
    x, w = jnp.ones((WORLD * 2, 8)), jnp.ones(8)
    calls = {
        "fused_ag_mm": lambda x: sj.fused_ag_mm(x, jnp.ones((8, 3))),
        "mm_rs": lambda x: sj.mm_rs(x, jnp.ones((8, WORLD))),
        "lc_allgather": sj.lc_allgather,
        "all_reduce": sj.all_reduce,
        "all_reduce_rmsnorm": lambda x: sj.all_reduce_rmsnorm(x, x, w),
    }
    sj.init(timeout_ms=60_000)
    try:
        for name, call in calls.items():
            for run in (jax.jit(call), call, jax.vmap(call, axis_name="x")):
                start = time.monotonic()
                with pytest.raises(ValueError, match=r"outside jax.shard_map; call .* inside jax.shard_map\(f, mesh="):
                    run(x)
                assert time.monotonic() - start < 5, name

        def mapped(body, mesh, axis="x"):
            return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(axis), out_specs=P(axis)))

        half = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("y",))
        with pytest.raises(ValueError, match="axis 'y' has 2 devices but the symm group 4"):
            mapped(sj.all_reduce, half, "y")(x)
        two_d = jax.sharding.Mesh(np.array(jax.devices()).reshape(2, 2), ("x", "y"))
        with pytest.raises(ValueError, match="axis 'x' has 2 devices but the symm group 4"):
            mapped(partial(sj.all_reduce, axis_name="x"), two_d)(x)
        with pytest.raises(ValueError, match="pass axis_name="):
            mapped(sj.all_reduce, two_d)(x)
        with pytest.raises(ValueError, match="axis 'z' is not a manual axis"):
            mapped(partial(sj.all_reduce, axis_name="z"), sj.mesh("x"))(x)
    finally:
        sj.shutdown()


# --- all-reduce --------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("algorithm", [None, "one_shot", "two_shot"])
def test_all_reduce_sum_and_avg(mesh, dtype, algorithm):
    rng = np.random.default_rng(11)
    x = random(rng, (WORLD * 3, 40), dtype)  # device r holds rows 3r..3r+2

    def body(x):
        s = sj.all_reduce(x, algorithm=algorithm, axis_name="x")
        a = sj.all_reduce(x, "avg", algorithm=algorithm, axis_name="x")
        return s, a

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
    s, a = f(x)
    ref = sum(per_device(f64(x)))
    for got in per_device(s):
        assert_close(got, ref, dtype)
    for got in per_device(a):
        assert_close(got, ref / WORLD, dtype)


@pytest.mark.parametrize("dtype", [jnp.int8, jnp.uint8, jnp.int32])
@pytest.mark.parametrize("algorithm", [None, "one_shot", "two_shot"])
def test_all_reduce_integers_exact(mesh, dtype, algorithm):
    """Integers sum exactly, wrapping (int32 values beyond f32's 24 bits);
    "avg" divides the wrapped sum truncating toward zero. (int64 needs
    jax_enable_x64; the C and numpy tests cover it.)"""
    rng = np.random.default_rng(13)
    info = np.iinfo(dtype)
    if info.bits == 32:
        x = np.where(rng.random((WORLD * 3, 40)) < 0.5, -1, 1) * (
            (1 << 25) + 1 + rng.integers(0, 1 << 19, (WORLD * 3, 40))
        )
        x[0, :4] = info.max  # sums that wrap
    else:
        x = rng.integers(info.min, info.max, (WORLD * 3, 40), endpoint=True)
    x = jnp.asarray(x.astype(dtype))

    def body(x):
        s = sj.all_reduce(x, algorithm=algorithm, axis_name="x")
        a = sj.all_reduce(x, "avg", algorithm=algorithm, axis_name="x")
        return s, a

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
    s, a = f(x)
    total = sum(p.astype(object) for p in per_device(np.asarray(x)))
    wrapped = (total - info.min) % (1 << info.bits) + info.min
    avg = np.vectorize(lambda v: abs(v) // WORLD * (1 if v >= 0 else -1))(wrapped)
    for got in per_device(s):
        assert got.dtype == np.dtype(dtype)
        np.testing.assert_array_equal(got.astype(object), wrapped)
    for got in per_device(a):
        np.testing.assert_array_equal(got.astype(object), avg)


def test_lc_allgather_int32(mesh):
    x = jnp.asarray(np.arange(WORLD * 3 * 5, dtype=np.int32).reshape(WORLD * 3, 5) * 1000003 + (1 << 25) + 1)
    f = jax.jit(jax.shard_map(partial(sj.lc_allgather, axis_name="x"), mesh=mesh, in_specs=P("x"), out_specs=P("x")))
    for got in per_device(f(x)):
        np.testing.assert_array_equal(got, np.asarray(x))


@pytest.mark.parametrize("dtype", DTYPES)
def test_all_reduce_rmsnorm(mesh, dtype):
    rng = np.random.default_rng(12)
    tokens, hidden, eps = 2, 64, 1e-6
    x = random(rng, (WORLD * tokens, hidden), dtype)
    residual, weight = random(rng, (tokens, hidden), dtype), random(rng, (hidden,), dtype)

    def body(x, residual, weight):
        return sj.all_reduce_rmsnorm(x, residual, weight, eps, axis_name="x")

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("x"), P(), P()), out_specs=P("x")))
    out, r = f(x, residual, weight)
    s = np.asarray(jnp.asarray(sum(per_device(f64(x))), dtype), np.float64)
    r_ref = np.asarray(jnp.asarray(s + f64(residual), dtype), np.float64)
    want = r_ref / np.sqrt((r_ref**2).mean(-1, keepdims=True) + eps) * f64(weight)
    for got_out, got_r in zip(per_device(out), per_device(r)):
        assert_close(got_r, r_ref, dtype)
        assert_close(got_out, want, dtype)


def test_all_reduce_of_a_scalar(mesh):
    """A 0-d array reduces as psum reduces it, to a 0-d result."""
    x = jnp.arange(1.0, WORLD + 1, dtype=jnp.float32)  # device r holds r + 1

    def body(v):
        s = v.reshape(())
        total, avg = sj.all_reduce(s, axis_name="x"), sj.all_reduce(s, "avg", axis_name="x")
        assert total.shape == avg.shape == ()
        return total.reshape(1), avg.reshape(1)

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
    total, avg = f(x)
    want = float(sum(range(1, WORLD + 1)))
    np.testing.assert_array_equal(f64(total), np.full(WORLD, want))
    np.testing.assert_allclose(f64(avg), np.full(WORLD, want / WORLD), rtol=1e-6)


def test_all_reduce_trace_time_errors(mesh):
    x = jnp.ones((WORLD, 8), jnp.float32)

    def mapped(body):
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x")))

    with pytest.raises(ValueError, match="algorithm"):
        mapped(lambda x: sj.all_reduce(x, algorithm="x"))(x)
    with pytest.raises(ValueError, match="weight"):
        mapped(lambda x: sj.all_reduce_rmsnorm(x, x, jnp.ones(3, jnp.float32)))(x)
    # What the handlers would refuse only at run time, on every device.
    w = jnp.ones(8, jnp.float32)
    for eps in (float("nan"), -1e-6, 1e40):
        with pytest.raises(ValueError, match="eps is"):
            mapped(lambda x, eps=eps: sj.all_reduce_rmsnorm(x, x, w, eps)[0])(x)
    for eps in ("small", "1e-5", True):
        with pytest.raises(TypeError, match="eps must be a number"):
            mapped(lambda x, eps=eps: sj.all_reduce_rmsnorm(x, x, w, eps)[0])(x)
    with pytest.raises(ValueError, match="at most 8"):
        mapped(lambda x: sj.all_reduce(x.reshape(1, *(1,) * 8, 8)).reshape(1, 8))(x)
    with pytest.raises(ValueError, match="no empty arrays"):
        mapped(lambda x: sj.mm_rs(x[:, :0], jnp.ones((0, 4), jnp.float32)) + x[:, :4].sum())(x)
