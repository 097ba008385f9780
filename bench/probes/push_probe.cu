// How fast can SMs push tiles into a peer GPU's memory by TMA stores, and
// load such tiles back from their own GPU's memory? The fused
// reduce-scatter at mm_rs 512 (docs/history/KERNELS.md v20) pushes 4 MiB per rank
// from 68 SMs, at ~300-350 GB/s in its traces while 64 other SMs still
// multiply, and its own tiles then load 4 MiB of partials, slowly when they
// all do at once (v20c). This probe times both with nothing else running:
//
//   push: C CTAs on GPU 0 each store 64 KiB (a 128 x 256 bf16 tile, eight
//         boxes of 64 rows x 128 bytes) by TMA into GPU 1's memory, laid
//         out row-major with 16 KiB rows (the inbox: [rows][8192] bf16) or
//         each box contiguous; alone, with a st.release.sys flag per CTA
//         after its stores completed, and with GPU 1 pushing the same into
//         GPU 0 at once (both directions, as the fused kernel's two ranks);
//         and all of that again by TMA reduce-adds (cp.reduce.async.bulk
//         .add, bf16), which would let a peer add its partial straight
//         into C, plus reduce-adds into the GPU's own memory.
//   load: C CTAs each load 64 KiB by TMA from their own GPU's memory in
//         those layouts, hot (just written) and after 256 MiB of other
//         writes went through L2.
//
// Times are the kernel's own: %globaltimer from the first CTA's start to
// the last CTA's end, median of 9 launches.
//   nvcc -O2 -arch=sm_90a push_probe.cu -lcuda -o push_probe && ./push_probe
#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "cuda_check.h"
#include "probe_sync.h"

constexpr int COLS = 8192;          // a row-major buffer's columns (bf16): 16 KiB rows
constexpr int TILE_BYTES = 65536;   // per CTA: 128 rows x 256 columns of bf16
constexpr int BOXES = 8;            // 64 rows x 64 columns (128 bytes) each
constexpr int TILES_PER_ROW = COLS / 256;
constexpr int SMEM = TILE_BYTES + 1024 + 64;  // the tile, alignment slack, an mbarrier
constexpr int RUNS = 9;

enum Layout { ROW_MAJOR, CONTIGUOUS };

__device__ __forceinline__ uint32_t smem_addr(const void* p) { return (uint32_t)__cvta_generic_to_shared(p); }

// Where box b of CTA c goes: (x, y, z) in the layout's 3-D map.
__device__ __forceinline__ void box_at(int layout, int c, int b, int& x, int& y, int& z) {
    if (layout == ROW_MAJOR) {
        x = (c % TILES_PER_ROW) * 256 + (b % 4) * 64;
        y = (c / TILES_PER_ROW) * 128 + (b / 4) * 64;
        z = 0;
    } else {
        x = 0;
        y = 0;
        z = c * BOXES + b;
    }
}

__global__ void __launch_bounds__(128) push(const __grid_constant__ CUtensorMap map, int layout, uint32_t* flags,
                                            int reduce, uint64_t* times) {
    extern __shared__ unsigned char raw[];
    unsigned char* tile = raw + ((1024 - (smem_addr(raw) & 1023)) & 1023);
    for (int i = threadIdx.x; i < TILE_BYTES / 16; i += blockDim.x) {
        ((uint4*)tile)[i] = make_uint4(blockIdx.x, i, 0x3f803f80u, 0x40004000u);
    }
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    __syncthreads();
    if (threadIdx.x != 0) return;
    const uint64_t start = now_ns();
    for (int b = 0; b < BOXES; b++) {
        int x, y, z;
        box_at(layout, blockIdx.x, b, x, y, z);
        if (reduce) {
            // Adds the box into what is there (bf16, from the map's type).
            asm volatile(
                "cp.reduce.async.bulk.tensor.3d.global.shared::cta.add.tile.bulk_group [%0, {%1, %2, %3}], [%4];" ::"l"(
                    &map),
                "r"(x), "r"(y), "r"(z), "r"(smem_addr(tile + b * 8192))
                : "memory");
        } else {
            asm volatile("cp.async.bulk.tensor.3d.global.shared::cta.bulk_group [%0, {%1, %2, %3}], [%4];" ::"l"(&map),
                         "r"(x), "r"(y), "r"(z), "r"(smem_addr(tile + b * 8192))
                         : "memory");
        }
    }
    asm volatile("cp.async.bulk.commit_group;" ::: "memory");
    asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
    if (flags) {
        asm volatile("fence.proxy.async.global;" ::: "memory");
        asm volatile("st.release.sys.u32 [%0], %1;" ::"l"(flags + blockIdx.x), "r"(1u) : "memory");
    }
    times[2 * blockIdx.x] = start;
    times[2 * blockIdx.x + 1] = now_ns();
}

__global__ void __launch_bounds__(128) load(const __grid_constant__ CUtensorMap map, int layout, uint64_t* times) {
    extern __shared__ unsigned char raw[];
    unsigned char* tile = raw + ((1024 - (smem_addr(raw) & 1023)) & 1023);
    uint64_t* bar = (uint64_t*)(tile + TILE_BYTES);
    if (threadIdx.x != 0) return;
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_addr(bar)));
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    const uint64_t start = now_ns();
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)), "r"(TILE_BYTES)
                 : "memory");
    for (int b = 0; b < BOXES; b++) {
        int x, y, z;
        box_at(layout, blockIdx.x, b, x, y, z);
        asm volatile(
            "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, "
            "%4}], [%5];" ::"r"(smem_addr(tile + b * 8192)),
            "l"(&map), "r"(x), "r"(y), "r"(z), "r"(smem_addr(bar))
            : "memory");
    }
    asm volatile(
        "{\n.reg .pred done;\n"
        "wait_%=:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], 0;\n"
        "@!done bra wait_%=;\n}\n" ::"r"(smem_addr(bar))
        : "memory");
    times[2 * blockIdx.x] = start;
    times[2 * blockIdx.x + 1] = now_ns();
}

// The 3-D map of `ctas` tiles at `base` in `layout`: [1][rows][COLS] or
// [boxes][64][64], boxes of 64 x 64 x 1, 128-byte swizzle (as symm's maps).
static CUtensorMap encode(void* base, int layout, int ctas) {
    cuuint64_t dims[3], strides[2];
    if (layout == ROW_MAJOR) {
        const int rows = (ctas + TILES_PER_ROW - 1) / TILES_PER_ROW * 128;
        dims[0] = COLS, dims[1] = rows, dims[2] = 1;
        strides[0] = COLS * 2, strides[1] = (cuuint64_t)rows * COLS * 2;
    } else {
        dims[0] = 64, dims[1] = 64, dims[2] = (cuuint64_t)ctas * BOXES;
        strides[0] = 128, strides[1] = 8192;
    }
    const cuuint32_t box[3] = {64, 64, 1}, elem[3] = {1, 1, 1};
    CUtensorMap map;
    CUresult r = cuTensorMapEncodeTiled(&map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 3, base, dims, strides, box, elem,
                                        CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                                        CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    if (r != CUDA_SUCCESS) {
        fprintf(stderr, "cuTensorMapEncodeTiled: %d\n", (int)r);
        exit(1);
    }
    return map;
}

// First CTA start to last CTA end, in us.
static double span_us(const uint64_t* host_times, int ctas) {
    uint64_t lo = UINT64_MAX, hi = 0;
    for (int c = 0; c < ctas; c++) {
        lo = std::min(lo, host_times[2 * c]);
        hi = std::max(hi, host_times[2 * c + 1]);
    }
    return (hi - lo) / 1e3;
}

static double median(std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
}

struct Side {
    int dev;
    cudaStream_t stream;
    void* dst;        // the peer's memory this side pushes into
    void* local;      // this side's memory it loads from
    uint32_t* own_flags;
    uint32_t* flags;  // the peer's: each CTA's flag, released into the peer as in symm's kernel
    uint64_t* times;
    std::vector<uint64_t> host;
};

int main() {
    int devices = 0;
    CK(cudaGetDeviceCount(&devices));
    if (devices < 2) {
        printf("push_probe: needs two GPUs with peer access\n");
        return 0;
    }
    const int max_ctas = 132;
    // Row-major: 128 rows per TILES_PER_ROW CTAs (more than the contiguous layout's C x 64 KiB).
    const size_t bytes = (size_t)(max_ctas / TILES_PER_ROW + 1) * 128 * COLS * 2;
    Side side[2];
    for (int d = 0; d < 2; d++) {
        Side& s = side[d];
        s.dev = d;
        CK(cudaSetDevice(d));
        CK(cudaDeviceEnablePeerAccess(1 - d, 0));
        CK(cudaStreamCreateWithFlags(&s.stream, cudaStreamNonBlocking));
        CK(cudaMalloc(&s.local, bytes));
        CK(cudaMemset(s.local, 0x3c, bytes));
        CK(cudaMalloc(&s.own_flags, max_ctas * sizeof(uint32_t)));
        CK(cudaMalloc(&s.times, 2 * max_ctas * sizeof(uint64_t)));
        CK(cudaFuncSetAttribute(push, cudaFuncAttributeMaxDynamicSharedMemorySize, SMEM));
        CK(cudaFuncSetAttribute(load, cudaFuncAttributeMaxDynamicSharedMemorySize, SMEM));
        s.host.resize(2 * max_ctas);
    }
    for (int d = 0; d < 2; d++) side[d].dst = side[1 - d].local, side[d].flags = side[1 - d].own_flags;
    void* evict = nullptr;
    CK(cudaSetDevice(0));
    CK(cudaMalloc(&evict, 256u << 20));

    const int counts[] = {8, 16, 32, 64, 68, 128, 132};
    const char* names[] = {"row-major", "contiguous"};
    // Modes: stores into the peer alone, with a release per CTA, both GPUs
    // at once; the same by TMA reduce-adds (bf16); reduce-adds into this
    // GPU's own memory.
    constexpr int MODES = 7;
    printf("push: C CTAs x 64 KiB by TMA into the peer GPU (reduce-add: added to what is there), GB/s (us), median of %d\n",
           RUNS);
    printf("%-11s %5s %16s %16s %16s %16s %16s %16s %16s\n", "layout", "C", "store", "+release.sys", "both dirs",
           "reduce-add", "+release.sys", "both dirs", "reduce, local");
    for (int layout = 0; layout < 2; layout++) {
        for (int ctas : counts) {
            double gbps[MODES], us[MODES];
            for (int mode = 0; mode < MODES; mode++) {
                const int reduce = mode >= 3;
                const bool release = mode == 1 || mode == 4, both = mode == 2 || mode == 5, local = mode == 6;
                std::vector<double> runs;
                for (int run = 0; run < RUNS; run++) {
                    const int sides = both ? 2 : 1;
                    for (int d = 0; d < sides; d++) {
                        CK(cudaSetDevice(d));
                        CK(cudaDeviceSynchronize());
                    }
                    for (int d = 0; d < sides; d++) {
                        Side& s = side[d];
                        CK(cudaSetDevice(d));
                        const CUtensorMap map = encode(local ? s.local : s.dst, layout, ctas);
                        push<<<ctas, 128, SMEM, s.stream>>>(map, layout, release ? s.flags : nullptr, reduce, s.times);
                        CK(cudaGetLastError());
                    }
                    double worst = 0;
                    for (int d = 0; d < sides; d++) {
                        Side& s = side[d];
                        CK(cudaSetDevice(d));
                        CK(cudaStreamSynchronize(s.stream));
                        CK(cudaMemcpy(s.host.data(), s.times, 2 * ctas * sizeof(uint64_t), cudaMemcpyDeviceToHost));
                        worst = std::max(worst, span_us(s.host.data(), ctas));
                    }
                    runs.push_back(worst);
                }
                us[mode] = median(runs);
                gbps[mode] = (double)ctas * TILE_BYTES / (us[mode] * 1e3);
            }
            printf("%-11s %5d", names[layout], ctas);
            for (int mode = 0; mode < MODES; mode++) printf(" %7.0f (%6.1f)", gbps[mode], us[mode]);
            printf("\n");
        }
    }

    printf("load: C CTAs x 64 KiB by TMA from this GPU's memory, GB/s (us), median of %d\n", RUNS);
    printf("%-11s %5s %16s %16s\n", "layout", "C", "hot", "after 256 MiB");
    CK(cudaSetDevice(0));
    Side& s = side[0];
    for (int layout = 0; layout < 2; layout++) {
        for (int ctas : counts) {
            double gbps[2], us[2];
            const CUtensorMap map = encode(s.local, layout, ctas);
            for (int cold = 0; cold < 2; cold++) {
                std::vector<double> runs;
                for (int run = 0; run < RUNS; run++) {
                    // Hot: the tiles just rewritten (through L2); cold: then
                    // 256 MiB of other writes.
                    CK(cudaMemsetAsync(s.local, 0x3c, std::min(bytes, (size_t)ctas * TILE_BYTES + (size_t)128 * COLS * 2), s.stream));
                    if (cold) CK(cudaMemsetAsync(evict, run, 256u << 20, s.stream));
                    load<<<ctas, 128, SMEM, s.stream>>>(map, layout, s.times);
                    CK(cudaGetLastError());
                    CK(cudaStreamSynchronize(s.stream));
                    CK(cudaMemcpy(s.host.data(), s.times, 2 * ctas * sizeof(uint64_t), cudaMemcpyDeviceToHost));
                    runs.push_back(span_us(s.host.data(), ctas));
                }
                us[cold] = median(runs);
                gbps[cold] = (double)ctas * TILE_BYTES / (us[cold] * 1e3);
            }
            printf("%-11s %5d %7.0f (%6.1f) %7.0f (%6.1f)\n", names[layout], ctas, gbps[0], us[0], gbps[1], us[1]);
        }
    }
    return 0;
}
