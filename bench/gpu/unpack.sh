#!/usr/bin/env bash
# On the GPU machine: restores the executables build-bundle.sh compressed
# (run.sh and sanitize.sh call it; idempotent).
set -euo pipefail
cd "$(dirname "$0")/../.."
for f in bundle/*.gz; do
    [ -e "$f" ] || continue
    [ -x "${f%.gz}" ] && [ "${f%.gz}" -nt "$f" ] && continue
    gunzip -kf "$f" && chmod +x "${f%.gz}"
done
