"""Allocating an operation's outputs like its input: numpy on the host,
torch or cupy on the input's CUDA device. Other producers (jax arrays are
immutable) must pass ``out=``."""

import sys

import numpy as np


def empty_like(like, shape, dtype=None):
    """An uninitialized array of ``shape`` with ``dtype`` (default: ``like``'s
    dtype), in the same kind of memory and from the same library as ``like``.
    ``dtype`` is that library's dtype object (``np.float32``,
    ``torch.bfloat16``, ...)."""
    if isinstance(like, np.ndarray):
        return np.empty(shape, like.dtype if dtype is None else dtype)
    library = type(like).__module__.split(".")[0]
    if library == "torch":
        torch = sys.modules["torch"]
        return torch.empty(shape, dtype=like.dtype if dtype is None else dtype, device=like.device)
    if library == "cupy":
        cupy = sys.modules["cupy"]
        with like.device:
            return cupy.empty(shape, like.dtype if dtype is None else dtype)
    raise TypeError(f"cannot allocate an output like a {type(like).__module__}.{type(like).__name__}; pass out=")
