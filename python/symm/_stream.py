"""The stream argument of stream-ordered calls, as a ``CUstream`` value."""

import sys


def as_stream(stream):
    """``None`` (the default stream, NULL), an int (a ``CUstream``), or an
    object exposing one: ``__cuda_stream__()`` (the CUDA stream protocol),
    ``.cuda_stream`` (torch) or ``.ptr`` (cupy). The host backend ignores it."""
    if stream is None:
        return None
    if isinstance(stream, bool):
        raise TypeError("stream must be None, an int CUstream or a stream object, not a bool")
    if isinstance(stream, int):
        return stream or None
    for attr in ("__cuda_stream__", "cuda_stream", "ptr"):
        if hasattr(stream, attr):
            try:
                return int(stream.__cuda_stream__()[1] if attr == "__cuda_stream__" else getattr(stream, attr)) or None
            except Exception as e:
                raise TypeError(f"stream's {attr} gave no CUstream: {type(e).__name__}: {e}") from e
    raise TypeError(
        f"stream must be None, an int CUstream, or have __cuda_stream__/.cuda_stream/.ptr; got {type(stream).__name__}"
    )


def current_torch_stream(torch, device):
    """torch's current stream on ``device``, as an int (0: the default stream)."""
    get = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    return get(device) if get is not None else torch.cuda.current_stream(device).cuda_stream


def operation_stream(stream, array):
    """The stream an operation runs on: ``stream`` when given (as
    ``as_stream``); when None, the current stream of ``array``'s framework,
    where its producer queued it and its consumer will read the result:
    torch's for a CUDA tensor, cupy's for a cupy array (the NULL stream for
    anything else). The NULL stream instead would race with a caller on a
    non-blocking stream of its own, who reads the output before the
    library's work on the NULL stream is done."""
    if stream is not None:
        return as_stream(stream)
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(array, torch.Tensor):
        if not array.is_cuda:
            return None
        return current_torch_stream(torch, array.get_device()) or None
    cupy = sys.modules.get("cupy")
    if cupy is not None and isinstance(array, cupy.ndarray):
        with array.device:
            return cupy.cuda.get_current_stream().ptr or None
    return None
