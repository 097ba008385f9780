"""Can the decode layer hide its gather and reduce-scatter behind the
weights' read? One GPU, cuBLAS via torch, graph-replayed; the gather and
the reduce-scatter (latency-bound kernels that leave HBM idle) are
modelled by `torch.cuda._sleep` for as long as they take.

1. While the gather runs, a side stream reads the start of the first
   matmul's weights into L2 (by K: the first K columns of every row of the
   nn.Linear weight, which every CTA of a one-wave matmul reads first; or
   by N: the first rows). Does the matmul behind it then finish sooner?
2. The second matmul split by its output's columns (the weight's rows) in
   two, so that the first half's reduce-scatter overlaps the second half:
   what does the split cost, and what does it save?

Each call reads a different copy of the weights (copies enough to exceed
L2), as a model's layers do.

    python3 bench/probes/l2_prefetch_probe.py [--m 64 --hidden 8192 --ffn 14336]
"""
import argparse
import statistics

import torch

COPIES = 4


def replayed(fn, calls, iters):
    """Median ms per call of replays of a CUDA graph of `calls` calls of
    `fn(i)`."""
    side = torch.cuda.Stream()
    for i in range(calls):
        fn(i, side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i, side)
    for _ in range(3):
        graph.replay()
    times = []
    for _ in range(iters):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return statistics.median(times)


def cycles_for(us):
    """`_sleep` cycles that take about `us` microseconds (calibrated)."""
    probe = 100_000
    ms = replayed(lambda i, s: torch.cuda._sleep(probe), 8, 10)
    return int(probe * us / (ms * 1e3))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--m", type=int, default=64)
    p.add_argument("--hidden", type=int, default=8192)
    p.add_argument("--ffn", type=int, default=14336, help="per rank")
    p.add_argument("--gather-us", type=float, default=7.0)
    p.add_argument("--rs-us", type=float, default=9.0)
    p.add_argument("--rs-half-us", type=float, default=7.0)
    p.add_argument("--iters", type=int, default=30)
    args = p.parse_args()
    m, hid, ffn = args.m, args.hidden, args.ffn
    torch.manual_seed(0)
    bf16 = torch.bfloat16
    print(f"{torch.cuda.get_device_name()}: L2 {torch.cuda.get_device_properties(0).L2_cache_size >> 20} MiB;"
          f" M {m}, hidden {hid}, ffn per rank {ffn}")
    x = torch.randn(m, hid, device="cuda", dtype=bf16)
    h = torch.randn(m, ffn, device="cuda", dtype=bf16)
    w1 = [torch.randn(ffn, hid, device="cuda", dtype=bf16) / hid**0.5 for _ in range(COPIES)]  # x @ w1.t()
    w2 = [torch.randn(hid, ffn, device="cuda", dtype=bf16) / ffn**0.5 for _ in range(COPIES)]  # h @ w2.t()
    y, out = torch.empty(m, ffn, device="cuda", dtype=bf16), torch.empty(m, hid, device="cuda", dtype=bf16)
    halves = [torch.empty(m, hid // 2, device="cuda", dtype=bf16) for _ in range(2)]
    sink = torch.empty(max(ffn, hid), device="cuda", dtype=bf16)
    gather, rs, rs_half = cycles_for(args.gather_us), cycles_for(args.rs_us), cycles_for(args.rs_half_us)
    w1_bytes = ffn * hid * 2

    def read(w):
        torch.amax(w, dim=1, out=sink[: w.shape[0]])

    def mm1(i, side, region=None, join=True):
        main = torch.cuda.current_stream()
        if region is not None:
            side.wait_stream(main)
            with torch.cuda.stream(side):
                read(region(w1[i % COPIES]))
        torch.cuda._sleep(gather)
        if region is not None and join:
            main.wait_stream(side)
        torch.mm(x, w1[i % COPIES].t(), out=y)
        if region is not None and not join:
            main.wait_stream(side)

    rows = []
    base = replayed(lambda i, s: mm1(i, s), COPIES * 2, args.iters)
    alone = replayed(lambda i, s: torch.mm(x, w1[i % COPIES].t(), out=y), COPIES * 2, args.iters)
    rows.append(("mm1 alone", alone, None))
    rows.append(("gather then mm1", base, None))
    for frac in (1 / 16, 1 / 8, 3 / 16, 1 / 4):
        k0, n0 = int(hid * frac) // 64 * 64, int(ffn * frac) // 64 * 64
        by_k = lambda w, k0=k0: w[:, :k0]
        by_n = lambda w, n0=n0: w[:n0]
        read_ms = replayed(lambda i, s: read(by_k(w1[i % COPIES])), COPIES * 2, args.iters)
        rows.append((f"read {frac:.3f} of W1 by K alone", read_ms, frac * w1_bytes / (read_ms * 1e6)))
        for name, region in (("K", by_k), ("N", by_n)):
            t = replayed(lambda i, s: mm1(i, s, region), COPIES * 2, args.iters)
            rows.append((f"gather || read {frac:.3f} by {name}, then mm1", t, None))
        t = replayed(lambda i, s: mm1(i, s, by_k, join=False), COPIES * 2, args.iters)
        rows.append((f"gather || read {frac:.3f} by K, mm1 not waiting", t, None))

    def mm2(i, side, split):
        w, main = w2[i % COPIES], torch.cuda.current_stream()
        if not split:
            torch.mm(h, w.t(), out=out)
            torch.cuda._sleep(rs)
            return
        torch.mm(h, w[: hid // 2].t(), out=halves[0])
        side.wait_stream(main)
        with torch.cuda.stream(side):
            torch.cuda._sleep(rs_half)
        torch.mm(h, w[hid // 2:].t(), out=halves[1])
        torch.cuda._sleep(rs_half)
        main.wait_stream(side)

    rows.append(("mm2 alone", replayed(lambda i, s: torch.mm(h, w2[i % COPIES].t(), out=out), COPIES * 2,
                                      args.iters), None))
    rows.append(("mm2 halves alone", replayed(lambda i, s: [torch.mm(h, w2[i % COPIES][j * hid // 2:(j + 1) * hid // 2].t(),
                                                                     out=halves[j]) for j in range(2)],
                                              COPIES * 2, args.iters), None))
    rows.append(("mm2 then rs", replayed(lambda i, s: mm2(i, s, False), COPIES * 2, args.iters), None))
    rows.append(("mm2 halves, rs of the first overlapping", replayed(lambda i, s: mm2(i, s, True), COPIES * 2, args.iters),
                 None))
    for name, ms, gbps in rows:
        print(f"{name:48s} {ms * 1e3:8.2f} us" + (f"  ({gbps:.0f} GB/s)" if gbps else ""))


if __name__ == "__main__":
    main()
