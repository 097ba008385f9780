#!/usr/bin/env bash
# Runs on nvidia-h200-x2 from the repository root, bundle/ carried: an A/B
# of one environment variable on the benchmark, with the checks that the
# change needs first. Writes into $OUT:
#   lib-tests.txt  the library GPU tests matching $AB_TESTS (default: the
#                  sm90 reduce-scatter ones)
#   pytest.txt     test_cuda_fused.py on two GPUs
#   bench-<value>-<run>.txt  bench_ops.py $AB_BENCH_ARGS (default: --quick
#                  --only mm_rs) with $AB_VAR set to each of $AB_VALUES
#                  ("unset": not set) in turn, $AB_RUNS rounds (default 2)
#   profile.txt    profile_ops.py $AB_PROFILE_ARGS, when given
# e.g. AB_VAR=SYMM_RS_HEAD_KB AB_VALUES="unset 0" bash bench/gpu/ab.sh
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=$PWD/python SYMM_LIBRARY=$PWD/bundle/libsymm.so
OUT=${OUT:-/tmp/symm-out}
mkdir -p "$OUT"
step() { echo "[${SECONDS}s] $*" | tee -a "$OUT/steps.txt"; }
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; echo "bundle $(cat bundle/commit)"; } > "$OUT/gpus.txt"
step lib-tests
# shellcheck disable=SC2086
timeout 240 bundle/symm-lib-tests ${AB_TESTS:-gpu_sm90_matmul_reduce_scatter gpu_sm90_reduce_scatter} \
    --test-threads 1 --nocapture > "$OUT/lib-tests.txt" 2>&1
echo "rc=$?" >> "$OUT/lib-tests.txt"
step pytest
timeout 240 python3 -m pytest -q python/tests/test_cuda_fused.py > "$OUT/pytest.txt" 2>&1
echo "rc=$?" >> "$OUT/pytest.txt"
for run in $(seq "${AB_RUNS:-2}"); do
    for value in ${AB_VALUES:?}; do
        step "bench $AB_VAR=$value run $run"
        if [ "$value" = unset ]; then unset "${AB_VAR:?}"; else export "${AB_VAR:?}=$value"; fi
        # shellcheck disable=SC2086
        timeout 200 torchrun --nproc-per-node 2 bench/bench_ops.py ${AB_BENCH_ARGS:---quick --only mm_rs} \
            --out "$OUT/bench-$value-$run" > "$OUT/bench-$value-$run.txt" 2>&1
        echo "rc=$?" >> "$OUT/bench-$value-$run.txt"
    done
done
unset "$AB_VAR"
if [ -n "${AB_PROFILE_ARGS:-}" ]; then
    step profile
    # shellcheck disable=SC2086
    timeout 150 torchrun --nproc-per-node 2 bench/gpu/profile_ops.py $AB_PROFILE_ARGS > "$OUT/profile.txt" 2>&1
    echo "rc=$?" >> "$OUT/profile.txt"
fi
step done
