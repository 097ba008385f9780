#!/usr/bin/env bash
# Runs on nvidia-h200-x2 from the repository root, bundle/ carried: the
# fused reduce-scatter's narrow peer tiles (bench/KERNELS.md v19) against
# the same kernel without them (SYMM_RS_NARROW=0), at mm_rs 512x14336x8192.
# Writes into $OUT:
#   lib-tests.txt   the sm90 reduce-scatter and trace GPU tests
#   traces.txt      fused_trace.py with and without narrow tiles
#   bench.txt       bench_ops.py --quick --only mm_rs with and without,
#                   $NARROW_RUNS rounds (default 2), alternating
#   pytest.txt      test_cuda_fused.py on two GPUs (narrow tiles on)
#   probe.txt       eager_gap_probe.py, mm_rs 512, fused and pipelined
#                   forced, one call at a time (narrow tiles on)
#   raw.tgz         the raw traces and records
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=$PWD/python SYMM_LIBRARY=$PWD/bundle/libsymm.so
OUT=${OUT:-/tmp/symm-out}
RAW=$(mktemp -d)
mkdir -p "$OUT"
step() { echo "[${SECONDS}s] $*" | tee -a "$OUT/steps.txt"; }
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; echo "bundle $(cat bundle/commit)"; } > "$OUT/gpus.txt"
set_narrow() { if [ "$1" = on ]; then unset SYMM_RS_NARROW; else export SYMM_RS_NARROW=0; fi; }
step lib-tests
timeout 240 bundle/symm-lib-tests gpu_sm90_matmul_reduce_scatter gpu_sm90_reduce_scatter gpu_sm90_trace \
    --test-threads 1 --nocapture > "$OUT/lib-tests.txt" 2>&1
echo "rc=$?" >> "$OUT/lib-tests.txt"
step pytest
timeout 240 python3 -m pytest -q python/tests/test_cuda_fused.py > "$OUT/pytest.txt" 2>&1
echo "rc=$?" >> "$OUT/pytest.txt"
for narrow in ${NARROW_TRACE:-on off}; do
    step "trace narrow $narrow"
    set_narrow "$narrow"
    echo "=== narrow peer tiles $narrow" >> "$OUT/traces.txt"
    mkdir -p "$RAW/trace-$narrow"
    timeout 120 torchrun --nproc-per-node 2 bench/gpu/fused_trace.py --cases mm_rs:512:14336:8192 \
        --out "$RAW/trace-$narrow" 2>&1 | grep -v "^W1\|FutureWarning\|enable_symm_mem_for_group" >> "$OUT/traces.txt"
    echo "rc=${PIPESTATUS[0]}" >> "$OUT/traces.txt"
done
for run in $(seq "${NARROW_RUNS:-2}"); do
    for narrow in on off; do
        step "bench narrow $narrow run $run"
        set_narrow "$narrow"
        echo "=== narrow peer tiles $narrow, run $run" >> "$OUT/bench.txt"
        timeout 200 torchrun --nproc-per-node 2 bench/bench_ops.py --quick --only mm_rs \
            --out "$RAW/bench-$narrow-$run" 2>&1 | grep -v '^{' >> "$OUT/bench.txt"
        echo "rc=${PIPESTATUS[0]}" >> "$OUT/bench.txt"
    done
done
step probe
unset SYMM_RS_NARROW
timeout 150 torchrun --nproc-per-node 2 bench/gpu/eager_gap_probe.py --op mm_rs --shape 512:14336:8192 \
    --algos fused,pipelined 2>&1 | grep -v "^W1\|FutureWarning\|enable_symm_mem_for_group" > "$OUT/probe.txt"
echo "rc=${PIPESTATUS[0]}" >> "$OUT/probe.txt"
tar -C "$RAW" -czf "$OUT/raw.tgz" .
step done
