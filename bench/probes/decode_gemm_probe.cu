// Can a matmul at decode sizes (M <= 64 rows, bound by reading the weights)
// stream the weights faster than cuBLAS, whose kernels reach ~3.65 TB/s of
// the H200's ~4.2 (decode layer, bench/results/2026-11-29-h200-x2-285f8f0-families)?
//
// C[M, N] = A[M, K] . W[N, K]^T (W a Linear weight, K-major), bf16 or f16,
// f32 accumulation, by mma.sync. Each of a CTA's 8 warps owns 32 columns
// and streams their rows of W into shared memory by cp.async (16 lanes
// copy 256 contiguous bytes of a row), three stages deep; the k of an
// mma.m16n8k16 is permuted so that lane (g, t) reads its B fragment of two
// mmas as one 16-byte load (row g, k 8t .. 8t + 7) and A's rows g and g + 8
// at the same k, A (small, L2-resident) straight from global memory.
// Work is split stream-K: the (slice of 256 columns, 128 k) units in
// slice-major order are cut evenly among the CTAs; a CTA that covers a
// whole slice writes C, others leave f32 partials in two slots each, and
// the last of a slice's CTAs to arrive sums them in CTA order (so the
// result does not depend on timing) and resets the slice's counter.
//
// Answer (H200, bench/results/2026-11-29-h200-x1-*-decode-gemm-probe/):
// not this way. At M = 1 the stream reaches 2.0-3.0 TB/s against cuBLAS's
// 3.5-4.2 and a plain read's 4.1-4.3, and it slows with M (A's fragments
// from L2 at every k-step). cuBLAS takes 1.03-1.11 x the read's time at
// M <= 16 on weights of 8192 x 14336 and larger, 1.10-1.17 x at M = 64. A kernel that would beat it
// needs W by the bulk tensor copy engine and A staged in shared memory.
//
// Built as a shared library by decode_gemm_probe.py:
//   nvcc -O3 -arch=sm_90a -shared -Xcompiler -fPIC decode_gemm_probe.cu -o decode_gemm_probe.so
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace {

constexpr int WARPS = 8;
constexpr int SLICE = 32 * WARPS;  // columns per CTA slice
constexpr int UNIT_K = 128;        // k per unit: 256 bytes of a row
constexpr int PITCH = UNIT_K * 2 + 16;
constexpr int STAGE_BYTES = 32 * PITCH;
constexpr int STAGES = 3;
constexpr int SMEM_BYTES = WARPS * STAGES * STAGE_BYTES;

template <typename T>
__device__ __forceinline__ void mma(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                                    uint32_t b1) {
    if constexpr (sizeof(T) == 2 && __is_same(T, __nv_bfloat16)) {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
            "{%0,%1,%2,%3};"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
    } else {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
            "{%0,%1,%2,%3};"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
    }
}

__device__ __forceinline__ uint4 load_stream(const void* p) {
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
}

template <typename T>
__device__ __forceinline__ void store_pair(T* p, float x, float y) {
    if constexpr (__is_same(T, __nv_bfloat16)) {
        *reinterpret_cast<__nv_bfloat162*>(p) = __floats2bfloat162_rn(x, y);
    } else {
        *reinterpret_cast<__half2*>(p) = __floats2half2_rn(x, y);
    }
}

template <typename T>
__device__ __forceinline__ void store_one(T* p, float x) {
    if constexpr (__is_same(T, __nv_bfloat16)) {
        *p = __float2bfloat16_rn(x);
    } else {
        *p = __float2half_rn(x);
    }
}

struct Args {
    const void* a;
    const void* w;
    void* c;
    long long lda, ldw, ldc;  // elements
    int m, n, k;
    float* partials;     // [2 * gridDim.x][MT * 16][SLICE]
    unsigned* counters;  // [slices], zero between calls
};

// The CTA holding unit u: the largest c with floor(c * total / G) <= u.
__device__ __forceinline__ int cta_of(long long u, long long total, int grid) {
    return int(((u + 1) * grid - 1) / total);
}

template <typename T, int MT>
__global__ void __launch_bounds__(32 * WARPS) decode_gemm(Args p) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const T* A = static_cast<const T*>(p.a);
    const T* W = static_cast<const T*>(p.w);
    T* C = static_cast<T*>(p.c);
    const int per_slice = (p.k + UNIT_K - 1) / UNIT_K;
    const int slices = (p.n + SLICE - 1) / SLICE;
    const long long total = (long long)slices * per_slice;
    const int grid = gridDim.x, me = blockIdx.x;
    const long long u0 = me * total / grid, u1 = (me + 1) * total / grid;
    const int first_slice = int(u0 / per_slice);
    __shared__ int arrived;

    float acc[MT][4][4];
    auto zero = [&] {
#pragma unroll
        for (int i = 0; i < MT; ++i)
#pragma unroll
            for (int j = 0; j < 4; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.f;
    };
    zero();

    // Writes this CTA's sums over [from, to) units of slice s.
    auto flush = [&](int s, long long from, long long to) {
        const int col0 = s * SLICE + warp * 32;
        const bool whole = from == (long long)s * per_slice && to == (long long)(s + 1) * per_slice;
        if (whole) {
#pragma unroll
            for (int i = 0; i < MT; ++i)
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    const int col = col0 + j * 8 + 2 * t;
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        const int row = i * 16 + g + 8 * h;
                        if (row >= p.m) continue;
                        T* dst = C + row * p.ldc + col;
                        if (col + 1 < p.n && (p.ldc % 2) == 0) {
                            store_pair(dst, acc[i][j][2 * h], acc[i][j][2 * h + 1]);
                        } else {
                            if (col < p.n) store_one(dst, acc[i][j][2 * h]);
                            if (col + 1 < p.n) store_one(dst + 1, acc[i][j][2 * h + 1]);
                        }
                    }
                }
            return;
        }
        const int slot = 2 * me + (s == first_slice ? 0 : 1);
        float* mine = p.partials + (long long)slot * MT * 16 * SLICE;
#pragma unroll
        for (int i = 0; i < MT; ++i)
#pragma unroll
            for (int j = 0; j < 4; ++j)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int row = i * 16 + g + 8 * h, col = warp * 32 + j * 8 + 2 * t;
                    __stcg(reinterpret_cast<float2*>(mine + row * SLICE + col),
                           make_float2(acc[i][j][2 * h], acc[i][j][2 * h + 1]));
                }
        __threadfence();
        __syncthreads();
        const int c_first = cta_of((long long)s * per_slice, total, grid);
        const int c_last = cta_of((long long)(s + 1) * per_slice - 1, total, grid);
        if (threadIdx.x == 0) arrived = atomicAdd(p.counters + s, 1u);
        __syncthreads();
        if (arrived != c_last - c_first) return;
        // The last to arrive: every contributor's partial, in CTA order.
        __threadfence();
        const int rows = p.m, cols = min(SLICE, p.n - s * SLICE);
        for (int e = threadIdx.x; e < rows * cols; e += blockDim.x) {
            const int row = e / cols, col = e % cols;
            float sum = 0.f;
            for (int c = c_first; c <= c_last; ++c) {
                const int c_first_slice = int((c * total / grid) / per_slice);
                const int sl = 2 * c + (s == c_first_slice ? 0 : 1);
                sum += __ldcg(p.partials + ((long long)sl * MT * 16 + row) * SLICE + col);
            }
            store_one(C + row * p.ldc + s * SLICE + col, sum);
        }
        if (threadIdx.x == 0) p.counters[s] = 0;
    };

    // This warp's rows of W (32), one stage per unit: a copy instruction
    // moves 32 x 16 contiguous bytes of one row; rows padded by 16 bytes so
    // that the fragment reads of 8 rows hit distinct banks.
    extern __shared__ __align__(16) unsigned char smem[];
    unsigned char* mine = smem + warp * STAGES * STAGE_BYTES;
    const unsigned dst_lane = __cvta_generic_to_shared(mine) + 16 * lane;
    // The next unit to load: slice, k-unit, stage (no divisions in the loop).
    int ls = first_slice, lk = int(u0 - (long long)first_slice * per_slice), lstage = 0;
    long long left = u1 - u0;
    auto issue = [&] {
        if (left > 0) {
            const int row0 = ls * SLICE + warp * 32, k = lk * UNIT_K + (lane % (UNIT_K / 8)) * 8;
            const int part = lane / (UNIT_K / 8);  // lanes per row: UNIT_K / 8
            const T* src = W + (long long)(row0 + part) * p.ldw + k;
            const unsigned dst = dst_lane + lstage * STAGE_BYTES - 16 * lane + part * PITCH + (lane % (UNIT_K / 8)) * 16;
            const bool k_ok = k < p.k;
#pragma unroll
            for (int r = 0; r < 32; r += 32 / (UNIT_K / 8)) {
                const bool ok = k_ok && row0 + part + r < p.n;
                asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst + r * PITCH),
                             "l"(ok ? src + (long long)r * p.ldw : W), "r"(ok ? 16 : 0));
            }
            --left;
            if (++lk == per_slice) lk = 0, ++ls;
            if (++lstage == STAGES) lstage = 0;
        }
        asm volatile("cp.async.commit_group;");
    };
#pragma unroll
    for (int i = 0; i < STAGES - 1; ++i) issue();

    int s = first_slice, uk = int(u0 - (long long)first_slice * per_slice), stage = 0;
    long long from = u0;
    for (long long u = u0; u < u1; ++u) {
        if (uk == per_slice) {
            flush(s, from, u);
            zero();
            ++s;
            uk = 0;
            from = u;
        }
        asm volatile("cp.async.wait_group %0;" ::"n"(STAGES - 2));
        __syncwarp();
        const unsigned char* st = mine + stage * STAGE_BYTES + g * PITCH + 16 * t;
        const int k0 = uk * UNIT_K + 8 * t;
        const T* a_lo = A + (long long)g * p.lda + k0;
#pragma unroll
        for (int q = 0; q < UNIT_K / 32; ++q) {
            const int k = k0 + q * 32;
            uint4 b[4];
#pragma unroll
            for (int j = 0; j < 4; ++j) b[j] = *reinterpret_cast<const uint4*>(st + j * 8 * PITCH + q * 64);
#pragma unroll
            for (int i = 0; i < MT; ++i) {
                const int r0 = i * 16 + g;
                const uint4 zero4 = make_uint4(0, 0, 0, 0);
                const T* ap = a_lo + (long long)i * 16 * p.lda + q * 32;
                const uint4 lo = (r0 < p.m && k < p.k) ? __ldg(reinterpret_cast<const uint4*>(ap)) : zero4;
                const uint4 hi =
                    (r0 + 8 < p.m && k < p.k) ? __ldg(reinterpret_cast<const uint4*>(ap + 8 * p.lda)) : zero4;
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    mma<T>(acc[i][j], lo.x, hi.x, lo.y, hi.y, b[j].x, b[j].y);
                    mma<T>(acc[i][j], lo.z, hi.z, lo.w, hi.w, b[j].z, b[j].w);
                }
            }
        }
        __syncwarp();
        issue();
        ++uk;
        if (++stage == STAGES) stage = 0;
    }
    asm volatile("cp.async.wait_group 0;");
    flush(s, from, u1);
}

// Reads `bytes` (a multiple of 16) once: the bandwidth a pure weight stream can reach.
__global__ void read_all(const uint4* p, long long n, unsigned* sink) {
    unsigned x = 0;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        const uint4 v = load_stream(p + i);
        x ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    if (x == 0x12345678u) *sink = x;
}

int go(void (*kernel)(Args), const Args& a, int grid, cudaStream_t st) {
    cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, SMEM_BYTES);
    kernel<<<grid, 32 * WARPS, SMEM_BYTES, st>>>(a);
    return int(cudaGetLastError());
}

template <typename T>
int launch(const Args& a, int grid, cudaStream_t st) {
    const int mt = (a.m + 15) / 16;
    switch (mt) {
        case 1: return go(decode_gemm<T, 1>, a, grid, st);
        case 2: return go(decode_gemm<T, 2>, a, grid, st);
        case 3:
        case 4: return go(decode_gemm<T, 4>, a, grid, st);
        default: return -1;
    }
}

}  // namespace

extern "C" {

// dtype: 0 bf16, 1 f16. grid: CTAs (at most the number of units).
int probe_decode_gemm(int dtype, const void* a, long long lda, const void* w, long long ldw, void* c, long long ldc,
                      int m, int n, int k, float* partials, unsigned* counters, int grid, void* stream) {
    if (m < 1 || m > 64 || k % 8 || lda % 8 || ldw % 8) return -2;
    Args args{a, w, c, lda, ldw, ldc, m, n, k, partials, counters};
    const long long units = (long long)((n + SLICE - 1) / SLICE) * ((k + UNIT_K - 1) / UNIT_K);
    if (grid > units) grid = int(units);
    auto st = static_cast<cudaStream_t>(stream);
    return dtype == 0 ? launch<__nv_bfloat16>(args, grid, st) : launch<__half>(args, grid, st);
}

int probe_read(const void* p, long long bytes, unsigned* sink, int grid, int block, void* stream) {
    read_all<<<grid, block, 0, static_cast<cudaStream_t>(stream)>>>(static_cast<const uint4*>(p), bytes / 16, sink);
    return int(cudaGetLastError());
}

long long probe_partials_bytes(int grid) { return 2LL * grid * 64 * SLICE * 4; }
int probe_slice() { return SLICE; }
}
