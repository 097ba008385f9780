"""Times decode_gemm_probe.cu's matmul against torch.matmul (cuBLAS) and a
pure read of the weights, at decode sizes, on one GPU; checks every result
against float64 first (outputs poisoned with NaN, so unwritten elements
show).

Each call reads a different copy of the weights (copies enough to exceed
L2), as a model's layers do. Implementations are interleaved round-robin
(sustained matmuls run at the power cap), and each time is the median
over rounds of the mean of a burst of calls between two events.

    python3 bench/probes/decode_gemm_probe.py [--boxes 2]
    python3 bench/probes/decode_gemm_probe.py --trace   # per-CTA timeline
    python3 bench/probes/decode_gemm_probe.py --debug   # where wrong elements lie
"""
import argparse
import ctypes
import os
import statistics
import subprocess
import sys
import tempfile

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
SHAPES = [  # (N, K): a Linear weight of N outputs over K inputs
    (14336, 8192), (8192, 14336), (7168, 4096), (4096, 7168), (28672, 8192), (5000, 3000),
]
MS = [1, 8, 16, 33, 64]
COLD_BYTES = 512 << 20


def build():
    so = os.path.join(tempfile.mkdtemp(), "decode_gemm_probe.so")
    subprocess.run(["nvcc", "-O3", "-gencode=arch=compute_90a,code=sm_90a", "-shared", "-Xcompiler", "-fPIC", "-lineinfo",
                    os.path.join(HERE, "decode_gemm_probe.cu"), "-lcuda", "-o", so], check=True)
    lib = ctypes.CDLL(so)
    ll, i, p = ctypes.c_longlong, ctypes.c_int, ctypes.c_void_p
    lib.probe_decode_gemm.argtypes = [i, p, ll, p, ll, p, ll, i, i, i, p, p, i, p, i, p]
    lib.probe_read.argtypes = [p, ll, p, i, i, p]
    lib.probe_partials_bytes.restype = ll
    lib.probe_partials_bytes.argtypes = [i]
    return lib


def within(out, ref, bound, dtype):
    """Every element within its rounding to `dtype` (half an ulp, doubled)
    plus 1e-4 of the sum of its terms' magnitudes (f32 accumulation): a
    unit of k summed twice or missed is ~1e-3 of that sum, and |ref| is
    ~sqrt(k) times smaller than the sum on random data."""
    ulp = 2.0 ** -8 if dtype == torch.bfloat16 else 2.0 ** -11
    return bool(((out.double() - ref).abs() <= ulp * ref.abs() + 1e-4 * bound).all())


def timed(fn, calls):
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for c in range(calls):
        fn(c)
    e.record()
    e.synchronize()
    return s.elapsed_time(e) / calls


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--grids", default="1,2", help="CTAs per SM to try")
    ap.add_argument("--ncu", action="store_true", help="one call each of M 1 and 64 at 14336 x 8192, for a profiler")
    ap.add_argument("--boxes", type=int, default=1, help="boxes of 64 k per pipeline stage (1 or 2)")
    ap.add_argument("--trace", action="store_true", help="per-CTA timeline of a few calls (globaltimer)")
    ap.add_argument("--debug", action="store_true", help="where the wrong elements of a few calls lie")
    args = ap.parse_args()
    lib = build()
    dev = torch.cuda.current_device()
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    grids = [sms * int(x) for x in args.grids.split(",")]
    stream = torch.cuda.current_stream().cuda_stream
    partials = torch.empty(lib.probe_partials_bytes(max(grids)) // 4, device="cuda", dtype=torch.float32)
    sink = torch.zeros(1, device="cuda", dtype=torch.int32)
    if args.debug:
        n, k = 8192, 14336
        counters = torch.zeros(n // 128, device="cuda", dtype=torch.int32)
        w = torch.randn(n, k, device="cuda", dtype=torch.float16) / k ** 0.5
        for m in (1, 8, 16, 33, 64):
            a = torch.randn(m, k, device="cuda", dtype=torch.float16)
            ref = a.double() @ w.double().t()
            bound = a.double().abs() @ w.double().abs().t()
            outs = []
            for rep in range(12):
                out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.float16)
                lib.probe_decode_gemm(1, a.data_ptr(), k, w.data_ptr(), k, out.data_ptr(), n, m, n, k,
                                      partials.data_ptr(), counters.data_ptr(), grids[0], stream, args.boxes, None)
                torch.cuda.synchronize()
                outs.append(out)
                err = (out.double() - ref).abs() / bound
                bad = (err > 1e-3).nonzero()
                cols = sorted(set(bad[:, 1].tolist()))
                if len(bad) or rep == 11:
                    print(f"m {m} rep {rep}: max err {err.max().item():.2e}, {len(bad)} bad elements, rows "
                          f"{sorted(set(bad[:, 0].tolist()))[:8]}, cols {cols[:12]}..., slices "
                          f"{sorted(set(c // 256 for c in cols))}, same as rep 0: {torch.equal(out, outs[0])}")
        return
    if args.trace:
        n, k = 14336, 8192
        counters = torch.zeros(n // 128, device="cuda", dtype=torch.int32)
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
        trace = torch.zeros(3 * grids[0], device="cuda", dtype=torch.int64)
        for m in (1, 16, 64):
            a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
            for rep in range(6):
                lib.probe_decode_gemm(0, a.data_ptr(), k, ws[rep % 3].data_ptr(), k, out.data_ptr(), n, m, n, k,
                                      partials.data_ptr(), counters.data_ptr(), grids[0], stream, args.boxes,
                                      trace.data_ptr())
                torch.cuda.synchronize()
                t = (trace.view(-1, 3) - trace.view(-1, 3)[:, 0].min()).double() / 1e3
                start, loop, end = t[:, 0], t[:, 1] - t[:, 0], t[:, 2]
                q = lambda x: f"{x.min().item():6.1f} {x.median().item():6.1f} {x.max().item():6.1f}"
                print(f"m {m:2} rep {rep}: span {end.max().item():6.1f} us; start skew {start.max().item():5.1f}; "
                      f"units min/med/max {q(loop)}; tail after last loop end "
                      f"{(end.max() - (t[:, 1]).max()).item():5.1f}; GB/s over span "
                      f"{n * k * 2 / end.max().item() / 1e3:6.0f}")
        return
    if args.ncu:
        w = torch.randn(14336, 8192, device="cuda", dtype=torch.bfloat16)
        counters = torch.zeros(112, device="cuda", dtype=torch.int32)
        for m in (1, 64):
            a = torch.randn(m, 8192, device="cuda", dtype=torch.bfloat16)
            out = torch.empty(m, 14336, device="cuda", dtype=torch.bfloat16)
            for _ in range(2):
                lib.probe_decode_gemm(0, a.data_ptr(), 8192, w.data_ptr(), 8192, out.data_ptr(), 14336, m, 14336,
                                      8192, partials.data_ptr(), counters.data_ptr(), grids[0], stream, args.boxes, None)
            torch.matmul(a, w.t())
        torch.cuda.synchronize()
        return
    print(f"# {torch.cuda.get_device_name(dev)}, {sms} SMs, torch {torch.__version__}")
    print("dtype  M      N      K  copies  read_us  cublas_us  ours_us(grid)  best_grid  ours/cublas  "
          "ours/read  TB/s(ours)  TB/s(cublas)  TB/s(read)  max_err")
    worst = 0.0
    for dtype, tdt in ((0, torch.bfloat16), (1, torch.float16)):
        for n, k in SHAPES:
            wbytes = n * k * 2
            copies = max(2, -(-COLD_BYTES // wbytes))
            ws = [torch.randn(n, k, device="cuda", dtype=tdt) / k ** 0.5 for _ in range(copies)]
            counters = torch.zeros(-(-n // 128), device="cuda", dtype=torch.int32)
            for m in MS:
                if dtype == 1 and m not in (16, 64):
                    continue
                a = torch.randn(m, k, device="cuda", dtype=tdt)
                out = torch.empty(m, n, device="cuda", dtype=tdt)

                def ours(c, grid):
                    w = ws[c % copies]
                    rc = lib.probe_decode_gemm(dtype, a.data_ptr(), k, w.data_ptr(), k, out.data_ptr(), n, m, n, k,
                                               partials.data_ptr(), counters.data_ptr(), grid, stream, args.boxes, None)
                    assert rc == 0, rc

                # Correctness at every grid, twice (the counters must reset).
                case_err = 0.0
                for grid in grids:
                    for c in range(2):
                        out.fill_(float("nan"))
                        ours(c, grid)
                        ref = a.double() @ ws[c % copies].double().t()
                        bound = a.double().abs() @ ws[c % copies].double().abs().t()
                        err = ((out.double() - ref).abs() / bound.clamp_min(1e-30)).max().item()
                        if not within(out, ref, bound, tdt):
                            print(f"FAIL dtype {dtype} m {m} n {n} k {k} grid {grid}: rel err {err}")
                            sys.exit(1)
                        case_err = max(case_err, err)
                worst = max(worst, case_err)
                fns = {"read": lambda c: lib.probe_read(ws[c % copies].data_ptr(), wbytes, sink.data_ptr(),
                                                        sms * 4, 512, stream),
                       "cublas": lambda c: torch.matmul(a, ws[c % copies].t(), out=out)}
                for grid in grids:
                    fns[grid] = lambda c, grid=grid: ours(c, grid)
                times = {name: [] for name in fns}
                for fn in fns.values():
                    timed(fn, 3)
                for _ in range(args.rounds):
                    for name, fn in fns.items():
                        times[name].append(timed(fn, args.calls))
                med = {name: statistics.median(v) * 1e3 for name, v in times.items()}
                best = min(grids, key=lambda g: med[g])
                moved = (n * k + m * k + m * n) * 2
                tb = lambda us: moved / us / 1e6
                print(f"{'bf16' if dtype == 0 else 'f16':5} {m:2} {n:6} {k:6} {copies:6} {med['read']:8.1f} "
                      f"{med['cublas']:10.1f}  " + "/".join(f"{med[g]:.1f}" for g in grids) +
                      f"  {best // sms:9}  {med[best] / med['cublas']:11.3f}  {med[best] / med['read']:9.3f}  "
                      f"{tb(med[best]):10.2f}  {tb(med['cublas']):12.2f}  {wbytes / med['read'] / 1e6:10.2f}  {case_err:.2e}",
                      flush=True)
            ws.clear()
    print(f"PASS: every element within its rounding plus 1e-4 of the sum of |a||w| of float64; "
          f"worst {worst:.2e} of that sum")


if __name__ == "__main__":
    main()
