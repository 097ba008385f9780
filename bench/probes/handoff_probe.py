"""How long does the GPU take to hand work between its SMs and its copy
engines? A kernel, then a pull of 2 MiB from the other GPU (a copy
engine), then a kernel, on GPU 0, the hand-offs made four ways:

  stream    all three on one stream;
  events    the copy on a second stream, forked and joined by events (as
            symm's pipelined paths fork their pulls);
  memops    the same streams, but the fork and the join made by
            cuStreamWriteValue32 / cuStreamWaitValue32 on flags in device
            memory instead of events.
The first kernel spins ~0.2 ms, so that the host has issued the rest
before it ends: the gaps are the GPU's, not the host's issue time.

From torch.profiler (CUPTI): the gaps from the first kernel's end to the
copy's start and from the copy's end to the second kernel's start,
medians over the repetitions, in us. Needs two GPUs with peer access.

    python3 bench/probes/handoff_probe.py [--reps 30]
"""
import argparse
import ctypes
import statistics

import torch
from torch.profiler import ProfilerActivity, profile

cuda = ctypes.CDLL("libcuda.so.1")
write_value = cuda.cuStreamWriteValue32_v2
write_value.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
wait_value = cuda.cuStreamWaitValue32_v2
wait_value.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
WAIT_GEQ = 0x0  # CU_STREAM_WAIT_VALUE_GEQ


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--mib", type=int, default=2)
    args = p.parse_args()
    assert torch.cuda.device_count() >= 2, "needs two GPUs"
    torch.cuda.set_device(0)
    n = args.mib << 20
    src = torch.randn(n // 2, device="cuda:1", dtype=torch.bfloat16)
    dst = torch.empty(n // 2, device="cuda:0", dtype=torch.bfloat16)
    x = torch.zeros(1024, device="cuda:0")
    flags = torch.zeros(64, dtype=torch.int32, device="cuda:0")
    main_s, side = torch.cuda.current_stream(), torch.cuda.Stream()
    count = [0]

    def k1():
        torch.cuda._sleep(400_000)

    def k2():
        x.add_(1)

    def stream():
        k1()
        dst.copy_(src, non_blocking=True)
        k2()

    def events():
        k1()
        side.wait_stream(main_s)
        with torch.cuda.stream(side):
            dst.copy_(src, non_blocking=True)
        main_s.wait_stream(side)
        k2()

    def memops():
        count[0] += 1
        v = count[0]
        k1()
        assert write_value(main_s.cuda_stream, flags.data_ptr(), v, 0) == 0
        assert wait_value(side.cuda_stream, flags.data_ptr(), v, WAIT_GEQ) == 0
        with torch.cuda.stream(side):
            dst.copy_(src, non_blocking=True)
        assert write_value(side.cuda_stream, flags.data_ptr() + 4, v, 0) == 0
        assert wait_value(main_s.cuda_stream, flags.data_ptr() + 4, v, WAIT_GEQ) == 0
        k2()

    variants = {"stream": stream, "events": events, "memops": memops}
    for name, fn in variants.items():
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(args.reps):
                fn()
                torch.cuda.synchronize()
        ev = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                    key=lambda e: e.time_range.start)
        to_copy, from_copy, copy = [], [], []
        for i, e in enumerate(ev):
            if "emcpy" not in e.name or i == 0 or i + 1 >= len(ev):
                continue
            before, after = ev[i - 1], ev[i + 1]
            to_copy.append((e.time_range.start - before.time_range.end))
            from_copy.append((after.time_range.start - e.time_range.end))
            copy.append(e.time_range.elapsed_us())
        med = lambda v: statistics.median(v) if v else float("nan")
        print(f"{name:7s} kernel end -> copy start {med(to_copy):6.1f} us, copy {med(copy):6.1f} us, "
              f"copy end -> kernel start {med(from_copy):6.1f} us  ({len(copy)} copies; "
              f"names: {sorted({e.name[:40] for e in ev})})", flush=True)


if __name__ == "__main__":
    main()
