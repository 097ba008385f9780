"""The fused path (symm's own Hopper matmul kernel) of fused_ag_mm and
mm_rs: one rank per GPU on threads (two, or SYMM_TEST_WORLD), forced with
SYMM_ALGO=fused, which fails instead of falling back when the kernel cannot
run the call. Skipped unless torch sees that many GPUs of compute
capability 9.0."""

import pytest
from ranks import GPU_TEST_WORLD, on_threads

import symm

torch = pytest.importorskip("torch")
WORLD = GPU_TEST_WORLD
if torch.cuda.device_count() < WORLD:
    pytest.skip(f"needs {WORLD} Hopper GPUs, torch sees {torch.cuda.device_count()} CUDA devices",
                allow_module_level=True)
if torch.cuda.get_device_capability(0) != (9, 0):
    pytest.skip(f"needs Hopper GPUs, GPU 0 is sm_{''.join(map(str, torch.cuda.get_device_capability(0)))}",
                allow_module_level=True)

TOLERANCE = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 1.2e-2}


@pytest.fixture(autouse=True)
def forced_fused(monkeypatch):
    monkeypatch.setenv("SYMM_ALGO", "fused")


def cuda_groups():
    return symm.local_groups(WORLD, backend="cuda", timeout_ms=30000)


def randn(seed, shape, dtype):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(dtype)


def weight(seed, k, n, dtype):
    """A K-major [k, n] B: a Linear weight [n, k] transposed."""
    return (randn(seed, (n, k), dtype) / k**0.5).t()


def rel_err(got, ref):
    got = got.double().cpu()
    assert not got.isnan().any(), "an output element was not written"
    return ((got - ref).norm() / ref.norm()).item()


# Outputs in the operands' dtype: the CUDA backend (as torch's fused op)
# writes no wider output.
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows,k,ns", [(64, 128, [96]), (200, 264, [136, 40]), (512, 1024, [768])])
def test_fused_ag_mm_matches_float64(dtype, rows, k, ns):
    shards = [randn(10 + r, (rows, k), dtype) for r in range(WORLD)]
    bs = [weight(20 + i, k, n, dtype) for i, n in enumerate(ns)]
    gathered = torch.cat(shards).double()

    def rank_main(g):
        torch.cuda.set_device(g.rank)
        a = shards[g.rank].cuda()
        ws = [b.cuda() for b in bs]
        outs = [torch.full((rows * WORLD, b.shape[1]), float("nan"), dtype=dtype, device="cuda") for b in bs]
        ag = torch.full((rows * WORLD, k), float("nan"), dtype=dtype, device="cuda")
        symm.fused_ag_mm(g, a, ws, 0, out=outs, ag_out=ag)
        torch.cuda.synchronize()
        g.check_async_error()
        return ag.cpu(), [o.cpu() for o in outs]

    for ag, outs in on_threads(rank_main, cuda_groups(), deadline_s=120):
        assert torch.equal(ag.double(), gathered)
        for out, b in zip(outs, bs):
            e = rel_err(out, gathered @ b.double())
            assert e < TOLERANCE[dtype], e


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("op", ["sum", "avg"])
@pytest.mark.parametrize("m,k,n", [(256, 128, 256), (400, 136, 200), (2048, 1024, 1280)])
def test_fused_mm_rs_matches_float64(dtype, op, m, k, n):
    a = [randn(30 + r, (m, k), dtype) for r in range(WORLD)]
    b = [weight(40 + r, k, n, dtype) for r in range(WORLD)]
    total = sum(x.double() @ y.double() for x, y in zip(a, b))
    if op == "avg":
        total /= WORLD

    def rank_main(g):
        torch.cuda.set_device(g.rank)
        out = torch.full((m // WORLD, n), float("nan"), dtype=dtype, device="cuda")
        for _ in range(3):  # repeated calls reuse the flags and inbox
            out.fill_(float("nan"))
            symm.mm_rs(g, a[g.rank].cuda(), b[g.rank].cuda(), 0, op=op, out=out)
        torch.cuda.synchronize()
        g.check_async_error()
        return out.cpu()

    for rank, out in enumerate(on_threads(rank_main, cuda_groups(), deadline_s=120)):
        e = rel_err(out, total.chunk(WORLD)[rank])
        assert e < TOLERANCE[dtype], e


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("op", ["sum", "avg"])
@pytest.mark.parametrize("m,k,n", [(512, 1024, 4096), (256, 512, 4104)])
def test_fused_mm_rs_into_symmetric_out(dtype, op, m, k, n):
    """`out` in a rendezvoused symmetric buffer, at the same offset on both
    ranks: at these one-wave shapes each rank writes its partial straight
    into the other's `out`, which adds its own (SYMM_RS_C_ADD). Calls into
    it alternate with calls into an ordinary output (the inbox path), every
    output poisoned first."""
    a = [randn(50 + r, (m, k), dtype) for r in range(WORLD)]
    b = [weight(60 + r, k, n, dtype) for r in range(WORLD)]
    total = sum(x.double() @ y.double() for x, y in zip(a, b))
    if op == "avg":
        total /= WORLD
    offset = 256  # bytes into the buffer

    def rank_main(g):
        torch.cuda.set_device(g.rank)
        numel = m // WORLD * n
        with g.create(offset + 2 * numel) as buf, buf.rendezvous():
            raw = torch.as_tensor(buf.cuda_bytes(), device="cuda")
            symmetric = raw[offset:].view(dtype).view(m // WORLD, n)
            got = []
            for i in range(4):
                out = symmetric if i % 2 == 0 else torch.empty_like(symmetric)
                out.fill_(float("nan"))
                symm.mm_rs(g, a[g.rank].cuda(), b[g.rank].cuda(), 0, op=op, out=out)
                got.append(out.cpu())  # synchronizes: the next call overwrites it
            g.check_async_error()
            return got

    for rank, outs in enumerate(on_threads(rank_main, cuda_groups(), deadline_s=120)):
        for i, out in enumerate(outs):
            e = rel_err(out, total.chunk(WORLD)[rank])
            assert e < TOLERANCE[dtype], (rank, i, e)


def test_fused_mm_rs_back_to_back_across_shapes_and_skew():
    """Fused mm_rs calls follow one another with no barrier between them:
    a rank pushes into a peer's inbox only once the peer's previous call
    has read it (a count of calls the kernel keeps beside its tile flags). Two
    shapes alternate (different tilings of the same inbox), a fused ag_mm
    runs between them (the workspace, not the mailbox), one rank at a time
    starts late by a ~1 ms spin, and nothing is synchronized until the
    end; every output is its own poisoned tensor."""
    dtype = torch.bfloat16
    shapes = [(512, 1024, 768), (256, 512, 1280)]  # m, k, n
    a = {s: [randn(80 + r + 2 * i, s[:2], dtype) for r in range(WORLD)] for i, s in enumerate(shapes)}
    b = {s: weight(90 + i, s[1], s[2], dtype) for i, s in enumerate(shapes)}
    want = {s: sum(x.double() for x in a[s]) @ b[s].double() for s in shapes}
    rounds = 4

    def rank_main(g):
        torch.cuda.set_device(g.rank)
        dev = {s: ([x.cuda() for x in a[s]], b[s].cuda()) for s in shapes}
        outs = []
        for i in range(rounds):
            for s in shapes:
                m, k, n = s
                if (i + shapes.index(s)) % WORLD == g.rank:
                    torch.cuda._sleep(2_000_000)  # about a millisecond: this rank starts late
                out = torch.full((m // WORLD, n), float("nan"), dtype=dtype, device="cuda")
                symm.mm_rs(g, dev[s][0][g.rank], dev[s][1], 0, out=out)
                outs.append((s, out))
            gathered = symm.fused_ag_mm(g, dev[shapes[0]][0][g.rank], dev[shapes[0]][1], 0)
            outs.append(("ag", gathered))
        torch.cuda.synchronize()
        g.check_async_error()
        return [(s, t.cpu()) for s, t in outs]

    ag_want = torch.cat(a[shapes[0]]).double() @ b[shapes[0]].double()
    for rank, outs in enumerate(on_threads(rank_main, cuda_groups(), deadline_s=120)):
        assert len(outs) == rounds * (len(shapes) + 1)
        for s, got in outs:
            ref = ag_want if s == "ag" else want[s].chunk(WORLD)[rank]
            e = rel_err(got, ref)
            assert e < TOLERANCE[dtype], (rank, s, e)


def test_fused_mm_rs_shapes_whose_flags_outgrow_each_other():
    """A shape with more tiles than the last one's has tile flags where the
    last shape's flags ended. When the flags and the inbox shared one buffer,
    each laid out by the call's shape, those flags lay where the small
    shape's peer had just pushed its partials, read as set, and rank 1's
    own tiles added partials that had not arrived (the previous call's, or
    the small shape's). Now the flags have a buffer of their own. Rank 0
    starts every large call late, so rank 1's tiles reach their flags
    first; every large call has inputs of its own, so stale partials show."""
    dtype = torch.bfloat16
    large, small = (2048, 256, 4096), (256, 256, 256)  # m, k, n: 128 tiles a chunk, then 1
    calls = [(large, 0), (small, 0), (large, 1), (small, 1), (large, 2)]
    a = {(s, i): [randn(300 + 10 * i + 5 * (s == small) + r, s[:2], dtype) for r in range(WORLD)] for s, i in calls}
    b = {s: weight(400 + (s == small), s[1], s[2], dtype) for s in (large, small)}
    want = {(s, i): sum(x.double() for x in a[s, i]) @ b[s].double() for s, i in calls}

    def rank_main(g):
        torch.cuda.set_device(g.rank)
        ws = {s: w.cuda() for s, w in b.items()}
        xs = {c: a[c][g.rank].cuda() for c in calls}
        outs = []
        for s, i in calls:
            m, _, n = s
            if s == large and g.rank == 0:
                torch.cuda._sleep(2_000_000)  # about a millisecond
            out = torch.full((m // WORLD, n), float("nan"), dtype=dtype, device="cuda")
            symm.mm_rs(g, xs[s, i], ws[s], 0, out=out)
            outs.append(((s, i), out))
        torch.cuda.synchronize()
        g.check_async_error()
        return [(c, t.cpu()) for c, t in outs]

    for rank, outs in enumerate(on_threads(rank_main, cuda_groups(), deadline_s=120)):
        assert [c for c, _ in outs] == calls
        for c, got in outs:
            e = rel_err(got, want[c].chunk(WORLD)[rank])
            assert e < TOLERANCE[dtype], (rank, c, e)


def test_fused_refuses_what_it_cannot_run():
    """A row-major B cannot feed the kernel: with SYMM_ALGO=fused the call
    fails on every rank with a message (nothing hangs)."""
    dtype = torch.bfloat16

    def rank_main(g):
        torch.cuda.set_device(g.rank)
        a, w = randn(1, (64, 128), dtype).cuda(), randn(2, (128, 64), dtype).cuda()
        with pytest.raises(symm.SymmError, match="SYMM_ALGO=fused"):
            symm.fused_ag_mm(g, a, w, 0)

    on_threads(rank_main, cuda_groups(), deadline_s=120)


def test_fused_ops_captured_in_a_cuda_graph_replay_like_eager():
    dtype = torch.bfloat16
    shards = [randn(50 + r, (256, 512), dtype) for r in range(WORLD)]
    b = weight(60, 512, 384, dtype)

    def rank_main(g):
        torch.cuda.set_device(g.rank)
        a, w = shards[g.rank].cuda(), b.cuda()
        outs = [torch.empty(256 * WORLD, 384, dtype=dtype, device="cuda"),
                torch.empty(256 // WORLD, 384, dtype=dtype, device="cuda")]
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())

        def step():
            symm.fused_ag_mm(g, a, w, 0, out=outs[0], stream=s)
            symm.mm_rs(g, a, w, 0, out=outs[1], stream=s)

        with torch.cuda.stream(s):
            step()
            eager = [t.clone() for t in outs]
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=s, capture_error_mode="thread_local"):
                step()
            replays = []
            for _ in range(3):
                for t in outs:
                    t.fill_(float("nan"))
                graph.replay()
                replays.append([t.clone() for t in outs])
        s.synchronize()
        g.check_async_error()
        return [t.cpu() for t in eager], [[t.cpu() for t in r] for r in replays]

    for eager, replays in on_threads(rank_main, cuda_groups(), deadline_s=120):
        assert not any(t.isnan().any() for t in eager)
        for replay in replays:
            for got, want in zip(replay, eager):
                assert torch.equal(got, want)


# --- fp8 (torch.float8_e4m3fn / float8_e5m2) through the fused kernel, against
# a float64 reference of torch._scaled_mm's definition. The kernel leaves the
# accumulation to the tensor cores (torch's use_fast_accum), about 14 bits of
# mantissa per 32 products, so f32 outputs get a looser bound than in
# test_cuda.py. ---------------------------------------------------------------
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FP8_TOLERANCE = {**TOLERANCE, torch.float32: 2e-3}


def fp8_tensor(seed, shape, dtype):
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(shape, generator=g) * 8 - 4).to(dtype)


def scales(seed, shape):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(shape, generator=g) * 1.75 + 0.25


def max_rel_err(got, ref):
    got = got.double().cpu()
    assert not got.isnan().any(), "an output element was not written"
    return ((got - ref).abs().max() / ref.abs().max()).item()


# 198 rows: row scales of 792 bytes, gathered into 800-byte slots.
@pytest.mark.parametrize("row_wise", [False, True])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows,k,n", [(198, 256, 320), (512, 1024, 768)])
def test_fused_ag_mm_fp8(row_wise, out_dtype, rows, k, n):
    shards = [fp8_tensor(70 + r, (rows, k), E4M3) for r in range(WORLD)]
    w = fp8_tensor(72, (n, k), E5M2)  # a row-major [N, K] weight; B = w.t()
    sa = [scales(73 + r, (rows, 1) if row_wise else (1,)) for r in range(WORLD)]
    if not row_wise:
        sa = [sa[0]] * WORLD  # tensor-wise: one scale for the whole gathered A
    sb = scales(75, (1, n) if row_wise else (1,))
    bias = torch.randn(n).to(out_dtype) if out_dtype != torch.float32 else None

    def rank_main(g):
        torch.cuda.set_device(g.rank)
        r, dev = g.rank, torch.device("cuda", g.rank)
        out = torch.full((rows * WORLD, n), float("nan"), dtype=out_dtype, device=dev)
        for _ in range(2):  # the second call reuses the flags and slots
            out.fill_(float("nan"))
            symm.fused_ag_mm(
                g,
                shards[r].to(dev),
                w.to(dev).t(),
                0,
                out=out,
                a_scale=sa[r].to(dev),
                b_scales=sb.to(dev),
                biases=None if bias is None else bias.to(dev),
            )
        torch.cuda.synchronize()
        g.check_async_error()
        return out.cpu()

    gathered_scale = torch.cat(sa) if row_wise else sa[0]
    want = (torch.cat(shards).double() * gathered_scale.double()) @ (w.double().t() * sb.double())
    want = want + (0 if bias is None else bias.double())
    for out in on_threads(rank_main, cuda_groups(), deadline_s=120):
        e = max_rel_err(out, want)
        assert e < FP8_TOLERANCE[out_dtype], e


@pytest.mark.parametrize("row_wise", [False, True])
@pytest.mark.parametrize("op,m,algorithm", [("sum", 400, None), ("avg", 400, None), ("sum", 2400, "pipelined")])
def test_fused_mm_rs_fp8_with_bias(row_wise, op, m, algorithm):
    """Each rank's product includes its bias (torch's
    fused_scaled_matmul_reduce_scatter). Summed at 1200 rows a chunk and
    pipelined, two ranks multiply their own chunk in pieces onto the
    pulled partials (fp8 matmuls accumulating)."""
    k, n = 256, 272
    a = [fp8_tensor(80 + r, (m, k), E5M2) for r in range(WORLD)]
    w = [fp8_tensor(82 + r, (n, k), E4M3) for r in range(WORLD)]
    sa = [scales(84 + r, (m, 1) if row_wise else (1,)) for r in range(WORLD)]
    sb = [scales(86 + r, (1, n) if row_wise else (1,)) for r in range(WORLD)]
    g_bias = torch.Generator().manual_seed(88)
    bias = [torch.randn(n, generator=g_bias).to(torch.bfloat16) for _ in range(WORLD)]

    def rank_main(g):
        torch.cuda.set_device(g.rank)
        r, dev = g.rank, torch.device("cuda", g.rank)
        out = torch.full((m // WORLD, n), float("nan"), dtype=torch.bfloat16, device=dev)
        symm.mm_rs(
            g, a[r].to(dev), w[r].to(dev).t(), 0, op=op, out=out,
            a_scale=sa[r].to(dev), b_scale=sb[r].to(dev), bias=bias[r].to(dev), algorithm=algorithm,
        )
        torch.cuda.synchronize()
        g.check_async_error()
        return out.cpu()

    total = sum(
        (x.double() * s.double()) @ (y.double().t() * t.double()) + c.double()
        for x, y, s, t, c in zip(a, w, sa, sb, bias)
    )
    if op == "avg":
        total /= WORLD
    for r, out in enumerate(on_threads(rank_main, cuda_groups(), deadline_s=120)):
        e = max_rel_err(out, total.chunk(WORLD)[r])
        assert e < FP8_TOLERANCE[torch.bfloat16], e
