#!/usr/bin/env bash
# CI (.ci/run): the C/C++ install. Runs the README's install line,
# scripts/install.sh, into a temporary prefix, checks the layout, then builds
# and runs a C program with pkg-config and a C++ one with CMake's
# find_package(symm) against it (ffi-tests/install/run.sh), neither with
# LD_LIBRARY_PATH. After the release build, the install's cargo build is a
# no-op. CMake comes from PyPI (pinned), pkg-config from the system.
set -euo pipefail
cd "$(dirname "$0")/.."

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
prefix="$work/prefix"

command -v pkg-config >/dev/null || { echo "test-install: pkg-config is missing (Debian: pkg-config)" >&2; exit 1; }
python3 -m venv "$work/tools"
"$work/tools/bin/pip" install --quiet --disable-pip-version-check cmake==4.4.5

# The README's line, with a temporary prefix.
bash scripts/install.sh --prefix "$prefix"

version="$(sed -n '/^\[package\]/,/^\[/s/^version *= *"\([^"]*\)".*/\1/p' Cargo.toml)"
major="${version%%.*}"
for f in include/symm.h "lib/libsymm.so.$version" lib/pkgconfig/symm.pc \
    lib/cmake/symm/symmConfig.cmake lib/cmake/symm/symmConfigVersion.cmake; do
    [[ -f "$prefix/$f" ]] || { echo "test-install: $prefix/$f is missing" >&2; exit 1; }
done
[[ "$(readlink "$prefix/lib/libsymm.so.$major")" == "libsymm.so.$version" ]] || { echo "test-install: bad libsymm.so.$major link" >&2; exit 1; }
[[ "$(readlink "$prefix/lib/libsymm.so")" == "libsymm.so.$major" ]] || { echo "test-install: bad libsymm.so link" >&2; exit 1; }
readelf -d "$prefix/lib/libsymm.so.$version" | grep -q "Library soname: \[libsymm.so.$major\]" ||
    { echo "test-install: the installed library's SONAME is not libsymm.so.$major" >&2; exit 1; }
echo "test-install: layout of symm $version under $prefix ok"

CMAKE="$work/tools/bin/cmake" bash ffi-tests/install/run.sh "$prefix"
