#!/usr/bin/env bash
# On the GPU machine: restores the executables build-bundle.sh compressed
# and puts the Python extension it built into the package (run.sh,
# checks.sh and sanitize.sh call it; idempotent).
set -euo pipefail
cd "$(dirname "$0")/../.."
for f in bundle/*.xz bundle/base/*.xz; do
    [ -e "$f" ] || continue
    [ -x "${f%.xz}" ] && [ "${f%.xz}" -nt "$f" ] && continue
    if command -v xz >/dev/null; then
        xz -dkf "$f"
    else
        python3 -c 'import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[1][:-3], "wb"))' "$f"
    fi
    chmod +x "${f%.xz}"
done
if [ -e bundle/_fastcall_ext.abi3.so ]; then
    cp bundle/_fastcall_ext.abi3.so python/symm/
fi
