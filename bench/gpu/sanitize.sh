#!/usr/bin/env bash
# Runs on the GPU machine (one GPU is enough) from the repository root, with
# bundle/ carried: compute-sanitizer's memcheck, racecheck and synccheck over
# the library's GPU unit tests of small cases (the sm90 matmul on odd shapes, bf16/f16 and fp8,
# its flag waits, including one that times out, and its reduce-scatter
# epilogue, its narrow peer tiles, its column cut; the reduction and copy kernels; the LL kernels,
# two ranks on the one GPU). Writes one report per tool
# into $OUT and exits non-zero if any tool found an error.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# Two ranks share the GPU in the LL kernels' test: no lazy loading while one spins.
export CUDA_MODULE_LOADING=EAGER
OUT=${OUT:-/tmp/symm-out}
mkdir -p "$OUT"
bash bench/gpu/unpack.sh
tests="gpu_sm90_matmul_padded_output gpu_sm90_matmul_waits_for_gathered_chunks gpu_sm90_matmul_reduce_scatter_epilogue
gpu_sm90_matmul_matches_reference_on_any_shape gpu_sm90_fp8_matches_reference gpu_reduce_matches_host
gpu_copy_every_layout gpu_sm90_reduce_scatter_narrow_peer_tiles
gpu_sm90_matmul_column_cut gpu_lines_kernels_with_two_ranks_on_one_gpu"
fail=0
for tool in memcheck racecheck synccheck; do
    # shellcheck disable=SC2086 # one argument per test name
    timeout 300 compute-sanitizer --tool "$tool" --error-exitcode 9 bundle/symm-lib-tests $tests --test-threads 1 \
        > "$OUT/sanitizer-$tool.txt" 2>&1
    rc=$?
    echo "$tool: exit $rc; $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/sanitizer-$tool.txt" | tail -1)"
    [ "$rc" = 0 ] || fail=1
done
exit $fail
