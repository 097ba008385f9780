#!/usr/bin/env bash
# Runs on nvidia-h200-x2 from the repository root, bundle/ carried: the
# checks and measurements of the reduce-scatter's tails (helper CTAs, see
# kernels/gemm_sm90.cu) in one call. Writes into $OUT:
#   lib-tests.txt      the sm90 reduce-scatter library tests (tails included)
#   trace-<v>.txt      fused_trace.py, mm_rs 512 (and ag_mm 512 for the
#                      first value), SYMM_RS_TAIL=<v> ("unset": not set);
#                      raw traces in traces.tar.gz
#   bench-<v>-<run>.txt bench_ops.py --quick --only mm_rs, the values of
#                      $TAIL_VALUES (default "unset 0") alternating, two rounds
#   pytest.txt         test_cuda_fused.py on two GPUs (TAIL_PYTEST=0: not run)
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=$PWD/python SYMM_LIBRARY=$PWD/bundle/libsymm.so
OUT=${OUT:-/tmp/symm-out}
values=${TAIL_VALUES:-unset 0}
mkdir -p "$OUT/traces"
step() { echo "[${SECONDS}s] $*" | tee -a "$OUT/steps.txt"; }
tail_env() { if [ "$1" = unset ]; then unset SYMM_RS_TAIL; else export SYMM_RS_TAIL=$1; fi; }
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; echo "bundle $(cat bundle/commit)"; } > "$OUT/gpus.txt"
step lib-tests
timeout 200 bundle/symm-lib-tests gpu_sm90_matmul_reduce_scatter gpu_sm90_reduce_scatter --test-threads 1 \
    --nocapture > "$OUT/lib-tests.txt" 2>&1
echo "rc=$?" >> "$OUT/lib-tests.txt"
cases=mm_rs:512:14336:8192,ag_mm:512:8192:14336
for v in $values; do
    step "trace SYMM_RS_TAIL=$v"
    tail_env "$v"
    mkdir -p "$OUT/traces/$v"
    timeout 120 torchrun --nproc-per-node 2 bench/gpu/fused_trace.py --out "$OUT/traces/$v" --cases "$cases" \
        > "$OUT/trace-$v.txt" 2>&1
    echo "rc=$?" >> "$OUT/trace-$v.txt"
    cases=mm_rs:512:14336:8192
done
tar -C "$OUT" -czf "$OUT/traces.tar.gz" traces && rm -rf "$OUT/traces"
for run in 1 2; do
    for v in $values; do
        step "bench SYMM_RS_TAIL=$v run $run"
        tail_env "$v"
        timeout 120 torchrun --nproc-per-node 2 bench/bench_ops.py --quick --only mm_rs \
            --out "$OUT/bench-$v-$run" > "$OUT/bench-$v-$run.txt" 2>&1
        echo "rc=$?" >> "$OUT/bench-$v-$run.txt"
        mv "$OUT/bench-$v-$run/records.jsonl" "$OUT/bench-$v-$run-records.jsonl" && rmdir "$OUT/bench-$v-$run"
    done
done
unset SYMM_RS_TAIL
if [ "${TAIL_PYTEST:-1}" = 1 ]; then
    step pytest
    timeout 200 python3 -m pytest -q python/tests/test_cuda_fused.py > "$OUT/pytest.txt" 2>&1
    echo "rc=$?" >> "$OUT/pytest.txt"
fi
step done
