// Element type codes and f32 conversions shared by the kernels (no toolkit
// headers: bit manipulation and PTX cvt, sm_80+).
#pragma once
#include "common.cuh"

// Element type codes (match GemmDtype's order on the Rust side).
#define SYMM_DT_F32 0
#define SYMM_DT_BF16 1
#define SYMM_DT_F16 2
// 8-bit float inputs of the sm90 matmul (Fp8 on the Rust side); never outputs.
#define SYMM_DT_E4M3 3
#define SYMM_DT_E5M2 4

static __device__ __forceinline__ float symm_bf16_bits_to_f32(uint32_t h) {
    return __uint_as_float(h << 16);
}

static __device__ __forceinline__ float symm_f16_bits_to_f32(uint32_t h) {
    float f;
    unsigned short s = (unsigned short)h;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(s));
    return f;
}

static __device__ __forceinline__ unsigned short symm_f32_to_bf16_bits(float f) {
    unsigned short s;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(s) : "f"(f));
    return s;
}

static __device__ __forceinline__ unsigned short symm_f32_to_f16_bits(float f) {
    unsigned short s;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(s) : "f"(f));
    return s;
}

// Two f32 -> one 32-bit word holding {hi: cvt(hi), lo: cvt(lo)}.
static __device__ __forceinline__ uint32_t symm_pack_bf16x2(float lo, float hi) {
    uint32_t r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

static __device__ __forceinline__ uint32_t symm_pack_f16x2(float lo, float hi) {
    uint32_t r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

