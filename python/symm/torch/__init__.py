"""symm for PyTorch: ``torch.ops.symm.*``, operators with the schemas and
semantics of ``torch.ops.symm_mem.*``, run by symm, so moving is one word::

    import symm.torch  # registers torch.ops.symm
    symm.torch.enable_symm_mem_for_group(group_name)  # optional: else at first use
    ag, (y,) = torch.ops.symm.fused_all_gather_matmul(x, [w], 0, group_name)
    z = torch.ops.symm.fused_matmul_reduce_scatter(h, w2, "sum", 0, group_name)

The group name is a torch.distributed process group's (``pg.group_name``);
its symm group forms through that group's store. The operators have fake
kernels (``torch.compile(fullgraph=True)`` traces them as opaque calls) and
the functional ones autograd formulas; all run on the current CUDA stream
and may be captured in CUDA graphs once the group's workspace is grown
(one eager call, or ``get_group(name).reserve_workspace(nbytes)``).
"""

import torch

from ._groups import (
    disable_symm_mem_for_group,
    enable_symm_mem_for_group,
    get_group,
    is_symm_mem_enabled_for_group,
)
from ._ops import OPERATORS
from ._symmetric import register_with_torch, symmetric_args

__all__ = [
    "OPERATORS",
    "disable_symm_mem_for_group",
    "enable_symm_mem_for_group",
    "get_group",
    "is_symm_mem_enabled_for_group",
    "register_with_torch",
    "symmetric_args",
]

register_with_torch()
