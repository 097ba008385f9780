#!/usr/bin/env bash
# Runs on nvidia-h200-x2 from the repository root, bundle/ carried: an A/B
# of one environment variable on the benchmark, with the checks that the
# change needs first. Writes into $OUT (few files: the device tool brings
# back only so many):
#   lib-tests.txt  the library GPU tests matching $AB_TESTS (default: the
#                  sm90 reduce-scatter ones)
#   pytest.txt     test_cuda_fused.py on two GPUs
#   bench.txt      bench_ops.py $AB_BENCH_ARGS (default: --quick --only
#                  mm_rs) with $AB_VAR at each of $AB_VALUES ("unset": not
#                  set) in turn, $AB_RUNS rounds (default 2), tables only
#   profile.txt    profile_ops.py $AB_PROFILE_ARGS, when given
#   probe.txt      bench/probes/eager_gap_probe.py $AB_PROBE_ARGS with $AB_VAR
#                  at the first of $AB_VALUES, when given
#   raw.tgz        the benchmark's records
# e.g. AB_VAR=SYMM_GRAPHS AB_VALUES="unset 0" \
#      AB_PROBE_ARGS="--op mm_rs --shape 512:14336:8192 --algos fused,pipelined" bash bench/gpu/ab.sh
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=$PWD/python SYMM_LIBRARY=$PWD/bundle/libsymm.so
bash bench/gpu/unpack.sh
OUT=${OUT:-/tmp/symm-out}
RAW=$(mktemp -d)
mkdir -p "$OUT"
step() { echo "[${SECONDS}s] $*" | tee -a "$OUT/steps.txt"; }
set_value() { if [ "$1" = unset ]; then unset "${AB_VAR:?}"; else export "${AB_VAR:?}=$1"; fi; }
quiet() { grep -v "^W1\|FutureWarning\|enable_symm_mem_for_group"; }
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
        set_value "$value"
        echo "=== $AB_VAR=$value, run $run" >> "$OUT/bench.txt"
        # shellcheck disable=SC2086
        timeout 200 torchrun --nproc-per-node 2 bench/bench_ops.py ${AB_BENCH_ARGS:---quick --only mm_rs} \
            --out "$RAW/bench-$value-$run" 2>&1 | quiet | grep -v '^{' >> "$OUT/bench.txt"
        echo "rc=${PIPESTATUS[0]}" >> "$OUT/bench.txt"
    done
done
unset "$AB_VAR"
if [ -n "${AB_PROFILE_ARGS:-}" ]; then
    step profile
    # shellcheck disable=SC2086
    timeout 150 torchrun --nproc-per-node 2 bench/gpu/profile_ops.py $AB_PROFILE_ARGS > "$OUT/profile.txt" 2>&1
    echo "rc=$?" >> "$OUT/profile.txt"
fi
if [ -n "${AB_PROBE_ARGS:-}" ]; then
    step probe
    set_value "${AB_VALUES%% *}"
    # shellcheck disable=SC2086
    timeout 150 torchrun --nproc-per-node 2 bench/probes/eager_gap_probe.py $AB_PROBE_ARGS 2>&1 | quiet > "$OUT/probe.txt"
    echo "rc=${PIPESTATUS[0]}" >> "$OUT/probe.txt"
    unset "$AB_VAR"
fi
tar -C "$RAW" -czf "$OUT/raw.tgz" .
step done
