#!/usr/bin/env bash
# Installs symm for C and C++ programs: the library, its header, a
# pkg-config file and a CMake package.
#
#   bash scripts/install.sh --prefix /opt/symm
#
# lays out
#
#   <prefix>/include/symm.h
#   <libdir>/libsymm.so.<version>               the library (SONAME libsymm.so.<major>)
#   <libdir>/libsymm.so.<major> -> libsymm.so.<version>
#   <libdir>/libsymm.so -> libsymm.so.<major>   for -lsymm
#   <libdir>/pkgconfig/symm.pc
#   <libdir>/cmake/symm/symmConfig.cmake        imported target symm::symm
#   <libdir>/cmake/symm/symmConfigVersion.cmake
#
# with the version of Cargo.toml, after `cargo build --release` (a no-op
# when the library is up to date; the build finds nvcc as build.rs says).
# Then: `pkg-config --cflags --libs symm` with PKG_CONFIG_PATH=<libdir>/pkgconfig,
# or find_package(symm) with CMAKE_PREFIX_PATH=<prefix>.
#
# Programs find libsymm.so.<major> at run time without LD_LIBRARY_PATH:
# symm.pc's flags carry an RPATH to <libdir> unless <libdir> is a system
# library directory (/usr/lib, /usr/lib64, /usr/lib/<multiarch>, ...; run
# ldconfig after installing there), and CMake gives programs it builds the
# RPATH of the libraries they link.
#
# Options:
#   --prefix DIR   where to install (default /usr/local)
#   --libdir DIR   the library directory, absolute or relative to the prefix (default lib)
#   --destdir DIR  stage the files under DIR (DIR/<prefix>/...) while the
#                  generated files name <prefix>, for packagers (also env DESTDIR)
#   --no-build     install target/release/libsymm.so as it is, without cargo
#   --strip        strip the installed library's debug information
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
prefix=/usr/local
libdir=lib
destdir="${DESTDIR:-}"
build=1
strip=0

usage() { sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//' >&2; exit 2; }
die() { echo "install.sh: $*" >&2; exit 1; }

while [[ $# -gt 0 ]]; do
    case "$1" in
        --prefix) prefix="${2:?--prefix needs a directory}"; shift 2 ;;
        --prefix=*) prefix="${1#*=}"; shift ;;
        --libdir) libdir="${2:?--libdir needs a directory}"; shift 2 ;;
        --libdir=*) libdir="${1#*=}"; shift ;;
        --destdir) destdir="${2:?--destdir needs a directory}"; shift 2 ;;
        --destdir=*) destdir="${1#*=}"; shift ;;
        --no-build) build=0; shift ;;
        --strip) strip=1; shift ;;
        -h|--help) usage ;;
        *) echo "install.sh: unknown argument $1" >&2; usage ;;
    esac
done

[[ "$prefix" == /* ]] || prefix="$(pwd)/$prefix"
prefix="${prefix%/}"
[[ -n "$prefix" ]] || die "the prefix cannot be /"
[[ "$libdir" == /* ]] || libdir="$prefix/$libdir"
libdir="${libdir%/}"
includedir="$prefix/include"
[[ "$libdir" == "$prefix"/* ]] || die "--libdir $libdir is not inside the prefix $prefix"

# The version: Cargo.toml's, which the header's SYMM_VERSION_* must equal.
version="$(sed -n '/^\[package\]/,/^\[/s/^version *= *"\([^"]*\)".*/\1/p' "$repo/Cargo.toml")"
[[ "$version" =~ ^([0-9]+)\.([0-9]+)\.([0-9]+)$ ]] || die "cannot read a version from Cargo.toml (got '$version')"
major="${BASH_REMATCH[1]}" minor="${BASH_REMATCH[2]}" patch="${BASH_REMATCH[3]}"
header="$repo/include/symm.h"
for part in MAJOR:$major MINOR:$minor PATCH:$patch; do
    grep -q "^#define SYMM_VERSION_${part%%:*} ${part#*:}\$" "$header" ||
        die "include/symm.h's SYMM_VERSION_${part%%:*} is not ${part#*:} (Cargo.toml's $version): regenerate it"
done

target_dir="${CARGO_TARGET_DIR:-$repo/target}"
[[ "$target_dir" == /* ]] || target_dir="$repo/$target_dir"
lib="$target_dir/release/libsymm.so"
if [[ $build == 1 ]]; then
    cargo build --release --lib --manifest-path "$repo/Cargo.toml"
fi
[[ -f "$lib" ]] || die "$lib is missing: run cargo build --release (or leave out --no-build)"
soname="libsymm.so.$major"
if command -v readelf >/dev/null; then
    found="$(readelf -d "$lib" | sed -n 's/.*(SONAME).*\[\(.*\)\].*/\1/p')"
    [[ "$found" == "$soname" ]] || die "$lib has SONAME '$found', not $soname: rebuild it"
fi

# Text of template $1 with every @NAME@ replaced by the value of variable NAME.
render() {
    local text name
    text="$(<"$repo/packaging/$1")"
    for name in PREFIX LIBDIR INCLUDEDIR VERSION MAJOR MINOR RPATH CMAKEDIR_TO_PREFIX LIBDIR_REL INCLUDEDIR_REL; do
        text="${text//@$name@/"${!name}"}"
    done
    [[ "$text" != *@[A-Z_]*@* ]] || die "packaging/$1 has a placeholder install.sh does not know"
    printf '%s\n' "$text"
}

PREFIX="$prefix" LIBDIR="$libdir" INCLUDEDIR="$includedir"
VERSION="$version" MAJOR="$major" MINOR="$minor"
# No RPATH for the directories the loader searches anyway.
if [[ "$libdir" =~ ^(/usr)?/lib(32|64|/[^/]*-linux-[^/]*)?$ ]]; then
    RPATH=""
else
    RPATH=' -Wl,-rpath,${libdir}'
fi
LIBDIR_REL="${libdir#"$prefix"/}"
INCLUDEDIR_REL="${includedir#"$prefix"/}"
# From <libdir>/cmake/symm back up to the prefix.
CMAKEDIR_TO_PREFIX="$(printf '%s' "$LIBDIR_REL/cmake/symm" | sed 's|[^/][^/]*|..|g')"

stage="${destdir%/}"
install -d "$stage$includedir" "$stage$libdir/pkgconfig" "$stage$libdir/cmake/symm"
install -m 644 "$header" "$stage$includedir/symm.h"
install -m 755 "$lib" "$stage$libdir/libsymm.so.$version"
if [[ $strip == 1 ]]; then
    strip --strip-debug "$stage$libdir/libsymm.so.$version"
fi
ln -sfn "libsymm.so.$version" "$stage$libdir/$soname"
ln -sfn "$soname" "$stage$libdir/libsymm.so"
render symm.pc.in > "$stage$libdir/pkgconfig/symm.pc"
render symmConfig.cmake.in > "$stage$libdir/cmake/symm/symmConfig.cmake"
render symmConfigVersion.cmake.in > "$stage$libdir/cmake/symm/symmConfigVersion.cmake"
chmod 644 "$stage$libdir/pkgconfig/symm.pc" "$stage$libdir/cmake/symm/"*.cmake

echo "install.sh: symm $version installed under $stage$prefix" >&2
echo "  pkg-config: PKG_CONFIG_PATH=$libdir/pkgconfig pkg-config --cflags --libs symm" >&2
echo "  CMake:      find_package(symm $major.$minor) with CMAKE_PREFIX_PATH=$prefix; link symm::symm" >&2
