// The Hopper matmul's reduce-scatter entry points (matmul + reduce-scatter
// over the ranks' row chunks): symm_gemm_sm90_rs_<inputs>_n<BN>[_exact],
// as gemm_sm90.cu's. A unit of its own so the two compile side by side.
#include "sm90_kernel.cuh"

SYMM_GEMM_ENTRY(symm_gemm_sm90_rs_bf16_n256, SYMM_DT_BF16, SYMM_DT_BF16, 256, false, SYMM_GEMM_REDUCE_SCATTER)
SYMM_GEMM_ENTRY(symm_gemm_sm90_rs_bf16_n128, SYMM_DT_BF16, SYMM_DT_BF16, 128, false, SYMM_GEMM_REDUCE_SCATTER)
SYMM_GEMM_ENTRY(symm_gemm_sm90_rs_f16_n256, SYMM_DT_F16, SYMM_DT_F16, 256, false, SYMM_GEMM_REDUCE_SCATTER)
SYMM_GEMM_ENTRY(symm_gemm_sm90_rs_f16_n128, SYMM_DT_F16, SYMM_DT_F16, 128, false, SYMM_GEMM_REDUCE_SCATTER)
// fp8: fast accumulation (both tiles), and exact (`_exact`, 128-wide).
SYMM_GEMM_ENTRY(symm_gemm_sm90_rs_e4m3_e4m3_n256, SYMM_DT_E4M3, SYMM_DT_E4M3, 256, false, SYMM_GEMM_REDUCE_SCATTER)
SYMM_GEMM_ENTRY(symm_gemm_sm90_rs_e4m3_e4m3_n128, SYMM_DT_E4M3, SYMM_DT_E4M3, 128, false, SYMM_GEMM_REDUCE_SCATTER)
SYMM_GEMM_ENTRY(symm_gemm_sm90_rs_e4m3_e4m3_n128_exact, SYMM_DT_E4M3, SYMM_DT_E4M3, 128, true, SYMM_GEMM_REDUCE_SCATTER)
SYMM_GEMM_ENTRY(symm_gemm_sm90_rs_e4m3_e5m2_n256, SYMM_DT_E4M3, SYMM_DT_E5M2, 256, false, SYMM_GEMM_REDUCE_SCATTER)
SYMM_GEMM_ENTRY(symm_gemm_sm90_rs_e4m3_e5m2_n128, SYMM_DT_E4M3, SYMM_DT_E5M2, 128, false, SYMM_GEMM_REDUCE_SCATTER)
SYMM_GEMM_ENTRY(symm_gemm_sm90_rs_e4m3_e5m2_n128_exact, SYMM_DT_E4M3, SYMM_DT_E5M2, 128, true, SYMM_GEMM_REDUCE_SCATTER)
SYMM_GEMM_ENTRY(symm_gemm_sm90_rs_e5m2_e4m3_n256, SYMM_DT_E5M2, SYMM_DT_E4M3, 256, false, SYMM_GEMM_REDUCE_SCATTER)
SYMM_GEMM_ENTRY(symm_gemm_sm90_rs_e5m2_e4m3_n128, SYMM_DT_E5M2, SYMM_DT_E4M3, 128, false, SYMM_GEMM_REDUCE_SCATTER)
SYMM_GEMM_ENTRY(symm_gemm_sm90_rs_e5m2_e4m3_n128_exact, SYMM_DT_E5M2, SYMM_DT_E4M3, 128, true, SYMM_GEMM_REDUCE_SCATTER)
