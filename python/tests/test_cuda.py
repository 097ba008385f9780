"""The operations on the CUDA backend with torch and cupy arrays: two ranks
(SYMM_TEST_WORLD for more) on threads, each on a GPU of its own and a
stream of its own. Skipped unless torch sees two GPUs."""

import functools

import numpy as np
import pytest
from ranks import GPU_TEST_WORLD, on_threads

import symm

torch = pytest.importorskip("torch")
if torch.cuda.device_count() < 2:
    # Two ranks of one process on one GPU must make no device-synchronizing
    # call while the other waits or captures (README), and these tests make
    # them (torch.cuda.synchronize, symmetric buffers made and freed).
    pytest.skip(f"needs two CUDA devices, torch sees {torch.cuda.device_count()}", allow_module_level=True)

WORLD = GPU_TEST_WORLD
GPUS = torch.cuda.device_count()
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def device(g):
    """The GPU of rank ``g.rank``."""
    return g.rank % GPUS


def cuda_groups():
    devices = [r % GPUS for r in range(WORLD)]
    return symm.local_groups(WORLD, devices=devices, backend="cuda", timeout_ms=30000,
                             allow_shared_device=GPUS < WORLD)


def on_ranks(rank_main, deadline_s=120):
    """``rank_main(g)`` on every rank's thread at once, each on its GPU and
    a stream of its own: ranks on one GPU must not share torch's default
    stream, where one rank's wait for a peer would hold back the peer's
    signal queued behind it."""

    def run(g):
        torch.cuda.set_device(device(g))
        with torch.cuda.stream(torch.cuda.Stream()):
            return rank_main(g)

    return on_threads(run, cuda_groups(), deadline_s=deadline_s)


def inputs(seed, shape, dtype):
    """Every rank's input, made on the CPU from one seed."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g).to(dtype) for _ in range(WORLD)]


def assert_close(got, ref, tolerance=TOLERANCE):
    err = (got.double().cpu() - ref).abs().max() / ref.abs().max()
    assert err <= tolerance[got.dtype], f"relative error {err:.2e} for {got.dtype}"


# fp8 operands: Hopper's fp8 tensor cores accumulate with about 14 mantissa
# bits between cuBLASLt's promotions to f32 (torch._scaled_mm alike), which
# bounds an f32 output's accuracy (measured: 1.5e-4 of the largest element).
FP8_TOLERANCE = {**TOLERANCE, torch.float32: 1e-3}


@pytest.mark.parametrize("dtype", list(TOLERANCE))
def test_ag_mm_torch_outputs_on_the_input_device(dtype):
    shards, (b,) = inputs(1, (64, 128), dtype), inputs(2, (128, 96), dtype)[:1]
    gathered = torch.cat(shards).double()

    def rank_main(g):
        torch.cuda.set_device(device(g))
        a, w = shards[g.rank].cuda(), b.cuda()
        ag, out = symm.fused_ag_mm(g, a, w, 0, return_ag=True)
        torch.cuda.synchronize()
        assert out.device == a.device and out.dtype == dtype and ag.shape == (64 * WORLD, 128)
        return ag.cpu(), out.cpu()

    for ag, out in on_ranks(rank_main):
        assert torch.equal(ag.double(), gathered)
        assert_close(out, gathered @ b.double())


def test_ag_mm_gathering_k_with_two_bs():
    """gather_dim -1: the shards lie side by side (pitched copies into the
    workspace), one matmul over the whole K per B."""
    dtype = torch.bfloat16
    shards = inputs(5, (48, 64), dtype)
    bs = [inputs(6 + i, (64 * WORLD, n), dtype)[0] for i, n in enumerate((40, 24))]
    gathered = torch.cat(shards, dim=1).double()

    def rank_main(g):
        torch.cuda.set_device(device(g))
        outs = symm.fused_ag_mm(g, shards[g.rank].cuda(), [b.cuda() for b in bs], -1)
        torch.cuda.synchronize()
        return [o.cpu() for o in outs]

    for outs in on_ranks(rank_main):
        for out, b in zip(outs, bs):
            assert_close(out, gathered @ b.double())


def test_mm_rs_on_a_side_stream():
    dtype = torch.bfloat16
    a, b = inputs(3, (2, 64, 128), dtype), inputs(4, (128, 64), dtype)
    total = sum(x.double() @ y.double() for x, y in zip(a, b))

    def rank_main(g):
        torch.cuda.set_device(device(g))
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            out = symm.mm_rs(g, a[g.rank].cuda(), b[g.rank].cuda(), 1, stream=side)
        side.synchronize()
        return out.cpu()

    for r, out in enumerate(on_ranks(rank_main)):
        assert out.shape == (2, 64 // WORLD, 64)
        assert_close(out, torch.chunk(total, WORLD, dim=1)[r])


@pytest.mark.parametrize("algo", ["pipelined", "sequential"])
@pytest.mark.parametrize("rows, n", [(2048, 192), (128, 2176)])
def test_mm_rs_sums_three_times(algo, rows, n):
    """Pipelined, 2048 rows per rank: this rank's chunk goes in four pieces,
    three multiplied onto the peer's partial pulled into the output and
    the first summed at the end; 128 rows: one chunk each, summed at the
    end. Into a poisoned output each time (the third call a graph
    replay)."""
    dtype = torch.bfloat16
    a, b = inputs(14, (rows * WORLD, 256), dtype), inputs(15, (256, n), dtype)
    total = sum(x.double() @ y.double() for x, y in zip(a, b))

    def rank_main(g):
        torch.cuda.set_device(device(g))
        x, w = a[g.rank].cuda(), b[g.rank].cuda()
        out = torch.empty(rows, n, dtype=dtype, device="cuda")
        got = []
        for _ in range(3):
            out.fill_(float("nan"))
            symm.mm_rs(g, x, w, 0, out=out, algorithm=algo)
            got.append(out.cpu())
        return got

    for r, got in enumerate(on_ranks(rank_main)):
        for out in got:
            assert_close(out, torch.chunk(total, WORLD, dim=0)[r])


def test_mm_rs_avg_into_a_strided_output():
    dtype = torch.float16
    a, b = inputs(5, (64, 128), dtype), inputs(6, (128, 64), dtype)
    mean = sum(x.double() @ y.double() for x, y in zip(a, b)) / WORLD

    def rank_main(g):
        torch.cuda.set_device(device(g))
        whole = torch.full((64 // WORLD, 128), float("nan"), dtype=dtype, device="cuda")
        out = whole[:, ::2]
        symm.mm_rs(g, a[g.rank].cuda(), b[g.rank].cuda(), 0, op="avg", out=out)
        torch.cuda.synchronize()
        assert whole[:, 1::2].isnan().all(), "wrote outside the output"
        return out.cpu()

    for r, out in enumerate(on_ranks(rank_main)):
        assert_close(out, torch.chunk(mean, WORLD, dim=0)[r])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("batch,seq,hidden,n", [(2, 3, 64, 40), (4, 11, 128, 96), (3, 128, 256, 512)])
def test_sequence_parallel_batched_matmuls(dtype, batch, seq, hidden, n):
    """[batch, seq, hidden] gathered and scattered along dim 1 (one
    strided-batched cuBLASLt matmul per rank's slice), sequence slices that
    are not multiples of 8 too, into outputs with padded rows and a gap
    between batches, poisoned: the gaps stay NaN."""
    total = seq * WORLD
    shards = inputs(11, (batch, seq, hidden), dtype)
    a_full = inputs(12, (batch, total, hidden), dtype)
    bs = inputs(13, (hidden, n), dtype)
    gathered = torch.cat([x.double() for x in shards], 1)
    summed = sum(x.double() @ y.double() for x, y in zip(a_full, bs))

    def padded(rows):
        # Rows of n + 8 in batches one row apart: [batch, rows + 1, n + 8].
        whole = torch.full((batch, rows + 1, n + 8), float("nan"), dtype=dtype, device="cuda")
        return whole, whole[:, :rows, :n]

    def rank_main(g):
        torch.cuda.set_device(device(g))
        (ag_whole, ag_out), (rs_whole, rs_out) = padded(total), padded(seq)
        symm.fused_ag_mm(g, shards[g.rank].cuda(), [bs[g.rank].cuda()], 1, out=[ag_out])
        symm.mm_rs(g, a_full[g.rank].cuda(), bs[g.rank].cuda(), 1, op="sum", out=rs_out)
        torch.cuda.synchronize()
        for whole, rows in ((ag_whole, total), (rs_whole, seq)):
            assert whole[:, rows:, :].isnan().all() and whole[:, :, n:].isnan().all(), "wrote into a gap"
        return ag_out.cpu(), rs_out.cpu()

    for r, (ag_out, rs_out) in enumerate(on_ranks(rank_main)):
        assert_close(ag_out, gathered @ bs[r].double())
        assert_close(rs_out, torch.chunk(summed, WORLD, dim=1)[r])


# --- fp8: torch.float8_e4m3fn / float8_e5m2 tensors, checked against a
# float64 reference of torch._scaled_mm's definition and, where this torch
# and GPU run it, against torch._scaled_mm itself. ---------------------------
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def fp8_inputs(seed, shape, dtype=E4M3, n=WORLD):
    g = torch.Generator().manual_seed(seed)
    return [(torch.rand(shape, generator=g) * 8 - 4).to(dtype) for _ in range(n)]


def scale_inputs(seed, shape, n=WORLD):
    g = torch.Generator().manual_seed(seed)
    return [torch.rand(shape, generator=g) * 1.75 + 0.25 for _ in range(n)]


def scaled_mm_or_none(a, b, sa, sb, bias, out_dtype):
    """torch._scaled_mm where this torch/GPU supports the combination."""
    try:
        return torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, bias=bias, out_dtype=out_dtype)
    except (RuntimeError, NotImplementedError):
        return None


@pytest.mark.parametrize("row_wise", [False, True])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_ag_mm_fp8_like_scaled_mm(row_wise, out_dtype):
    m, k, n = 64, 128, 96
    shards = fp8_inputs(11, (m, k))
    (w,) = fp8_inputs(12, (n, k), E5M2, n=1)  # a row-major [N, K] weight; B = w.t()
    sa = scale_inputs(13, (m, 1) if row_wise else (1,))
    if not row_wise:
        sa = [sa[0]] * WORLD  # tensor-wise: one scale for the whole gathered A
    (sb,) = scale_inputs(14, (1, n) if row_wise else (1,), n=1)
    bias = torch.randn(n).to(out_dtype) if out_dtype != torch.float32 else None

    def rank_main(g):
        torch.cuda.set_device(device(g))
        r, dev = g.rank, torch.device("cuda", device(g))
        b = w.to(dev).t()
        out = symm.fused_ag_mm(
            g,
            shards[r].to(dev),
            b,
            0,
            a_scale=sa[r].to(dev),
            b_scales=sb.to(dev),
            biases=None if bias is None else bias.to(dev),
            out_dtype=out_dtype,
        )
        gsa = torch.cat(sa).to(dev) if row_wise else sa[0].to(dev)
        ref = scaled_mm_or_none(
            torch.cat(shards).to(dev), b, gsa, sb.to(dev), None if bias is None else bias.to(dev), out_dtype
        )
        torch.cuda.synchronize()
        assert out.dtype == out_dtype and out.shape == (m * WORLD, n)
        return out.cpu(), None if ref is None else ref.cpu()

    gathered_scale = torch.cat(sa) if row_wise else sa[0]
    want = (torch.cat(shards).double() * gathered_scale.double()) @ (w.double().t() * sb.double())
    want = want + (0 if bias is None else bias.double())
    for out, ref in on_ranks(rank_main):
        assert_close(out, want, FP8_TOLERANCE)
        if ref is not None:
            assert_close(out, ref.double(), FP8_TOLERANCE)


@pytest.mark.parametrize("row_wise", [False, True])
@pytest.mark.parametrize("scatter_dim", [0, 1])
def test_mm_rs_fp8_with_bias(row_wise, scatter_dim):
    """Each rank's product includes its bias (torch's
    fused_scaled_matmul_reduce_scatter), so the sum holds both."""
    m, k, n = 128, 64, 64
    a = fp8_inputs(21, (m, k))
    w = fp8_inputs(22, (n, k))
    sa = scale_inputs(23, (m, 1) if row_wise else (1,))
    sb = scale_inputs(24, (1, n) if row_wise else (1,))
    g_bias = torch.Generator().manual_seed(25)
    bias = [torch.randn(n, generator=g_bias).to(torch.bfloat16) for _ in range(WORLD)]

    def rank_main(g):
        torch.cuda.set_device(device(g))
        r, dev = g.rank, torch.device("cuda", device(g))
        out = symm.mm_rs(
            g,
            a[r].to(dev),
            w[r].to(dev).t(),
            scatter_dim,
            a_scale=sa[r].to(dev),
            b_scale=sb[r].to(dev),
            bias=bias[r].to(dev),
            out_dtype=torch.bfloat16,
        )
        torch.cuda.synchronize()
        assert out.dtype == torch.bfloat16
        return out.cpu()

    total = sum(
        (x.double() * s.double()) @ (y.double().t() * t.double()) + c.double()
        for x, y, s, t, c in zip(a, w, sa, sb, bias)
    )
    for r, out in enumerate(on_ranks(rank_main)):
        assert_close(out, torch.chunk(total, WORLD, dim=scatter_dim)[r], FP8_TOLERANCE)


FP8_MAX = {E4M3: 448.0, E5M2: 57344.0}


def assert_fp8_out(got, ref, terms, dtype):
    """``got`` (fp8) is ``ref`` (float64) rounded: NaN where ref is NaN, the
    format's largest finite value where ``|ref|`` exceeds it, else within
    one code of it, give or take the f32 product's own error: the fp8
    tensor cores sum with about 14 mantissa bits between promotions, so an
    element may be off by up to 2^-12 of the sum of its terms' magnitudes
    (``terms``: measured up to 1.6e-4, with the rounding after it exact:
    bench/results/2026-11-28-h200-x1-ec19680-fp8-out-probe/)."""
    m, mbits = FP8_MAX[dtype], 3 if dtype == E4M3 else 2
    assert got.dtype == dtype
    g = got.double()
    assert torch.equal(torch.isnan(g), torch.isnan(ref))
    ok = ~torch.isnan(ref)
    g, ref, slack = g[ok], ref[ok], terms[ok] * 2.0**-11
    big = ref.abs() - slack > m * 1.01
    assert torch.equal(g[big], torch.sign(ref[big]) * m), "saturated"
    small = ~big
    ref, slack = ref[small].clamp(-m, m), slack[small]
    assert ((g[small] - ref).abs() <= (ref.abs() + slack) * 2.0**-mbits + slack + 2.0**-9).all()
    assert big.any(), "the case must saturate some elements"


@pytest.mark.parametrize("row_wise", [False, True])
@pytest.mark.parametrize("out_dtype", [E4M3, E5M2])
def test_ag_mm_fp8_outputs(row_wise, out_dtype):
    """fp8 outputs with a bias and a result scale (torch's scale_result:
    cuBLASLt's D scale, a multiplier), compared with a float64 reference and,
    where this torch and GPU run it, torch._scaled_mm itself."""
    m, k, n = 64, 128, 96
    shards = fp8_inputs(41, (m, k))
    for s in shards:
        s.view(torch.uint8)[0, 0] = 0x7F  # e4m3's NaN
    (w,) = fp8_inputs(42, (n, k), E4M3 if out_dtype == E5M2 else E5M2, n=1)
    sa = scale_inputs(43, (m, 1) if row_wise else (1,))
    if not row_wise:
        sa = [sa[0]] * WORLD
    (sb,) = scale_inputs(44, (1, n) if row_wise else (1,), n=1)
    bias = torch.randn(n).to(torch.bfloat16)
    rs = torch.tensor([4.0 if out_dtype == E4M3 else 512.0])

    def rank_main(g):
        torch.cuda.set_device(device(g))
        r, dev = g.rank, torch.device("cuda", device(g))
        b = w.to(dev).t()
        out = symm.fused_ag_mm(
            g,
            shards[r].to(dev),
            b,
            0,
            a_scale=sa[r].to(dev),
            b_scales=sb.to(dev),
            biases=bias.to(dev),
            result_scales=rs.to(dev),
            out_dtype=out_dtype,
        )
        torch.cuda.synchronize()
        return out.cpu()

    gathered_scale = torch.cat(sa) if row_wise else sa[0]
    want = (torch.cat(shards).double() * gathered_scale.double()) @ (w.double().t() * sb.double())
    want = (want + bias.double()) * rs.double()
    terms = (torch.cat(shards).double().abs() * gathered_scale.double()) @ (w.double().abs().t() * sb.double())
    for out in on_ranks(rank_main):
        assert_fp8_out(out, want, terms * rs.double(), out_dtype)


@pytest.mark.parametrize("op", ["sum", "avg"])
@pytest.mark.parametrize("scatter_dim", [0, 1])
def test_mm_rs_fp8_out_by_default(op, scatter_dim):
    """Without out_dtype the output is a's fp8 type (as torch); the ranks'
    products, each with its bias, are summed in f32 and rounded once."""
    m, k, n = 128, 64, 64
    a = fp8_inputs(51, (m, k))
    a[0].view(torch.uint8)[3, 0] = 0x7F  # e4m3's NaN
    w = fp8_inputs(52, (n, k), E5M2)
    sa = scale_inputs(53, (m, 1))
    sb = scale_inputs(54, (1, n))
    bias = torch.randn(n).to(torch.float16)
    rs = torch.tensor([8.0])

    def rank_main(g):
        torch.cuda.set_device(device(g))
        r, dev = g.rank, torch.device("cuda", device(g))
        out = symm.mm_rs(
            g,
            a[r].to(dev),
            w[r].to(dev).t(),
            scatter_dim,
            op=op,
            a_scale=sa[r].to(dev),
            b_scale=sb[r].to(dev),
            bias=bias.to(dev),
            result_scale=rs.to(dev),
        )
        torch.cuda.synchronize()
        return out.cpu()

    total = sum(
        (x.double() * s.double()) @ (y.double().t() * t.double()) + bias.double() for x, y, s, t in zip(a, w, sa, sb)
    )
    terms = sum((x.double().abs() * s.double()) @ (y.double().abs().t() * t.double()) for x, y, s, t in zip(a, w, sa, sb))
    if op == "avg":
        total, terms = total / WORLD, terms / WORLD
    total, terms = total * rs.double(), terms * rs.double()
    for r, out in enumerate(on_ranks(rank_main)):
        chunk = functools.partial(torch.chunk, chunks=WORLD, dim=scatter_dim)
        assert_fp8_out(out, chunk(total)[r], chunk(terms)[r], E4M3)


def test_fp8_row_major_b_is_refused_with_the_layout_named():
    (a,) = fp8_inputs(31, (16, 32), n=1)
    one = torch.ones(1)

    def rank_main(g):
        torch.cuda.set_device(device(g))
        dev = torch.device("cuda", device(g))
        b = torch.zeros(32, 16, device=dev).to(E4M3)  # row-major [K, N]
        with pytest.raises(symm.SymmUnsupported, match="column-major"):
            symm.fused_ag_mm(g, a.to(dev), b, 0, a_scale=one.to(dev), b_scales=one.to(dev))

    on_ranks(rank_main)


class CudaArrayOnly:
    """Hides DLPack, so the CUDA array interface is what symm reads."""

    def __init__(self, arr):
        self.__cuda_array_interface__ = arr.__cuda_array_interface__
        self._arr = arr


def test_lc_allgather_with_cupy_through_the_cuda_array_interface():
    cupy = pytest.importorskip("cupy")
    xs = [np.arange(4096, dtype=np.float32).reshape(64, 64) + 1000 * r for r in range(WORLD)]

    def rank_main(g):
        with cupy.cuda.Device(device(g)), cupy.cuda.Stream(non_blocking=True):
            x = cupy.asarray(xs[g.rank])
            out = cupy.full((64 * WORLD, 64), cupy.nan, dtype=cupy.float32)
            symm.lc_allgather(g, CudaArrayOnly(x), out=CudaArrayOnly(out), stream=cupy.cuda.get_current_stream())
            allocated = symm.lc_allgather(g, x)
            cupy.cuda.get_current_stream().synchronize()
            return cupy.asnumpy(out), cupy.asnumpy(allocated)

    for out, allocated in on_ranks(rank_main):
        np.testing.assert_array_equal(out, np.concatenate(xs))
        np.testing.assert_array_equal(allocated, np.concatenate(xs))


def test_lc_allgather_large_from_ordinary_and_symmetric_memory():
    """8 MiB per rank (this rank's part then goes on the side stream), read
    from a torch tensor (staged) and from a symmetric buffer (in place)."""
    n = 4 << 20  # bf16 elements
    xs = inputs(11, (n,), torch.bfloat16)

    def rank_main(g):
        torch.cuda.set_device(device(g))
        ordinary = xs[g.rank].cuda()
        with g.create(2 * n) as buf, buf.rendezvous():
            symmetric = torch.as_tensor(buf.cuda_bytes(), device="cuda").view(torch.bfloat16)
            symmetric.copy_(ordinary)
            got = []
            for x in (ordinary, symmetric):
                out = torch.full((WORLD * n,), float("nan"), dtype=torch.bfloat16, device="cuda")
                symm.lc_allgather(g, x, out=out)
                got.append(out.cpu())
            return got

    want = torch.cat(xs)
    for got in on_ranks(rank_main):
        for out in got:
            assert torch.equal(out, want)


@pytest.mark.parametrize("dtype,shape", [
    (torch.bfloat16, (3,)), (torch.uint8, (5,)), (torch.int8, (1001,)), (torch.float8_e4m3fn, (9, 7)),
    (torch.int32, (1000, 8)), (torch.int64, (3, 5)), (torch.float16, (33, 3)), (torch.float32, (4, 5)),
    (torch.bfloat16, (64, 1024)), (torch.bfloat16, (1024, 1024)), (torch.uint8, (1500001,)),
])
def test_lc_allgather_small_sizes_bit_exact(dtype, shape):
    """Up to a few MiB per rank the gather takes the SM path on GPUs (LL
    lines; pieces above about 1 MiB): bit for bit for every dtype (random
    bytes, NaN patterns included), odd tails (3 bf16, 5, 1001 and
    1500001 bytes), from contiguous and
    strided inputs into contiguous and strided outputs whose gaps stay
    poisoned, three calls in a row (the later ones replayed)."""
    size = torch.empty((), dtype=dtype).element_size()
    gen = torch.Generator().manual_seed(31)
    raw = [torch.randint(0, 256, (*shape[:-1], shape[-1] * size), generator=gen, dtype=torch.uint8)
           for _ in range(WORLD)]
    want = torch.cat(raw)

    def wide(rows_shape):
        """A poisoned tensor twice as wide as `rows_shape` in its last dim,
        and its bytes by element: [..., 2 * last, size] (byte views keep
        the checks free of any float conversion)."""
        t = torch.empty((*rows_shape[:-1], 2 * rows_shape[-1]), dtype=dtype, device="cuda")
        return t, t.view(torch.uint8).view(*rows_shape[:-1], 2 * rows_shape[-1], size)

    def rank_main(g):
        torch.cuda.set_device(device(g))
        x = raw[g.rank].cuda().view(dtype)
        spread, spread_bytes = wide(shape)
        spread_bytes.fill_(0x5A)
        spread_bytes[..., ::2, :] = raw[g.rank].cuda().view(*shape, size)
        got = []
        for src in (x, spread[..., ::2]):
            for strided_out in (False, True):
                # Strided: every other element of a poisoned tensor.
                rows = (WORLD * shape[0], *shape[1:])
                whole, whole_bytes = wide(rows)
                out = whole[..., ::2] if strided_out else torch.empty(rows, dtype=dtype, device="cuda")
                for _ in range(3):
                    (whole if strided_out else out).view(torch.uint8).fill_(0x5A)
                    symm.lc_allgather(g, src, out=out)
                torch.cuda.current_stream().synchronize()
                if strided_out:
                    got.append((whole_bytes[..., ::2, :].reshape(want.shape).cpu(), whole_bytes[..., 1::2, :].cpu()))
                else:
                    got.append((out.view(torch.uint8).cpu(), None))
        return got

    for got in on_ranks(rank_main):
        for out, gaps in got:
            assert torch.equal(out, want)
            assert gaps is None or (gaps == 0x5A).all(), "wrote outside the output"


def test_repeated_calls_replayed_as_graphs_match_eager():
    """A call repeated with the same arguments is captured on its second
    occurrence and replayed after that: every one of five calls of each
    operation, into a poisoned output, writes the reference."""
    dtype = torch.bfloat16
    shards, (b,) = inputs(12, (64, 128), dtype), inputs(13, (128, 48), dtype)[:1]
    ag_ref = torch.cat(shards).double() @ b.double()
    rs_ref = sum(s.double() @ b.double() for s in shards)

    def rank_main(g):
        torch.cuda.set_device(device(g))
        a, w = shards[g.rank].cuda(), b.cuda()
        ag, rs, lc = (torch.empty(64 * WORLD, 48, dtype=dtype, device="cuda"),
                      torch.empty(64 // WORLD, 48, dtype=dtype, device="cuda"),
                      torch.empty(64 * WORLD, 128, dtype=dtype, device="cuda"))
        results = []
        for _ in range(5):
            for t in (ag, rs, lc):
                t.fill_(float("nan"))
            symm.fused_ag_mm(g, a, w, 0, out=ag)
            symm.mm_rs(g, a, w, 0, out=rs)
            symm.lc_allgather(g, a, out=lc)
            results.append([t.cpu() for t in (ag, rs, lc)])
        return results

    for rank, results in enumerate(on_ranks(rank_main)):
        for ag, rs, lc in results:
            assert_close(ag, ag_ref)
            assert_close(rs, rs_ref.chunk(WORLD)[rank])
            assert torch.equal(lc, torch.cat(shards))


def test_host_arrays_and_numpy_views_are_refused_on_cuda():
    def rank_main(g):
        with pytest.raises(symm.SymmInvalidArgument, match="host memory"):
            symm.lc_allgather(g, np.ones((2, 2), np.float32))
        with g.create(4096) as buf, buf.rendezvous() as h:
            assert h.peer_ptr((g.rank + 1) % WORLD) != 0
            with pytest.raises(symm.SymmUnsupported, match="host backend"):
                h.peer_array(0, np.float32)

    on_ranks(rank_main)


def test_ops_captured_in_a_cuda_graph_replay_like_eager():
    """Once a call's workspace exists, all three operations can be captured
    in a CUDA graph; every replay writes what the eager call wrote."""
    dtype = torch.bfloat16
    shards, (b,) = inputs(7, (128, 256), dtype), inputs(8, (256, 96), dtype)[:1]

    def rank_main(g):
        torch.cuda.set_device(device(g))
        a, w = shards[g.rank].cuda(), b.cuda()
        outs = [
            torch.empty(128 * WORLD, 96, dtype=dtype, device="cuda"),
            torch.empty(128 // WORLD, 96, dtype=dtype, device="cuda"),
            torch.empty(128 * WORLD, 256, dtype=dtype, device="cuda"),
        ]
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())

        def step():
            symm.fused_ag_mm(g, a, w, 0, out=outs[0], stream=s)
            symm.mm_rs(g, a, w, 0, out=outs[1], stream=s)
            symm.lc_allgather(g, a, out=outs[2], stream=s)

        with torch.cuda.stream(s):
            step()  # eager: sizes the workspace, plans the matmuls
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

    for eager, replays in on_ranks(rank_main):
        assert not any(t.isnan().any() for t in eager)
        for replay in replays:
            for got, want in zip(replay, eager):
                assert torch.equal(got, want)


def test_workspace_grows_while_earlier_calls_still_run():
    """A call that needs a larger workspace replaces the group's, whose
    memory earlier calls may still be using: it waits for them first. Here
    the earlier call sits behind a ~30 ms spin on the stream when the host
    issues the larger one (unmapped early, its pulls would read freed
    memory: an illegal address, or wrong sums)."""
    dtype = torch.bfloat16
    small_a, small_b = inputs(20, (256, 256), dtype), inputs(21, (256, 128), dtype)
    big_a, big_b = inputs(22, (4096, 1024), dtype), inputs(23, (1024, 1024), dtype)
    small = sum(x.double() @ y.double() for x, y in zip(small_a, small_b))
    big = sum(x.double() @ y.double() for x, y in zip(big_a, big_b))

    def rank_main(g):
        torch.cuda.set_device(device(g))
        x, w = small_a[g.rank].cuda(), small_b[g.rank].cuda()
        X, W = big_a[g.rank].cuda(), big_b[g.rank].cuda()
        torch.cuda.synchronize()
        torch.cuda._sleep(50_000_000)
        first = symm.mm_rs(g, x, w, 0)
        second = symm.mm_rs(g, X, W, 0)  # grows the workspace
        torch.cuda.current_stream().synchronize()
        g.check_async_error()
        return first.cpu(), second.cpu()

    for r, (first, second) in enumerate(on_ranks(rank_main)):
        assert_close(first, torch.chunk(small, WORLD, dim=0)[r])
        assert_close(second, torch.chunk(big, WORLD, dim=0)[r])


def test_workspace_growth_is_refused_inside_a_capture():
    """Inside a graph capture the workspace cannot be replaced (the graph
    would keep using the old memory): the call fails on every rank with a
    message saying what to do, and nothing hangs."""
    dtype = torch.bfloat16
    small_a, small_b = inputs(24, (128, 128), dtype), inputs(25, (128, 64), dtype)
    big_a, big_b = inputs(26, (2048, 512), dtype), inputs(27, (512, 512), dtype)

    def rank_main(g):
        torch.cuda.set_device(device(g))
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            symm.mm_rs(g, small_a[g.rank].cuda(), small_b[g.rank].cuda(), 0, stream=s)
            X, W = big_a[g.rank].cuda(), big_b[g.rank].cuda()
            s.synchronize()
            graph = torch.cuda.CUDAGraph()
            with pytest.raises(symm.SymmError, match="before capturing"):
                with torch.cuda.graph(graph, stream=s, capture_error_mode="thread_local"):
                    symm.mm_rs(g, X, W, 0, stream=s)
        s.synchronize()

    on_ranks(rank_main)


# --- all-reduce -----------------------------------------------------------------------
@pytest.mark.parametrize("dtype", list(TOLERANCE))
@pytest.mark.parametrize("algorithm", [None, "one_shot", "two_shot"])
@pytest.mark.parametrize("numel", [1, 4097, 3 << 20])
def test_all_reduce_torch(dtype, algorithm, numel):
    xs = inputs(20, (numel,), dtype)
    ref = sum(x.double() for x in xs)

    def rank_main(g):
        x = xs[g.rank].cuda()
        outs = []
        for _ in range(3):  # the second call on is replayed as a graph
            out = symm.all_reduce(g, x, algorithm=algorithm)
            avg = symm.all_reduce(g, x, op="avg", algorithm=algorithm)
            outs.append((out, avg))
        y = x.clone()
        symm.all_reduce(g, y, inplace=True, algorithm=algorithm)
        torch.cuda.current_stream().synchronize()
        return outs, y

    results = on_ranks(rank_main)
    for outs, y in results:
        for out, avg in outs:
            assert_close(out, ref)
            assert_close(avg, ref / WORLD)
        assert_close(y, ref)
    assert torch.equal(results[0][1].cpu(), results[1][1].cpu()), "ranks differ"


def test_all_reduce_ranks_strided_or_not():
    """Rank 0's input and output contiguous, the others' every other column
    of wider tensors, on a fresh group (its workspace made by the first
    call, and grown by a larger one): every rank asks for the same
    workspace, and all get the sum."""
    dtype = torch.bfloat16

    def rank_main(g):
        got = []
        for rows in (64, 4096):
            x = inputs(21 + rows, (rows, 256), dtype)[g.rank].cuda()
            if g.rank == 0:
                out = torch.full_like(x, float("nan"))
            else:
                wide = torch.zeros((rows, 512), dtype=dtype, device="cuda")
                wide[:, 0::2] = x
                x = wide[:, 0::2]
                out = torch.full((rows, 512), float("nan"), dtype=dtype, device="cuda")[:, 1::2]
            symm.all_reduce(g, x, out=out)
            got.append(out.cpu())
        torch.cuda.current_stream().synchronize()
        return got

    for got in on_ranks(rank_main):
        for out, rows in zip(got, (64, 4096)):
            assert_close(out, sum(x.double() for x in inputs(21 + rows, (rows, 256), dtype)))


def int_inputs(seed, numel, np_dtype):
    """Every rank's integer input: int64 near +-2^60 and its limits, int32
    around 2^25 + 1 and its limits (so f32, and for int64 f64, would lose
    bits, and sums wrap), int8 and uint8 over their whole range."""
    rng = np.random.default_rng(seed)
    info = np.iinfo(np_dtype)
    xs = []
    for _ in range(WORLD):
        if info.bits >= 32:
            base = (1 << 60) if info.bits == 64 else (1 << 25) + 1
            small = rng.integers(-(1 << 19), 1 << 19, numel)
            x = np.where(rng.random(numel) < 0.25, info.max - np.abs(small), base + small)
            x = np.where(rng.random(numel) < 0.5, -x, x).astype(np_dtype)
        else:
            x = rng.integers(info.min, info.max, numel, np_dtype, endpoint=True)
        xs.append(x)
    return xs


def int_sum_and_avg(xs):
    """The wrapped sum (numpy integer arithmetic wraps) and it divided by
    the world size truncating toward zero (NCCL's ncclAvg)."""
    s = xs[0].copy()
    for x in xs[1:]:
        s += x
    q = s // WORLD
    q += ((q < 0) & (s % WORLD != 0)).astype(s.dtype)
    return s, q


INT_DTYPES = {torch.int8: np.int8, torch.uint8: np.uint8, torch.int32: np.int32, torch.int64: np.int64}


@pytest.mark.parametrize("dtype", list(INT_DTYPES))
@pytest.mark.parametrize("algorithm", [None, "one_shot", "two_shot"])
@pytest.mark.parametrize("numel", [1, 4097, (3 << 20) + 1])
def test_all_reduce_integers_exact_torch(dtype, algorithm, numel):
    xs = int_inputs(25, numel, INT_DTYPES[dtype])
    want, want_avg = int_sum_and_avg(xs)

    def rank_main(g):
        x = torch.from_numpy(xs[g.rank]).cuda()
        outs = []
        for _ in range(2):
            out = torch.full_like(x, 0x5A)
            symm.all_reduce(g, x, out=out, algorithm=algorithm)
            avg = symm.all_reduce(g, x, op="avg", algorithm=algorithm)
            outs.append((out, avg))
        # Strided, and 1-byte types at an odd address.
        whole = torch.full((2 * numel + 1,), 0x5A, dtype=dtype, device="cuda")
        symm.all_reduce(g, x, out=whole[1::2], algorithm=algorithm)
        torch.cuda.current_stream().synchronize()
        return [(o.cpu().numpy(), a.cpu().numpy()) for o, a in outs], whole.cpu().numpy()

    for outs, whole in on_ranks(rank_main):
        for out, avg in outs:
            np.testing.assert_array_equal(out, want)
            np.testing.assert_array_equal(avg, want_avg)
        np.testing.assert_array_equal(whole[1::2], want)
        assert (whole[0::2] == 0x5A).all(), "wrote outside the output"


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.uint8])
def test_lc_allgather_integers_torch(dtype):
    """Token ids and the like: gathered bit for bit, strided input included."""
    xs = [torch.from_numpy(x).reshape(-1, 8) for x in int_inputs(26, 8 * 1000, INT_DTYPES[dtype])]

    def rank_main(g):
        x = xs[g.rank].cuda()
        out = torch.full((WORLD * 1000, 8), 0x5A, dtype=dtype, device="cuda")
        symm.lc_allgather(g, x, out=out)
        strided = symm.lc_allgather(g, x.t().contiguous().t())
        torch.cuda.current_stream().synchronize()
        return out.cpu(), strided.cpu()

    want = torch.cat(xs)
    for out, strided in on_ranks(rank_main):
        assert torch.equal(out, want)
        assert torch.equal(strided, want)


def test_integers_refused_by_the_rmsnorm_on_cuda():
    def rank_main(g):
        x = torch.ones((2, 8), dtype=torch.int32, device="cuda")
        with pytest.raises(symm.SymmInvalidArgument, match="all_reduce_rmsnorm takes f32, bf16 or f16"):
            symm.all_reduce_rmsnorm(g, x, x.clone(), torch.ones(8, dtype=torch.int32, device="cuda"))

    on_ranks(rank_main)


# One-shot rows split over blocks (1x4096 two ways, 16x8192 four, 7x8200
# unevenly, 2x131072 eight ways past the registers) and whole (5x36).
@pytest.mark.parametrize("algorithm", [None, "one_shot", "two_shot"])
@pytest.mark.parametrize(
    "tokens,hidden", [(1, 4096), (16, 8192), (5, 36), (3, 20480), (7, 8200), (2, 131072), (300, 5000)]
)
def test_all_reduce_rmsnorm_torch(algorithm, tokens, hidden):
    dtype, eps = torch.bfloat16, 1e-6
    xs = inputs(21, (tokens, hidden), dtype)
    residual, weight = inputs(22, (tokens, hidden), dtype)[0], inputs(23, (hidden,), dtype)[0]
    s = sum(x.double() for x in xs).to(dtype).double()
    r = (s + residual.double()).to(dtype).double()
    want = r / torch.sqrt((r * r).mean(-1, keepdim=True) + eps) * weight.double()

    def rank_main(g):
        res = residual.cuda()
        out, ro = symm.all_reduce_rmsnorm(g, xs[g.rank].cuda(), res, weight.cuda(), eps, algorithm=algorithm)
        torch.cuda.current_stream().synchronize()
        return out, ro

    for out, ro in on_ranks(rank_main):
        assert_close(ro, r, {dtype: 2e-2})
        assert_close(out, want, {dtype: 2e-2})


def test_a_graph_captured_before_the_buffers_grow_replays_correctly():
    """Larger calls after a capture grow the all-reduce buffer and the
    workspace; the buffers the graph captured stay mapped (until the group
    is destroyed), so its replays still compute right."""
    small = 4096
    xs = inputs(31, (3 << 20,), torch.float32)  # the large all-reduce grows its buffer
    shards, big_shards = inputs(32, (64, 256), torch.float32), inputs(33, (4096, 256), torch.float32)
    b = inputs(34, (256, 128), torch.float32)[0]

    def rank_main(g):
        s = torch.cuda.current_stream()
        x, shard, bd = xs[g.rank][:small].cuda(), shards[g.rank].cuda(), b.cuda()
        out, mm = torch.empty_like(x), torch.empty(64 * WORLD, 128, device="cuda")

        def calls():
            symm.all_reduce(g, x, out=out, stream=s)
            symm.fused_ag_mm(g, shard, bd, 0, out=mm, algorithm="pipelined", stream=s)

        calls()  # sizes the buffers for these calls outside the capture
        s.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=s, capture_error_mode="thread_local"):
            calls()
        big_out = symm.all_reduce(g, xs[g.rank].cuda(), stream=s)
        big_mm = symm.fused_ag_mm(g, big_shards[g.rank].cuda(), bd, 0, algorithm="pipelined", stream=s)
        got = []
        for k in range(2):
            x.copy_(xs[g.rank][:small].cuda() * (k + 1))
            shard.copy_(shards[g.rank].cuda() * (k + 1))
            out.fill_(float("nan"))
            mm.fill_(float("nan"))
            graph.replay()
            s.synchronize()
            got.append((out.cpu(), mm.cpu()))
        g.check_async_error()
        return got, big_out.cpu(), big_mm.cpu()

    ref = sum(x.double() for x in xs)
    gathered = torch.cat(shards).double()
    for got, big_out, big_mm in on_ranks(rank_main):
        assert_close(big_out, ref)
        assert_close(big_mm, torch.cat(big_shards).double() @ b.double())
        for k, (out, mm) in enumerate(got):
            assert_close(out, ref[:small] * (k + 1))
            assert_close(mm, gathered * (k + 1) @ b.double())


def test_all_reduce_captured_in_a_cuda_graph():
    n = 8192
    xs = inputs(24, (n,), torch.bfloat16)

    def rank_main(g):
        # A stream of this rank's own: torch's default capture stream is one
        # for the process, and the ranks here are threads.
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):
            x = xs[g.rank].cuda()
            out = torch.empty_like(x)
            symm.all_reduce(g, x, out=out, stream=s)  # sizes the all-reduce buffer outside the capture
            s.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=s, capture_error_mode="thread_local"):
                symm.all_reduce(g, x, out=out, stream=s)
            got = []
            for k in range(3):
                x.copy_(xs[g.rank].cuda() * (k + 1))
                out.fill_(float("nan"))
                graph.replay()
                s.synchronize()
                got.append(out.clone())
        g.check_async_error()
        return got

    ref = sum(x.double() for x in xs)
    for got in on_ranks(rank_main):
        for k, out in enumerate(got):
            assert_close(out, ref * (k + 1))
