"""Where the Python wrapper's host time goes on this machine: the pieces of
reading one CUDA torch tensor, the whole wrapper of a plain fused_ag_mm call
and of a bound one (symm.bind) with the library call stubbed out, and a
torch.matmul for scale. One GPU, a world-1 group.

    PYTHONPATH=python SYMM_LIBRARY=bundle/libsymm.so python3 bench/gpu/python_pieces.py
"""
import sys, timeit, time, statistics
import torch, symm, symm.ops
from symm import _arrays, _tensor
torch.cuda.set_device(0)
g = symm.local_groups(1, backend="cuda")[0]
a = torch.randn(256, 8192, dtype=torch.bfloat16, device="cuda")
w = torch.randn(14336, 8192, dtype=torch.bfloat16, device="cuda").t()
c = torch.empty(256, 14336, dtype=torch.bfloat16, device="cuda")
s = torch.cuda.current_stream().cuda_stream
N = 20000
def t(stmt):
    us = timeit.timeit(stmt, globals=globals(), number=N) / N * 1e6
    print(f"  {stmt:58s} {us:6.2f} us", flush=True)
for stmt in ("_arrays._from_torch(a, s)", "_arrays.view(a, s)", "_tensor.Arg(g, a, 'a', s)",
             "a.data_ptr()", "a.stride()", "tuple(a.shape)", "a.get_device()", "a.is_cuda",
             "torch._C._cuda_getCurrentRawStream(0)", "torch.cuda.current_stream().cuda_stream"):
    t(stmt)
class Stub:
    def __init__(self, lib): self.lib = lib
    def __getattr__(self, n):
        f = getattr(self.lib, n)
        if n in ("symm_fused_ag_mm", "symm_mm_rs"):
            return lambda *args: 0
        return f
real = symm.ops.lib
symm.ops.lib = Stub(real)
def ag(): symm.fused_ag_mm(g, a, [w], gather_dim=0, out=[c], stream=s)
t("ag()  # whole wrapper, library call stubbed")
bound = symm.bind(symm.fused_ag_mm, g, a, [w], gather_dim=0, out=[c], stream=s)
t("bound()  # bound call, library call stubbed")
mm_out = torch.empty(256, 14336, dtype=torch.bfloat16, device="cuda")
def mm(): torch.matmul(a, w, out=mm_out)
for _ in range(50): mm()
torch.cuda.synchronize()
ts = []
for _ in range(30):
    t0 = time.perf_counter()
    for _ in range(20): mm()
    ts.append((time.perf_counter() - t0) / 20 * 1e6)
    torch.cuda.synchronize()
print(f"  torch.matmul 256x8192x14336 host {statistics.median(ts):.2f} us per call")
