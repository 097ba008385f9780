"""The kept calls of the plain operations (symm._fastcall) on numpy
arrays: a repeated call reuses its prepared call and gives the fresh
call's result; any change to what the preparation read (shape, strides,
dtype, aliasing, keywords, stream) prepares anew; an array at a kept
call's address is read anew. Outputs poisoned, references in float64.
Every test runs on both paths of a call: the compiled one
(``symm._fastcall_ext``, whose keys must equal Python's) and Python's."""

import contextlib
import os
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest
from ranks import on_threads

import symm
from symm import _fastcall

WORLD = 2
EXT = _fastcall._ext  # None where it is not built


def call_path(request, monkeypatch):
    """The `path` fixture's body (test_fastcall_torch.py shares it)."""
    if request.param == "python":
        monkeypatch.setattr(_fastcall, "_ext", None)
    elif EXT is None:
        if os.environ.get("SYMM_REQUIRE_FASTCALL_EXT") == "1":  # CI: it must have been built
            pytest.fail("symm._fastcall_ext is not built")
        pytest.skip("symm._fastcall_ext is not built")
    return request.param


@pytest.fixture(autouse=True, params=["c", "python"])
def path(request, monkeypatch):
    return call_path(request, monkeypatch)


@contextlib.contextmanager
def in_use(template):
    """The kept call held as another thread's call holds it: the C path's
    flag where it runs the call, else the Python path's lock."""
    if template.native is not None:
        template.native.busy = True
        try:
            yield
        finally:
            template.native.busy = False
    else:
        with template.busy:
            yield


def groups():
    return symm.local_groups(WORLD, backend="host", timeout_ms=10000)


def kept(g):
    return sum(len(c) for c in g._calls.values())


def inputs(shape, dtype=np.float32, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(shape).astype(dtype) for _ in range(WORLD)]


def summed(xs):
    return np.sum([x.astype(np.float64) for x in xs], axis=0)


def test_repeated_call_is_kept_and_equal():
    xs = inputs((8, 16))

    def rank_main(g):
        outs = []
        for _ in range(3):
            out = np.full((8, 16), np.nan, np.float32)
            assert symm.all_reduce(g, xs[g.rank], out=out) is out
            outs.append(out)
        return kept(g), outs

    for n, outs in on_threads(rank_main, groups()):
        assert n == 1
        for out in outs:
            np.testing.assert_allclose(out, summed(xs), rtol=1e-6)
        np.testing.assert_array_equal(outs[0], outs[2])


def test_every_change_gives_the_fresh_result():
    xs, ys = inputs((8, 16)), inputs((16, 8), seed=1)
    halves = inputs((8, 16), np.float16, seed=2)

    def rank_main(g):
        me = g.rank
        x, checks = xs[me], []

        def ar(arr, ref, **kw):
            out = np.full(arr.shape, np.nan, np.float32 if arr.dtype == np.float32 else arr.dtype)
            symm.all_reduce(g, arr, out=out, **kw)
            checks.append((out, ref))

        ar(x, summed(xs))
        ar(x.copy(), summed(xs))  # new address, same kind: kept call, new address
        ar(ys[me], summed(ys))  # shape
        ar(ys[me].T, summed(ys).T)  # strides
        ar(halves[me], summed(halves))  # dtype
        ar(x, summed(xs) / WORLD, op="avg")  # keyword
        ar(x, summed(xs), algorithm="two_shot")
        ar(x, summed(xs), stream=7)  # the host backend ignores the stream; a new key still
        n = kept(g)
        y = x.copy()
        symm.all_reduce(g, y, out=y)  # aliasing
        checks.append((y, summed(xs)))
        return n, checks

    for n, checks in on_threads(rank_main, groups()):
        assert n == 7
        for got, ref in checks:
            np.testing.assert_allclose(got.astype(np.float64), ref, rtol=2e-3, atol=2e-3)


def test_keyword_reaches_the_library():
    a, b = inputs((4, 8)), np.ones((8, 4), np.float32)

    def rank_main(g):
        symm.fused_ag_mm(g, a[g.rank], b, 0, algorithm="sequential")
        with pytest.raises(symm.SymmUnsupported):
            symm.fused_ag_mm(g, a[g.rank], b, 0, algorithm="fused")

    on_threads(rank_main, groups())


def test_same_address_new_shape_dtype_and_contents():
    # Arrays of one buffer at one address: a kept call must not read the
    # old shape, dtype or contents.
    def rank_main(g):
        buf = np.empty(512, np.float32)
        results = []
        for shape, dtype, value in (((8, 16), np.float32, 1), ((16, 8), np.float32, 2), ((8, 16), np.float32, 3)):
            x = buf[: np.prod(shape)].reshape(shape)
            x[...] = value * (g.rank + 1)
            results.append((symm.all_reduce(g, x), value * 3))
        h = buf.view(np.float16)[:64].reshape(8, 8)
        h[...] = g.rank + 1
        results.append((symm.all_reduce(g, h), 3))
        return results

    for results in on_threads(rank_main, groups()):
        shapes = [r.shape for r, _ in results]
        assert shapes == [(8, 16), (16, 8), (8, 16), (8, 8)]
        assert results[-1][0].dtype == np.float16
        for got, want in results:
            np.testing.assert_array_equal(got, np.full(got.shape, want, got.dtype))


def test_allocated_outputs_are_new_every_call():
    a, b = inputs((4, 8)), inputs((8, 6), seed=3)

    def rank_main(g):
        got = [symm.fused_ag_mm(g, a[g.rank], [b[0]], 0, return_ag=True) for _ in range(3)]
        return kept(g), got

    ref = np.concatenate(a).astype(np.float64)
    for n, got in on_threads(rank_main, groups()):
        assert n == 1
        outs = [o[0] for _, o in got]
        assert len({o.__array_interface__["data"][0] for o in outs}) == 3
        for ag, (out,) in got:
            np.testing.assert_array_equal(ag, ref.astype(np.float32))
            np.testing.assert_allclose(out, ref @ b[0], rtol=1e-4, atol=1e-4)


def test_ops_with_kept_calls():
    a, b = inputs((4, 8)), inputs((8, 6), seed=4)
    res, w = inputs((4, 8), seed=5), np.linspace(0.5, 1.5, 8).astype(np.float32)

    def rank_main(g):
        me, got = g.rank, []
        for _ in range(2):
            got.append(
                (
                    symm.mm_rs(g, a[me], b[me], 0),
                    symm.lc_allgather(g, a[me]),
                    symm.all_reduce_rmsnorm(g, a[me], res[me], w, out=np.full((4, 8), np.nan, np.float32)),
                )
            )
        return kept(g), got

    products = summed([x @ y for x, y in zip(a, b)])
    for rank, (n, got) in enumerate(on_threads(rank_main, groups())):
        assert n == 3
        for rs, ag, (o, ro) in got:
            np.testing.assert_allclose(rs, products[2 * rank : 2 * rank + 2], rtol=1e-4, atol=1e-4)
            np.testing.assert_array_equal(ag, np.concatenate(a))
            r = summed(a) + res[rank]
            np.testing.assert_allclose(ro, r, rtol=1e-5, atol=1e-5)
            np.testing.assert_allclose(o, r / np.sqrt((r**2).mean(-1, keepdims=True) + 1e-6) * w, rtol=1e-4, atol=1e-4)


def test_bounded_and_cleared_on_close():
    def rank_main(g):
        for n in range(1, 80):
            symm.all_reduce(g, np.ones(n, np.float32))
        n = kept(g)
        g.close()
        return n, kept(g)

    for n, after in on_threads(rank_main, groups()):
        assert n == 64 and after == 0


def test_read_only_output_still_refused():
    def rank_main(g):
        x = np.ones(4, np.float32)
        out = np.empty(4, np.float32)
        symm.all_reduce(g, x, out=out)
        out.flags.writeable = False
        with pytest.raises(symm.SymmInvalidArgument, match="read-only"):
            symm.all_reduce(g, x, out=out)

    on_threads(rank_main, groups())


def test_kept_call_in_use_is_not_shared():
    """While a kept call writes its descriptors (held as by another
    thread), a call of the same kind prepares its own, and is right; the
    kept one is used again once free."""
    xs = inputs((4, 8))

    def rank_main(g):
        out = np.full((4, 8), np.nan, np.float32)
        symm.all_reduce(g, xs[g.rank], out=out)
        (cache,) = g._calls.values()
        (template,) = cache.values()
        with in_use(template):
            other = np.full((4, 8), np.nan, np.float32)
            symm.all_reduce(g, xs[g.rank], out=other)
        again = np.full((4, 8), np.nan, np.float32)
        symm.all_reduce(g, xs[g.rank], out=again)
        return other, again, list(cache.values()) == [template]

    for other, again, same_kept in on_threads(rank_main, groups()):
        np.testing.assert_allclose(other, summed(xs), rtol=1e-6)
        np.testing.assert_allclose(again, summed(xs), rtol=1e-6)
        assert same_kept


class Sub(np.ndarray):
    pass


def test_keys_agree_between_the_paths(path):
    """The C path's keys tell calls apart exactly as Python's do, for every
    kind of argument the key describes; what it does not describe is None
    on both."""
    if path != "c":
        pytest.skip("compares the C path with Python's")
    a = np.arange(24, dtype=np.float32).reshape(4, 6)
    ro = np.ones(3, np.int64)
    ro.flags.writeable = False
    cases = [
        ((a,), {}),
        ((a.copy(),), {}),  # equal to the one before
        ((a.T,), {}),
        ((a.astype(np.float16),), {}),
        ((a, a.T, a[::2]), {"out": a[:, 1:], "op": "sum"}),
        ((a, a.T, a[::2]), {"out": a[:, 1:], "op": "avg"}),
        ((a, a.T, a[::2]), {"op": "sum", "out": a[:, 1:]}),  # keywords in another order
        ((a, a), {"scale": 0.5}),  # aliasing
        ((a, a.copy()), {"scale": 0.5}),
        ((a,), {"x": -0.0, "y": 0.0, "z": NAN, "n": None, "b": True, "i": -3, "s": "avg"}),
        ((a,), {"x": 0.0, "y": 0.0, "z": NAN, "n": None, "b": True, "i": -3, "s": "avg"}),
        ((a,), {"x": -0.0, "y": 0.0, "z": NAN, "n": None, "b": 1, "i": -3, "s": "avg"}),
        ((a,), {"x": -0.0, "y": 0.0, "z": NAN, "n": None, "b": 1.0, "i": -3, "s": "avg"}),
        ((1,), {}),
        ((True,), {}),
        ((2**70,), {}),
        ((2**70 + 1,), {}),
        (("a" * 9,), {}),
        (("a" * 9 + "\0",), {}),
        (("\ud800",), {}),  # no UTF-8 bytes
        (([a, (ro, [a.astype(np.float16)])], 7), {"k": (1, 2.5)}),
        (([a, [ro, [a.astype(np.float16)]]], 7), {"k": (1, 2.5)}),  # a list for a tuple
        ((), {}),
        ((a, {"not": "described"}), {}),
        ((a.view(Sub),), {}),  # a subclass: not described
        ((a,), {"f": object()}),
        (([a[i % 4 :] for i in range(70)],), {}),  # more arrays than the C path holds without allocating
        (([[[[[[[[a]]]]]]]],), {}),  # lists 8 deep: described
        (([[[[[[[[[a]]]]]]]]],), {}),  # 9 deep: not
        ((a,), {"out_dtype": np.float16, "d": np.dtype("f4"), "l": [ml_dtypes.bfloat16, np.dtype(ml_dtypes.float8_e5m2)]}),
        ((a,), {"out_dtype": np.dtype("f2"), "d": np.dtype("f4"), "l": [ml_dtypes.bfloat16, np.dtype(ml_dtypes.float8_e5m2)]}),
    ]
    assert_keys_agree(cases)


NAN = float("nan")  # one object: Python's keys compare it equal to itself


def assert_keys_agree(cases):
    """For `cases`, (args, kwargs) each: the C path describes the calls
    Python's describes, with Python's arrays and addresses, and its keys
    of two calls are equal (and hash alike) exactly where Python's are."""
    found = []
    for args, kwargs in cases:
        mine, theirs = EXT.key_of(args, kwargs), _fastcall.key_of(args, kwargs)
        assert (mine is None) == (theirs is None), (args, kwargs)
        if theirs is not None:
            assert [id(x) for x in mine[1]] == [id(x) for x in theirs[1]], (args, kwargs)
            assert mine[2] == theirs[2], (args, kwargs)
            found.append((mine[0], theirs[0], (args, kwargs)))
    for i, (mine, theirs, case) in enumerate(found):
        for other_mine, other_theirs, other in found[i:]:
            assert (mine == other_mine) == (theirs == other_theirs), (case, other)
            if mine == other_mine:
                assert hash(mine) == hash(other_mine)


def test_the_five_operations_run_in_c(path):
    """On the C path a kept fused_ag_mm, mm_rs, lc_allgather, all_reduce and
    all_reduce_rmsnorm each run from C (a ``native`` call), with the fresh
    call's results."""
    a, b = inputs((4, 8)), inputs((8, 6), seed=6)
    res, w = inputs((4, 8), seed=7), np.linspace(0.5, 1.5, 8).astype(np.float32)

    def rank_main(g):
        me, got = g.rank, []
        for _ in range(3):
            out = [np.full((8, 6), np.nan, np.float32)]
            symm.fused_ag_mm(g, a[me], [b[0]], 0, out=out)
            rs = symm.mm_rs(g, a[me], b[me], 0, out=np.full((2, 6), np.nan, np.float32))
            ag = symm.lc_allgather(g, a[me], out=np.full((8, 8), np.nan, np.float32))
            ar = symm.all_reduce(g, a[me], op="avg")
            norm = symm.all_reduce_rmsnorm(g, a[me], res[me], w, eps=0.25)
            got.append((out[0], rs, ag, ar, norm))
        natives = [t.native is not None for c in g._calls.values() for t in c.values()]
        return natives, got

    products = summed([x @ y for x, y in zip(a, b)])
    for rank, (natives, got) in enumerate(on_threads(rank_main, groups())):
        assert len(natives) == 5 and all(natives) == (path == "c"), natives
        r = summed(a) + res[rank]
        for mm, rs, ag, ar, (o, ro) in got:
            np.testing.assert_allclose(mm, np.concatenate(a).astype(np.float64) @ b[0], rtol=1e-4, atol=1e-4)
            np.testing.assert_allclose(rs, products[2 * rank : 2 * rank + 2], rtol=1e-4, atol=1e-4)
            np.testing.assert_array_equal(ag, np.concatenate(a))
            np.testing.assert_allclose(ar, summed(a) / WORLD, rtol=1e-6)
            np.testing.assert_allclose(ro, r, rtol=1e-5, atol=1e-5)
            # eps reaches the library (its default is 1e-6): a float argument in C.
            np.testing.assert_allclose(o, r / np.sqrt((r**2).mean(-1, keepdims=True) + 0.25) * w, rtol=1e-4, atol=1e-5)


def test_a_kept_call_that_fails_raises():
    """A kept call the library refuses (the group aborted) raises its error."""

    def rank_main(g):
        x = np.ones(4, np.float32)
        symm.all_reduce(g, x)
        symm.all_reduce(g, x)
        g.abort()
        with pytest.raises((symm.SymmAbortedError, symm.SymmRemoteError)):
            symm.all_reduce(g, x)
        return kept(g)

    assert on_threads(rank_main, groups()) == [1] * WORLD


def test_bound_calls_on_both_paths(path):
    """symm.bind's calls of the five operations: made from C on the C path
    (``native``), through ctypes on Python's; each call reads the arrays'
    values of now (changed in place between calls); a refused call raises,
    and a closed group's."""
    a, b = inputs((4, 8)), inputs((8, 6), seed=8)
    res, w = inputs((4, 8), seed=9), np.linspace(0.5, 1.5, 8).astype(np.float32)

    def rank_main(g):
        me, x = g.rank, a[g.rank].copy()
        mm, rs, ag = np.empty((8, 6), np.float32), np.empty((2, 6), np.float32), np.empty((8, 8), np.float32)
        ar, o, ro = np.empty((4, 8), np.float32), np.empty((4, 8), np.float32), np.empty((4, 8), np.float32)
        calls = [
            symm.bind(symm.fused_ag_mm, g, x, [b[0]], 0, out=[mm]),
            symm.bind(symm.mm_rs, g, x, b[me], 0, out=rs),
            symm.bind(symm.lc_allgather, g, x, out=ag),
            symm.bind(symm.all_reduce, g, x, out=ar),
            symm.bind(symm.all_reduce_rmsnorm, g, x, res[me], w, eps=0.25, out=o, residual_out=ro),
        ]
        got = []
        for step in range(3):
            x[...] = a[me] * (step + 1)
            for out in (mm, rs, ag, ar, o, ro):
                out.fill(np.nan)
            for call in calls:
                call()
            got.append([t.copy() for t in (mm, rs, ag, ar, o, ro)])
        natives = [c.native is not None for c in calls]
        g.abort()
        with pytest.raises((symm.SymmAbortedError, symm.SymmRemoteError)):
            calls[3]()
        g.close()
        with pytest.raises(symm.SymmInvalidHandle):
            calls[3]()
        return natives, got

    for rank, (natives, got) in enumerate(on_threads(rank_main, groups())):
        assert natives == [path == "c"] * 5
        for step, (mm, rs, ag, ar, o, ro) in enumerate(got):
            xs = [x.astype(np.float64) * (step + 1) for x in a]
            np.testing.assert_allclose(mm, np.concatenate(xs) @ b[0], rtol=1e-4, atol=1e-4)
            np.testing.assert_allclose(rs, summed([x @ y for x, y in zip(xs, b)])[2 * rank : 2 * rank + 2],
                                       rtol=1e-4, atol=1e-4)
            np.testing.assert_array_equal(ag, np.concatenate(xs).astype(np.float32))
            np.testing.assert_allclose(ar, np.sum(xs, axis=0), rtol=1e-6)
            r = np.sum(xs, axis=0) + res[rank]
            np.testing.assert_allclose(ro, r, rtol=1e-5, atol=1e-5)
            np.testing.assert_allclose(o, r / np.sqrt((r**2).mean(-1, keepdims=True) + 0.25) * w, rtol=1e-4, atol=1e-5)


def test_many_arrays_in_one_call(path):
    """fused_ag_mm with 24 B matrices: a kept call of more arrays than the C
    path holds without allocating, with the fresh call's results."""
    a = inputs((4, 8))
    bs = [np.random.default_rng(i).standard_normal((8, 3)).astype(np.float32) for i in range(24)]

    def rank_main(g):
        got = []
        for step in range(3):
            x = a[g.rank] * (step + 1)
            outs = [np.full((8, 3), np.nan, np.float32) for _ in bs]
            symm.fused_ag_mm(g, x, bs, 0, out=outs)
            got.append(outs)
        return kept(g), got

    for n, got in on_threads(rank_main, groups()):
        assert n == 1
        for step, outs in enumerate(got):
            full = np.concatenate(a).astype(np.float64) * (step + 1)
            for out, b in zip(outs, bs):
                np.testing.assert_allclose(out, full @ b, rtol=1e-4, atol=1e-4)


def test_a_torch_it_cannot_read_leaves_tensors_to_the_full_path(path, tmp_path):
    """A torch module whose Tensor lacks what the C path reads (a future
    torch, say): its tensors are not described, and calls still work."""
    if path != "c":
        pytest.skip("the C path's reader of torch")
    script = tmp_path / "fake_torch.py"
    script.write_text(
        "import sys, types\n"
        "import numpy as np\n"
        "torch = types.ModuleType('torch')\n"
        "class Tensor: pass\n"
        "torch.Tensor, torch.strided, torch.dtype = Tensor, object(), type\n"
        "torch._C = types.SimpleNamespace()\n"
        "sys.modules['torch'] = torch\n"
        "import symm\n"
        "from symm import _fastcall\n"
        "assert _fastcall._ext.key_of((Tensor(),), {}) is None\n"
        "assert _fastcall._ext.key_of((np.ones(2),), {}) is not None\n"
        "(g,) = symm.local_groups(1, backend='host')\n"
        "for _ in range(3):\n"
        "    assert (symm.all_reduce(g, np.ones(4, np.float32)) == 1).all()\n"
        "print('ok')\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [os.path.dirname(os.path.dirname(symm.__file__)), os.environ.get("PYTHONPATH")])))
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr
