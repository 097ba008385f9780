"""Loading libsymm.so, its version, and the declarations in symm._lib
checked against include/symm.h (functions, constants, struct layouts)."""

import ctypes
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from ranks import PYTHON_DIR, SYMM_PARENT

import symm
from symm import _lib

HEADER = PYTHON_DIR.parent / "include" / "symm.h"


def _header_text():
    # Comments may contain parentheses and names; drop them first.
    text = HEADER.read_text()
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    return re.sub(r"//[^\n]*", "", text)


def _header_functions():
    """name -> number of parameters, for every function prototype."""
    protos = re.findall(r"\b(symm_\w+)\s*\(([^;{}]*?)\)\s*;", _header_text())
    return {name: 0 if params.strip() in ("", "void") else params.count(",") + 1 for name, params in protos}


def test_version_matches_header():
    assert symm.library_version() == (_lib.VERSION_MAJOR, _lib.VERSION_MINOR, _lib.VERSION_PATCH)
    assert Path(symm.library_path()).is_file()


def test_every_header_function_is_declared_with_its_arity():
    header = _header_functions()
    assert len(header) >= 27, "the prototype parser found too few functions"
    # Callback parameters contain commas; none of the declared functions
    # takes a function pointer directly, so a plain count is exact.
    assert sorted(set(header) - set(_lib.FUNCTIONS)) == [], "functions in symm.h missing from symm/_lib.py"
    assert sorted(set(_lib.FUNCTIONS) - set(header)) == [], "functions in symm/_lib.py not in symm.h"
    assert {n: len(_lib.FUNCTIONS[n][1]) for n in header} == header


def test_constants_match_header():
    defines = dict(re.findall(r"#define SYMM_(\w+) (-?\d+)\s*$", _header_text(), flags=re.M))
    assert len(defines) >= 20
    for name, value in defines.items():
        assert getattr(_lib, name) == int(value), f"SYMM_{name}"


@pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler")
def test_struct_layouts_match_c(tmp_path):
    """Every struct's size and field offsets as ctypes lays them out equal
    what the C compiler makes of the header."""
    lines, expect = [], []
    for cls, cname in _lib.C_STRUCT_NAMES.items():
        lines.append(f'printf("%zu\\n", sizeof({cname}));')
        expect.append(ctypes.sizeof(cls))
        for field, *_ in cls._fields_:
            lines.append(f'printf("%zu\\n", offsetof({cname}, {field}));')
            expect.append(getattr(cls, field).offset)
    src = tmp_path / "layout.c"
    body = "\n    ".join(lines)
    src.write_text(
        f'#include <stddef.h>\n#include <stdio.h>\n#include "symm.h"\n'
        f"int main(void) {{\n    {body}\n    return 0;\n}}\n"
    )
    exe = tmp_path / "layout"
    subprocess.run(["cc", f"-I{HEADER.parent}", str(src), "-o", str(exe)], check=True)
    got = [int(x) for x in subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout.split()]
    assert got == expect


def _import_in_subprocess(package_parent, env_extra):
    env = {k: v for k, v in os.environ.items() if k not in ("SYMM_LIBRARY", "CARGO_TARGET_DIR")}
    env.update(env_extra, PYTHONPATH=str(package_parent), LD_LIBRARY_PATH="")
    code = "import symm; print(symm.library_path())"
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=package_parent)


def test_symm_library_env_is_used_and_never_second_guessed(tmp_path):
    copy = tmp_path / "renamed.so"
    shutil.copy(symm.library_path(), copy)
    r = _import_in_subprocess(SYMM_PARENT, {"SYMM_LIBRARY": str(copy)})
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == str(copy)
    r = _import_in_subprocess(SYMM_PARENT, {"SYMM_LIBRARY": str(tmp_path / "missing.so")})
    assert r.returncode != 0
    assert "LibraryNotFoundError" in r.stderr and "missing.so" in r.stderr


def test_search_order_outside_the_repository(tmp_path):
    """A package copied out of the repository finds no target/ dirs: it
    fails listing every place it looked, and loads a copy placed inside it."""
    pkg = tmp_path / "site" / "symm"
    shutil.copytree(SYMM_PARENT / "symm", pkg, ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    r = _import_in_subprocess(pkg.parent, {})
    assert r.returncode != 0
    for place in ("SYMM_LIBRARY", str(pkg / "libsymm.so"), str(tmp_path / "target" / "release"), "system loader"):
        assert place in r.stderr
    shutil.copy(symm.library_path(), pkg / "libsymm.so")
    r = _import_in_subprocess(pkg.parent, {})
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == str(pkg / "libsymm.so")


def test_a_cargo_target_dir_is_searched(tmp_path):
    """With CARGO_TARGET_DIR set, `cargo build` puts the library there, not
    in the repository's target/: a package without its own copy looks
    there (listing it when missing) and loads the build found."""
    pkg = tmp_path / "site" / "symm"
    shutil.copytree(SYMM_PARENT / "symm", pkg, ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    target = tmp_path / "cargo-target"
    r = _import_in_subprocess(pkg.parent, {"CARGO_TARGET_DIR": str(target)})
    assert r.returncode != 0
    assert str(target / "release" / "libsymm.so") in r.stderr, r.stderr
    (target / "debug").mkdir(parents=True)
    shutil.copy(symm.library_path(), target / "debug" / "libsymm.so")
    r = _import_in_subprocess(pkg.parent, {"CARGO_TARGET_DIR": str(target)})
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == str(target / "debug" / "libsymm.so")


def test_an_installed_wheel_loads_the_library_inside_it():
    """A package installed from a wheel (`pip install ./python`) carries
    libsymm.so and loads it with no environment variable. CI runs these
    tests against the wheel in a clean venv with SYMM_REQUIRE_WHEEL=1, where
    this cannot skip."""
    pkg = SYMM_PARENT / "symm"
    if not (pkg / "libsymm.so").is_file():
        if os.environ.get("SYMM_REQUIRE_WHEEL") == "1":
            pytest.fail(f"SYMM_REQUIRE_WHEEL=1 but the symm under test ({pkg}) has no libsymm.so")
        pytest.skip(f"the symm under test ({pkg}) is not a wheel's: it has no libsymm.so")
    assert pkg != PYTHON_DIR / "symm"
    r = _import_in_subprocess(SYMM_PARENT, {})
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == str(pkg / "libsymm.so")
    if "SYMM_LIBRARY" not in os.environ:
        assert Path(symm.library_path()).resolve() == (pkg / "libsymm.so").resolve()


def test_nccl_wheel_is_found_and_an_explicit_library_kept(tmp_path, monkeypatch):
    """The Python package points SYMM_NCCL_LIBRARY at an installed
    nvidia-nccl wheel's libnccl.so.2 when unset, and never over a value the
    user set."""
    lib = tmp_path / "nvidia" / "nccl" / "lib"
    lib.mkdir(parents=True)
    (lib / "libnccl.so.2").write_bytes(b"stand-in")
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); from symm import _loader; "
        "_loader.point_at_nccl(); import os; print(os.environ.get('SYMM_NCCL_LIBRARY'))"
    )

    def run(extra):
        env = {k: v for k, v in os.environ.items() if k != "SYMM_NCCL_LIBRARY"}
        env.update(extra, PYTHONPATH=str(SYMM_PARENT))
        r = subprocess.run([sys.executable, "-c", code, str(tmp_path)], env=env, capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        return r.stdout.strip()

    assert run({}) == str(lib / "libnccl.so.2")
    assert run({"SYMM_NCCL_LIBRARY": "/mine/libnccl.so.2"}) == "/mine/libnccl.so.2"
