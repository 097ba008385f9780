#!/usr/bin/env bash
# Builds what the GPU machine needs and cannot build itself (it has no
# cargo): libsymm.so with the kernels' fatbin, into bundle/ (git-ignored,
# carried to the device by the `run` tool's `carry`). Sources travel with
# the working tree.
set -euo pipefail
cd "$(dirname "$0")/../.."
bash .ci/install-nvcc.sh >/dev/null
SYMM_REQUIRE_NVCC=1 cargo build --release
mkdir -p bundle
cp target/release/libsymm.so bundle/
git rev-parse --short HEAD > bundle/commit
if [ -n "$(git status --porcelain -- src kernels build.rs Cargo.toml)" ]; then echo "-dirty" >> bundle/commit; fi
echo "bundle/: $(du -sh bundle/libsymm.so | cut -f1) libsymm.so, commit $(tr -d '\n' < bundle/commit)"
