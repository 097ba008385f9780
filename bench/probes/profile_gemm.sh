#!/usr/bin/env bash
# Runs on the GPU machine (one GPU is enough) from the repository root, with
# bundle/ carried: Nsight Compute over symm's sm90 matmul and cuBLASLt's
# kernel on one benchmark shape (the library's timing test, restricted by
# SYMM_SM90_SHAPE), clocks locked to base as ncu does by default, so the
# two kernels are compared at the same clock whatever power draw does to
# it in a timed run. Writes $OUT/ncu-gemm-<shape>.txt.
#   SHAPE=2048x8192x14336 bash bench/probes/profile_gemm.sh
#   TEST=gpu_sm90_fp8_against_cublaslt LAUNCHES=24 ...: fp8 (the first 24
#   launches: symm exact, symm fast_accum, cuBLASLt exact and fast_accum).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/symm-out}
SHAPE=${SHAPE:-2048x8192x14336}
TEST=${TEST:-gpu_sm90_matmul_against_cublaslt}
LAUNCHES=${LAUNCHES:-12}
mkdir -p "$OUT"
# The test's first launches: one warm-up of each candidate (ours, then
# cuBLASLt, ...), 1 + 5 timed launches each: 12 kernels cover both.
SYMM_SM90_SHAPE=$SHAPE timeout 400 ncu --kernel-name regex:'symm_gemm_sm90_[bfe]|nvjet|sm90_xmma|cutlass' \
    --launch-count "$LAUNCHES" --section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
    --section WarpStateStats --section LaunchStats --section Occupancy \
    bundle/symm-lib-tests "$TEST" --test-threads 1 --nocapture > "$OUT/ncu-gemm-$SHAPE.txt" 2>&1
echo "ncu exit $?"
grep -E '^\s+(symm_gemm|nvjet|sm90|cutlass)|Duration|SM Frequency|Compute \(SM\) Throughput|Memory Throughput|gmma_cycles_active|L2 Hit|DRAM Throughput|Registers Per|Block Limit|Warp Cycles Per Issued|highest-utilized|SM Busy' \
    "$OUT/ncu-gemm-$SHAPE.txt" | head -120
