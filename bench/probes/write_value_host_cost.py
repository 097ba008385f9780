"""Host time of enqueueing a stream memory operation (cuStreamWriteValue32)
against a kernel launch and an event record + wait, on one GPU: what a
signal by store costs the calling thread (eager calls enqueue their pieces
while the GPU runs the earlier ones).

    python3 bench/probes/write_value_host_cost.py
"""
import ctypes
import time

import torch

cuda = ctypes.CDLL("libcuda.so.1")
write = cuda.cuStreamWriteValue32_v2
write.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
write.restype = ctypes.c_int

flag = torch.zeros(64, dtype=torch.int32, device="cuda")
x = torch.zeros(16, device="cuda")
stream = torch.cuda.current_stream()
other = torch.cuda.Stream()
n = 2000


def per_call_us(f):
    f()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        f()
    host = (time.perf_counter() - t) / n * 1e6
    torch.cuda.synchronize()
    return host


def write_value():
    r = write(stream.cuda_stream, flag.data_ptr(), 1, 0)
    assert r == 0, r


def event_hop():
    e = torch.cuda.Event()
    e.record(stream)
    other.wait_event(e)


print(f"cuStreamWriteValue32: {per_call_us(write_value):.2f} us per call on the host")
print(f"kernel launch (x.add_(1)): {per_call_us(lambda: x.add_(1)):.2f} us")
print(f"event record + wait: {per_call_us(event_hop):.2f} us")
