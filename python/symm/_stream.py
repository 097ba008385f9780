"""The stream argument of stream-ordered calls, as a ``CUstream`` value."""


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
    if hasattr(stream, "__cuda_stream__"):
        _version, handle = stream.__cuda_stream__()
        return int(handle) or None
    for attr in ("cuda_stream", "ptr"):
        if hasattr(stream, attr):
            return int(getattr(stream, attr)) or None
    raise TypeError(
        f"stream must be None, an int CUstream, or have __cuda_stream__/.cuda_stream/.ptr; got {type(stream).__name__}"
    )
