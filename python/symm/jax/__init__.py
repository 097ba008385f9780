"""symm's operations inside JAX programs, as XLA FFI custom calls.

    import symm.jax as sj
    sj.init()                       # groups over jax.devices(), rank = position
    mesh = sj.mesh("x")
    f = jax.jit(jax.shard_map(lambda a, b: sj.fused_ag_mm(a, b, axis_name="x"),
                              mesh=mesh, in_specs=(P("x"), P()), out_specs=P("x")))

On CUDA devices the operations run on the CUDA backend over the GPUs'
memory; on JAX's CPU devices (``--xla_force_host_platform_device_count``
or ``jax_num_cpu_devices``) on the host backend. XLA's CPU client runs the
N per-device programs of one multi-device executable concurrently on its
own thread pool (sized at least N for exactly this), so the collectives
meet; a call that waits longer than the group's timeout fails instead.
Each device's calls run in program order there too (``_order``).

The operations run only inside ``jax.shard_map`` over the group's devices
(elsewhere they raise ValueError while tracing), and support ``jax.grad``
(custom VJPs from symm's own operations) and ``jax.vmap``.
"""

from ._ops import all_reduce, all_reduce_rmsnorm, fused_ag_mm, lc_allgather, mm_rs
from ._setup import init, mesh, shutdown

__all__ = ["all_reduce", "all_reduce_rmsnorm", "fused_ag_mm", "init", "lc_allgather", "mesh", "mm_rs", "shutdown"]
