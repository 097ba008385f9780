// Reduction kernels for reduce-scatter: out[i] = scale * sum_{r<world} src_r[i].
//
// Entry points (one per element type; f32 accumulation in all of them):
//   symm_reduce_f32, symm_reduce_bf16, symm_reduce_f16
// (and, for integers, symm_reduce_int_{i8,u8,i32,i64}: see the end of the file)
//
//   (const uint64_t* srcs, int world, uint64_t src_offset, void* out,
//    const float* acc_in, float* acc_out, uint64_t n, float scale)
//
//   srcs        device array of `world` addresses (peers' symmetric buffers as
//               mapped in this process, or local chunks); element i of source
//               r is at srcs[r] + src_offset + i * sizeof(T).
//   world       1..SYMM_REDUCE_MAX_WORLD (checked by the host).
//   src_offset  bytes added to every srcs[r], so one table of buffer bases
//               serves every chunk (nothing to rewrite under graph capture).
//   out         n elements of T; unused (may be NULL) when acc_out is set.
//   acc_in      NULL, or n f32 partial sums added to the sum before scaling.
//   acc_out     NULL, or where the f32 result goes instead of `out` (for
//               chunked pipelines that accumulate in an f32 workspace).
//               acc_out may equal acc_in (in place).
//   n           number of elements.
//   scale       multiplies the sum (1 for sum, 1/world for avg).
//
// The sum is taken in f32 in rank order r = 0, 1, ..., world-1 (deterministic).
// Launch with SYMM_REDUCE_THREADS threads per block and any grid (grid-stride
// loops). The kernel decides itself whether 16-byte vector accesses are legal:
// it peels h < 16/sizeof(T) leading elements so that the first source is
// 16-byte aligned, and takes the vector path iff every pointer (sources,
// out/acc_out, acc_in) is 16-byte aligned at element h; otherwise (and for the
// tail) it uses scalar accesses. Pointers must be aligned to their element
// size. Sources and destinations must not overlap, except acc_out == acc_in.
#include "common.cuh"
#include "dtype.cuh"

#define SYMM_REDUCE_THREADS 256
#define SYMM_REDUCE_MAX_WORLD 128
// Blocks per SM the launcher aims for (caps registers at 64 per thread).
#define SYMM_REDUCE_MIN_BLOCKS 4

struct alignas(16) symm_vec16 {
    uint32_t w[4];
};

// Per-type traits: element size, elements per 16-byte vector, and scalar /
// vector loads and stores in f32.
template <int DT>
struct symm_red_traits;

template <>
struct symm_red_traits<SYMM_DT_F32> {
    static constexpr int kSize = 4;
    static constexpr int kVec = 4;
    static __device__ __forceinline__ float load(const unsigned char* p) {
        return *(const float*)p;
    }
    static __device__ __forceinline__ void store(unsigned char* p, float v) { *(float*)p = v; }
    static __device__ __forceinline__ void unpack_add(const symm_vec16& v, float* acc) {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            acc[j] += __uint_as_float(v.w[j]);
        }
    }
    static __device__ __forceinline__ symm_vec16 pack(const float* x) {
        symm_vec16 v;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            v.w[j] = __float_as_uint(x[j]);
        }
        return v;
    }
};

template <>
struct symm_red_traits<SYMM_DT_BF16> {
    static constexpr int kSize = 2;
    static constexpr int kVec = 8;
    static __device__ __forceinline__ float load(const unsigned char* p) {
        return symm_bf16_bits_to_f32(*(const unsigned short*)p);
    }
    static __device__ __forceinline__ void store(unsigned char* p, float v) {
        *(unsigned short*)p = symm_f32_to_bf16_bits(v);
    }
    static __device__ __forceinline__ void unpack_add(const symm_vec16& v, float* acc) {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            acc[2 * j] += __uint_as_float(v.w[j] << 16);
            acc[2 * j + 1] += __uint_as_float(v.w[j] & 0xffff0000u);
        }
    }
    static __device__ __forceinline__ symm_vec16 pack(const float* x) {
        symm_vec16 v;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            v.w[j] = symm_pack_bf16x2(x[2 * j], x[2 * j + 1]);
        }
        return v;
    }
};

template <>
struct symm_red_traits<SYMM_DT_F16> {
    static constexpr int kSize = 2;
    static constexpr int kVec = 8;
    static __device__ __forceinline__ float load(const unsigned char* p) {
        return symm_f16_bits_to_f32(*(const unsigned short*)p);
    }
    static __device__ __forceinline__ void store(unsigned char* p, float v) {
        *(unsigned short*)p = symm_f32_to_f16_bits(v);
    }
    static __device__ __forceinline__ void unpack_add(const symm_vec16& v, float* acc) {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            acc[2 * j] += symm_f16_bits_to_f32(v.w[j] & 0xffffu);
            acc[2 * j + 1] += symm_f16_bits_to_f32(v.w[j] >> 16);
        }
    }
    static __device__ __forceinline__ symm_vec16 pack(const float* x) {
        symm_vec16 v;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            v.w[j] = symm_pack_f16x2(x[2 * j], x[2 * j + 1]);
        }
        return v;
    }
};

static __device__ __forceinline__ symm_vec16 symm_ld_vec16(const unsigned char* p) {
    return *(const symm_vec16*)p;
}

static __device__ __forceinline__ void symm_st_vec16(unsigned char* p, const symm_vec16& v) {
    *(symm_vec16*)p = v;
}

// Arguments shared by the helpers below; the source addresses (with the
// offset applied) live in shared memory.
struct symm_red_args {
    const unsigned char* const* src;
    int world;
    unsigned char* out;
    const unsigned char* acc_in;
    unsigned char* acc_out;
    float scale;
};

// One element i, scalar accesses.
template <int DT>
static __device__ __forceinline__ void symm_reduce_one(const symm_red_args& a, uint64_t i) {
    typedef symm_red_traits<DT> Tr;
    float s = a.acc_in ? ((const float*)a.acc_in)[i] : 0.0f;
    for (int r = 0; r < a.world; ++r) {
        s += Tr::load(a.src[r] + i * Tr::kSize);
    }
    s *= a.scale;
    if (a.acc_out) {
        ((float*)a.acc_out)[i] = s;
    } else {
        Tr::store(a.out + i * Tr::kSize, s);
    }
}

// U vectors starting at elements e0, e0 + step, ... (all in range); W > 0 is
// the world size known at compile time, W == 0 means a.world at run time.
template <int DT, int W, int U>
static __device__ __forceinline__ void symm_reduce_vecs(const symm_red_args& a, uint64_t e0,
                                                        uint64_t step) {
    typedef symm_red_traits<DT> Tr;
    constexpr int V = Tr::kVec;
    float acc[U][V];
    if (a.acc_in) {
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const unsigned char* p = a.acc_in + (e0 + u * step) * 4;
#pragma unroll
            for (int q = 0; q < V / 4; ++q) {
                symm_vec16 v = symm_ld_vec16(p + 16 * q);
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    acc[u][4 * q + j] = __uint_as_float(v.w[j]);
                }
            }
        }
    } else {
#pragma unroll
        for (int u = 0; u < U; ++u) {
#pragma unroll
            for (int j = 0; j < V; ++j) {
                acc[u][j] = 0.0f;
            }
        }
    }
    if constexpr (W > 0) {
        // Issue every load before the first add: W * U 16-byte loads in flight.
        symm_vec16 v[W][U];
#pragma unroll
        for (int r = 0; r < W; ++r) {
#pragma unroll
            for (int u = 0; u < U; ++u) {
                v[r][u] = symm_ld_vec16(a.src[r] + (e0 + u * step) * Tr::kSize);
            }
        }
#pragma unroll
        for (int r = 0; r < W; ++r) {
#pragma unroll
            for (int u = 0; u < U; ++u) {
                Tr::unpack_add(v[r][u], acc[u]);
            }
        }
    } else {
#pragma unroll 4
        for (int r = 0; r < a.world; ++r) {
#pragma unroll
            for (int u = 0; u < U; ++u) {
                Tr::unpack_add(symm_ld_vec16(a.src[r] + (e0 + u * step) * Tr::kSize), acc[u]);
            }
        }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
#pragma unroll
        for (int j = 0; j < V; ++j) {
            acc[u][j] *= a.scale;
        }
        const uint64_t e = e0 + u * step;
        if (a.acc_out) {
#pragma unroll
            for (int q = 0; q < V / 4; ++q) {
                symm_vec16 o;
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    o.w[j] = __float_as_uint(acc[u][4 * q + j]);
                }
                symm_st_vec16(a.acc_out + e * 4 + 16 * q, o);
            }
        } else {
            symm_st_vec16(a.out + e * Tr::kSize, Tr::pack(acc[u]));
        }
    }
}

// Vector loop over vectors [0, nv) of elements starting at `head`.
template <int DT, int W, int U>
static __device__ void symm_reduce_vec_loop(const symm_red_args& a, uint64_t head, uint64_t nv) {
    constexpr int V = symm_red_traits<DT>::kVec;
    const uint64_t stride = (uint64_t)gridDim.x * blockDim.x;
    uint64_t v = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x;
    for (; v + (U - 1) * stride < nv; v += U * stride) {
        symm_reduce_vecs<DT, W, U>(a, head + v * V, stride * V);
    }
    for (; v < nv; v += stride) {
        symm_reduce_vecs<DT, W, 1>(a, head + v * V, 0);
    }
}

static __device__ __forceinline__ bool symm_aligned16(const unsigned char* p) {
    return ((uint64_t)p & 15u) == 0;
}

template <int DT>
static __device__ void symm_reduce_impl(const uint64_t* srcs, int world, uint64_t src_offset,
                                        void* out, const float* acc_in, float* acc_out, uint64_t n,
                                        float scale) {
    typedef symm_red_traits<DT> Tr;
    constexpr int V = Tr::kVec;
    __shared__ const unsigned char* s_src[SYMM_REDUCE_MAX_WORLD];
    if (world <= 0 || world > SYMM_REDUCE_MAX_WORLD || n == 0) {
        return;
    }
    for (int r = threadIdx.x; r < world; r += blockDim.x) {
        s_src[r] = (const unsigned char*)(srcs[r] + src_offset);
    }
    __syncthreads();

    symm_red_args a;
    a.src = s_src;
    a.world = world;
    a.out = (unsigned char*)out;
    a.acc_in = (const unsigned char*)acc_in;
    a.acc_out = (unsigned char*)acc_out;
    a.scale = scale;

    // Peel `head` elements so that source 0 is 16-byte aligned, then check
    // that every other pointer is aligned at that element too.
    const uint64_t mis = (uint64_t)s_src[0] & 15u;
    uint64_t head = mis % Tr::kSize == 0 ? ((16u - mis) & 15u) / Tr::kSize : 0;
    bool vec = mis % Tr::kSize == 0 && n >= head + V;
    if (vec) {
        for (int r = 1; r < world; ++r) {
            vec = vec && symm_aligned16(s_src[r] + head * Tr::kSize);
        }
        vec = vec && (acc_out ? symm_aligned16(a.acc_out + head * 4)
                              : symm_aligned16(a.out + head * Tr::kSize));
        vec = vec && (acc_in == nullptr || symm_aligned16(a.acc_in + head * 4));
    }
    const uint64_t gtid = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x;
    const uint64_t gstride = (uint64_t)gridDim.x * blockDim.x;
    if (!vec) {
        for (uint64_t i = gtid; i < n; i += gstride) {
            symm_reduce_one<DT>(a, i);
        }
        return;
    }
    const uint64_t nv = (n - head) / V;
    const uint64_t body_end = head + nv * V;
    // Head and tail: fewer than 2 * V elements, scalar.
    const uint64_t rest = head + (n - body_end);
    for (uint64_t j = gtid; j < rest; j += gstride) {
        symm_reduce_one<DT>(a, j < head ? j : body_end + (j - head));
    }
    switch (world) {
        case 1:
            symm_reduce_vec_loop<DT, 1, 2>(a, head, nv);
            break;
        case 2:
            symm_reduce_vec_loop<DT, 2, 2>(a, head, nv);
            break;
        case 4:
            symm_reduce_vec_loop<DT, 4, 2>(a, head, nv);
            break;
        case 8:
            symm_reduce_vec_loop<DT, 8, 1>(a, head, nv);
            break;
        default:
            symm_reduce_vec_loop<DT, 0, 2>(a, head, nv);
            break;
    }
}

extern "C" __global__ void __launch_bounds__(SYMM_REDUCE_THREADS, SYMM_REDUCE_MIN_BLOCKS)
    symm_reduce_f32(const uint64_t* srcs, int world, uint64_t src_offset, void* out,
                    const float* acc_in, float* acc_out, uint64_t n, float scale) {
    symm_reduce_impl<SYMM_DT_F32>(srcs, world, src_offset, out, acc_in, acc_out, n, scale);
}

extern "C" __global__ void __launch_bounds__(SYMM_REDUCE_THREADS, SYMM_REDUCE_MIN_BLOCKS)
    symm_reduce_bf16(const uint64_t* srcs, int world, uint64_t src_offset, void* out,
                     const float* acc_in, float* acc_out, uint64_t n, float scale) {
    symm_reduce_impl<SYMM_DT_BF16>(srcs, world, src_offset, out, acc_in, acc_out, n, scale);
}

extern "C" __global__ void __launch_bounds__(SYMM_REDUCE_THREADS, SYMM_REDUCE_MIN_BLOCKS)
    symm_reduce_f16(const uint64_t* srcs, int world, uint64_t src_offset, void* out,
                    const float* acc_in, float* acc_out, uint64_t n, float scale) {
    symm_reduce_impl<SYMM_DT_F16>(srcs, world, src_offset, out, acc_in, acc_out, n, scale);
}

// Integers: out[i] = (sum_r srcs[r][i]) / divisor for i < n, summed in the
// element's unsigned form (wrapping modulo 2^bits), then divided in 64 bits,
// truncating toward zero as C division does (divisor 1: the sum). E is the
// element type, U its unsigned form. Scalar accesses, any grid; `out` may be
// one of the sources (each thread reads its element before writing it).
//
//   (const uint64_t* srcs, int world, void* out, uint64_t n, uint32_t divisor)
template <typename E, typename U>
__device__ __forceinline__ void symm_reduce_int_impl(const uint64_t* srcs, int world, void* out, uint64_t n,
                                                     uint32_t divisor) {
    const uint64_t stride = (uint64_t)gridDim.x * blockDim.x;
    for (uint64_t i = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        U sum = 0;
        for (int r = 0; r < world; ++r) {
            sum = (U)(sum + ((const U*)srcs[r])[i]);
        }
        const long long v = (long long)(E)sum;
        ((E*)out)[i] = (E)(divisor > 1u ? v / (long long)divisor : v);
    }
}

extern "C" __global__ void __launch_bounds__(SYMM_REDUCE_THREADS)
    symm_reduce_int_i8(const uint64_t* srcs, int world, void* out, uint64_t n, uint32_t divisor) {
    symm_reduce_int_impl<signed char, unsigned char>(srcs, world, out, n, divisor);
}

extern "C" __global__ void __launch_bounds__(SYMM_REDUCE_THREADS)
    symm_reduce_int_u8(const uint64_t* srcs, int world, void* out, uint64_t n, uint32_t divisor) {
    symm_reduce_int_impl<unsigned char, unsigned char>(srcs, world, out, n, divisor);
}

extern "C" __global__ void __launch_bounds__(SYMM_REDUCE_THREADS)
    symm_reduce_int_i32(const uint64_t* srcs, int world, void* out, uint64_t n, uint32_t divisor) {
    symm_reduce_int_impl<int, unsigned int>(srcs, world, out, n, divisor);
}

extern "C" __global__ void __launch_bounds__(SYMM_REDUCE_THREADS)
    symm_reduce_int_i64(const uint64_t* srcs, int world, void* out, uint64_t n, uint32_t divisor) {
    symm_reduce_int_impl<long long, unsigned long long>(srcs, world, out, n, divisor);
}
