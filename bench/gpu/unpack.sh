#!/usr/bin/env bash
# On the GPU machine: restores the executables build-bundle.sh compressed
# and puts the Python extension it built into the package (run.sh,
# checks.sh and sanitize.sh call it; idempotent).
set -euo pipefail
cd "$(dirname "$0")/../.."
for f in bundle/*.gz; do
    [ -e "$f" ] || continue
    [ -x "${f%.gz}" ] && [ "${f%.gz}" -nt "$f" ] && continue
    gunzip -kf "$f" && chmod +x "${f%.gz}"
done
if [ -e bundle/_fastcall_ext.abi3.so ]; then
    cp bundle/_fastcall_ext.abi3.so python/symm/
fi
