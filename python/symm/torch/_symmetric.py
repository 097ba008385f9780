"""Which arguments of the ``torch.ops.symm`` operators symm uses in place
when they lie in symmetric memory, from the library's own answer
(``symm.symmetric_args``), in the operators' argument names; and their
registration with torch's registry of symmetric-memory arguments, where
this torch has one."""

import symm

from ._ops import _lib

# torch operator -> (symm operation, {symm's C argument name: the operator's}).
# mm_rs's symmetric `out` has no counterpart: the operator allocates it.
_SOURCES = {
    "fused_all_gather_matmul": ("fused_ag_mm", {}),
    "fused_all_gather_scaled_matmul": ("fused_ag_mm", {}),
    "fused_matmul_reduce_scatter": ("mm_rs", {}),
    "fused_scaled_matmul_reduce_scatter": ("mm_rs", {}),
    "_low_contention_all_gather": ("lc_allgather", {"input": "tensor"}),
    "one_shot_all_reduce": ("all_reduce", {"input": "input"}),
    "one_shot_all_reduce_out": ("all_reduce", {"input": "input"}),
    "two_shot_all_reduce_": ("all_reduce", {"input": "input"}),
    "two_shot_all_reduce_out": ("all_reduce", {"input": "input"}),
    "multimem_all_reduce_": ("all_reduce", {"input": "input"}),
}


def symmetric_args(operator):
    """The arguments of ``torch.ops.symm.<operator>`` that symm reads (or
    writes) where they are when they lie in one of the group's symmetric
    buffers, instead of copying them through its workspace: a dict of
    argument name -> "read" or "write"."""
    if operator not in _SOURCES:
        raise ValueError(f"{operator!r} is not one of {sorted(_SOURCES)}")
    operation, names = _SOURCES[operator]
    found = symm.symmetric_args(operation, c_names=True)
    return {names[n]: access for n, access in found.items() if n in names}


def register_with_torch():
    """Registers each operator's symmetric arguments with torch's registry
    (``Library.register_symm_mem_args``) where this torch has it (2.11 has
    not); returns whether it did."""
    register = getattr(_lib, "register_symm_mem_args", None)
    if register is None:
        return False
    for operator in _SOURCES:
        args = list(symmetric_args(operator))
        if args:
            register(operator, args)
    return True
