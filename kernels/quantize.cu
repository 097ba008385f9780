// fp8 outputs of the scaled matmuls: an f32 product, with the bias and the
// result scale applied, rounded once into an fp8 matrix of any strides, as
// cuBLASLt writes an fp8 D (see `Quantize` in src/backend/mod.rs).
//
// Entry points, one per format:
//   symm_quantize_e4m3, symm_quantize_e5m2
//
//   (unsigned char* dst, int64_t dst_row, int64_t dst_col, const float* src,
//    uint64_t rows, uint64_t cols, const void* bias, int bias_dtype,
//    float bias_weight, const float* scale)
//
//   dst          element (i, j) at dst + i * dst_row + j * dst_col (bytes).
//   src          contiguous rows x cols f32, not overlapping dst.
//   bias         NULL, or `cols` elements of bias_dtype (SYMM_DT_BF16 or
//                SYMM_DT_F16).
//   scale        NULL (1), or one f32, read when the kernel runs.
//   dst[i, j] = encode((src[i, j] + bias_weight * bias[j]) * scale), in f32
//   in that order.
//
// The encoding is `Fp8::encode` of src/fp8.rs bit for bit: round to nearest,
// ties to even, subnormals kept; magnitudes past the largest finite value
// (infinities too) saturate to it; NaN becomes 0x7f. Integer arithmetic on
// the f32's bits, so it needs no sm_89 conversion instruction and gives the
// same bits on every architecture.
//
// One thread per element, grid-stride; launch with SYMM_QUANTIZE_THREADS
// threads per block and any grid. A pass over the product after the matmul:
// 4 bytes read and 1 written per element (plus the bias, cached).
#include "common.cuh"
#include "dtype.cuh"

#define SYMM_QUANTIZE_THREADS 256

// MBITS mantissa bits, exponent bias BIAS, largest finite magnitude code MAX.
template <int MBITS, int BIAS, unsigned MAX>
static __device__ __forceinline__ unsigned char symm_fp8_encode(float v) {
    const uint32_t bits = __float_as_uint(v);
    if ((bits & 0x7fffffffu) > 0x7f800000u) {
        return 0x7f;
    }
    const unsigned sign = (bits >> 31) << 7;
    const uint32_t abits = bits & 0x7fffffffu;
    // The largest finite value's f32 bits: exponent MAX >> MBITS, mantissa MAX's low bits.
    const uint32_t max_bits = ((uint32_t)((int)(MAX >> MBITS) - BIAS + 127) << 23) |
                              ((uint32_t)(MAX & ((1u << MBITS) - 1)) << (23 - MBITS));
    if (abits >= max_bits) {
        return (unsigned char)(sign | MAX);
    }
    int e = (int)(abits >> 23) - 127;
    if (e < 1 - BIAS) {
        e = 1 - BIAS;
    }
    // |v| in units of the spacing at exponent e (exact: a power-of-two
    // scale), rounded to nearest even.
    const float a = __uint_as_float(abits);
    const float scaled = a * __uint_as_float((uint32_t)(127 + MBITS - e) << 23);
    const uint32_t units = (uint32_t)__float2int_rn(scaled);
    uint32_t code;
    if (e == 1 - BIAS && units < (1u << MBITS)) {
        code = units;
    } else {
        code = ((uint32_t)(e + BIAS) << MBITS) + units - (1u << MBITS);
    }
    return (unsigned char)(sign | code);
}

template <int MBITS, int BIAS, unsigned MAX>
static __device__ void symm_quantize_impl(unsigned char* dst, int64_t dst_row, int64_t dst_col, const float* src,
                                          uint64_t rows, uint64_t cols, const void* bias, int bias_dtype,
                                          float bias_weight, const float* scale) {
    const float s = scale ? *scale : 1.0f;
    const uint64_t n = rows * cols;
    for (uint64_t t = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; t < n; t += (uint64_t)gridDim.x * blockDim.x) {
        const uint64_t i = t / cols, j = t - i * cols;
        float v = src[t];
        // Explicit roundings: no fused multiply-add, so the host's bits.
        if (bias) {
            const uint32_t h = ((const unsigned short*)bias)[j];
            const float b = bias_dtype == SYMM_DT_BF16 ? symm_bf16_bits_to_f32(h) : symm_f16_bits_to_f32(h);
            v = __fadd_rn(v, __fmul_rn(bias_weight, b));
        }
        dst[(int64_t)i * dst_row + (int64_t)j * dst_col] = symm_fp8_encode<MBITS, BIAS, MAX>(__fmul_rn(v, s));
    }
}

#define SYMM_QUANTIZE(NAME, MBITS, BIAS, MAX)                                                                  \
    extern "C" __global__ void __launch_bounds__(SYMM_QUANTIZE_THREADS)                                          \
        symm_quantize_##NAME(unsigned char* dst, int64_t dst_row, int64_t dst_col, const float* src,            \
                             uint64_t rows, uint64_t cols, const void* bias, int bias_dtype, float bias_weight, \
                             const float* scale) {                                                              \
        symm_quantize_impl<MBITS, BIAS, MAX>(dst, dst_row, dst_col, src, rows, cols, bias, bias_dtype,          \
                                             bias_weight, scale);                                               \
    }

SYMM_QUANTIZE(e4m3, 3, 7, 0x7eu)
SYMM_QUANTIZE(e5m2, 2, 15, 0x7bu)
