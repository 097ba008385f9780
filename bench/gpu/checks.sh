#!/usr/bin/env bash
# Runs on the GPU machine from the repository root, with bundle/ carried: the
# named checks, each into its own $OUT/NAME.txt, with their start times in
# $OUT/steps.txt. A shorter, selectable run.sh for one device call.
#   bash bench/gpu/checks.sh [CHECK...]     (default: every check below)
# Checks: lib (the library's GPU unit tests, or those SYMM_LIB_FILTER names), cuda (test_cuda + test_cuda_fused,
# SYMM_CUDA_ROUNDS fresh processes, default 1), hosts (test_cuda_hosts), torch
# (test_torch_cuda), jax (test_jax_cuda), allreduce (bench_allreduce.py), ar_profile
# (probes/allreduce_profile.py), profile (profile_ops.py with
# SYMM_PROFILE_ARGS; not in the default list), host_overhead, families (bench_families.py),
# ops_check (every operation against the host backend), fuzz (randomly drawn
# calls, python/tests/ops_fuzz.py; SYMM_FUZZ_CASES), fuzz_memcheck (the same
# under compute-sanitizer's memcheck), diverge (one rank's call
# differing from its peers', python/tests/diverge_fuzz.py; SYMM_DIVERGE_CASES),
# bench (bench_ops.py);
# every check but hosts, ar_profile and host_overhead at SYMM_WORLD ranks
# (default 2);
# hosts_bench (bench_hosts.py, world 2: NCCL's network transport, then its
# default; SYMM_HOSTS_BENCH_ARGS, e.g. --quick; then the results JSON
# <date>-<kind>-w2-<commit>-hosts.json; not in the default list);
# hosts_bench4 (the same on four GPUs as two pretend hosts of two);
# baseline (bench_ops.py, or bench/SYMM_BASELINE_BENCH, e.g.
# bench_families.py with SYMM_BENCH_ARGS="--only comm_heavy", of the
# baseline in bundle/base/, built by build-baseline.sh, and of this tree in
# turn, SYMM_BASELINE_ROUNDS times (default 3), at SYMM_WORLD with
# SYMM_BENCH_ARGS; not in the default list);
# tag_cost (bench/probes/tag_cost_probe.py: the LL kernels graph-replayed,
# baseline and this tree in turn; not in the default list);
# lib_ab (the library's GPU tests SYMM_LIB_FILTER names, of the baseline
# built by `build-baseline.sh COMMIT --tests` and of this tree in turn,
# SYMM_BASELINE_ROUNDS times, with their printed timings; not in the
# default list).
set -uo pipefail
# Never NVLink multicast on these machines.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/symm-out}
mkdir -p "$OUT"
root=$PWD
export PYTHONPATH=$root/python SYMM_LIBRARY=$root/bundle/libsymm.so
bash bench/gpu/unpack.sh
ngpu=$(nvidia-smi -L | wc -l)
world=${SYMM_WORLD:-2}
export SYMM_TEST_WORLD=$world  # the GPU tests' world
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader >"$OUT/gpus.txt"
echo "commit $(cat bundle/commit)" >>"$OUT/gpus.txt"
fail=0

step() { # step NAME COMMAND...: output to $OUT/NAME.txt, last lines echoed
    local name=$1; shift
    echo "[${SECONDS}s] $name: $*" | tee -a "$OUT/steps.txt"
    "$@" >>"$OUT/$name.txt" 2>&1
    local rc=$?
    echo "[${SECONDS}s] $name exit $rc" | tee -a "$OUT/steps.txt"
    tail -n 3 "$OUT/$name.txt"
    [ "$rc" = 0 ] || fail=1
}

checks=${*:-lib cuda hosts torch fuzz diverge allreduce ar_profile host_overhead}
for c in $checks; do
    case $c in
    lib) step lib timeout 600 bundle/symm-lib-tests "${SYMM_LIB_FILTER:-gpu_}" --test-threads 1 ;;
    cuda)
        for i in $(seq "${SYMM_CUDA_ROUNDS:-1}"); do
            step "cuda-$i" timeout 300 python3 -m pytest -q -x python/tests/test_cuda.py python/tests/test_cuda_fused.py
        done ;;
    hosts) step hosts timeout 300 python3 -m pytest -q python/tests/test_cuda_hosts.py ;;
    torch) step torch timeout 600 python3 -m pytest -q python/tests/test_torch_cuda.py ;;
    jax) step jax env XLA_PYTHON_CLIENT_MEM_FRACTION=0.6 timeout 300 python3 -m pytest -q python/tests/test_jax_cuda.py ;;
    allreduce) step allreduce timeout 600 torchrun --nproc-per-node "$world" bench/gpu/bench_allreduce.py --out "$OUT" ${SYMM_AR_BENCH_ARGS:-} ;;
    profile) step profile timeout 180 torchrun --nproc-per-node 2 bench/gpu/profile_ops.py ${SYMM_PROFILE_ARGS:-} ;;
    ar_profile) step ar_profile timeout 300 torchrun --nproc-per-node 2 bench/probes/allreduce_profile.py ${SYMM_AR_PROFILE_ARGS:-} ;;
    fuzz)
        # Randomly drawn calls of every operation (python/tests/ops_fuzz.py), a
        # fresh seed each run (printed); ranks share GPU 0 where there are too few.
        gpus=$([ "$ngpu" -ge "$world" ] && echo "$world" || echo 1)
        step fuzz env CUDA_MODULE_LOADING=EAGER timeout "${SYMM_FUZZ_TIMEOUT:-540}" python3 python/tests/ops_fuzz.py \
            --backend cuda --world "$world" --gpus "$gpus" --cases "${SYMM_FUZZ_CASES:-200}" ${SYMM_FUZZ_ARGS:-} ;;
    fuzz_memcheck)
        # The drawn calls under memcheck, every process: no out-of-bounds or
        # misaligned access by any kernel or copy they make.
        gpus=$([ "$ngpu" -ge "$world" ] && echo "$world" || echo 1)
        step fuzz_memcheck env CUDA_MODULE_LOADING=EAGER timeout "${SYMM_FUZZ_TIMEOUT:-540}" compute-sanitizer --tool memcheck \
            --target-processes all --error-exitcode 9 --print-limit 20 python3 python/tests/ops_fuzz.py \
            --backend cuda --world "$world" --gpus "$gpus" --cases "${SYMM_FUZZ_CASES:-200}" ;;
    diverge)
        # One rank's call differing from its peers' (a fresh seed, printed):
        # every rank fails cleanly, in bounded time.
        gpus=$([ "$ngpu" -ge "$world" ] && echo "$world" || echo 1)
        step diverge env CUDA_MODULE_LOADING=EAGER timeout "${SYMM_DIVERGE_TIMEOUT:-540}" python3 python/tests/diverge_fuzz.py \
            --backend cuda --world "$world" --gpus "$gpus" --cases "${SYMM_DIVERGE_CASES:-40}" ;;
    ops_check) step ops_check timeout 300 python3 bench/gpu/ops_check.py --world "$world" --gpus "$world" ;;
    bench) step bench timeout "${SYMM_BENCH_TIMEOUT:-300}" torchrun --nproc-per-node "$world" bench/bench_ops.py --out "$OUT" ${SYMM_BENCH_ARGS:-} ;;
    host_overhead) step host_overhead timeout 300 python3 bench/gpu/host_overhead.py --gpus "$([ "$ngpu" -ge 2 ] && echo 2 || echo 1)" ;;
    hosts_bench)
        for t in network default; do
            # A hung run prints every thread's stack before the timeout ends it.
            step hosts_bench env SYMM_BENCH_WATCHDOG_S=270 timeout 300 torchrun --nproc-per-node 2 \
                bench/gpu/bench_hosts.py --out "$OUT" --transport "$t" ${SYMM_HOSTS_BENCH_ARGS:-}
        done
        step hosts_collect python3 bench/gpu/collect.py "$OUT/hosts_bench.txt" "$OUT" "$(cat bundle/commit)" ;;
    hosts_bench4)
        # Four GPUs as two pretend hosts of two: the level inside a host.
        for t in network default; do
            step hosts_bench4 env SYMM_BENCH_WATCHDOG_S=270 timeout 300 torchrun --nproc-per-node 4 \
                bench/gpu/bench_hosts.py --out "$OUT" --hosts 2 --transport "$t" ${SYMM_HOSTS_BENCH_ARGS:-}
        done
        step hosts4_collect python3 bench/gpu/collect.py "$OUT/hosts_bench4.txt" "$OUT" "$(cat bundle/commit)" ;;
    baseline)
        for i in $(seq "${SYMM_BASELINE_ROUNDS:-3}"); do
            # Each side with its own package and benchmark script.
            for side in base head; do
                if [ $side = base ]; then dir=$root/bundle/base lib=$root/bundle/base/libsymm.so
                else dir=$root lib=$root/bundle/libsymm.so; fi
                step "baseline-$side-$i" env PYTHONPATH="$dir/python" SYMM_LIBRARY="$lib" timeout 300 \
                    torchrun --nproc-per-node "$world" "$dir/bench/${SYMM_BASELINE_BENCH:-bench_ops.py}" \
                    --out "$OUT/$side-$i" ${SYMM_BENCH_ARGS:-}
            done
        done ;;
    lib_ab)
        for i in $(seq "${SYMM_BASELINE_ROUNDS:-3}"); do
            for side in base head; do
                bin=bundle/symm-lib-tests; [ $side = base ] && bin=bundle/base/symm-lib-tests
                step "lib_ab-$side-$i" timeout 300 "$bin" "${SYMM_LIB_FILTER:-gpu_}" --test-threads 1 --nocapture
            done
        done ;;
    tag_cost)
        # The LL kernels' graph-replayed time, baseline and this tree in turn.
        step tag_cost timeout 300 python3 bench/probes/tag_cost_probe.py --world "$world" \
            --gpus "$([ "$ngpu" -ge "$world" ] && echo "$world" || echo 1)" \
            --lib "base=$root/bundle/base/libsymm.so:$root/bundle/base/python" --lib "head=$root/bundle/libsymm.so:$root/python" ;;
    families) step families timeout "${SYMM_FAMILIES_TIMEOUT:-480}" torchrun --nproc-per-node "$world" bench/bench_families.py --out "$OUT" ${SYMM_FAMILIES_ARGS:-} ;;
    *) echo "unknown check $c" | tee -a "$OUT/steps.txt"; fail=1 ;;
    esac
done
echo "overall: $([ $fail = 0 ] && echo PASS || echo FAIL)" | tee -a "$OUT/steps.txt"
# The device tool brings back only a few files: everything else in one archive.
(cd "$OUT" && find . -type f ! -name steps.txt ! -name checks.tgz -printf '%P\n' | tar czf checks.tgz -T - --remove-files)
exit $fail
