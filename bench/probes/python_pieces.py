"""Where the Python wrapper's host time goes on this machine: the pieces of
reading one CUDA torch tensor, the whole wrapper of a plain fused_ag_mm call
and of a bound one (symm.bind) with the library call stubbed out, and a
torch.matmul for scale. One GPU, a world-1 group; timeit means.

    PYTHONPATH=python SYMM_LIBRARY=bundle/libsymm.so python3 bench/probes/python_pieces.py
"""
import statistics
import time
import timeit

import torch

import symm
import symm.ops
from symm import _arrays, _tensor  # noqa: F401 - named in the timed statements

N = 20000


def main():
    torch.cuda.set_device(0)
    g = symm.local_groups(1, backend="cuda")[0]
    a = torch.randn(256, 8192, dtype=torch.bfloat16, device="cuda")
    w = torch.randn(14336, 8192, dtype=torch.bfloat16, device="cuda").t()
    c = torch.empty(256, 14336, dtype=torch.bfloat16, device="cuda")
    s = torch.cuda.current_stream().cuda_stream
    names = dict(globals(), g=g, a=a, w=w, c=c, s=s)

    def t(stmt):
        us = timeit.timeit(stmt, globals=names, number=N) / N * 1e6
        print(f"  {stmt:58s} {us:6.2f} us", flush=True)

    for stmt in ("_arrays._from_torch(a, s)", "_arrays.view(a, s)", "_tensor.Arg(g, a, 'a', s)",
                 "a.data_ptr()", "a.stride()", "tuple(a.shape)", "a.get_device()", "a.is_cuda",
                 "torch._C._cuda_getCurrentRawStream(0)", "torch.cuda.current_stream().cuda_stream"):
        t(stmt)

    class Stub:
        """The library with the two matmul operations doing nothing."""

        def __init__(self, lib):
            self.lib = lib

        def __getattr__(self, name):
            fn = getattr(self.lib, name)
            return (lambda *args: 0) if name in ("symm_fused_ag_mm", "symm_mm_rs") else fn

    symm.ops.lib = Stub(symm.ops.lib)
    names["ag"] = lambda: symm.fused_ag_mm(g, a, [w], gather_dim=0, out=[c], stream=s)
    t("ag()  # whole wrapper, library call stubbed")
    names["bound"] = symm.bind(symm.fused_ag_mm, g, a, [w], gather_dim=0, out=[c], stream=s)
    t("bound()  # bound call, library call stubbed")

    mm_out = torch.empty(256, 14336, dtype=torch.bfloat16, device="cuda")
    for _ in range(50):
        torch.matmul(a, w, out=mm_out)
    torch.cuda.synchronize()
    per_call = []
    for _ in range(30):
        t0 = time.perf_counter()
        for _ in range(20):
            torch.matmul(a, w, out=mm_out)
        per_call.append((time.perf_counter() - t0) / 20 * 1e6)
        torch.cuda.synchronize()
    print(f"  torch.matmul 256x8192x14336 host {statistics.median(per_call):.2f} us per call")


if __name__ == "__main__":
    main()
