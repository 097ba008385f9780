#!/usr/bin/env bash
# CI (.ci/run): the plain calls' compiled hit path (python/symm/_fastcall_ext.c)
# under AddressSanitizer and UndefinedBehaviorSanitizer: the extension
# built with both into a copy of the package, then the Python tests that
# drive it (both paths, every kind of argument, bound calls, failures).
# Needs the release library and the venv of .ci/test.
set -euo pipefail
cd "$(dirname "$0")/.."

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
cp -r python/symm "$work/symm"
rm -f "$work"/symm/_fastcall_ext*.so
include="$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["include"])')"
gcc -shared -fPIC -O1 -g -fno-omit-frame-pointer -fsanitize=address,undefined -fno-sanitize-recover=undefined \
    -DPy_LIMITED_API=0x030A0000 -I"$include" -Iinclude \
    python/symm/_fastcall_ext.c -lm -o "$work/symm/_fastcall_ext.abi3.so"
# The interpreter is not instrumented: the runtimes come first, and leaks
# are not counted (Python's own allocations would be). An allocation no
# machine can make returns NULL, as without ASan, where a test asks for one
# (an output that cannot be allocated is a SymmOutOfMemoryError).
export LD_PRELOAD="$(gcc -print-file-name=libasan.so) $(gcc -print-file-name=libubsan.so)"
export ASAN_OPTIONS=detect_leaks=0:allocator_may_return_null=1 UBSAN_OPTIONS=print_stacktrace=1
export SYMM_LIBRARY="$PWD/target/release/libsymm.so" PYTHONPATH="$work" SYMM_REQUIRE_FASTCALL_EXT=1
.venv/bin/python -c 'import sys, symm._fastcall as f
assert f._ext is not None and f._ext.__file__.startswith(sys.argv[1]), f._ext' "$work"
.venv/bin/python -m pytest -q -p no:cacheprovider \
    python/tests/test_fastcall.py python/tests/test_fastcall_torch.py python/tests/test_ops.py
