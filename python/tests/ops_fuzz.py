"""Every operation on randomly drawn calls, against float64 references.

Each case is drawn from one seed, so every rank draws the same calls: the
operation, its shapes (any size, not only multiples of a tile), dtype, the
dimension gathered or scattered, operand layouts (transposed, padded rows),
outputs given (strided, poisoned) or allocated, a forced algorithm, fp8
scales. Every call is then checked:

- each output element against a float64 reference, within a bound from
  the dtype's rounding and the sum of the terms' magnitudes (one wrong
  tile shows, however large the output); integers and gathers bit for bit;
- no element left unwritten (outputs are poisoned first) and no byte of a
  strided output's gaps written;
- inputs unchanged;
- the same call again with new values in the same arrays (the library
  replays its first preparation), through ``symm.bind``, and (CUDA)
  captured into a ``torch.cuda.CUDAGraph`` and replayed on new values.

Each case runs on one of two groups of the same ranks, and (CUDA) on
torch's default stream or all of it on a side stream.

A library error on a valid call is a failure, but for a forced "fused"
where the fused kernel cannot run (``SymmUnsupported``, counted apart).

On the host backend (numpy arrays, ranks as threads), as the CI test does:

    python3 python/tests/ops_fuzz.py --backend host --world 3 --cases 50

On GPUs (torch tensors, one process per rank; rank r on device r % gpus):

    python3 python/tests/ops_fuzz.py --backend cuda --world 2 --gpus 2 --cases 300

A failure names its case: ``--seed S --cases N+1 --case N`` runs it alone.
"""

import argparse
import contextlib
import os
import subprocess
import sys
import threading
import time
import traceback

import ml_dtypes
import numpy as np

import symm

NP = {
    "f32": np.dtype(np.float32),
    "bf16": np.dtype(ml_dtypes.bfloat16),
    "f16": np.dtype(np.float16),
    "e4m3": np.dtype(ml_dtypes.float8_e4m3fn),
    "e5m2": np.dtype(ml_dtypes.float8_e5m2),
    "i8": np.dtype(np.int8),
    "u8": np.dtype(np.uint8),
    "i32": np.dtype(np.int32),
    "i64": np.dtype(np.int64),
}
NAMES = {v: k for k, v in NP.items()}  # numpy dtype -> our name
FLOATS = ("f32", "bf16", "f16")
INTS = ("i8", "u8", "i32", "i64")
# Unit roundoff of each output dtype (f32: a few roundings of f32 sums).
EPS = {"f32": 2.0**-20, "bf16": 2.0**-8, "f16": 2.0**-11, "e4m3": 2.0**-3, "e5m2": 2.0**-2}
# Spacing of the subnormals, where rounding is absolute.
TINY = {NP["f32"]: 2.0**-149, NP["bf16"]: 2.0**-133, NP["f16"]: 2.0**-24}
# Accumulation error of a matmul per input dtype, relative to the sum of
# the terms' magnitudes: fp8 tensor cores keep ~14 bits between promotions.
ACC = {"f32": 0.0, "bf16": 2.0**-20, "f16": 2.0**-20, "e4m3": 2.0**-11, "e5m2": 2.0**-11}

# Multiply-adds of the largest matmul drawn, and elements of its largest
# operand, per backend (the host's matmuls are slow; references are numpy's).
BUDGET = {"host": 1 << 21, "cuda": 1 << 32}
PAIR_CAP = {"host": 1 << 18, "cuda": 1 << 25}


def f64(x):
    return np.asarray(x).astype(np.float64)


# --- arrays on the backend's device ------------------------------------------
class NumpyArrays:
    """numpy arrays (the host backend's)."""

    graphs = False  # no CUDA graphs to capture into

    def on_stream(self, name):
        return contextlib.nullcontext()

    def put(self, x):
        return np.array(x, copy=True)

    def get(self, x):
        return np.array(x, copy=True)

    def dtype(self, name):
        return NP[name]

    def swap(self, x):
        return x.swapaxes(-1, -2)

    def expand(self, x, shape):
        return np.broadcast_to(x, shape)

    def copy_into(self, dst, src):
        dst[...] = src

    def sync(self):
        pass


class TorchArrays:
    """torch tensors on `device` (CUDA, or the CPU for the host backend),
    moved bit for bit."""

    BITS = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}

    def __init__(self, torch, device):
        self.torch, self.device = torch, device
        self.graphs = device != "cpu"  # calls captured into torch.cuda graphs too
        self.side = torch.cuda.Stream() if self.graphs else None
        t = torch
        self.dtypes = {
            "f32": t.float32, "bf16": t.bfloat16, "f16": t.float16, "e4m3": t.float8_e4m3fn,
            "e5m2": t.float8_e5m2, "i8": t.int8, "u8": t.uint8, "i32": t.int32, "i64": t.int64,
        }
        self.names = {v: k for k, v in self.dtypes.items()}
        self.bits = {1: t.uint8, 2: t.int16, 4: t.int32, 8: t.int64}

    def on_stream(self, name):
        """The case's work on the current stream, or all of it on a side
        stream (symm runs on torch's current stream)."""
        if name == "side" and self.side is not None:
            return self.torch.cuda.stream(self.side)
        return contextlib.nullcontext()

    def put(self, x):
        x = np.ascontiguousarray(x)
        name = NAMES[x.dtype]
        bits = self.torch.from_numpy(x.view(self.BITS[x.dtype.itemsize]))
        return bits.to(self.device, copy=True).view(self.dtypes[name])

    def get(self, x):
        name = self.names[x.dtype]
        return x.contiguous().view(self.bits[x.element_size()]).cpu().numpy().view(NP[name])

    def dtype(self, name):
        return self.dtypes[name]

    def swap(self, x):
        return x.transpose(-1, -2)

    def expand(self, x, shape):
        return x.expand(*shape)

    def copy_into(self, dst, src):
        dst.copy_(self.put(src))

    def sync(self):
        if self.device != "cpu":
            self.torch.cuda.synchronize()


# --- drawing calls ---------------------------------------------------------------
def size(rng, lo, hi, multiple=None):
    """Log-uniform in [lo, hi]; rounded to `multiple` (at least one) when given."""
    n = int(np.exp(rng.uniform(np.log(lo), np.log(hi + 1))))
    n = min(max(n, lo), hi)
    if multiple:
        n = max(multiple, n // multiple * multiple)
    return n


def fit(dims, budget, pair_cap):
    """Halves the largest of `dims` (a dict: m, k, n) until their product
    fits `budget` and each operand's (m k, k n, m n) fits `pair_cap`."""

    def over():
        m, k, n = (float(dims[x]) for x in "mkn")
        return m * k * n > budget or max(m * k, k * n, m * n) > pair_cap

    while over():
        x = max(dims, key=dims.get)
        dims[x] = max(1, dims[x] // 2)
    return dims


def values(rng, shape, dtype):
    """Random values of `dtype` (the references take them exactly as
    stored): normal floats rounded to the dtype, integers over their whole
    range, fp8 codes of [-4, 4]."""
    dt = NP[dtype]
    if dtype in INTS:
        info = np.iinfo(dt)
        return rng.integers(info.min, info.max, size=shape, dtype=dt, endpoint=True)
    if dtype in ("e4m3", "e5m2"):
        x = rng.uniform(-4, 4, shape)
    else:
        x = rng.standard_normal(shape)
    return x.astype(dt)


def draw_matmul(rng, op, world, backend):
    """A fused_ag_mm or mm_rs call: shapes, dtype, layouts, options."""
    fp8 = rng.random() < 0.2
    dtype = "e4m3" if fp8 else str(rng.choice(FLOATS, p=[0.2, 0.5, 0.3]))
    case = {"op": op, "dtype": dtype, "fp8": fp8}
    if fp8:
        case["row_wise"] = bool(rng.random() < 0.5)
        case["out_dtype"] = str(rng.choice(["bf16", "f32", "f16"], p=[0.6, 0.2, 0.2]))
        # A bias needs a bf16 or f16 output (torch._scaled_mm's rule).
        case["bias"] = case["out_dtype"] != "f32" and bool(rng.random() < 0.5)
        # Scales and bias where the caller has them: aligned, or one element off.
        case["vectors"] = str(rng.choice(["contiguous", "offset"]))
    ndim = 3 if rng.random() < 0.3 else 2
    dim = int(rng.integers(0, ndim))
    # fp8 K and N in multiples of 16 (cuBLASLt's rule); mostly whole
    # 16-byte rows otherwise, sometimes not.
    k_unit = 16 if fp8 else (8 if rng.random() < 0.8 else 1)
    n_unit = 16 if fp8 else (8 if rng.random() < 0.7 else 1)
    # Each rank's part of a split K or N stays a whole number of units.
    if op == "mm_rs" and dim == ndim - 1:
        n_unit *= world
    dims = {"m": size(rng, 1, 6144) * world, "k": size(rng, k_unit, 8192), "n": size(rng, n_unit, 8192)}
    dims = fit(dims, BUDGET[backend], PAIR_CAP[backend])  # the matmul over every rank's part
    m = max(dims["m"] // world, 1)
    k = max(k_unit, dims["k"] // k_unit * k_unit)
    n = max(n_unit, dims["n"] // n_unit * n_unit)
    lead = [m]
    if ndim == 3:
        b = size(rng, 1, 8)
        lead = [b, max(1, m // b)]
    case["k"] = k
    if op == "ag_mm":
        gathers_k = dim == ndim - 1
        if gathers_k and fp8 and case["row_wise"]:
            case["row_wise"] = False  # a row's scale cannot differ between ranks' parts of K
        nb = int(rng.choice([1, 2, 3], p=[0.6, 0.3, 0.1]))
        ns = [n] + [max(n_unit, size(rng, 1, n) // n_unit * n_unit) for _ in range(nb - 1)]
        case.update(dim=dim, shard=[*lead, k], ns=ns, b_rows=k * world if gathers_k else k)
        case["return_ag"] = bool(rng.random() < 0.3)
    else:
        shape = [*lead, n]
        if dim < ndim - 1:  # the scattered dimension of the product divides by the world
            shape[dim] = max(1, shape[dim] // world) * world
        case.update(dim=dim, a=[*shape[:-1], k], n=n, reduce=str(rng.choice(["sum", "avg"])))
    # Layouts: B K-major (a Linear weight's transpose, fp8's only one) or
    # row-major; A contiguous, with padded rows, every other element of
    # a wider array, one element past an aligned start, one row broadcast
    # (stride 0), or (2-D) transposed.
    case["b_kmajor"] = bool(fp8 or rng.random() < 0.6)
    # fp8's B 16-byte aligned, as cuBLASLt needs (refused otherwise).
    case["b_layout"] = "offset" if not fp8 and rng.random() < 0.2 else "contiguous"
    layouts = ["contiguous", "every_other", "offset", "broadcast"]
    layouts += [] if fp8 else ["padded"]
    layouts += ["transposed"] if ndim == 2 and not fp8 else []
    case["a_layout"] = str(rng.choice(layouts))
    outs = ["allocated", "given", "strided", "offset"] + (["symmetric"] if op == "mm_rs" else [])
    case["out"] = str(rng.choice(outs))
    case["algorithm"] = rng.choice([None, "sequential", "pipelined", "fused"], p=[0.5, 0.15, 0.15, 0.2])
    case["bind"] = bool(rng.random() < 0.3)
    case["graph"] = bool(rng.random() < 0.3)
    return case


def draw(rng, world, backend):
    """One call of any operation, sized for `backend` (the host's matmuls
    and messages smaller)."""
    op = str(rng.choice(["ag_mm", "mm_rs", "lc_allgather", "all_reduce", "rmsnorm"], p=[0.3, 0.3, 0.1, 0.2, 0.1]))
    if op in ("ag_mm", "mm_rs"):
        return draw_matmul(rng, op, world, backend)
    cap = (1 << 16) if backend == "host" else (1 << 23)
    if op == "lc_allgather":
        numel = size(rng, 1, cap)
        ndim = int(rng.integers(1, 4))
        shape = [numel] if ndim == 1 else [max(1, numel // 64), size(rng, 1, 64)] + [3] * (ndim - 2)
        dtype = str(rng.choice(list(NP)))
        return {"op": op, "shape": shape, "dtype": dtype, "layout": str(rng.choice(["contiguous", "offset", "symmetric"])),
                "out": str(rng.choice(["allocated", "given", "offset"])), "bind": bool(rng.random() < 0.3),
                "graph": bool(rng.random() < 0.3)}
    if op == "all_reduce":
        numel = size(rng, 1, cap)
        cols = size(rng, 1, 512)
        shape = [max(1, numel // cols), cols]
        dtype = str(rng.choice(FLOATS + INTS, p=[0.2, 0.3, 0.2, 0.075, 0.075, 0.075, 0.075]))
        return {
            "op": op, "shape": shape, "dtype": dtype, "reduce": str(rng.choice(["sum", "avg"])),
            "layout": str(rng.choice(["contiguous", "padded", "every_other", "offset", "symmetric"],
                                     p=[0.4, 0.15, 0.15, 0.15, 0.15])),
            "out": str(rng.choice(["allocated", "given", "offset", "inplace"])),
            "algorithm": rng.choice([None, "one_shot", "two_shot"]), "bind": bool(rng.random() < 0.3),
            "graph": bool(rng.random() < 0.3),
        }
    hidden = size(rng, 1, 16384 if backend == "cuda" else 2048)
    tokens = size(rng, 1, 256 if backend == "cuda" else 16)
    return {
        "op": "rmsnorm", "shape": [tokens, hidden], "dtype": str(rng.choice(FLOATS)),
        "eps": float(rng.choice([1e-6, 1e-5, 1e-2])), "inplace": bool(rng.random() < 0.3),
        "algorithm": rng.choice([None, "one_shot", "two_shot"]), "bind": bool(rng.random() < 0.3),
        "graph": bool(rng.random() < 0.3), "layout": str(rng.choice(["contiguous", "offset", "symmetric"])),
    }


# --- one case on one rank ----------------------------------------------------------
class Failure(AssertionError):
    pass


class Unsupported(Exception):
    """The library declined a call it documents it may decline (see `Runner.call`)."""


def laid_out(dev, x, layout):
    """`x` (numpy) on the device in `layout`; returns (the view, the whole)."""
    if layout == "transposed":
        whole = dev.put(np.ascontiguousarray(x.swapaxes(-1, -2)))
        return dev.swap(whole), whole
    if layout == "every_other":  # every other element of its last dimension: no BLAS layout
        wide = np.zeros((*x.shape[:-1], 2 * x.shape[-1]), x.dtype)
        wide[..., ::2] = x
        whole = dev.put(wide)
        return whole[..., ::2], whole
    if layout == "broadcast":  # its first row for every row (stride 0): `x` has equal rows
        whole = dev.put(np.ascontiguousarray(x[..., :1, :]))
        return dev.expand(whole, x.shape), whole
    if layout == "offset":  # one element past an aligned start: off every vector width
        flat = np.zeros(x.size + 1, x.dtype)
        flat[1:] = x.reshape(-1)
        whole = dev.put(flat)
        return whole[1:].reshape(x.shape), whole
    if layout == "padded":
        pad = np.zeros((*x.shape[:-1], x.shape[-1] + 8), x.dtype)
        pad[..., : x.shape[-1]] = x
        whole = dev.put(pad)
        return whole[..., : x.shape[-1]], whole
    whole = dev.put(x)
    return whole, whole


def equal_rows(x, layout):
    """`x`, with every row its first where `layout` broadcasts one."""
    return np.array(np.broadcast_to(x[..., :1, :], x.shape)) if layout == "broadcast" else x


def write_input(dev, st, x, layout):
    """New values `x` into the case's input (`st["a"]`): a broadcast's one
    row, else every element."""
    if layout == "broadcast":
        dev.copy_into(st["a_whole"], np.ascontiguousarray(x[..., :1, :]))
    else:
        dev.copy_into(st["a"], x)


def poison(dtype, shape):
    """An output full of NaN (floats) or 0x5A bytes (integers)."""
    if dtype in INTS:
        return np.frombuffer(b"\x5a" * (int(np.prod(shape)) * NP[dtype].itemsize), NP[dtype]).reshape(shape).copy()
    return np.full(shape, np.nan, np.float32).astype(NP[dtype])


def output(dev, st, key, kind, dtype, shape):
    """An output to pass (None when the call allocates it) and the whole
    buffer it lies in (for "strided", every other column of it; for
    "offset", all but its first element), poisoned. Made on the case's
    first round and kept in `st` under `key`, so later rounds pass the same
    arrays (the library's kept calls)."""
    if kind == "allocated":
        return None, None
    full = {"strided": (*shape[:-1], 2 * shape[-1]), "offset": (int(np.prod(shape)) + 1,)}.get(kind, tuple(shape))
    if key not in st:
        whole = dev.put(poison(dtype, full))
        view = {"strided": lambda: whole[..., ::2], "offset": lambda: whole[1:].reshape(tuple(shape))}
        st[key] = (view.get(kind, lambda: whole)(), whole)
    else:
        dev.copy_into(st[key][1], poison(dtype, full))
    return st[key]


def check_close(what, got, ref, bound):
    """Every element of `got` within `bound` (elementwise) of `ref`, or of
    the spacing of `got`'s dtype's subnormals."""
    bound = bound + TINY.get(np.asarray(got).dtype, 0.0)
    got = f64(got)
    if got.shape != ref.shape:
        raise Failure(f"{what}: shape {got.shape}, expected {ref.shape}")
    bad = ~(np.abs(got - ref) <= bound)
    if bad.any():
        i = tuple(int(v[0]) for v in np.nonzero(bad))
        raise Failure(
            f"{what}: {int(bad.sum())} of {bad.size} elements off; first at {i}: got {got[i]!r}, "
            f"expected {ref[i]!r} +- {np.broadcast_to(bound, ref.shape)[i]:.3g}"
        )


def check_bits(what, got, ref):
    g, r = np.ascontiguousarray(got), np.ascontiguousarray(ref)
    if g.shape != r.shape or g.dtype != r.dtype:
        raise Failure(f"{what}: {g.dtype}{list(g.shape)}, expected {r.dtype}{list(r.shape)}")
    bad = g.view(np.uint8).reshape(g.shape + (-1,)) != r.view(np.uint8).reshape(r.shape + (-1,))
    if bad.any():
        i = tuple(int(v[0]) for v in np.nonzero(bad.any(-1)))
        raise Failure(f"{what}: {int(bad.any(-1).sum())} elements differ; first at {i}: {g[i]!r} vs {r[i]!r}")


def check_gaps(dev, what, kind, whole, dtype):
    """The odd columns of a strided output's buffer are still poison."""
    if kind != "strided":
        return
    w = dev.get(whole)
    check_bits(f"{what} (the gaps between its columns)", w[..., 1::2], poison(dtype, w[..., 1::2].shape))


class Runner:
    """Runs cases on one rank's group."""

    def __init__(self, g, dev, seed, shared=False):
        self.g, self.dev, self.seed, self.shared = g, dev, seed, shared
        self.rank, self.world = g.rank, g.world_size

    def call(self, case, fn, *args, **kwargs):
        """A call of the library; what it may decline is Unsupported: a
        forced "fused" it cannot run, and integer all-reduces where ranks
        share a GPU (its device-side kernels need a GPU per rank)."""
        try:
            return fn(self.g, *args, **kwargs)
        except symm.SymmUnsupported as e:
            if kwargs.get("algorithm") == "fused" or self.shared and case["dtype"] in INTS:
                raise Unsupported(str(e)) from e
            raise

    def run(self, index, case):
        """Runs the case: a first call, the same with new inputs, bound."""
        rounds = ["plain", "again"] + (["bound"] if case["bind"] else [])
        rounds += ["graph", "graph_again"] if case.get("graph") and self.dev.graphs else []
        op = getattr(self, case["op"])
        state = {"symmetric": []}
        try:
            with self.dev.on_stream(case["stream"]):
                for i, how in enumerate(rounds):
                    rng = np.random.default_rng([self.seed, index, i])
                    op(case, rng, how, state)
            self.dev.sync()
        finally:
            for owner in reversed(state["symmetric"]):  # handles, then buffers
                owner.close()

    def placed(self, st, x, layout):
        """`x` (numpy) on the device in `layout`, or in a rendezvoused
        symmetric buffer ("symmetric": read, or written, by the peers in
        place), made for this case and closed after it."""
        if layout != "symmetric":
            return laid_out(self.dev, x, layout)[0]
        buf = self.g.create(max(x.nbytes, 1))
        st["symmetric"] += [buf, buf.rendezvous()]
        if isinstance(self.dev, NumpyArrays):
            view = buf.array(x.dtype, x.shape)
        else:
            torch = self.dev.torch
            if self.dev.device == "cpu":
                raw = torch.from_numpy(buf.array(np.uint8, (x.nbytes,)))
            else:
                raw = torch.as_tensor(buf.cuda_bytes(), device="cuda")[: x.nbytes]
            view = raw.view(self.dev.dtype(NAMES[x.dtype])).view(x.shape)
        self.dev.copy_into(view, x)
        return view

    def invoke(self, how, st, fn):
        """Calls `fn` (the operation, its arrays in `st`) as round `how` has
        it: eagerly, or captured into a CUDA graph ("graph": captured once
        the eager rounds grew the workspace, then replayed) and replayed
        again on new inputs ("graph_again"). A graph's outputs are those of
        its capture."""
        if how == "graph":
            torch = self.dev.torch
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                st["graph_result"] = fn()
            st["graph"] = graph
        if how in ("graph", "graph_again"):
            st["graph"].replay()
            return st["graph_result"]
        return fn()

    def inputs_unchanged(self, what, arrays):
        for name, (dev_array, host) in arrays.items():
            check_bits(f"{what}: input {name} after the call", self.dev.get(dev_array), host)

    # -- fused_ag_mm
    def ag_mm(self, c, rng, how, st):
        dev, world, r = self.dev, self.world, self.rank
        dt = c["dtype"]
        shards = [equal_rows(values(rng, c["shard"], dt), c["a_layout"]) for _ in range(world)]
        bs = [values(rng, (nn, c["b_rows"]), dt).T if c["b_kmajor"] else values(rng, (c["b_rows"], nn), dt)
              for nn in c["ns"]]
        kw = {"algorithm": c["algorithm"]}
        fp8 = c["fp8"]
        if fp8:
            rows = c["shard"][:-1]
            sa = [rng.uniform(0.25, 2, (*rows, 1) if c["row_wise"] else (1,)).astype(np.float32) for _ in range(world)]
            if not c["row_wise"]:
                sa = [sa[0]] * world
            sb = [rng.uniform(0.25, 2, (1, nn) if c["row_wise"] else (1,)).astype(np.float32) for nn in c["ns"]]
            bias = [values(rng, (nn,), c["out_dtype"]) if c["bias"] else None for nn in c["ns"]]
        if "a" not in st:  # the first round makes the arrays
            b_views = [dev.swap(laid_out(dev, b.T, c["b_layout"])[0]) if c["b_kmajor"] else laid_out(dev, b, c["b_layout"])[0]
                       for b in bs]
            st["a"], st["a_whole"] = laid_out(dev, shards[r], c["a_layout"])
            st["bs"] = b_views
            if fp8:
                vec = lambda x: laid_out(dev, x, c["vectors"])[0]  # noqa: E731
                st.update(sa=vec(sa[r]), sb=[vec(x) for x in sb], bias=[None if x is None else vec(x) for x in bias])
        else:  # new values into the same arrays
            write_input(dev, st, shards[r], c["a_layout"])
            for view, b in zip(st["bs"], bs):
                dev.copy_into(view, b)
            if fp8:
                dev.copy_into(st["sa"], sa[r])
                for view, x in zip(st["sb"], sb):
                    dev.copy_into(view, x)
                for view, x in zip(st["bias"], bias):
                    if x is not None:
                        dev.copy_into(view, x)
        dim = c["dim"]
        gathered_shape = list(c["shard"])
        gathered_shape[dim] *= world
        out_dt = c["out_dtype"] if fp8 else dt
        outs, wholes = zip(*[output(dev, st, f"out{i}", c["out"], out_dt, [*gathered_shape[:-1], nn])
                              for i, nn in enumerate(c["ns"])])
        ag, ag_whole = (None, None)
        if c["return_ag"] and c["out"] != "allocated":
            ag, ag_whole = output(dev, st, "ag", c["out"], dt, gathered_shape)
        if fp8:
            kw.update(a_scale=st["sa"], b_scales=st["sb"], biases=st["bias"], out_dtype=dev.dtype(out_dt))
        given = None if c["out"] == "allocated" else list(outs)
        if how == "bound":
            if "bound" not in st:
                st["bound"] = symm.bind(symm.fused_ag_mm, self.g, st["a"], st["bs"], dim, out=given, ag_out=ag,
                                        return_ag=c["return_ag"], **kw)
            result = st["bound"]()
        else:
            result = self.invoke(how, st, lambda: self.call(c, symm.fused_ag_mm, st["a"], st["bs"], dim, out=given,
                                                            ag_out=ag, return_ag=c["return_ag"], **kw))
        got_ag, got = result if c["return_ag"] else (None, result)
        what = f"ag_mm ({how})"
        # References.
        a_ref = np.concatenate([f64(s) * (f64(sa[i]) if fp8 else 1.0) for i, s in enumerate(shards)], axis=dim)
        a_mag = np.abs(a_ref)
        for i, (o, b) in enumerate(zip(got, bs)):
            bf = f64(b) * (f64(sb[i]) if fp8 else 1.0)
            ref = a_ref @ bf
            mag = a_mag @ np.abs(bf)
            if fp8 and bias[i] is not None:
                ref = ref + f64(bias[i])
                mag = mag + np.abs(f64(bias[i]))
            check_close(f"{what} output {i}", dev.get(o), ref, EPS[out_dt] * (np.abs(ref) + mag) + ACC[dt] * mag)
            check_gaps(dev, f"{what} output {i}", c["out"], wholes[i], out_dt)
        if c["return_ag"]:
            check_bits(f"{what} ag_out", dev.get(got_ag), np.concatenate(shards, axis=dim))
            check_gaps(dev, f"{what} ag_out", c["out"], ag_whole, dt)
        self.inputs_unchanged(what, {"a_shard": (st["a"], shards[r]), **{f"bs[{i}]": (v, b) for i, (v, b) in
                                                                         enumerate(zip(st["bs"], bs))}})

    # -- mm_rs
    def mm_rs(self, c, rng, how, st):
        dev, world, r = self.dev, self.world, self.rank
        dt = c["dtype"]
        a = [equal_rows(values(rng, c["a"], dt), c["a_layout"]) for _ in range(world)]
        b = [values(rng, (c["n"], c["k"]), dt).T if c["b_kmajor"] else values(rng, (c["k"], c["n"]), dt)
             for _ in range(world)]
        fp8 = c["fp8"]
        kw = {"algorithm": c["algorithm"], "op": c["reduce"]}
        if fp8:
            rows = c["a"][:-1]
            sa = [rng.uniform(0.25, 2, (*rows, 1) if c["row_wise"] else (1,)).astype(np.float32) for _ in range(world)]
            sb = [rng.uniform(0.25, 2, (1, c["n"]) if c["row_wise"] else (1,)).astype(np.float32) for _ in range(world)]
            bias = [values(rng, (c["n"],), c["out_dtype"]) if c["bias"] else None for _ in range(world)]
        if "a" not in st:  # the first round makes the arrays
            a_view, st["a_whole"] = laid_out(dev, a[r], c["a_layout"])
            b_view = dev.swap(laid_out(dev, b[r].T, c["b_layout"])[0]) if c["b_kmajor"] else laid_out(dev, b[r], c["b_layout"])[0]
            st.update(a=a_view, b=b_view)
            if fp8:
                vec = lambda x: laid_out(dev, x, c["vectors"])[0]  # noqa: E731
                st.update(sa=vec(sa[r]), sb=vec(sb[r]), bias=None if bias[r] is None else vec(bias[r]))
        else:
            write_input(dev, st, a[r], c["a_layout"])
            dev.copy_into(st["b"], b[r])
            if fp8:
                dev.copy_into(st["sa"], sa[r])
                dev.copy_into(st["sb"], sb[r])
                if bias[r] is not None:
                    dev.copy_into(st["bias"], bias[r])
        dim = c["dim"]
        shape = [*c["a"][:-1], c["n"]]
        shape[dim] //= world
        out_dt = c["out_dtype"] if fp8 else dt
        if c["out"] == "symmetric":  # the peers write their partials into it in place
            if "out" not in st:
                st["out"] = (self.placed(st, poison(out_dt, shape), "symmetric"), None)
            else:
                dev.copy_into(st["out"][0], poison(out_dt, shape))
        out, whole = st["out"] if c["out"] == "symmetric" else output(dev, st, "out", c["out"], out_dt, shape)
        if fp8:
            kw.update(a_scale=st["sa"], b_scale=st["sb"], bias=st["bias"],
                      out_dtype=dev.dtype(out_dt))
        if how == "bound":
            if "bound" not in st:
                st["bound"] = symm.bind(symm.mm_rs, self.g, st["a"], st["b"], dim, out=out, **kw)
            got = st["bound"]()
        else:
            got = self.invoke(how, st, lambda: self.call(c, symm.mm_rs, st["a"], st["b"], dim, out=out, **kw))
        what = f"mm_rs ({how})"
        total, mag = 0.0, 0.0
        for x_, y_, i in zip(a, b, range(world)):
            x, y = f64(x_), f64(y_)
            if fp8:
                x, y = x * f64(sa[i]), y * f64(sb[i])
            p, q = x @ y, np.abs(x) @ np.abs(y)
            if fp8 and bias[i] is not None:
                p, q = p + f64(bias[i]), q + np.abs(f64(bias[i]))
            total, mag = total + p, mag + q
        if c["reduce"] == "avg":
            total, mag = total / world, mag / world
        pick = [slice(None)] * len(shape)
        pick[dim] = slice(r * shape[dim], (r + 1) * shape[dim])
        ref, mag = total[tuple(pick)], mag[tuple(pick)]
        # Partials may be rounded to the output dtype before they are summed.
        check_close(what, dev.get(got), ref, 2 * EPS[out_dt] * (np.abs(ref) + mag) + ACC[dt] * mag)
        check_gaps(dev, what, c["out"], whole, out_dt)
        self.inputs_unchanged(what, {"a": (st["a"], a[r]), "b": (st["b"], b[r])})

    # -- lc_allgather
    def lc_allgather(self, c, rng, how, st):
        dev, world, r = self.dev, self.world, self.rank
        xs = [values(rng, c["shape"], c["dtype"]) for _ in range(world)]
        if "x" not in st:
            st["x"] = self.placed(st, xs[r], c["layout"])
        else:
            dev.copy_into(st["x"], xs[r])
        out, _ = output(dev, st, "out", c["out"], c["dtype"], [c["shape"][0] * world, *c["shape"][1:]])
        if how == "bound":
            st.setdefault("bound", symm.bind(symm.lc_allgather, self.g, st["x"], out=out))
            got = st["bound"]()
        else:
            got = self.invoke(how, st, lambda: symm.lc_allgather(self.g, st["x"], out=out))
        check_bits(f"lc_allgather ({how})", dev.get(got), np.concatenate(xs))
        self.inputs_unchanged("lc_allgather", {"x": (st["x"], xs[r])})

    # -- all_reduce
    def all_reduce(self, c, rng, how, st):
        dev, world, r = self.dev, self.world, self.rank
        dt = c["dtype"]
        xs = [values(rng, c["shape"], dt) for _ in range(world)]
        if "x" not in st:
            st["x"] = self.placed(st, xs[r], c["layout"])
        else:
            dev.copy_into(st["x"], xs[r])
        inplace = c["out"] == "inplace"
        out, _ = (None, None) if inplace else output(dev, st, "out", c["out"], dt, c["shape"])
        kw = {"op": c["reduce"], "algorithm": c["algorithm"]}
        if inplace:
            kw["inplace"] = True
        else:
            kw["out"] = out
        if how == "bound":
            st.setdefault("bound", symm.bind(symm.all_reduce, self.g, st["x"], **kw))
            got = st["bound"]()
        else:
            got = self.invoke(how, st, lambda: self.call(c, symm.all_reduce, st["x"], **kw))
        what = f"all_reduce ({how})"
        if dt in INTS:
            total = xs[0].copy()
            for x in xs[1:]:
                total = (total + x).astype(NP[dt])  # wraps, as the library's sum
            if c["reduce"] == "avg":
                w = NP[dt].type(world)
                q = total // w
                total = np.where((total % w != 0) & (total < 0), q + 1, q).astype(NP[dt])  # toward zero
            check_bits(what, dev.get(got), total)
        else:
            total = sum(f64(x) for x in xs)
            mag = sum(np.abs(f64(x)) for x in xs)
            if c["reduce"] == "avg":
                total, mag = total / world, mag / world
            check_close(what, dev.get(got), total, EPS[dt] * (np.abs(total) + mag))
        if not inplace:
            self.inputs_unchanged(what, {"x": (st["x"], xs[r])})

    # -- all_reduce_rmsnorm
    def rmsnorm(self, c, rng, how, st):
        dev, world, r = self.dev, self.world, self.rank
        dt = c["dtype"]
        xs = [values(rng, c["shape"], dt) for _ in range(world)]
        res = values(rng, c["shape"], dt)
        w = values(rng, c["shape"][-1:], dt)
        if "x" not in st:
            # The residual too: written in place by inplace=True.
            st.update(x=self.placed(st, xs[r], c["layout"]), res=laid_out(dev, res, c["layout"])[0], w=dev.put(w))
        else:
            dev.copy_into(st["x"], xs[r])
            dev.copy_into(st["res"], res)
            dev.copy_into(st["w"], w)
        kw = {"eps": c["eps"], "algorithm": c["algorithm"], "inplace": c["inplace"]}
        if how == "bound":
            st.setdefault("bound", symm.bind(symm.all_reduce_rmsnorm, self.g, st["x"], st["res"], st["w"], **kw))
            out, res_out = st["bound"]()
        else:
            out, res_out = self.invoke(how, st, lambda: symm.all_reduce_rmsnorm(self.g, st["x"], st["res"], st["w"], **kw))
        what = f"all_reduce_rmsnorm ({how})"
        total = sum(f64(x) for x in xs)
        mag = sum(np.abs(f64(x)) for x in xs)
        rr = total + f64(res)
        rmag = mag + np.abs(f64(res))
        # The sum may be rounded to the dtype before the residual is added.
        check_close(f"{what} residual_out", dev.get(res_out), rr, 2 * EPS[dt] * (np.abs(rr) + rmag))
        got_r = f64(dev.get(res_out))
        ms = (got_r * got_r).mean(-1, keepdims=True)
        ref = got_r / np.sqrt(ms + c["eps"]) * f64(w)
        # From the rounded residual the library returned: the norm's own error.
        scale = np.abs(got_r) / np.sqrt(ms + c["eps"]) * np.abs(f64(w))
        check_close(f"{what} out", dev.get(out), ref, 4 * EPS[dt] * (np.abs(ref) + scale))


def describe(case):
    return " ".join(f"{k}={v}" for k, v in case.items())


def run_rank(groups, dev, backend, seed, cases, log=print, stop_after=1, shared=False, only=None):
    """Draws and runs `cases` cases on this rank's groups (two groups of the
    same ranks, each case on one of them), arrays made by `dev`; returns
    (failures, declined, cases run). Stops after `stop_after` failures: a
    failed collective may leave the group unusable. `only`: run that case
    alone (the others are drawn, not run), to repeat a failure."""
    rng = np.random.default_rng(seed)
    failures, unsupported = [], 0
    done = 0
    g = groups[0]
    for index in range(cases):
        case = draw(rng, g.world_size, backend)
        case["group"] = int(rng.integers(0, len(groups)))
        case["stream"] = str(rng.choice(["current", "side"]))
        if only is not None and index != only:
            continue
        t0 = time.perf_counter()
        try:
            Runner(groups[case["group"]], dev, seed, shared).run(index, case)
        except Unsupported:
            unsupported += 1
        except Exception as e:  # noqa: BLE001 -- every failure is reported with its case
            detail = "".join(traceback.format_exception_only(type(e), e)).strip()
            failures.append(f"case {index} [{describe(case)}]: {detail}")
            log(f"rank {g.rank}: FAIL case {index} [{describe(case)}]\n{traceback.format_exc()}")
            if len(failures) >= stop_after:
                break
        done += 1
        if g.rank == 0:
            log(f"case {index} {time.perf_counter() - t0:.2f}s {describe(case)}")
    return failures, unsupported, done


def run_threads(world, seed, cases, log=print, arrays="numpy", only=None):
    """Every rank on a thread of this process, on the host backend, with
    numpy arrays or torch CPU tensors; returns the failures (each rank's)
    and each rank's (failures, declined, cases run)."""
    if arrays == "torch":
        import torch

        dev = TorchArrays(torch, "cpu")
    else:
        dev = NumpyArrays()
    groups = symm.local_groups(world, backend="host", timeout_ms=60000)
    others = symm.local_groups(world, backend="host", timeout_ms=60000)
    results = [None] * world

    def main(i):
        results[i] = run_rank([groups[i], others[i]], dev, "host", seed, cases, log, only=only)

    threads = [threading.Thread(target=main, args=(i,), daemon=True) for i in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for g in groups + others:
        g.close()
    return [f for res in results for f in res[0]], results


def rank_process(args):
    """One rank of a CUDA run (SYMM_TEST_RANK), torch tensors on its device."""
    import torch

    rank = int(os.environ["SYMM_TEST_RANK"])
    device = rank % args.gpus
    torch.cuda.set_device(device)
    groups = [
        symm.Group.from_unique_id(bytes.fromhex(os.environ[var]), args.world, rank, device=device, backend="cuda",
                                  timeout_ms=120000, allow_shared_device=args.gpus < args.world)
        for var in ("SYMM_TEST_UID", "SYMM_TEST_UID2")
    ]
    failures, unsupported, done = run_rank(groups, TorchArrays(torch, "cuda"), "cuda", args.seed, args.cases,
                                           log=lambda s: print(s, flush=True), shared=args.gpus < args.world,
                                           only=args.case)
    torch.cuda.synchronize()
    for g in groups:
        g.check_async_error()
        g.close()
    print(f"rank {rank}: {done} cases, {len(failures)} failed, {unsupported} declined", flush=True)
    return 1 if failures else 0


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", choices=["host", "cuda"], default="host")
    p.add_argument("--arrays", choices=["numpy", "torch"], default="numpy", help="host: numpy arrays or torch tensors")
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--gpus", type=int, default=1, help="cuda: rank r runs on device r %% gpus")
    p.add_argument("--cases", type=int, default=100)
    p.add_argument("--seed", type=int, default=int(time.time()) % 100000)
    p.add_argument("--case", type=int, help="run only case N of the seed's draws (to repeat a failure)")
    args = p.parse_args()
    if "SYMM_TEST_RANK" in os.environ:
        sys.exit(rank_process(args))
    print(f"ops_fuzz backend={args.backend} world={args.world} seed={args.seed} cases={args.cases}", flush=True)
    if args.backend == "host":
        failures, results = run_threads(args.world, args.seed, args.cases, arrays=args.arrays, only=args.case)
        ok, declined = not failures, results[0][1]
    else:
        env = dict(os.environ, SYMM_TEST_UID=symm.get_unique_id().hex(), SYMM_TEST_UID2=symm.get_unique_id().hex())
        argv = [sys.executable, __file__, *sys.argv[1:], "--seed", str(args.seed)]
        procs = [subprocess.Popen(argv, env=dict(env, SYMM_TEST_RANK=str(r))) for r in range(args.world)]
        ok, declined = all(p.wait() == 0 for p in procs), "in the ranks' lines"
    print(f"{'PASS' if ok else 'FAIL'} ops_fuzz backend={args.backend} world={args.world} seed={args.seed} "
          f"cases={args.cases} (declined: {declined})", flush=True)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
