#!/usr/bin/env bash
# Builds what the GPU machine needs and cannot build itself (it has no
# cargo): libsymm.so with the kernels' fatbin, into bundle/ (git-ignored,
# carried to the device by the `run` tool's `carry`). Sources travel with
# the working tree.
set -euo pipefail
cd "$(dirname "$0")/../.."
bash .ci/install-nvcc.sh >/dev/null
SYMM_REQUIRE_NVCC=1 cargo build --release --lib --example sm90_matmul
mkdir -p bundle
cp target/release/libsymm.so bundle/
# The sm90 matmul alone against cuBLASLt (bench/sm90_matmul.rs).
cp target/release/examples/sm90_matmul bundle/
# The library's unit tests, whose GPU parts (gpu_* tests) run on the device.
tests=$(SYMM_REQUIRE_NVCC=1 cargo test --release --lib --no-run --message-format=json 2>/dev/null |
    python3 bench/gpu/lib-tests-path.py)
cp "$tests" bundle/symm-lib-tests
# The plain calls' C path (python/setup.py's stable-ABI extension, built in
# place by the editable install, as .ci/test builds it); unpack.sh puts it
# back into python/symm/ on the device.
[ -x .venv/bin/pip ] || python3 -m venv .venv
.venv/bin/pip install -q --no-deps -e python
cp python/symm/_fastcall_ext.abi3.so bundle/
# Debug info would push the bundle past what the device tool carries (64 MiB).
strip --strip-debug bundle/libsymm.so bundle/symm-lib-tests bundle/sm90_matmul
# Each of them embeds the kernels: compressed (bench/gpu/unpack.sh restores
# them on the device), the bundle and the working tree stay under that limit
# (xz: a third smaller than gzip, so a baseline fits beside them).
rm -f bundle/*.gz bundle/*.xz
xz -6 -T0 -f bundle/libsymm.so bundle/symm-lib-tests bundle/sm90_matmul
# One line: results files are named after it.
dirty=$([ -n "$(git status --porcelain -- src kernels build.rs Cargo.toml)" ] && echo -dirty || true)
echo "$(git rev-parse --short HEAD)$dirty" > bundle/commit
echo "bundle/: $(du -sh bundle | cut -f1), commit $(cat bundle/commit)"
