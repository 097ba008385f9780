"""What splitting mm_rs's matmul costs, by how it is split (cuBLAS via
torch, one GPU, nothing else running).

    python3 bench/probes/split_matmul_probe.py [--m 512 --k 14336 --n 8192]

A pipelined mm_rs computes the peers' part of the product first, so that
its transfer overlaps the rest. Split by rows (today's pipelined path),
each part reads all of B; split by columns, each part reads its own
columns of B once, but every part's peer rows still travel after it.
Prints, per split, the parts' time back to back on one stream (median
of --iters replays of a CUDA graph of them) against the whole matmul,
and checks every split's result against the whole product."""
import argparse
import statistics

import torch


def timed(fn, iters):
    """Median ms of replays of a CUDA graph of `fn` (so the parts' launches
    cost what they would in a captured pipeline, not Python's issue time)."""
    fn()  # cuBLAS's workspace and heuristics outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(5):
        graph.replay()
    times = []
    for _ in range(iters):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--m", type=int, default=512)
    p.add_argument("--k", type=int, default=14336)
    p.add_argument("--n", type=int, default=8192)
    p.add_argument("--iters", type=int, default=50)
    args = p.parse_args()
    m, k, n = args.m, args.k, args.n
    torch.manual_seed(0)
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5  # B = weight.t(), K-major
    c = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    whole = a @ weight.t()

    def rows(parts):
        """Row blocks of C, each a contiguous piece of it."""
        step = m // parts
        return (lambda: [torch.matmul(a[i:i + step], weight.t(), out=c[i:i + step]) for i in range(0, m, step)],
                lambda: c, c)

    def cols(widths):
        """Column blocks of C of the given widths (in eighths of N), each
        into a contiguous buffer of its own (cuBLAS through torch writes no
        strided column block)."""
        bounds = [n * sum(widths[:i]) // 8 for i in range(len(widths) + 1)]
        bufs = [torch.empty(m, hi - lo, device="cuda", dtype=torch.bfloat16) for lo, hi in zip(bounds, bounds[1:])]
        return (lambda: [torch.matmul(a, weight[lo:hi].t(), out=o) for lo, hi, o in zip(bounds, bounds[1:], bufs)],
                lambda: torch.cat(bufs, dim=1), bufs)

    base = timed(lambda: torch.matmul(a, weight.t(), out=c), args.iters)
    print(f"whole {m}x{k}x{n}: {base:.4f} ms", flush=True)
    splits = [("rows x2", rows(2)), ("rows x4", rows(4))]
    splits += [(f"cols {':'.join(map(str, w))} (eighths)", cols(w)) for w in ((4, 4), (2, 2, 2, 2), (5, 3), (6, 2), (7, 1))]
    for name, (fn, result, written) in splits:
        for t in written if isinstance(written, list) else [written]:
            t.fill_(float("nan"))
        fn()
        got = result()
        err = ((got.float() - whole.float()).norm() / whole.float().norm()).item()
        assert err < 1e-2, f"{name}: relative error {err}"
        t = timed(fn, args.iters)
        print(f"{name}: {t:.4f} ms ({t / base:.3f} x whole), relerr {err:.1e}", flush=True)


if __name__ == "__main__":
    main()
