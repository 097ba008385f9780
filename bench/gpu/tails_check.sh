#!/usr/bin/env bash
# Runs on nvidia-h200-x2 from the repository root, bundle/ carried: the
# checks and measurements of the reduce-scatter's tails (helper CTAs, see
# kernels/gemm_sm90.cu) in one call. Writes into $OUT:
#   lib-tests.txt      the sm90 reduce-scatter library tests (tails included)
#   trace-tails.txt    fused_trace.py, mm_rs 512 (tails) and ag_mm 512
#   trace-notail.txt   fused_trace.py, mm_rs 512 with SYMM_RS_TAIL=0
#   bench-<v>-<run>.txt bench_ops.py --quick --only mm_rs, SYMM_RS_TAIL
#                      unset / 0 alternating, two rounds
#   pytest.txt         test_cuda_fused.py on two GPUs
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=$PWD/python SYMM_LIBRARY=$PWD/bundle/libsymm.so
OUT=${OUT:-/tmp/symm-out}
mkdir -p "$OUT/t1" "$OUT/t0"
step() { echo "[${SECONDS}s] $*" | tee -a "$OUT/steps.txt"; }
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; echo "bundle $(cat bundle/commit)"; } > "$OUT/gpus.txt"
step lib-tests
timeout 200 bundle/symm-lib-tests gpu_sm90_matmul_reduce_scatter gpu_sm90_reduce_scatter --test-threads 1 \
    --nocapture > "$OUT/lib-tests.txt" 2>&1
echo "rc=$?" >> "$OUT/lib-tests.txt"
step trace
timeout 120 torchrun --nproc-per-node 2 bench/gpu/fused_trace.py --out "$OUT/t1" \
    --cases mm_rs:512:14336:8192,ag_mm:512:8192:14336 > "$OUT/trace-tails.txt" 2>&1
echo "rc=$?" >> "$OUT/trace-tails.txt"
SYMM_RS_TAIL=0 timeout 120 torchrun --nproc-per-node 2 bench/gpu/fused_trace.py --out "$OUT/t0" \
    --cases mm_rs:512:14336:8192 > "$OUT/trace-notail.txt" 2>&1
echo "rc=$?" >> "$OUT/trace-notail.txt"
for run in 1 2; do
    for v in unset 0; do
        step "bench SYMM_RS_TAIL=$v run $run"
        if [ "$v" = unset ]; then unset SYMM_RS_TAIL; else export SYMM_RS_TAIL=$v; fi
        timeout 120 torchrun --nproc-per-node 2 bench/bench_ops.py --quick --only mm_rs \
            --out "$OUT/bench-$v-$run" > "$OUT/bench-$v-$run.txt" 2>&1
        echo "rc=$?" >> "$OUT/bench-$v-$run.txt"
    done
done
unset SYMM_RS_TAIL
step pytest
timeout 200 python3 -m pytest -q python/tests/test_cuda_fused.py > "$OUT/pytest.txt" 2>&1
echo "rc=$?" >> "$OUT/pytest.txt"
step done
