// The Hopper matmul's matmul entry points (plain, gathered, column cut):
// symm_gemm_sm90_<inputs>_n<BN>[_exact], one per input type pair, tile
// width and (fp8) accumulation, and the probe the host runs first. The
// kernel is sm90_kernel.cuh; docs/sm90-kernel.md describes it.
#include "sm90_kernel.cuh"

// Which SASS the driver loaded: 1 when this module has the sm_90a kernels.
extern "C" __global__ void symm_gemm_sm90_probe(int32_t* out) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    *out = 1;
#else
    *out = 0;
#endif
}

SYMM_GEMM_ENTRY(symm_gemm_sm90_bf16_n256, SYMM_DT_BF16, SYMM_DT_BF16, 256, false, SYMM_GEMM_MATMUL)
SYMM_GEMM_ENTRY(symm_gemm_sm90_bf16_n128, SYMM_DT_BF16, SYMM_DT_BF16, 128, false, SYMM_GEMM_MATMUL)
SYMM_GEMM_ENTRY(symm_gemm_sm90_f16_n256, SYMM_DT_F16, SYMM_DT_F16, 256, false, SYMM_GEMM_MATMUL)
SYMM_GEMM_ENTRY(symm_gemm_sm90_f16_n128, SYMM_DT_F16, SYMM_DT_F16, 128, false, SYMM_GEMM_MATMUL)
// fp8: fast accumulation (both tiles), and exact (`_exact`, 128-wide).
SYMM_GEMM_ENTRY(symm_gemm_sm90_e4m3_e4m3_n256, SYMM_DT_E4M3, SYMM_DT_E4M3, 256, false, SYMM_GEMM_MATMUL)
SYMM_GEMM_ENTRY(symm_gemm_sm90_e4m3_e4m3_n128, SYMM_DT_E4M3, SYMM_DT_E4M3, 128, false, SYMM_GEMM_MATMUL)
SYMM_GEMM_ENTRY(symm_gemm_sm90_e4m3_e4m3_n128_exact, SYMM_DT_E4M3, SYMM_DT_E4M3, 128, true, SYMM_GEMM_MATMUL)
SYMM_GEMM_ENTRY(symm_gemm_sm90_e4m3_e5m2_n256, SYMM_DT_E4M3, SYMM_DT_E5M2, 256, false, SYMM_GEMM_MATMUL)
SYMM_GEMM_ENTRY(symm_gemm_sm90_e4m3_e5m2_n128, SYMM_DT_E4M3, SYMM_DT_E5M2, 128, false, SYMM_GEMM_MATMUL)
SYMM_GEMM_ENTRY(symm_gemm_sm90_e4m3_e5m2_n128_exact, SYMM_DT_E4M3, SYMM_DT_E5M2, 128, true, SYMM_GEMM_MATMUL)
SYMM_GEMM_ENTRY(symm_gemm_sm90_e5m2_e4m3_n256, SYMM_DT_E5M2, SYMM_DT_E4M3, 256, false, SYMM_GEMM_MATMUL)
SYMM_GEMM_ENTRY(symm_gemm_sm90_e5m2_e4m3_n128, SYMM_DT_E5M2, SYMM_DT_E4M3, 128, false, SYMM_GEMM_MATMUL)
SYMM_GEMM_ENTRY(symm_gemm_sm90_e5m2_e4m3_n128_exact, SYMM_DT_E5M2, SYMM_DT_E4M3, 128, true, SYMM_GEMM_MATMUL)
