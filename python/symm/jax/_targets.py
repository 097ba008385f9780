"""Registers symm's XLA FFI handlers with JAX: one custom-call target per
operation, served on XLA's CPU platform (host backend) and CUDA platform."""

import jax

from .._lib import lib

# target name -> the handlers' stem in libsymm.so (symm_xla_<stem>_<platform>)
TARGETS = {
    "symm_fused_ag_mm": "fused_ag_mm",
    "symm_mm_rs": "mm_rs",
    "symm_lc_allgather": "lc_allgather",
    "symm_all_reduce": "all_reduce",
    "symm_all_reduce_rmsnorm": "all_reduce_rmsnorm",
}
# XLA platform name -> the handlers' platform suffix
PLATFORMS = {"cpu": "cpu", "CUDA": "cuda"}

_registered = False


def register():
    """Registers every target once per process (XLA keeps registrations for
    the life of the process; registering twice is refused by some versions)."""
    global _registered
    if _registered:
        return
    for target, stem in TARGETS.items():
        for platform, suffix in PLATFORMS.items():
            handler = getattr(lib, f"symm_xla_{stem}_{suffix}")
            jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(handler), platform=platform)
    _registered = True
