"""Finds and loads libsymm.so.

Search order: env ``SYMM_LIBRARY``, the copy inside this package (a wheel's,
which ``pip install ./python`` builds with cargo: setup.py), the
``release`` then ``debug`` builds of a checkout (for working from one, e.g.
after ``pip install -e python``): in ``CARGO_TARGET_DIR`` where it is set,
as cargo builds there, then in the repository's ``target``; then the
system loader. An
explicit ``SYMM_LIBRARY`` is never second-guessed: if it cannot be loaded
that is the error, because silently picking another build would hide a
misconfiguration.
"""

import ctypes
import ctypes.util
import os
from pathlib import Path

LIBRARY_NAME = "libsymm.so"


class LibraryNotFoundError(ImportError):
    """libsymm.so could not be loaded from any place symm looks."""


def _candidates():
    package_dir = Path(__file__).resolve().parent
    repo = package_dir.parent.parent  # python/symm/ -> repository root
    yield package_dir / LIBRARY_NAME
    # As cargo reads it: relative to the working directory.
    cargo_target = os.environ.get("CARGO_TARGET_DIR")
    if cargo_target:
        yield Path(cargo_target) / "release" / LIBRARY_NAME
        yield Path(cargo_target) / "debug" / LIBRARY_NAME
    yield repo / "target" / "release" / LIBRARY_NAME
    yield repo / "target" / "debug" / LIBRARY_NAME


def nccl_from_wheel():
    """The ``libnccl.so.2`` of an installed ``nvidia-nccl-cu*`` wheel (the
    one torch installs), or None. Found without importing anything."""
    import importlib.util

    try:
        spec = importlib.util.find_spec("nvidia.nccl")
    except (ImportError, ValueError):
        return None
    for location in (spec.submodule_search_locations or []) if spec else []:
        path = Path(location) / "lib" / "libnccl.so.2"
        if path.is_file():
            return str(path)
    return None


def point_at_nccl():
    """Sets ``SYMM_NCCL_LIBRARY`` to the NCCL wheel's library when unset, so
    that groups spanning hosts find NCCL where torch installed it."""
    if not os.environ.get("SYMM_NCCL_LIBRARY"):
        wheel = nccl_from_wheel()
        if wheel:
            os.environ["SYMM_NCCL_LIBRARY"] = wheel


def load():
    """Returns the loaded library as a ``ctypes.CDLL``.

    CDLL (not PyDLL) releases the GIL during every call, which collectives of
    several ranks in one process (threads) depend on.
    """
    point_at_nccl()
    explicit = os.environ.get("SYMM_LIBRARY")
    if explicit:
        try:
            return ctypes.CDLL(explicit)
        except OSError as e:
            raise LibraryNotFoundError(f"SYMM_LIBRARY={explicit!r} could not be loaded: {e}") from e

    tried = ["env SYMM_LIBRARY (not set)"]
    for path in _candidates():
        if path.is_file():
            try:
                return ctypes.CDLL(str(path))
            except OSError as e:
                tried.append(f"{path} ({e})")
        else:
            tried.append(f"{path} (missing)")

    system = ctypes.util.find_library("symm") or LIBRARY_NAME
    try:
        return ctypes.CDLL(system)
    except OSError as e:
        tried.append(f"system loader for {system!r} ({e})")
    raise LibraryNotFoundError(
        "libsymm.so not found; build it with `cargo build --release`, install symm with `pip install ./python` "
        "(which builds it into the package), or set SYMM_LIBRARY to its path. Looked at:\n  " + "\n  ".join(tried)
    )
