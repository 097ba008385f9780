"""How a matmul's time grows with its rows, one GPU, nothing else running:
what the cost model's split cost must follow (a pipelined path multiplies
pieces of the rows; where a piece leaves the last wave of tiles part
empty, the pieces cost more than the whole).

    python3 bench/probes/matmul_rows_probe.py [--device 0] [--kn 14336x7168,...] [--out rows.json]

For each B of k x n (bf16, as the operations' weights: [n, k] transposed)
and each row count, the median ms of replays of a CUDA graph of
--calls matmuls: symm's own (a world-1 group's fused_ag_mm: its local
matmul after staging A, a copy) and torch.matmul. Writes one JSON row per
(k, n, rows); run it with SYMM_GEMM_TUNE=0 too to see what timing
cuBLASLt's candidates gains."""
import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python"))
import symm  # noqa: E402

KN = "14336x7168,7168x4480,8192x14336,14336x8192,4096x11008,2048x4096,5120x3072,8192x1024"
ROWS = list(range(64, 4097, 64)) + list(range(4608, 16385, 512))


def replay_ms(fn, calls, reps, settle=0.0):
    """Median ms per call of `reps` replays of a graph of `calls` calls,
    `settle` seconds after a first call (which may time cuBLASLt's
    candidates: dozens of launches that leave the GPU at its power cap,
    slowing whatever is timed next by up to 10-20% on large matmuls)."""
    fn()
    torch.cuda.synchronize()
    time.sleep(settle)
    graph = torch.cuda.CUDAGraph()
    # thread_local: symm's host-side calls beside the capture are legal.
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        for _ in range(calls):
            fn()
    graph.replay()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", type=int, default=0)
    ap.add_argument("--kn", default=KN)
    ap.add_argument("--rows", default=None, help="comma-separated row counts (default: 64..4096 by 64, then by 512)")
    ap.add_argument("--calls", type=int, default=5)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--settle", type=float, default=0.0, help="seconds idle after each shape's first call")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.cuda.set_device(args.device)
    (g,) = symm.local_groups(1, devices=[args.device])
    rows = [int(r) for r in args.rows.split(",")] if args.rows else ROWS
    out = []
    for kn in args.kn.split(","):
        k, n = (int(x) for x in kn.split("x"))
        w = (torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5).t()
        a_all = torch.randn(max(rows), k, device="cuda", dtype=torch.bfloat16)
        c_all = torch.empty(max(rows), n, device="cuda", dtype=torch.bfloat16)
        for m in rows:
            a, c = a_all[:m], c_all[:m]
            # On the stream current at the call: the capture's, while capturing.
            mine = lambda: symm.fused_ag_mm(g, a, [w], 0, out=[c], stream=torch.cuda.current_stream().cuda_stream)  # noqa: E731
            symm_ms = replay_ms(mine, args.calls, args.reps, args.settle)
            torch_ms = replay_ms(lambda: torch.matmul(a, w, out=c), args.calls, args.reps, args.settle)
            row = {"k": k, "n": n, "rows": m, "symm_ms": symm_ms, "torch_ms": torch_ms,
                   "gemm_tune": os.environ.get("SYMM_GEMM_TUNE", "1") != "0",
                   "symm_tflops": 2 * m * k * n / symm_ms / 1e9}
            out.append(row)
            print(json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": out}, f, indent=1)


if __name__ == "__main__":
    main()
