#!/usr/bin/env bash
# Runs on nvidia-h200-x2 from the repository root, bundle/ carried: the
# checks and the A/B of the fused reduce-scatter in parts of k
# (plan::rs_k_parts, bench/KERNELS.md v14). Writes into $OUT:
#   lib-tests.txt    the sm90 reduce-scatter GPU tests (both layouts)
#   pytest.txt       test_cuda_fused.py on two GPUs
#   bench-<parts>/   bench_ops.py --quick --only mm_rs (M = 512), with the
#                    plan's parts of k ("auto") and forced to one ("1"),
#                    in alternating runs (SYMM_RS_AB_RUNS of each, default 2)
#   profile.txt      profile_ops.py --back-to-back, fused and pipelined
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=$PWD/python SYMM_LIBRARY=$PWD/bundle/libsymm.so
OUT=${OUT:-/tmp/symm-out}
mkdir -p "$OUT"
step() { echo "[${SECONDS}s] $*" | tee -a "$OUT/steps.txt"; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$OUT/gpus.txt"
echo "bundle $(cat bundle/commit)" >> "$OUT/gpus.txt"
step lib-tests
timeout 240 bundle/symm-lib-tests gpu_sm90_matmul_reduce_scatter gpu_sm90_reduce_scatter --test-threads 1 \
    --nocapture > "$OUT/lib-tests.txt" 2>&1
echo "rc=$?" >> "$OUT/lib-tests.txt"
step pytest
timeout 240 python3 -m pytest -q python/tests/test_cuda_fused.py > "$OUT/pytest.txt" 2>&1
echo "rc=$?" >> "$OUT/pytest.txt"
for run in $(seq "${SYMM_RS_AB_RUNS:-2}"); do
    for parts in auto 1; do
        step "bench parts=$parts run $run"
        if [ "$parts" = auto ]; then unset SYMM_RS_K_PARTS; else export SYMM_RS_K_PARTS=$parts; fi
        timeout 200 torchrun --nproc-per-node 2 bench/bench_ops.py --quick --only mm_rs \
            --out "$OUT/bench-$parts-$run" > "$OUT/bench-$parts-$run.txt" 2>&1
        echo "rc=$?" >> "$OUT/bench-$parts-$run.txt"
    done
done
unset SYMM_RS_K_PARTS
step profile
timeout 120 torchrun --nproc-per-node 2 bench/gpu/profile_ops.py --back-to-back --calls 6 \
    --cases mm_rs:512:14336:8192:fused,mm_rs:512:14336:8192:pipelined > "$OUT/profile.txt" 2>&1
echo "rc=$?" >> "$OUT/profile.txt"
step done
