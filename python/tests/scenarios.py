"""Per-rank test bodies shared by the thread tests (local groups) and the
multi-process tests (rank_worker.py): the same checks over every bootstrap.
Each takes this rank's Group and raises on failure."""

import os
import time

import numpy as np
import pytest

import symm

N = 4096  # uint32 elements per rank


def exchange(group, rounds=3):
    """Every rank writes its slot of every peer's buffer through peer arrays;
    after a barrier each rank sees all slots, in several rounds."""
    rank, world = group.rank, group.world_size
    part = N // world
    with group.create(N * 4) as buf:
        mine = buf.array(np.uint32)
        assert not mine.any(), "fresh symmetric memory is zeroed"  # checked before peers can write
        h = buf.rendezvous()
        assert h.peer_ptr(rank) == buf.ptr
        for rnd in range(rounds):
            for p in range(world):
                slot = slice(rank * part, (rank + 1) * part)
                h.peer_array(p, np.uint32)[slot] = (rnd << 24) | (rank << 16) | np.arange(part)
            h.barrier()
            expect = np.concatenate([(rnd << 24) | (r << 16) | np.arange(part) for r in range(world)])
            np.testing.assert_array_equal(mine[: world * part], expect.astype(np.uint32))
            h.barrier()  # nobody writes the next round before all have read
        h.close()


def ring_signals(group, rounds=20):
    """A token passes to rank+1 with a signal on channel 5 and is acknowledged
    on channel 6; the signal pad shows the signal until it is consumed."""
    rank, world = group.rank, group.world_size
    nxt, prev = (rank + 1) % world, (rank - 1) % world
    with group.create(N * 4) as buf, buf.rendezvous() as h:
        mine, peer = h.peer_array(rank, np.uint32), h.peer_array(nxt, np.uint32)
        for rnd in range(1, rounds + 1):
            if rnd > 1:
                h.wait_signal(nxt, channel=6)
            peer[N - 1 - rank] = 1000 * rnd + rank
            h.put_signal(nxt, channel=5)
            h.wait_signal(prev, channel=5)
            assert mine[N - 1 - prev] == 1000 * rnd + prev
            h.put_signal(prev, channel=6)
        h.wait_signal(nxt, channel=6)
        # Only rank 0 -> last rank on channel 7: its slot reads 1 until waited on.
        last = world - 1
        if rank == 0:
            h.put_signal(last, channel=7)
        h.barrier(channel=1)
        pad = h.signal_pad(rank)
        assert pad.shape == (symm.SIGNAL_CHANNELS, world)
        assert pad[7, 0] == (1 if rank == last else 0)
        if rank == last:
            h.wait_signal(0, channel=7)
            assert pad[7, 0] == 0, "waiting consumes the signal"
        h.barrier(channel=1)


def progress_flags(group, rounds=20):
    """Each round, a rank writes a block into rank+1's buffer, then raises a
    flag there with write_value; rank+1 waits for it with wait_value."""
    rank, world = group.rank, group.world_size
    nxt = (rank + 1) % world
    flag = N * 4 - 4  # byte offset of the flag: the buffer's last uint32
    with group.create(N * 4) as buf, buf.rendezvous() as h:
        mine, peer = h.peer_array(rank, np.uint32), h.peer_array(nxt, np.uint32)
        for rnd in range(1, rounds + 1):
            peer[rnd] = rnd * 7 + rank
            h.write_value(nxt, flag, rnd)
            h.wait_value(rank, flag, rnd)
            assert mine[rnd] == rnd * 7 + (rank - 1) % world
        with pytest.raises(symm.SymmInvalidArgument, match="4-byte aligned"):
            h.write_value(nxt, 2, 1)
        h.barrier()


def failed(group, deadline_s=10):
    """The group's failure, waiting for it to reach this rank."""
    deadline = time.monotonic() + deadline_s
    while (failure := group.health()) is None and time.monotonic() < deadline:
        time.sleep(0.001)
    assert failure is not None, "the group did not fail on this rank"
    return failure


def refuses_everything(group, h):
    """A failed group refuses every call until it is closed."""
    for call in (h.barrier, lambda: group.create(64), lambda: group.reserve_workspace(4096)):
        with pytest.raises(symm.SymmAbortedError, match="no longer usable"):
            call()


def wait_value_timeout_fails_the_group(group):
    """A flag that never comes: every rank's wait_value times out (or stops
    when a peer's did, naming it), and the group has failed everywhere."""
    rank = group.rank
    flag = N * 4 - 4
    with group.create(N * 4) as buf, buf.rendezvous() as h:
        h.barrier()
        group.set_timeout(100)
        with pytest.raises((symm.SymmTimeoutError, symm.SymmRemoteError), match="buffer did not reach 1 "):
            h.wait_value(rank, flag, 1)
        assert isinstance(failed(group), (symm.SymmTimeoutError, symm.SymmRemoteError))
        refuses_everything(group, h)


def mismatched_sizes(group):
    """The last rank allocates 8 more bytes: rendezvous fails on every rank."""
    extra = 8 if group.rank == group.world_size - 1 else 0
    with group.create(4096 + extra) as buf:
        with pytest.raises(symm.SymmMismatchError, match="sizes differ") as e:
            buf.rendezvous()
        assert e.value.status_name == "SYMM_ERROR_MISMATCH"


def peer_skips_barrier(group):
    """The last rank never enters a barrier: the others time out naming it."""
    last = group.world_size - 1
    with group.create(64) as buf, buf.rendezvous() as h:
        h.barrier()
        group.set_timeout(300)
        if group.rank != last:
            # The first rank to time out stops the others, who name it.
            with pytest.raises((symm.SymmTimeoutError, symm.SymmRemoteError), match=f"rank {last} did not arrive"):
                h.barrier(channel=2)
        # The group failed on every rank, the absent one included.
        assert f"rank {last} did not arrive" in failed(group).message
        refuses_everything(group, h)


def tensor_ops(group):
    """The three operations on float32, against float64 references; every
    rank builds every rank's inputs from one seed."""
    rank, world = group.rank, group.world_size
    rng = np.random.default_rng(11)
    a = [rng.standard_normal((2 * world, 16)).astype(np.float32) for _ in range(world)]
    b = rng.standard_normal((16, 4)).astype(np.float32)
    full = np.concatenate(a).astype(np.float64)

    ag, out = symm.fused_ag_mm(group, a[rank], b, 0, return_ag=True)
    np.testing.assert_array_equal(ag, full)
    np.testing.assert_allclose(out, full @ b, rtol=1e-5, atol=1e-5)

    total = sum(x.astype(np.float64) @ b for x in a)
    np.testing.assert_allclose(symm.mm_rs(group, a[rank], b, 0), np.split(total, world)[rank], rtol=1e-5, atol=1e-5)

    np.testing.assert_array_equal(symm.lc_allgather(group, a[rank]), full)


def agreed_algorithm(group):
    """Run where every rank has the same SYMM_ALGO (SYMM_TEST_ALGO names
    it, "" for none): the plan query names it (or the cost model's choice)
    on every rank, and mm_rs and fused_ag_mm run with it, also when a call
    forces another algorithm alike on every rank."""
    want = os.environ["SYMM_TEST_ALGO"] or "sequential"  # a tiny call: the cost model's pick
    plans = [group.plan(op, 2 * group.world_size, 16, 4, "f32")["algorithm"] for op in ("ag_mm", "mm_rs")]
    assert plans == [want, want], plans
    tensor_ops(group)
    rank, world = group.rank, group.world_size
    rng = np.random.default_rng(5)
    a = [rng.standard_normal((2 * world, 16)).astype(np.float32) for _ in range(world)]
    b = rng.standard_normal((16, 4)).astype(np.float32)
    total = sum(x.astype(np.float64) @ b for x in a)
    for algorithm in ("sequential", "pipelined"):
        got = symm.mm_rs(group, a[rank], b, 0, algorithm=algorithm)
        np.testing.assert_allclose(got, np.split(total, world)[rank], rtol=1e-5, atol=1e-5)


def all_scenarios(group):
    exchange(group)
    tensor_ops(group)
    ring_signals(group)
    progress_flags(group)
    mismatched_sizes(group)
    peer_skips_barrier(group)  # last: it fails the group


def across_hosts(group):
    """A group whose ranks are on different hosts (SYMM_HOST_ID) forms and
    rendezvouses a symmetric buffer: this rank's own memory is mapped, a
    rank on another host is refused (its memory is not mapped here) for
    pointers and signals, and a barrier is over this host's ranks."""
    me, peer = group.rank, 1 - group.rank
    with group.create(4096) as buf:
        h = buf.rendezvous()
        assert h.peer_ptr(me) == buf.ptr
        for refused in (lambda: h.peer_ptr(peer), lambda: h.signal_pad_ptr(peer), lambda: h.put_signal(peer)):
            try:
                refused()
            except symm.SymmUnsupported as e:
                assert "another host" in str(e), e
            else:
                raise AssertionError("a rank on another host was reached")
        h.barrier()
        import torch

        torch.cuda.synchronize()
        group.check_async_error()


def across_hosts_matmuls(group):
    """fused_ag_mm and mm_rs in a CUDA group spanning (pretend) hosts, with
    torch tensors on this rank's GPU: every gather and scatter dim, two Bs,
    ag_out, sum and avg, strided inputs and outputs, fp8 with row-wise
    scales into bf16 and fp8 outputs, against float64 math on every rank's
    inputs (each rank makes all of them from one seed), outputs poisoned;
    then a call that differs between ranks fails on every rank with
    SymmMismatchError and writes nothing."""
    import torch

    rank, world = group.rank, group.world_size
    torch.cuda.set_device(rank % torch.cuda.device_count())
    dev = torch.device("cuda", torch.cuda.current_device())
    tolerance = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float8_e4m3fn: 2**-3}

    def inputs(seed, shape, dtype=torch.float32):
        g = torch.Generator().manual_seed(seed)
        return [torch.randn(shape, generator=g, dtype=torch.float64).to(dtype) for _ in range(world)]

    def f64(t):
        return t.detach().to("cpu", torch.float64)

    def close(got, ref, what):
        tol = tolerance[got.dtype]
        assert list(got.shape) == list(ref.shape), f"{what}: shape {list(got.shape)}, expected {list(ref.shape)}"
        err = (f64(got) - ref).abs().max() / ref.abs().max().clamp_min(1e-30)
        assert err <= tol, f"{what}: relative error {err:.2e} (tolerance {tol:.0e})"

    def poisoned(shape, dtype=torch.float32, strided=False):
        # Strided: every row of a tensor twice as wide.
        wide = torch.full((*shape[:-1], 2 * shape[-1]), float("nan"), device=dev).to(dtype)
        return wide[..., : shape[-1]] if strided else wide[..., : shape[-1]].contiguous()

    for dtype in (torch.float32, torch.bfloat16):
        for gd in (0, 1, 2):
            shards = inputs(1, (2, 3, 16), dtype)
            k = 16 * world if gd == 2 else 16
            bs = [inputs(2 + i, (k, n), dtype) for i, n in enumerate((8, 24))]
            full = torch.cat([f64(a) for a in shards], gd)
            gathered = list(shards[0].shape)
            gathered[gd] *= world
            a = torch.cat([shards[rank], shards[rank]], -1).to(dev)[..., :16]  # strided
            outs = [poisoned([*gathered[:-1], b[0].shape[1]], dtype, strided=True) for b in bs]
            ag = poisoned(gathered, dtype)
            symm.fused_ag_mm(group, a, [b[rank].to(dev) for b in bs], gd, out=outs, ag_out=ag)
            torch.cuda.synchronize()
            assert torch.equal(f64(ag), full), f"fused_ag_mm {dtype} gather_dim {gd}: ag_out"
            for out, b in zip(outs, bs):
                close(out, full @ f64(b[rank]), f"fused_ag_mm {dtype} gather_dim {gd}")

        a = inputs(3, (2 * world, 3 * world, 16), dtype)
        b = inputs(4, (16, 8 * world), dtype)
        total = sum(f64(x) @ f64(y) for x, y in zip(a, b))
        for sd in (0, 1, 2):
            for op in ("sum", "avg"):
                shape = list(total.shape)
                shape[sd] //= world
                out = poisoned(shape, dtype, strided=True)
                symm.mm_rs(group, a[rank].to(dev), b[rank].to(dev), sd, op=op, out=out)
                torch.cuda.synchronize()
                ref = total.chunk(world, dim=sd)[rank] / (world if op == "avg" else 1)
                close(out, ref, f"mm_rs {dtype} scatter_dim {sd} {op}")

    # Compute-bound shards and chunks (512 rows of bf16): fused_ag_mm splits
    # its matmul to overlap the gather across hosts.
    shards = inputs(20, (512, 64), torch.bfloat16)
    (b,) = inputs(21, (64, 40), torch.bfloat16)[:1]
    out = symm.fused_ag_mm(group, shards[rank].to(dev), b.to(dev), 0)
    torch.cuda.synchronize()
    close(out, torch.cat([f64(x) for x in shards]) @ f64(b), "fused_ag_mm overlapped")
    a, b = inputs(22, (512 * world, 64), torch.bfloat16), inputs(23, (64, 40), torch.bfloat16)
    out = symm.mm_rs(group, a[rank].to(dev), b[rank].to(dev), 0)
    torch.cuda.synchronize()
    total = sum(f64(x) @ f64(y) for x, y in zip(a, b))
    close(out, total.chunk(world)[rank], "mm_rs compute-bound")

    # fp8, row-wise scales.
    m, k, n = 16, 32, 48

    def fp8(seed, shape):
        g = torch.Generator().manual_seed(seed)
        return [(torch.rand(shape, generator=g) * 8 - 4).to(torch.float8_e4m3fn) for _ in range(world)]

    def scales(seed, shape):
        g = torch.Generator().manual_seed(seed)
        return [torch.rand(shape, generator=g) * 1.75 + 0.25 for _ in range(world)]

    w = fp8(10, (n, k))  # row-major [N, K]: B = w.t() is column-major
    bias = inputs(11, (n,), torch.bfloat16)
    a, sa, sb = fp8(12, (m, k)), scales(13, (m, 1)), scales(14, (1, n))
    B = w[rank].to(dev).t()
    out = symm.fused_ag_mm(group, a[rank].to(dev), [B], 0, a_scale=sa[rank].to(dev), b_scales=[sb[rank].to(dev)],
                           biases=[bias[rank].to(dev)], out_dtype=torch.bfloat16)[0]
    torch.cuda.synchronize()
    gathered = torch.cat([f64(x) * f64(s) for x, s in zip(a, sa)])
    close(out, gathered @ (f64(w[rank]).t() * f64(sb[rank])) + f64(bias[rank]), "fused_ag_mm fp8 row-wise")
    a, sa = fp8(15, (world * m, k)), scales(16, (world * m, 1))
    for out_dtype in (torch.bfloat16, torch.float8_e4m3fn):
        got = symm.mm_rs(group, a[rank].to(dev), B, 0, a_scale=sa[rank].to(dev), b_scale=sb[rank].to(dev),
                         bias=bias[rank].to(dev), out_dtype=out_dtype)
        torch.cuda.synchronize()
        total = sum((f64(x) * f64(s)) @ (f64(y).t() * f64(t)) + f64(bb) for x, s, y, t, bb in zip(a, sa, w, sb, bias))
        close(got, total.chunk(world)[rank], f"mm_rs fp8 row-wise into {out_dtype}")

    # A call that differs between ranks: every rank fails, nothing written.
    x = torch.ones((2, 16), device=dev)
    y = torch.ones((16, 8 + 8 * (rank == world - 1)), device=dev)
    out = poisoned([2 * world, y.shape[1]])
    with pytest.raises(symm.SymmMismatchError):
        symm.fused_ag_mm(group, x, [y], 0, out=[out])
    torch.cuda.synchronize()
    assert out.isnan().all()


def across_hosts_collectives(group):
    """all_reduce (sum and avg; bf16, f32 and int32; out of place, in place,
    input and output strided or not, apart and differently between ranks),
    lc_allgather (as laid out) and all_reduce_rmsnorm in a CUDA group spanning
    (pretend) hosts, with torch tensors on this rank's GPU, against float64
    math (exact int64 for int32, the average truncated toward zero) on every
    rank's inputs (each rank makes all of them from one seed), outputs
    poisoned; then a call that differs between ranks fails on every rank
    with SymmMismatchError and writes nothing."""
    import torch

    rank, world = group.rank, group.world_size
    torch.cuda.set_device(rank % torch.cuda.device_count())
    dev = torch.device("cuda", torch.cuda.current_device())
    tolerance = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
    poison = {torch.float32: float("nan"), torch.bfloat16: float("nan"), torch.int32: -(2**31)}

    def inputs(seed, shape, dtype):
        g = torch.Generator().manual_seed(seed)
        if dtype == torch.int32:
            return [torch.randint(-1000, 1000, shape, generator=g, dtype=torch.int32) for _ in range(world)]
        return [torch.randn(shape, generator=g, dtype=torch.float64).to(dtype) for _ in range(world)]

    def f64(t):
        return t.detach().to("cpu", torch.float64)

    def close(got, ref, what):
        assert list(got.shape) == list(ref.shape), f"{what}: shape {list(got.shape)}, expected {list(ref.shape)}"
        if got.dtype == torch.int32:
            assert torch.equal(got.cpu().to(torch.int64), ref.to(torch.int64)), f"{what}: not exact"
            return
        tol = tolerance[got.dtype]
        err = (f64(got) - ref).abs().max() / ref.abs().max().clamp_min(1e-30)
        assert err <= tol, f"{what}: relative error {err:.2e} (tolerance {tol:.0e})"

    def poisoned(shape, dtype, strided=False):
        # Strided: every row of a tensor twice as wide.
        wide = torch.full((*shape[:-1], 2 * shape[-1]), poison[dtype], dtype=dtype, device=dev)
        return wide[..., : shape[-1]] if strided else wide[..., : shape[-1]].contiguous()

    def on_gpu(t, strided):
        # Strided: every row of a tensor twice as wide, read in place.
        t = t.to(dev)
        return torch.cat([t, t], -1)[..., : t.shape[-1]] if strided else t

    # (input strided, output strided): with each rank alone on its host, a
    # contiguous output takes NCCL's result straight, a strided one is
    # staged; the last differs between ranks within one call.
    layouts = ((False, False), (True, True), (True, False), (False, True), (rank % 2 == 0, rank % 2 == 1))

    shape = (6, 40)
    for dtype in (torch.float32, torch.bfloat16, torch.int32):
        xs = inputs(1, shape, dtype)
        if dtype == torch.int32:
            total = sum(x.to(torch.int64) for x in xs)
        else:
            total = sum(f64(x) for x in xs)
        for op in ("sum", "avg"):
            if op == "sum":
                ref = total
            elif dtype == torch.int32:
                ref = torch.div(total, world, rounding_mode="trunc")
            else:
                ref = total / world
            for strided, out_strided in layouts:
                what = f"all_reduce {dtype} {op} strided {strided} out strided {out_strided}"
                out = poisoned(shape, dtype, out_strided)
                got = symm.all_reduce(group, on_gpu(xs[rank], strided), op=op, out=out)
                torch.cuda.synchronize()
                assert got.data_ptr() == out.data_ptr()
                close(out, ref, what)
                x = on_gpu(xs[rank], strided)
                symm.all_reduce(group, x, op=op, inplace=True)
                torch.cuda.synchronize()
                close(x, ref, f"{what} in place")

    for dtype in (torch.float32, torch.bfloat16):
        xs = inputs(2, (3, 24), dtype)
        for strided, out_strided in layouts:
            out = poisoned((3 * world, 24), dtype, out_strided)
            symm.lc_allgather(group, on_gpu(xs[rank], strided), out=out)
            torch.cuda.synchronize()
            want = torch.cat([f64(x) for x in xs])
            assert torch.equal(f64(out), want), f"lc_allgather {dtype} strided {strided} out strided {out_strided}"

        hidden, eps = 64, 1e-6
        xs = inputs(3, (5, hidden), dtype)
        residual, weight = inputs(4, (5, hidden), dtype)[0], inputs(5, (hidden,), dtype)[0]
        r = sum(f64(x) for x in xs) + f64(residual)
        normed = r / (r.pow(2).mean(-1, keepdim=True) + eps).sqrt() * f64(weight)
        for inplace, x_strided in ((False, True), (True, True), (False, False)):
            what = f"all_reduce_rmsnorm {dtype} inplace {inplace} x strided {x_strided}"
            out = poisoned((5, hidden), dtype, strided=x_strided)
            res = residual.to(dev)
            res_out = None if inplace else poisoned((5, hidden), dtype)
            got, got_res = symm.all_reduce_rmsnorm(group, on_gpu(xs[rank], x_strided), res, weight.to(dev), eps=eps,
                                                   out=out, residual_out=res_out, inplace=inplace)
            torch.cuda.synchronize()
            close(got_res, r, f"{what}: residual_out")
            close(got, normed, f"{what}: out")
            if inplace:
                assert got_res.data_ptr() == res.data_ptr()

    # A call that differs between ranks: every rank fails, nothing written.
    x = torch.ones((4, 8 + 8 * (rank == world - 1)), device=dev)
    out = poisoned(list(x.shape), torch.float32)
    with pytest.raises(symm.SymmMismatchError):
        symm.all_reduce(group, x, out=out)
    torch.cuda.synchronize()
    assert out.isnan().all()
