#!/usr/bin/env bash
# CI (.ci/run): the Python package as users install it. Runs the README's
# install lines in clean virtual environments:
#
#   1. `pip wheel --no-deps ./python -w target/wheels`: cargo builds
#      libsymm.so into a platform wheel. After the release build this
#      compiles nothing (python/setup.py); the wheel's tag, and its library
#      (stripped, SONAME, kernels embedded), are checked;
#   2. `pip install '<that wheel>[jax]'` into a clean venv (jax pinned, as in
#      .ci/test, by a constraints file), then `import symm` from outside the
#      repository with no environment variable, and the Python tests
#      (python/tests) against the installed package, JAX's included;
#   3. `pip install ./python` (not editable) into another clean venv, and
#      `import symm` from outside the repository.
set -euo pipefail
cd "$(dirname "$0")/.."
repo="$(pwd)"

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
die() { echo "test-wheel: $*" >&2; exit 1; }

version="$(sed -n '/^\[package\]/,/^\[/s/^version *= *"\([^"]*\)".*/\1/p' Cargo.toml)"
wheel="target/wheels/symm-$version-py3-none-linux_$(uname -m).whl"

# The lines below are the README's; fail when it says something else.
wheel_line="pip wheel --no-deps ./python -w target/wheels"
install_wheel_line="pip install '$wheel[jax]'"
install_src_line="pip install ./python"
for line in "$wheel_line" "$install_wheel_line" "$install_src_line"; do
    grep -qF -- "$line" README.md || die "README.md no longer says \`$line\`: update it or this script"
done

unset SYMM_LIBRARY LD_LIBRARY_PATH
# Imports symm from outside the repository and checks that it loaded the
# library inside the installed package (with SYMM_REQUIRE_NVCC=1, as in CI:
# one with the fatbins embedded).
import_check() {
    (cd "$work" && "$1" -c '
import os, pathlib, symm
pkg = pathlib.Path(symm.__file__).resolve().parent
lib = pathlib.Path(symm.library_path()).resolve()
assert "site-packages" in pkg.parts, pkg
assert lib == pkg / "libsymm.so", (lib, pkg)
if os.environ.get("SYMM_REQUIRE_NVCC") == "1":  # CI: the kernels compiled by nvcc are inside
    assert symm.build_info()["kernels"] == "fatbin", symm.build_info()
print(f"import symm: {pkg}, library {lib.name}, {symm.build_info()}")
')
}

stage() { printf '\n== %s  [test-wheel at %ds]\n' "$*" "$SECONDS"; }

stage "1. $wheel_line"
python3 -m venv "$work/venv"
pip="$work/venv/bin/pip"
rm -f target/wheels/symm-*.whl
"$pip" wheel --no-deps ./python -w target/wheels
[[ -f "$wheel" ]] || die "no $wheel; target/wheels holds: $(ls target/wheels)"
mkdir "$work/unpacked"
"$work/venv/bin/python" -c 'import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])' "$wheel" "$work/unpacked"
lib="$work/unpacked/symm/libsymm.so"
[[ -f "$lib" ]] || die "the wheel has no symm/libsymm.so"
[[ -f "$work/unpacked/symm/_fastcall_ext.abi3.so" ]] || die "the wheel has no symm/_fastcall_ext.abi3.so"
grep -qx "Tag: py3-none-linux_$(uname -m)" "$work/unpacked/symm-$version.dist-info/WHEEL" || die "the wheel's WHEEL file has another tag"
grep -qx "Root-Is-Purelib: false" "$work/unpacked/symm-$version.dist-info/WHEEL" || die "the wheel claims to be pure Python"
readelf -d "$lib" | grep -q "Library soname: \[libsymm.so.${version%%.*}\]" || die "the wheel's libsymm.so has no SONAME"
! readelf -S "$lib" | grep -q '\.debug_' || die "the wheel's libsymm.so is not stripped"
echo "test-wheel: $wheel ($(du -k "$wheel" | cut -f1) KiB, libsymm.so $(du -k "$lib" | cut -f1) KiB, stripped)"

stage "2. $install_wheel_line"
printf 'jax==0.10.2\njaxlib==0.10.2\n' > "$work/constraints.txt"
PIP_CONSTRAINT="$work/constraints.txt" "$pip" install --quiet --disable-pip-version-check "$wheel[jax]"
"$pip" install --quiet --disable-pip-version-check "$wheel[test]"
import_check "$work/venv/bin/python"
stage "2b. python/tests against the installed wheel"
# From the repository root, whose python/ is not on sys.path: the tests
# import the installed symm (SYMM_REQUIRE_WHEEL: and check that they do).
SYMM_REQUIRE_WHEEL=1 SYMM_REQUIRE_JAX=1 SYMM_REQUIRE_FASTCALL_EXT=1 "$work/venv/bin/python" -m pytest "$repo/python/tests" -q -p no:cacheprovider

stage "3. $install_src_line"
python3 -m venv "$work/venv-src"
"$work/venv-src/bin/pip" install --quiet --disable-pip-version-check ./python
import_check "$work/venv-src/bin/python"
stage "done"
