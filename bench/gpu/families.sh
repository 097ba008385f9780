#!/usr/bin/env bash
# Runs bench_families.py alone on the GPU machine (2+ GPUs) from the
# repository root, with bundle/ carried (only bundle/libsymm.so and
# bundle/commit are used): the log, families-records.jsonl, the results
# JSON (<date>-<kind>-w<world>-<commit>-families.json) and a PNG per family
# into $OUT. Arguments go to bench_families.py (--quick, --only ...).
#   OUT=dir [SYMM_FAMILIES_TIMEOUT=480] [SYMM_FAMILIES_WORLD=2] bash bench/gpu/families.sh [ARGS]
set -uo pipefail
# Never NVLink multicast on these machines.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=$PWD/python SYMM_LIBRARY=$PWD/bundle/libsymm.so
# A hung case prints every thread's stack before the timeout ends the run.
limit=${SYMM_FAMILIES_TIMEOUT:-480}
export SYMM_BENCH_WATCHDOG_S=$(( limit > 60 ? limit - 30 : limit ))
OUT=${OUT:-/tmp/symm-out}
mkdir -p "$OUT"
log="$OUT/families-log.txt"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpus.txt" | tee "$log"
timeout "$limit" torchrun --nproc-per-node "${SYMM_FAMILIES_WORLD:-2}" bench/bench_families.py \
    --out "$OUT" "$@" 2>&1 | tee -a "$log"
rc=${PIPESTATUS[0]}
echo "bench_families.py: exit $rc" | tee -a "$log"
python3 bench/gpu/collect.py "$log" "$OUT" "$(cat bundle/commit)" || rc=1
if python3 -c 'import matplotlib' 2>/dev/null; then
    for f in "$OUT"/*-families.json; do [ -e "$f" ] && python3 bench/plot_families.py "$f"; done
else
    echo "no matplotlib here: draw the PNGs elsewhere with python3 bench/plot_families.py FILE.json"
fi
exit $rc
