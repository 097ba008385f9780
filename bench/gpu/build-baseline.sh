#!/usr/bin/env bash
# Builds a baseline for the `baseline` check of checks.sh: the library,
# Python package and benchmark of COMMIT, into bundle/base/ (carried with
# bundle/). The kernels come from the shared kernel cache where their
# sources are unchanged.
#   bash bench/gpu/build-baseline.sh COMMIT
set -euo pipefail
cd "$(dirname "$0")/../.."
commit=$(git rev-parse --short "${1:?a commit}")
root=$PWD
tree=$(mktemp -d)
trap 'git worktree remove --force "$tree"' EXIT
git worktree add -q --detach "$tree" "$commit"
(cd "$tree" && SYMM_NVCC_DIR=${SYMM_NVCC_DIR:-$root/.venv/nvcc} SYMM_KERNEL_CACHE=$root/target/symm-kernels \
    SYMM_REQUIRE_NVCC=1 CARGO_TARGET_DIR=$root/target/baseline cargo build --release --lib)
rm -rf bundle/base
mkdir -p bundle/base
cp -r "$tree/python" "$tree/bench" bundle/base/
rm -rf bundle/base/bench/results  # not needed there, and the carry is limited
find bundle/base -name __pycache__ -prune -exec rm -rf {} +
cp target/baseline/release/libsymm.so bundle/base/
strip --strip-debug bundle/base/libsymm.so
gzip -f bundle/base/libsymm.so
echo "$commit" > bundle/base/commit
echo "bundle/base/: $(du -sh bundle/base | cut -f1), commit $commit"
