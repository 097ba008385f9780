#!/usr/bin/env bash
# Runs on a one-GPU machine (nvidia-h100-x1 or nvidia-h200) from the
# repository root, with bundle/ carried: what one GPU can check of the fused
# kernels between two-GPU runs. The library's GPU unit tests; the one-GPU
# reduce-scatter timing (two ranks in one context, half the SMs each:
# fused pushed, fused from registers and the matmuls without the scatter)
# and the all-gather timing (the fused kernel beside a copy engine's
# delivery, against the plain matmul and the copy) SYMM_REPEAT times; the
# Python operations at world 4 on the one GPU; randomly drawn calls
# (ops_fuzz.py) and ranks that disagree (diverge_fuzz.py), two ranks on the
# GPU; then compute-sanitizer (sanitize.sh). Log and reports into $OUT.
#   [SYMM_REPEAT=3] [SYMM_SANITIZE=1] bash bench/gpu/one_gpu.sh
set -uo pipefail
# Never NVLink multicast on these machines.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# Ranks sharing one context: lazy module loading would synchronize the
# device at a kernel's first launch while another rank spins in a wait.
export CUDA_MODULE_LOADING=EAGER
OUT=${OUT:-/tmp/symm-out}
mkdir -p "$OUT"
log="$OUT/log.txt"
root=$PWD
bash bench/gpu/unpack.sh
fail=0

say() { echo "$*" | tee -a "$log"; }
run() { say "[${SECONDS}s] \$ $*"; "$@" 2>&1 | tee -a "$log"; local rc=${PIPESTATUS[0]}; [ "$rc" = 0 ] || { say "exit $rc"; fail=1; }; }

say "commit $(tr -d "\n" < bundle/commit), $(date -u +%Y-%m-%dT%H:%MZ)"
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader | tee -a "$log"

run timeout 300 bundle/symm-lib-tests gpu_ --test-threads 1 --nocapture
for _ in $(seq "${SYMM_REPEAT:-3}"); do
    run timeout 120 bundle/symm-lib-tests gpu_sm90_reduce_scatter_push_against_registers --nocapture
    run timeout 120 bundle/symm-lib-tests gpu_sm90_gather_beside_a_copy_engine --nocapture
done
export PYTHONPATH=$root/python SYMM_LIBRARY=$root/bundle/libsymm.so
run timeout 300 python3 bench/gpu/ops_check.py --world 4 --gpus 1
run timeout 300 python3 python/tests/ops_fuzz.py --backend cuda --world 2 --gpus 1 --cases "${SYMM_FUZZ_CASES:-150}"
run timeout 200 python3 python/tests/diverge_fuzz.py --backend cuda --world 2 --gpus 1 --cases "${SYMM_DIVERGE_CASES:-30}"
if [ "${SYMM_SANITIZE:-1}" = 1 ]; then
    run bash bench/gpu/sanitize.sh
fi
say "overall: $([ $fail = 0 ] && echo PASS || echo FAIL)"
exit $fail
