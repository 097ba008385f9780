#!/usr/bin/env bash
# Runs on the GPU machine (nvidia-h200-x2, or -x4 for world 4) from the repository root, with
# bundle/ carried: builds the GPU test programs with the machine's nvcc
# against bundle/libsymm.so, runs them, and writes the log and the results
# JSON (bench/results format) into $OUT.
#   [SYMM_BENCH=0] [SYMM_JAX=1] [SYMM_PROFILE=1] [SYMM_FAMILIES=1] bash bench/gpu/run.sh
#   SYMM_BENCH=0: tests only, no benchmark. SYMM_JAX=1: also symm.jax on CUDA
#   (one process, two GPUs): its tests (before the benchmark, which may run
#   out of time), and with the benchmark, bench_jax.py (last).
#   SYMM_PROFILE=1: profile_ops.py's per-rank timelines, before the benchmark.
#   SYMM_FAMILIES=1: also bench_families.py (the families of shapes of
#   bench/families.py, world SYMM_FAMILIES_WORLD=2, cut at
#   SYMM_FAMILIES_TIMEOUT=480 s, with SYMM_FAMILIES_ARGS), after the
#   benchmarks; `checks.sh families` runs it alone.
set -uo pipefail
# Never NVLink multicast on these machines.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/symm-out}
mkdir -p "$OUT" /tmp/symm-bin
log="$OUT/log.txt"
root=$PWD
fail=0

say() { echo "$*" | tee -a "$log"; }
run() { say "[${SECONDS}s] \$ $*"; "$@" 2>&1 | tee -a "$log"; local rc=${PIPESTATUS[0]}; [ "$rc" = 0 ] || { say "exit $rc"; fail=1; }; }

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpus.txt" | tee -a "$log"
nvidia-smi topo -m >>"$log" 2>&1 || true

# Programs linked with libsymm.so load it by its SONAME (a link made
# here: the bundle may travel without links).
bash bench/gpu/unpack.sh
ln -sf libsymm.so bundle/libsymm.so.0
build() { # build NAME SOURCE
    nvcc -O2 -std=c++17 -arch=native -I include -I examples-c "$2" -o "/tmp/symm-bin/$1" \
        -L bundle -lsymm -Xlinker -rpath -Xlinker "$root/bundle" 2>&1 | tee -a "$log"
}

ngpu=$(nvidia-smi -L | wc -l)
# The library's own GPU unit tests (cuBLASLt, reduce, pack, the sm90 matmul
# against cuBLASLt on the benchmark shapes), built here by build-bundle.sh.
run timeout 900 bundle/symm-lib-tests gpu_ --test-threads 1 --nocapture
# The sm90 matmul alone against cuBLASLt on the benchmark's shapes (bf16, fp8).
run timeout 300 bundle/sm90_matmul
# Whether copies (same GPU, from a peer, through a VMM mapping) wait for busy SMs.
nvcc -O2 -arch=native bench/probes/copy_engine_probe.cu -lcuda -o /tmp/symm-bin/copy_engine_probe 2>&1 | tee -a "$log"
run /tmp/symm-bin/copy_engine_probe 64
build cuda_memory ffi-tests/gpu/cuda_memory.cu || fail=1
if [ "$ngpu" -ge 4 ]; then
    run /tmp/symm-bin/cuda_memory --world-size 4 --bench
    run /tmp/symm-bin/cuda_memory --world-size 4 --local
    run /tmp/symm-bin/cuda_memory --world-size 2 --bench
elif [ "$ngpu" -ge 2 ]; then
    run /tmp/symm-bin/cuda_memory --world-size 2 --bench
    run /tmp/symm-bin/cuda_memory --world-size 2 --local
    run /tmp/symm-bin/cuda_memory --world-size 4 --shared-device
else
    run /tmp/symm-bin/cuda_memory --world-size 4 --shared-device
fi
# Two ranks sharing one context: lazy module loading would synchronize the
# device at a kernel's first launch while the other rank spins in a signal.
run env CUDA_MODULE_LOADING=EAGER /tmp/symm-bin/cuda_memory --world-size 2 --local --shared-device

if [ "${SYMM_GPU_OPS:-1}" = 1 ]; then
    export PYTHONPATH=$root/python SYMM_LIBRARY=$root/bundle/libsymm.so
    # They need two GPUs (pytest would exit 5, nothing collected, on one).
    [ "$ngpu" -ge 2 ] && run python3 -m pytest -q python/tests/test_cuda.py python/tests/test_cuda_fused.py
    # Groups across pretend hosts (each rank its own), over NCCL's default and network transports.
    [ "$ngpu" -ge 2 ] && run timeout 300 python3 -m pytest -q python/tests/test_cuda_hosts.py
    # symm.torch's operators under torchrun (2 GPUs), beside torch.ops.symm_mem.
    [ "$ngpu" -ge 2 ] && run timeout 1800 python3 -m pytest -q python/tests/test_torch_cuda.py
    if [ "$ngpu" -ge 4 ]; then
        run python3 bench/gpu/ops_check.py --world 4 --gpus 4
        [ "$ngpu" -ge 8 ] && run python3 bench/gpu/ops_check.py --world 8 --gpus 8
    else
        run python3 bench/gpu/ops_check.py --world 4 --gpus 1
    fi
    # Randomly drawn calls of every operation (a fresh seed, printed), each
    # rank on a GPU of its own where there are two.
    g=$([ "$ngpu" -ge 2 ] && echo 2 || echo 1)
    run env CUDA_MODULE_LOADING=EAGER timeout 400 python3 python/tests/ops_fuzz.py --backend cuda --world 2 --gpus "$g" \
        --cases "${SYMM_FUZZ_CASES:-200}"
    # One rank's call differing from its peers': every rank fails cleanly.
    run env CUDA_MODULE_LOADING=EAGER timeout 400 python3 python/tests/diverge_fuzz.py --backend cuda --world 2 --gpus "$g" \
        --cases "${SYMM_DIVERGE_CASES:-40}"
    if [ "${SYMM_JAX:-0}" = 1 ] && [ "$ngpu" -ge 2 ]; then
        # Its own pytest process: the CPU-platform tests pin JAX to the CPU.
        run env XLA_PYTHON_CLIENT_MEM_FRACTION=0.6 python3 -c 'import jax; print("jax", jax.__version__, jax.devices())'
        run env XLA_PYTHON_CLIENT_MEM_FRACTION=0.6 python3 -m pytest -q python/tests/test_jax_cuda.py
    fi
    # Each operation's first call (and each algorithm's) while one rank's
    # GPU is still busy: completes, right (PyTorch's fused op hangs there:
    # --case torch_cold; docs/history/NOTES.md).
    [ "$ngpu" -ge 2 ] && run timeout 180 torchrun --nproc-per-node 2 bench/gpu/first_use_race.py --case symm_cold
    # Host time per call (Python wrapper, library, driver launches).
    run timeout 300 python3 bench/gpu/host_overhead.py --gpus "$([ "$ngpu" -ge 2 ] && echo 2 || echo 1)"
    if [ "$ngpu" -ge 2 ] && [ "${SYMM_PROFILE:-0}" = 1 ]; then
        run timeout 180 torchrun --nproc-per-node 2 bench/gpu/profile_ops.py ${SYMM_PROFILE_ARGS:-}
    fi
    # World = every GPU of the machine (2, 4 or 8), or SYMM_BENCH_WORLD.
    if [ "$ngpu" -ge 2 ] && [ "${SYMM_BENCH:-1}" = 1 ]; then
        run torchrun --nproc-per-node "${SYMM_BENCH_WORLD:-$ngpu}" bench/bench_ops.py --out "$OUT" ${SYMM_BENCH_ARGS:-}
    fi
    # The all-reduce beside NCCL and PyTorch's one-/two-shot, and the fused
    # RMSNorm, at world 2 and, on four GPUs or more, world 4 (SYMM_AR_WORLDS
    # overrides; SYMM_AR_BENCH=0 skips it).
    if [ "$ngpu" -ge 2 ] && [ "${SYMM_BENCH:-1}" = 1 ] && [ "${SYMM_AR_BENCH:-1}" = 1 ]; then
        for w in ${SYMM_AR_WORLDS:-2 $([ "$ngpu" -ge 4 ] && echo 4)}; do
            run timeout 900 torchrun --nproc-per-node "$w" bench/gpu/bench_allreduce.py --out "$OUT" ${SYMM_AR_BENCH_ARGS:-}
        done
    fi
    if [ "$ngpu" -ge 2 ] && [ "${SYMM_FAMILIES:-0}" = 1 ]; then
        run timeout "${SYMM_FAMILIES_TIMEOUT:-480}" torchrun --nproc-per-node "${SYMM_FAMILIES_WORLD:-2}" \
            bench/bench_families.py --out "$OUT" ${SYMM_FAMILIES_ARGS:-}
    fi
fi

if [ "${SYMM_JAX:-0}" = 1 ] && [ "$ngpu" -ge 2 ] && [ "${SYMM_BENCH:-1}" = 1 ]; then
    export PYTHONPATH=$root/python SYMM_LIBRARY=$root/bundle/libsymm.so XLA_PYTHON_CLIENT_MEM_FRACTION=0.6
    run python3 bench/bench_jax.py ${SYMM_JAX_BENCH_ARGS:-}
fi

python3 bench/gpu/collect.py "$log" "$OUT" "$(cat bundle/commit)" || fail=1
# The all-reduce and families charts, where matplotlib is installed (else draw
# them from the results JSON elsewhere: bench/plot_allreduce.py, bench/plot_families.py).
for f in "$OUT"/*-w*.json; do
    python3 -c 'import matplotlib' 2>/dev/null && grep -q '"allreduce"' "$f" && python3 bench/plot_allreduce.py "$f" 2>&1 | tee -a "$log"
    python3 -c 'import matplotlib' 2>/dev/null && grep -q '"family"' "$f" && python3 bench/plot_families.py "$f" 2>&1 | tee -a "$log"
done
say "overall: $([ $fail = 0 ] && echo PASS || echo FAIL)"
exit $fail
