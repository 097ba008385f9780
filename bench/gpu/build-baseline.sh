#!/usr/bin/env bash
# Builds a baseline for the `baseline` check of checks.sh: the library,
# Python package and benchmark of COMMIT, into bundle/base/ (carried with
# bundle/). The kernels come from the shared kernel cache where their
# sources are unchanged. With --tests, also its library's unit tests (for
# the `lib_ab` check).
#   bash bench/gpu/build-baseline.sh COMMIT [--tests]
set -euo pipefail
cd "$(dirname "$0")/../.."
commit=$(git rev-parse --short "${1:?a commit}")
root=$PWD
tree=$(mktemp -d)
trap 'git worktree remove --force "$tree"' EXIT
git worktree add -q --detach "$tree" "$commit"
# cargo in COMMIT's tree, with the shared kernel cache and its own target.
in_tree() {
    (cd "$tree" && SYMM_NVCC_DIR=${SYMM_NVCC_DIR:-$root/.venv/nvcc} SYMM_KERNEL_CACHE=$root/target/symm-kernels \
        SYMM_REQUIRE_NVCC=1 CARGO_TARGET_DIR=$root/target/baseline "$@")
}
in_tree cargo build --release --lib
rm -rf bundle/base
mkdir -p bundle/base
if [ "${2:-}" = --tests ]; then
    tests=$(in_tree cargo test --release --lib --no-run --message-format=json 2>/dev/null |
        python3 bench/gpu/lib-tests-path.py)
    cp "$tests" bundle/base/symm-lib-tests
    strip --strip-debug bundle/base/symm-lib-tests
    xz -6 -T0 -f bundle/base/symm-lib-tests
fi
cp -r "$tree/python" "$tree/bench" bundle/base/
# Its plain calls' C path too, as python/setup.py builds it (stable ABI),
# so that plain calls compare C path with C path.
if [ -f "$tree/python/symm/_fastcall_ext.c" ]; then
    include="$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["include"])')"
    gcc -shared -fPIC -O2 -DPy_LIMITED_API=0x030A0000 -I"$include" -I"$tree/include" \
        "$tree/python/symm/_fastcall_ext.c" -lm -o bundle/base/python/symm/_fastcall_ext.abi3.so
fi
rm -rf bundle/base/bench/results  # not needed there, and the carry is limited
find bundle/base -name __pycache__ -prune -exec rm -rf {} +
cp target/baseline/release/libsymm.so bundle/base/
strip --strip-debug bundle/base/libsymm.so
xz -6 -T0 -f bundle/base/libsymm.so
echo "$commit" > bundle/base/commit
echo "bundle/base/: $(du -sh bundle/base | cut -f1), commit $commit"
