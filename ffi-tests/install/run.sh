#!/usr/bin/env bash
# Builds and runs the programs of this directory against symm installed
# under PREFIX by scripts/install.sh, as a user's build would:
#
#   bash ffi-tests/install/run.sh PREFIX
#
# consumer.c with `pkg-config --cflags --libs symm`, consumer.cpp with
# CMake's find_package(symm) (CMakeLists.txt). Neither runs with
# LD_LIBRARY_PATH: each must find libsymm.so.<major> in PREFIX by itself.
#
# Env: PKG_CONFIG (default pkg-config), CMAKE (default cmake), CC.
set -euo pipefail
[[ $# == 1 ]] || { echo "usage: $0 PREFIX" >&2; exit 2; }
prefix="$(cd "$1" && pwd)"
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
pkg_config="${PKG_CONFIG:-pkg-config}"
cmake="${CMAKE:-cmake}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
unset LD_LIBRARY_PATH

# The program must ask for the SONAME and get it from the prefix.
check_loads_from_prefix() {
    local needed resolved
    needed="$(readelf -d "$1" | sed -n 's/.*(NEEDED).*\[\(libsymm[^]]*\)\].*/\1/p')"
    [[ "$needed" =~ ^libsymm\.so\.[0-9]+$ ]] || { echo "$1 needs '$needed', not libsymm.so.<major>" >&2; return 1; }
    resolved="$(ldd "$1" | sed -n "s/^[[:space:]]*$needed => \([^ ]*\).*/\1/p")"
    [[ "$resolved" == "$prefix"/* ]] || { echo "$1 loads $needed from '$resolved', not from $prefix" >&2; return 1; }
    echo "$(basename "$1"): $needed => $resolved"
}

echo "== C, pkg-config"
export PKG_CONFIG_PATH="$prefix/lib/pkgconfig"
flags="$("$pkg_config" --cflags --libs symm)"
echo "pkg-config: symm $("$pkg_config" --modversion symm): $flags"
# shellcheck disable=SC2086 # the flags are words
"${CC:-cc}" -std=c11 -Wall -Wextra -Werror -pedantic "$here/consumer.c" -o "$work/consumer_c" $flags
check_loads_from_prefix "$work/consumer_c"
SYMM_BACKEND=host "$work/consumer_c"

echo "== C++, CMake find_package(symm)"
"$cmake" -S "$here" -B "$work/cmake" -DCMAKE_PREFIX_PATH="$prefix" -DCMAKE_BUILD_TYPE=Release >"$work/cmake.log" ||
    { cat "$work/cmake.log"; exit 1; }
"$cmake" --build "$work/cmake" >>"$work/cmake.log" || { cat "$work/cmake.log"; exit 1; }
check_loads_from_prefix "$work/cmake/consumer_cxx"
SYMM_BACKEND=host "$work/cmake/consumer_cxx"
