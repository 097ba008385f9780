"""One rank of a symm.torch test: ``python torch_scenarios.py SCENARIO``,
as one of WORLD_SIZE processes (RANK set). On the CPU (the host backend)
the ranks meet through a gloo process group on the file
SYMM_TEST_INIT_FILE (test_torch.py starts them); on GPUs through torchrun's
variables with SYMM_TEST_DEVICE=cuda (test_torch_cuda.py starts them),
where every operation is also checked against ``torch.ops.symm_mem`` on
the same inputs. Every result is checked against float64 math on every
rank's inputs (each rank makes all of them from one seed). A failure
exits non-zero with its traceback."""

import os
import sys
import traceback

import torch
import torch.distributed as dist

import symm
import symm.torch as st

DEVICE = os.environ.get("SYMM_TEST_DEVICE", "cpu")
CUDA = DEVICE == "cuda"
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2, torch.float8_e4m3fn: 2**-3}


class Ctx:
    def __init__(self):
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.name = dist.group.WORLD.group_name
        self.device = torch.device(DEVICE, self.rank % max(torch.cuda.device_count(), 1)) if CUDA else "cpu"
        self.torch_symm_mem = False  # torch's symmetric memory enabled for the group

    def inputs(self, seed, shape, dtype=torch.float32, scale=1.0):
        """Every rank's tensor of ``shape`` (on the CPU, float64 values rounded to ``dtype``)."""
        g = torch.Generator().manual_seed(seed)
        return [(torch.randn(shape, generator=g, dtype=torch.float64) * scale).to(dtype) for _ in range(self.world)]

    def mine(self, ts):
        return ts[self.rank].to(self.device)

    def torch_ops(self):
        """torch.ops.symm_mem on this group, on GPUs (None on the CPU)."""
        if not CUDA:
            return None
        if not self.torch_symm_mem:
            from torch.distributed import _symmetric_memory as tsm

            tsm.enable_symm_mem_for_group(self.name)
            self.torch_symm_mem = True
        return torch.ops.symm_mem

    def torch_symmetric(self, t):
        """A copy of ``t`` in torch's symmetric memory (its one- and two-shot
        all-reduces read their input there only)."""
        from torch.distributed import _symmetric_memory as tsm

        buf = tsm.empty(t.shape, dtype=t.dtype, device=t.device)
        tsm.rendezvous(buf, self.name)
        buf.copy_(t)
        return buf


def f64(t):
    return t.detach().to("cpu", torch.float64)


def close(got, ref, what, tolerance=None):
    tol = tolerance if tolerance is not None else TOLERANCE[got.dtype]
    assert list(got.shape) == list(ref.shape), f"{what}: shape {list(got.shape)}, expected {list(ref.shape)}"
    err = (f64(got) - ref).abs().max() / ref.abs().max().clamp_min(1e-30)
    assert err <= tol, f"{what}: relative error {err:.2e} for {got.dtype} (tolerance {tol:.0e})"


def same(got, ref, what):
    assert torch.equal(f64(got), f64(ref)), f"{what}: not the same values"


def agree(a, b, what):
    """symm's result and torch.ops.symm_mem's on the same inputs."""
    close(a, f64(b), f"{what} (symm vs torch.ops.symm_mem)", 2 * TOLERANCE[a.dtype])


# --- the operations, eagerly -------------------------------------------------
def ops(c):
    for dtype in DTYPES:
        ag_mm(c, dtype)
        mm_rs(c, dtype)
        lc_allgather(c, dtype)
        all_reduces(c, dtype)


def ag_mm(c, dtype):
    W, r, tops = c.world, c.rank, c.torch_ops()
    for gd in (0, 1, 2, -1):
        shards = c.inputs(1, (2, 3, 16), dtype)
        k = 16 * W if gd % 3 == 2 else 16
        bs = [c.inputs(2 + i, (k, n), dtype) for i, n in enumerate((8, 24))]
        full = torch.cat([f64(a) for a in shards], gd)
        for nb in (1, 2):
            mine = [c.mine(b) for b in bs[:nb]]
            for return_A in (True, False):
                what = f"fused_all_gather_matmul {dtype} gather_dim {gd} {nb} B return_A {return_A}"
                ag, outs = torch.ops.symm.fused_all_gather_matmul(c.mine(shards), mine, gd, c.name, return_A=return_A)
                assert (ag is None) != return_A, what
                if return_A:
                    same(ag, full, what + " (gathered A)")
                assert len(outs) == nb
                for out, b in zip(outs, bs):
                    close(out, full @ f64(b[r]), what)
                if tops is not None and gd >= 0:
                    t_ag, t_outs = tops.fused_all_gather_matmul(c.mine(shards), mine, gd, c.name, return_A=return_A)
                    for out, t_out in zip(outs, t_outs):
                        agree(out, t_out, what)
                    if return_A:
                        same(ag, t_ag, what + " gathered A vs torch's")


def mm_rs(c, dtype):
    W, r, tops = c.world, c.rank, c.torch_ops()
    a = c.inputs(3, (2 * W, 3 * W, 16), dtype)
    b = c.inputs(4, (16, 8 * W), dtype)
    for sd in (0, 1, 2, -1):
        for op in ("sum", "avg"):
            what = f"fused_matmul_reduce_scatter {dtype} scatter_dim {sd} {op}"
            got = torch.ops.symm.fused_matmul_reduce_scatter(c.mine(a), c.mine(b), op, sd, c.name)
            total = sum(f64(x) @ f64(y) for x, y in zip(a, b))
            ref = total.chunk(W, dim=sd)[r] / (W if op == "avg" else 1)
            close(got, ref, what)
            if tops is not None and sd >= 0:
                agree(got, tops.fused_matmul_reduce_scatter(c.mine(a), c.mine(b), op, sd, c.name), what)


def lc_allgather(c, dtype):
    xs = c.inputs(5, (3, 5, 2), dtype)
    got = torch.ops.symm._low_contention_all_gather(c.mine(xs), c.name)
    same(got, torch.cat([f64(x) for x in xs]), f"_low_contention_all_gather {dtype}")
    tops = c.torch_ops()
    if tops is not None:
        theirs = tops._low_contention_all_gather(c.mine(xs), c.name)
        # torch's op copies on a stream of its own and returns at once (its
        # result is registered work to wait for); symm's runs on the current one.
        torch.cuda.synchronize()
        same(got, theirs, "_low_contention_all_gather vs torch's")


def poisoned(like):
    return torch.full_like(like, float("nan"))


def all_reduces(c, dtype):
    W, tops = c.world, c.torch_ops()
    xs = c.inputs(6, (4, 33), dtype)
    for op in ("sum", "avg"):
        ref = sum(f64(x) for x in xs) / (W if op == "avg" else 1)
        what = f"{dtype} {op}"
        x = c.mine(xs)
        close(torch.ops.symm.one_shot_all_reduce(x, op, c.name), ref, "one_shot_all_reduce " + what)
        out = poisoned(x)
        ret = torch.ops.symm.one_shot_all_reduce_out(x, op, c.name, out)
        assert ret.data_ptr() == out.data_ptr()
        close(out, ref, "one_shot_all_reduce_out " + what)
        y = x.clone()
        ret = torch.ops.symm.two_shot_all_reduce_(y, op, c.name)
        assert ret.data_ptr() == y.data_ptr()
        close(y, ref, "two_shot_all_reduce_ " + what)
        out = poisoned(x)
        ret = torch.ops.symm.two_shot_all_reduce_out(x.clone(), op, c.name, out)
        assert ret.data_ptr() == out.data_ptr()
        close(out, ref, "two_shot_all_reduce_out " + what)
        y = x.clone()
        torch.ops.symm.multimem_all_reduce_(y, op, c.name)
        close(y, ref, "multimem_all_reduce_ " + what)
        # torch 2.11's one- and two-shot kernels have no f16.
        if tops is not None and op == "sum" and dtype != torch.float16:
            sx = c.torch_symmetric(x)
            agree(torch.ops.symm.one_shot_all_reduce(x, op, c.name), tops.one_shot_all_reduce(sx, op, c.name), what)
            t_out = poisoned(x)
            tops.two_shot_all_reduce_out(c.torch_symmetric(x), op, c.name, t_out)
            out = poisoned(x)
            torch.ops.symm.two_shot_all_reduce_out(x.clone(), op, c.name, out)
            agree(out, t_out, "two_shot_all_reduce_out " + what)
            sy = c.torch_symmetric(x)
            tops.two_shot_all_reduce_(sy, op, c.name)
            y = x.clone()
            torch.ops.symm.two_shot_all_reduce_(y, op, c.name)
            agree(y, sy, "two_shot_all_reduce_ " + what)


# --- fp8 ----------------------------------------------------------------------
def fp8(c, seed, shape):
    g = torch.Generator().manual_seed(seed)
    return [(torch.rand(shape, generator=g) * 8 - 4).to(torch.float8_e4m3fn) for _ in range(c.world)]


def scales(c, seed, shape):
    g = torch.Generator().manual_seed(seed)
    return [torch.rand(shape, generator=g) * 1.75 + 0.25 for _ in range(c.world)]


def scaled(c):
    """The scaled (fp8) operators: tensor-wise, row-wise and (all-gather)
    replicated row-wise A scales, bf16 outputs, a bias."""
    W, r, tops = c.world, c.rank, c.torch_ops()
    m, k, n = 16, 32, 48
    w = fp8(c, 10, (n, k))  # row-major [N, K]: B = w.t() is column-major
    bias = c.inputs(11, (n,), torch.bfloat16)
    for mode in ("tensor", "row", "replicated"):
        a = fp8(c, 12, (m, k))
        if mode == "tensor":
            sa = scales(c, 13, (1,))
            sa = [sa[0]] * W  # one value for the whole gathered A
            full_scale = [sa[0].expand(m, 1)] * W
        else:
            sa = scales(c, 13, (m, 1))
            full_scale = sa
        if mode == "replicated":
            sa = [torch.cat(full_scale)] * W
        sb = scales(c, 14, (1, n) if mode != "tensor" else (1,))
        what = f"fused_all_gather_scaled_matmul {mode}-wise"
        B = c.mine(w).t()
        args = (c.mine(a), [B], c.mine(sa), [c.mine(sb)], 0, c.name, [c.mine(bias)], [None], [torch.bfloat16], [False])
        ag, (out,) = torch.ops.symm.fused_all_gather_scaled_matmul(*args)
        same(ag, torch.cat([f64(x) for x in a]), what + " gathered A")
        gathered = torch.cat([f64(x) * f64(s) for x, s in zip(a, full_scale)])
        ref = gathered @ (f64(w[r]).t() * f64(sb[r])) + f64(bias[r])
        close(out, ref, what)
        if tops is not None:
            agree(out, tops.fused_all_gather_scaled_matmul(*args)[1][0], what)

        # matmul + reduce-scatter as torch's op takes it: A flattened to a
        # matrix with the output's shape beside it, or A as it is.
        for a_shape, out_shape, sd in (((W * m, k), [W, m, n], 0), ((W, 12, k), [W, 12, n], 1)):
            what = f"fused_scaled_matmul_reduce_scatter {mode}-wise A {list(a_shape)} output {out_shape}"
            a = fp8(c, 15, a_shape)
            sa = scales(c, 16, (1,) if mode == "tensor" else (*a_shape[:-1], 1))
            args = (c.mine(a), B, c.mine(sa), c.mine(sb), "sum", sd, sd, c.name, out_shape)
            kwargs = {"bias": c.mine(bias), "out_dtype": torch.bfloat16}
            got = torch.ops.symm.fused_scaled_matmul_reduce_scatter(*args, **kwargs)
            total = sum(
                (f64(x).reshape(-1, k) * f64(s).reshape(-1, 1)) @ (f64(y).t() * f64(t)) + f64(bb)
                for x, s, y, t, bb in zip(a, sa, w, sb, bias)
            )
            close(got, total.view(out_shape).chunk(W, dim=sd)[r], what)
            if tops is not None:
                agree(got, tops.fused_scaled_matmul_reduce_scatter(*args, **kwargs), what)
    one_row_shards(c)
    scaled_fp8_outputs(c)


def one_row_shards(c):
    """A one-row shard's ``[1, 1]`` A scale is that row's (torch tests
    row-wise first), gathered with it, also beside a one-element B scale:
    not one rank's scale over the whole gathered A. Not compared with
    torch.ops.symm_mem, whose _scaled_mm takes no row-wise A scale with a
    tensor-wise B scale."""
    W, r = c.world, c.rank
    k, n = 32, 48
    w, a = fp8(c, 30, (n, k)), fp8(c, 31, (1, k))
    sa, bias = scales(c, 32, (1, 1)), c.inputs(33, (n,), torch.bfloat16)
    for b_shape in ((1,), (1, n)):
        what = f"fused_all_gather_scaled_matmul, one-row shards, B scale {list(b_shape)}"
        sb = scales(c, 34, b_shape)
        args = (c.mine(a), [c.mine(w).t()], c.mine(sa), [c.mine(sb)], 0, c.name, [c.mine(bias)], [None],
                [torch.bfloat16], [False])
        _, (out,) = torch.ops.symm.fused_all_gather_scaled_matmul(*args)
        gathered = torch.cat([f64(x) * f64(s) for x, s in zip(a, sa)])
        close(out, gathered @ (f64(w[r]).t() * f64(sb[r])) + f64(bias[r]), what)


def scaled_fp8_outputs(c):
    """torch's default for the scaled operators: fp8 outputs (no out_dtype),
    with a result scale multiplying the product (torch._scaled_mm's
    scale_result, cuBLASLt's D scale). Not compared with torch.ops.symm_mem:
    torch 2.11's _scaled_mm ignores scale_result on CUDA (measured on an
    H200, bench/results/2026-11-28-h200-x1-ec19680-fp8-out-probe/). The
    tolerance of 2^-3 is one e4m3 code."""
    W, r = c.world, c.rank
    m, k, n = 16, 32, 48
    w, a = fp8(c, 20, (n, k)), fp8(c, 21, (m, k))
    sa, sb = [scales(c, 22, (1,))[0]] * W, scales(c, 23, (1,))
    rs = torch.tensor([0.25])
    B = c.mine(w).t()
    what = "fused_all_gather_scaled_matmul, fp8 out"
    args = (c.mine(a), [B], c.mine(sa), [c.mine(sb)], 0, c.name, [None], [c.mine([rs] * W)], [None], [False])
    ag, (out,) = torch.ops.symm.fused_all_gather_scaled_matmul(*args)
    assert out.dtype == torch.float8_e4m3fn, f"{what}: {out.dtype}"
    ref = torch.cat([f64(x) for x in a]) * f64(sa[0]) @ (f64(w[r]).t() * f64(sb[r])) * 0.25
    close(out, ref.clamp(-448, 448), what, 2**-3)
    what = "fused_scaled_matmul_reduce_scatter, fp8 out"
    a = fp8(c, 24, (W * m, k))
    args = (c.mine(a), B, c.mine(sa), c.mine(sb), "sum", 0, 0, c.name, None)
    got = torch.ops.symm.fused_scaled_matmul_reduce_scatter(*args, result_scale=c.mine([rs] * W))
    assert got.dtype == torch.float8_e4m3fn, f"{what}: {got.dtype}"
    total = sum(f64(x) * f64(s) @ (f64(y).t() * f64(t)) for x, s, y, t in zip(a, sa, w, sb)) * 0.25
    close(got, total.chunk(W)[r].clamp(-448, 448), what, 2**-3)


# --- autograd -----------------------------------------------------------------
def leaf(t, device):
    return t.detach().clone().to(device).requires_grad_()


def grads_of(c, make_loss, params_of_all):
    """The reference gradients of the sum of every rank's loss (float64, on
    the CPU) with respect to this rank's parameters."""
    every = [[p.to(torch.float64).requires_grad_() for p in ps] for ps in params_of_all]
    total = sum(make_loss(s, every) for s in range(c.world))
    total.backward()
    return [p.grad for p in every[c.rank]]


def autograd(c):
    """Each operator's gradients (this rank's loss through the collective)
    against float64 gradients of the sum of every rank's loss."""
    W, r = c.world, c.rank
    for gd in (0, 1, 2):
        for return_A in (True, False):
            shards = c.inputs(20, (2, 3, 8))
            k = 8 * W if gd == 2 else 8
            b1, b2 = c.inputs(21, (k, 5)), c.inputs(22, (k, 6))
            full_shape = [2, 3, 8]
            full_shape[gd] *= W
            g1, g2 = c.inputs(23, (*full_shape[:2], 5)), c.inputs(24, (*full_shape[:2], 6))
            ga = c.inputs(25, full_shape)

            def loss(s, ps, gd=gd, return_A=return_A, g1=g1, g2=g2, ga=ga):
                full = torch.cat([p[0] for p in ps], gd)
                v = ((full @ ps[s][1]) * f64(g1[s])).sum() + ((full @ ps[s][2]) * f64(g2[s])).sum()
                return v + ((full * f64(ga[s])).sum() if return_A else 0)

            want = grads_of(c, loss, list(zip(shards, b1, b2)))
            a, x1, x2 = leaf(shards[r], c.device), leaf(b1[r], c.device), leaf(b2[r], c.device)
            ag, (o1, o2) = torch.ops.symm.fused_all_gather_matmul(a, [x1, x2], gd, c.name, return_A=return_A)
            mine = (o1 * c.mine(g1)).sum() + (o2 * c.mine(g2)).sum() + ((ag * c.mine(ga)).sum() if return_A else 0)
            mine.backward()
            for got, ref, n in zip((a.grad, x1.grad, x2.grad), want, ("A", "B1", "B2")):
                close(got, ref, f"grad {n} of fused_all_gather_matmul gather_dim {gd} return_A {return_A}", 1e-5)
    for sd in (0, 1, 2):
        for op in ("sum", "avg"):
            a_all, b_all = c.inputs(30, (2 * W, 3 * W, 8)), c.inputs(31, (8, 4 * W))
            gs = c.inputs(32, [x // (W if i == sd else 1) for i, x in enumerate((2 * W, 3 * W, 4 * W))])

            def loss(s, ps, sd=sd, op=op, gs=gs):
                total = sum(p[0] @ p[1] for p in ps) / (W if op == "avg" else 1)
                return (total.chunk(W, dim=sd)[s] * f64(gs[s])).sum()

            want = grads_of(c, loss, list(zip(a_all, b_all)))
            a, b = leaf(a_all[r], c.device), leaf(b_all[r], c.device)
            (torch.ops.symm.fused_matmul_reduce_scatter(a, b, op, sd, c.name) * c.mine(gs)).sum().backward()
            for got, ref, n in zip((a.grad, b.grad), want, "AB"):
                close(got, ref, f"grad {n} of fused_matmul_reduce_scatter scatter_dim {sd} {op}", 1e-5)
    xs, gs = c.inputs(40, (3, 4)), c.inputs(41, (3 * W, 4))
    want = grads_of(c, lambda s, ps: (torch.cat([p[0] for p in ps]) * f64(gs[s])).sum(), [[x] for x in xs])
    x = leaf(xs[r], c.device)
    (torch.ops.symm._low_contention_all_gather(x, c.name) * c.mine(gs)).sum().backward()
    close(x.grad, want[0], "grad of _low_contention_all_gather", 1e-5)
    for op in ("sum", "avg"):
        gs = c.inputs(42, (3, 4))

        def loss(s, ps, op=op, gs=gs):
            return ((sum(p[0] for p in ps) / (W if op == "avg" else 1)) * f64(gs[s])).sum()

        want = grads_of(c, loss, [[x] for x in xs])
        x = leaf(xs[r], c.device)
        (torch.ops.symm.one_shot_all_reduce(x, op, c.name) * c.mine(gs)).sum().backward()
        close(x.grad, want[0], f"grad of one_shot_all_reduce {op}", 1e-5)
    # The in-place and _out all-reduces bump what they write's version, as
    # torch's in-place ops: a backward that saved it before fails.
    writes = {
        "two_shot_all_reduce_": lambda t: torch.ops.symm.two_shot_all_reduce_(t, "sum", c.name),
        "multimem_all_reduce_": lambda t: torch.ops.symm.multimem_all_reduce_(t, "sum", c.name),
        "one_shot_all_reduce_out": lambda t: torch.ops.symm.one_shot_all_reduce_out(t.clone(), "sum", c.name, t),
    }
    for name, write in writes.items():
        w = leaf(xs[r], c.device)
        saved = c.mine(xs).clone()
        y = (w * saved).sum()  # saves `saved` for w's gradient
        before = saved._version
        write(saved)
        assert saved._version > before, f"{name} left the version at {before}"
        try:
            y.backward()
        except RuntimeError as e:
            assert "modified by an inplace operation" in str(e), f"{name}: {e}"
        else:
            raise AssertionError(f"{name}: backward used the values written after they were saved")


# --- fake kernels and opcheck ---------------------------------------------------
def fake(c):
    """The fake kernels give the shapes and dtypes the operators return,
    and torch.library.opcheck accepts the functional operators."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    W = c.world
    a, b = leaf(c.inputs(50, (2, 3, 16))[c.rank], c.device), leaf(c.inputs(51, (16, 4 * W))[c.rank], c.device)
    x = leaf(c.inputs(52, (3, 8))[c.rank], c.device)
    cases = [
        (torch.ops.symm.fused_all_gather_matmul.default, (a, [b[:, :4], b], 1, c.name), {"return_A": True}),
        (torch.ops.symm.fused_all_gather_matmul.default, (a, [b], 0, c.name), {"return_A": False}),
        (torch.ops.symm.fused_matmul_reduce_scatter.default, (a, b, "avg", 2, c.name), {}),
        (torch.ops.symm.fused_matmul_reduce_scatter.default, (a.repeat(W, 1, 1), b, "sum", 0, c.name), {}),
        (torch.ops.symm._low_contention_all_gather.default, (x, c.name), {}),
        (torch.ops.symm.one_shot_all_reduce.default, (x, "sum", c.name), {}),
    ]
    for op, args, kwargs in cases:
        real = op(*args, **kwargs)
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            fake_args = [mode.from_tensor(t) if isinstance(t, torch.Tensor) else t for t in args]
            fake_args = [[mode.from_tensor(t) for t in v] if isinstance(v, list) else v for v in fake_args]
            got = op(*fake_args, **kwargs)
        flat_real, flat_fake = torch.utils._pytree.tree_leaves(real), torch.utils._pytree.tree_leaves(got)
        assert len(flat_real) == len(flat_fake), op
        for t, f in zip(flat_real, flat_fake):
            if t is None or f is None:
                assert t is None and f is None, op
                continue
            assert (t.shape, t.dtype, t.stride()) == (f.shape, f.dtype, f.stride()), f"{op}: {t.shape} vs {f.shape}"
    for op, args, kwargs in cases:
        # Every rank runs the same checks (each calls the operator, collectively).
        checks = ("test_schema", "test_autograd_registration", "test_faketensor")
        torch.library.opcheck(op, args, kwargs, test_utils=checks)
    with FakeTensorMode():
        try:
            torch.ops.symm.fused_matmul_reduce_scatter(torch.empty(W + 1, 4), torch.empty(4, 4), "sum", 0, c.name)
        except ValueError as e:
            assert "divide" in str(e)
        else:
            raise AssertionError("a product not divisible by the world size passed the fake kernel")


# --- torch.compile --------------------------------------------------------------
def mlp(x, w1, w2, group_name):
    """Two tensor-parallel layers: column-parallel (all-gather the token
    shards, then x @ w1's columns), then row-parallel (h @ w2's rows,
    reduce-scattered back to token shards)."""
    _, (h,) = torch.ops.symm.fused_all_gather_matmul(x, [w1], 0, group_name, return_A=False)
    h = torch.nn.functional.gelu(h)
    return torch.ops.symm.fused_matmul_reduce_scatter(h, w2, "sum", 0, group_name)


def block(x, w1, w2, group_name):
    """The MLP, then an in-place all-reduce of its output (the aliasing
    composite operators through functionalization)."""
    y = mlp(x, w1, w2, group_name) * 2
    torch.ops.symm.two_shot_all_reduce_(y, "avg", group_name)
    out = torch.empty_like(y)
    torch.ops.symm.one_shot_all_reduce_out(y, "sum", group_name, out)
    return out


def compiled(c):
    W, r = c.world, c.rank
    backend = "inductor" if CUDA else os.environ.get("SYMM_TEST_COMPILE_BACKEND", "aot_eager")
    d, hidden, tokens = 16, 8 * W, 4
    xs, w1s, w2s = c.inputs(60, (tokens, d)), c.inputs(61, (d, hidden // W)), c.inputs(62, (hidden // W, d))
    gs = c.inputs(63, (tokens, d))

    def loss(s, ps):
        full = torch.cat([p[0] for p in ps])
        h = torch.nn.functional.gelu(torch.cat([full @ p[1] for p in ps], 1))
        w2 = torch.cat([p[2] for p in ps])
        return ((h @ w2).chunk(W)[s] * f64(gs[s])).sum()

    want = grads_of(c, loss, list(zip(xs, w1s, w2s)))
    results = {}
    for mode in ("eager", "compiled"):
        fn = mlp if mode == "eager" else torch.compile(mlp, fullgraph=True, backend=backend)
        x, w1, w2 = (leaf(t[r], c.device) for t in (xs, w1s, w2s))
        y = fn(x, w1, w2, c.name)
        (y * c.mine(gs)).sum().backward()
        results[mode] = [y.detach(), x.grad, w1.grad, w2.grad]
        for got, ref, n in zip(results[mode][1:], want, ("x", "w1", "w2")):
            close(got, ref, f"{mode} MLP grad {n}", 1e-5)
    for e, k, n in zip(results["eager"], results["compiled"], ("y", "x", "w1", "w2")):
        close(k, f64(e), f"compiled ({backend}) MLP {n} vs eager", 1e-5)
    x, w1, w2 = (c.mine(t) for t in (xs, w1s, w2s))
    eager = block(x, w1, w2, c.name)
    got = torch.compile(block, fullgraph=True, backend=backend)(x, w1, w2, c.name)
    close(got, f64(eager), f"compiled ({backend}) block vs eager", 1e-5)


# --- arguments one rank gets wrong ----------------------------------------------
def refusals(c):
    """A bad argument on one rank, found by symm.torch or by symm, fails
    the call on every rank (the others with SymmRemoteError quoting it)
    instead of leaving them to pair the call with the bad rank's next one;
    the group then goes on."""
    W, r = c.world, c.rank
    bad = r == W - 1
    a, b = c.mine(c.inputs(40, (2 * W, 16))), c.mine(c.inputs(41, (16, 8)))
    fa, w = c.mine(fp8(c, 42, (2 * W, 32))), c.mine(fp8(c, 43, (16, 32)))
    sa, sb = c.mine(scales(c, 44, (1,))), c.mine(scales(c, 45, (1,)))
    ag_args = [fa, [w.t()], sa, [sb], 0, c.name, [None], [None], [torch.bfloat16], [False]]
    cases = {
        "reduce_op": lambda: torch.ops.symm.fused_matmul_reduce_scatter(a, b, "max" if bad else "sum", 0, c.name),
        "all-reduce op": lambda: torch.ops.symm.one_shot_all_reduce(a, "max" if bad else "sum", c.name),
        "gather_dim": lambda: torch.ops.symm.fused_all_gather_scaled_matmul(
            *ag_args[:4], 5 if bad else 0, *ag_args[5:]
        ),
        "out_dtypes": lambda: torch.ops.symm.fused_all_gather_scaled_matmul(
            *ag_args[:8], [] if bad else ag_args[8], ag_args[9]
        ),
        "A_scale": lambda: torch.ops.symm.fused_all_gather_scaled_matmul(
            *ag_args[:2], c.mine(scales(c, 46, (3, 1))) if bad else sa, *ag_args[3:]
        ),
        "output_shape": lambda: torch.ops.symm.fused_scaled_matmul_reduce_scatter(
            fa, w.t(), sa, sb, "sum", 0, 0, c.name, [W, 3, 16] if bad else [W, 2, 16], out_dtype=torch.bfloat16
        ),
    }
    for what, call in cases.items():
        try:
            call()
        except (ValueError, RuntimeError, symm.SymmError) as e:
            if not bad:
                assert isinstance(e, symm.errors.SymmRemoteError), f"{what}: {type(e).__name__}: {e}"
        else:
            raise AssertionError(f"{what}: rank {r}'s call succeeded")
        xs = c.inputs(47, (5,))
        close(torch.ops.symm.one_shot_all_reduce(c.mine(xs), "sum", c.name), sum(f64(x) for x in xs), what)


# --- bootstrap, CUDA graphs ------------------------------------------------------
def bootstrap(c):
    """A subgroup formed with the process group's store as symm's
    allgather (explicitly, and again after disabling), and the same ops."""
    ranks = list(range(c.world))
    pg = dist.new_group(ranks)
    name = pg.group_name
    assert not st.is_symm_mem_enabled_for_group(name)
    backend = "cuda" if CUDA else "host"
    for how in ("store", "unique_id"):
        g = st.enable_symm_mem_for_group(name, bootstrap=how, backend=backend, timeout_ms=30_000)
        assert st.get_group(name) is g and (g.rank, g.world_size) == (c.rank, c.world)
        xs = c.inputs(70, (5,))
        close(torch.ops.symm.one_shot_all_reduce(c.mine(xs), "sum", name), sum(f64(x) for x in xs), how)
        st.disable_symm_mem_for_group(name)
        assert not st.is_symm_mem_enabled_for_group(name)


def reinit(c):
    """The default process group destroyed and made again (same name,
    ranks reversed): the operators form a symm group for the new one,
    not reuse the old one, whose ranks are the old ones. Groups are named
    by name, ProcessGroup or None alike."""
    W, r, name = c.world, c.rank, c.name
    assert st.is_symm_mem_enabled_for_group(None) and st.is_symm_mem_enabled_for_group(dist.group.WORLD)
    old = st.get_group(name)
    dist.destroy_process_group()
    assert not st.is_symm_mem_enabled_for_group(name), "the process group is gone"
    rank = W - 1 - r
    dist.init_process_group(
        "gloo", init_method=f"file://{os.environ['SYMM_TEST_INIT_FILE']}.again", rank=rank, world_size=W
    )
    assert dist.group.WORLD.group_name == name, "torch reuses the name"
    backend = "cuda" if CUDA else "host"  # (forming at first use would pick CUDA wherever torch sees it)
    g = st.enable_symm_mem_for_group(dist.group.WORLD, backend=backend, timeout_ms=60_000)
    assert g is not old and g.rank == rank, (g, old)
    xs = c.inputs(90, (3, 4))
    got = torch.ops.symm._low_contention_all_gather(xs[rank].to(c.device), name)
    same(got, torch.cat(xs), "all-gather after re-init")
    st.disable_symm_mem_for_group(None)
    assert not st.is_symm_mem_enabled_for_group(name)
    st.enable_symm_mem_for_group(None, backend=backend, timeout_ms=60_000)


def graphs(c):
    """An operator captured in a CUDA graph after one eager call (which
    grows the workspace), replayed on new values."""
    W, r = c.world, c.rank
    a_all, b_all = c.inputs(80, (4, 32), torch.bfloat16), c.inputs(81, (32, 16), torch.bfloat16)
    a, b = c.mine(a_all), c.mine(b_all)
    torch.ops.symm.fused_all_gather_matmul(a, [b], 0, c.name)
    x = c.mine(c.inputs(82, (64,)))
    torch.ops.symm.one_shot_all_reduce(x, "sum", c.name)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        _, (out,) = torch.ops.symm.fused_all_gather_matmul(a, [b], 0, c.name, return_A=False)
        y = torch.ops.symm.one_shot_all_reduce(x, "sum", c.name)
    for seed in (83, 84):
        new_a, new_x = c.inputs(seed, (4, 32), torch.bfloat16), c.inputs(seed + 10, (64,))
        a.copy_(c.mine(new_a))
        x.copy_(c.mine(new_x))
        graph.replay()
        torch.cuda.synchronize()
        close(out, torch.cat([f64(t) for t in new_a]) @ f64(b_all[r]), f"graph replay {seed}: fused_all_gather_matmul")
        close(y, sum(f64(t) for t in new_x), f"graph replay {seed}: one_shot_all_reduce")


SCENARIOS = {f.__name__: f for f in (ops, scaled, autograd, fake, compiled, refusals, bootstrap, reinit, graphs)}


def main(names):
    if CUDA:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", os.environ["RANK"])))
        dist.init_process_group("cpu:gloo,cuda:nccl")
    else:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        dist.init_process_group("gloo", init_method="file://" + os.environ["SYMM_TEST_INIT_FILE"], rank=rank,
                                world_size=world)
    c = Ctx()
    st.enable_symm_mem_for_group(c.name, backend="cuda" if CUDA else "host", timeout_ms=60_000)
    try:
        for name in names:
            SCENARIOS[name](c)
            print(f"rank {c.rank}: {name} ok", flush=True)
    finally:
        st.disable_symm_mem_for_group(c.name)
        dist.destroy_process_group()


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except BaseException:  # noqa: BLE001 -- report and fail this rank
        traceback.print_exc()
        sys.stdout.flush()
        os._exit(1)
