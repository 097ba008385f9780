"""Builds libsymm.so with cargo and ships it inside the package.

The metadata is in pyproject.toml; this file adds what it cannot say.
setuptools-rust (its cdylib mode, ``Binding.NoBinding``) runs
``cargo rustc --release`` on the repository's Cargo.toml, one level up, so
a wheel is built from a checkout: ``pip install ./python`` or
``pip wheel ./python``. The build finds nvcc as ``cargo build`` does
(build.rs: ``NVCC``, ``CUDA_HOME``, ``PATH``, ``SYMM_NVCC_DIR`` or
``.venv/nvcc``), and reuses ``target/`` and its kernel cache. The library
is stripped and copied to ``symm/libsymm.so``, where ``symm._loader``
looks first after ``SYMM_LIBRARY``.

Adjustments to setuptools-rust's defaults:

- the file is ``libsymm.so``, not a Python extension module's name
  (``libsymm.cpython-311-x86_64-linux-gnu.so``): ctypes loads it, Python
  never imports it;
- the wheel is tagged ``py3-none-<platform>``: it holds native code for one
  platform, and any Python 3 can use it. Its one Python extension,
  ``symm._fastcall_ext`` (the plain calls' hit path in C), is built against
  the stable ABI of CPython 3.10 and is optional: where it does not load (an
  older or another interpreter) or could not be built, ``symm._fastcall``
  runs the same path in Python;
- an editable install (``pip install -e python``) builds no library: the
  loader then takes the repository's ``target/release/libsymm.so``, so a
  ``cargo build`` is seen without reinstalling (the extension is built, in
  place);
- cargo builds exactly what ``cargo build --release`` builds and sees the
  same ``PATH``, so that after a ``cargo build --release`` the wheel reuses
  the compiled crate instead of compiling it again (minutes): both crate
  types of Cargo.toml (setuptools-rust would ask for the cdylib alone), and
  ``PATH`` without the bin directories of pip's temporary build environment
  (build.rs reruns when ``PATH`` changes, as nvcc may be found there).
"""

import os

from setuptools import Extension, setup
from setuptools.command.bdist_wheel import bdist_wheel
from setuptools_rust import Binding, RustExtension, Strip, build_rust

LIBRARY_NAME = "libsymm.so"  # symm/_loader.py's LIBRARY_NAME


def _cargo_env():
    """The environment without pip's build-environment bin directories on PATH."""
    env = dict(os.environ)
    kept = [d for d in env.get("PATH", "").split(os.pathsep) if not _in_pip_build_env(d)]
    env["PATH"] = os.pathsep.join(kept)
    return env


def _in_pip_build_env(directory):
    return any(part.startswith("pip-build-env-") for part in directory.split(os.sep))


CARGO_TOML = os.path.join("..", "Cargo.toml")

# The stable ABI of CPython 3.10 (METH_FASTCALL and PyObject_CallNoArgs
# entered it then): one binary for every newer CPython.
FASTCALL_EXT = Extension(
    "symm._fastcall_ext",
    sources=["symm/_fastcall_ext.c"],
    include_dirs=[os.path.join("..", "include")],  # symm.h: the operations' prototypes
    define_macros=[("Py_LIMITED_API", "0x030A0000")],
    py_limited_api=True,
    libraries=["m"],
    extra_compile_args=["-O2"],
    optional=True,
)


class BuildRust(build_rust):
    def run(self):
        if getattr(self.get_finalized_command("build_ext"), "editable_mode", False):
            print("symm: editable install, no libsymm.so built; `cargo build --release` makes the one it loads")
            return
        if not os.path.isfile(CARGO_TOML):
            raise SystemExit(
                f"symm: no {os.path.abspath(CARGO_TOML)}: the package builds from python/ inside a checkout of "
                "the repository (pip 21.3 or newer builds in place; sdists are not supported)"
            )
        super().run()

    def get_dylib_ext_path(self, ext, target_fname):
        path = super().get_dylib_ext_path(ext, target_fname)
        return os.path.join(os.path.dirname(path), LIBRARY_NAME)


class BdistWheel(bdist_wheel):
    def get_tag(self):
        _, _, platform = super().get_tag()
        return "py3", "none", platform


setup(
    rust_extensions=[
        RustExtension(
            "symm.libsymm",
            path=CARGO_TOML,
            binding=Binding.NoBinding,
            args=["--crate-type", "cdylib,rlib"],
            env=_cargo_env(),
            strip=Strip.All,
            debug=False,
        )
    ],
    ext_modules=[FASTCALL_EXT],
    cmdclass={"build_rust": BuildRust, "bdist_wheel": BdistWheel},
    zip_safe=False,
)
