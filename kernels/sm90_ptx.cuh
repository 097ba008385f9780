// PTX plumbing of the fused Hopper matmul: mbarriers, TMA loads and
// stores, tensor-map prefetch, wgmma descriptors, fences and the wgmma
// instruction for each input type and tile width (wgmma.cuh). sm_90a only.
#pragma once
#include "sm90_params.cuh"
#include "wgmma.cuh"

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

static __device__ __forceinline__ uint32_t symm_smem_addr(const void* p) {
    return (uint32_t)__cvta_generic_to_shared(p);
}

static __device__ __forceinline__ void symm_mbar_init(uint64_t* bar, uint32_t count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(symm_smem_addr(bar)), "r"(count));
}

static __device__ __forceinline__ void symm_mbar_expect_tx(uint64_t* bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(symm_smem_addr(bar)), "r"(bytes)
                 : "memory");
}

static __device__ __forceinline__ void symm_mbar_arrive(uint64_t* bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(symm_smem_addr(bar)) : "memory");
}

static __device__ __forceinline__ void symm_mbar_wait(uint64_t* bar, uint32_t parity) {
    asm volatile(
        "{\n.reg .pred done;\n"
        "wait_%=:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        "@!done bra wait_%=;\n}\n" ::"r"(symm_smem_addr(bar)),
        "r"(parity)
        : "memory");
}

// 2-D tile load: box at (x = element along the contiguous dim, y = row).
static __device__ __forceinline__ void symm_tma_load(void* dst, const symm_tmap* map, int32_t x, int32_t y,
                                                     uint64_t* bar) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], "
        "[%4];" ::"r"(symm_smem_addr(dst)),
        "l"(map), "r"(x), "r"(y), "r"(symm_smem_addr(bar))
        : "memory");
}

// 3-D tile load: box at (x, y, z = the slowest dimension).
static __device__ __forceinline__ void symm_tma_load3(void* dst, const symm_tmap* map, int32_t x, int32_t y,
                                                      int32_t z, uint64_t* bar) {
    asm volatile(
        "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], "
        "[%5];" ::"r"(symm_smem_addr(dst)),
        "l"(map), "r"(x), "r"(y), "r"(z), "r"(symm_smem_addr(bar))
        : "memory");
}

// 2-D tile store from shared memory (box at x, y), in this thread's bulk group.
static __device__ __forceinline__ void symm_tma_store(const symm_tmap* map, const void* src, int32_t x, int32_t y) {
    asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%1, %2}], [%3];" ::"l"(map), "r"(x),
                 "r"(y), "r"(symm_smem_addr(src))
                 : "memory");
}

// The same box added to what the map's memory holds (in the map's type).
static __device__ __forceinline__ void symm_tma_reduce_add(const symm_tmap* map, const void* src, int32_t x,
                                                           int32_t y) {
    asm volatile("cp.reduce.async.bulk.tensor.2d.global.shared::cta.add.tile.bulk_group [%0, {%1, %2}], [%3];" ::"l"(
                     map),
                 "r"(x), "r"(y), "r"(symm_smem_addr(src))
                 : "memory");
}

// Fetches a tensor map into the TMA unit's descriptor cache ahead of its
// first use, as CUTLASS does at a kernel's start: otherwise the first copy
// through a map waits for it, and the maps first used late (a pushed tile's
// stores, an own tile's partials and sums) are on the kernel's last path.
static __device__ __forceinline__ void symm_tmap_prefetch(const symm_tmap* map) {
    asm volatile("prefetch.tensormap [%0];" ::"l"(map) : "memory");
}

// Shared-memory matrix descriptor of a K-major tile with 128-byte rows and
// the 128-byte swizzle TMA wrote: stride between 8-row groups 1024 bytes.
static __device__ __forceinline__ uint64_t symm_smem_desc(const void* p) {
    const uint64_t addr = symm_smem_addr(p);
    return ((addr & 0x3FFFF) >> 4) | (1ull << 16) | (64ull << 32) | (1ull << 62);
}

static __device__ __forceinline__ void symm_wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
static __device__ __forceinline__ void symm_wgmma_commit() {
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
}
template <int N>
static __device__ __forceinline__ void symm_wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}

// The two consumer warpgroups (256 threads) meet here; named barrier 1
// leaves barrier 0 (__syncthreads) to the whole CTA.
static __device__ __forceinline__ void symm_consumers_sync() {
    asm volatile("bar.sync 1, 256;" ::: "memory");
}

// Tells the compiler the registers of `acc` are read and written here, so
// it neither moves their accesses across this point nor assumes they are
// unchanged (as CUTLASS's warpgroup_fence_operand): wgmma writes them
// asynchronously.
template <int N>
static __device__ __forceinline__ void symm_fence_operand(float (&acc)[N]) {
#pragma unroll
    for (int i = 0; i < N; i++) asm volatile("" : "+f"(acc[i])::"memory");
}

// One wgmma of the tile's 64-row slice: 64 x BN x (32 bytes of k).
template <int A_DT, int B_DT, int BN>
static __device__ __forceinline__ void symm_wgmma(float (&d)[BN / 2], uint64_t da, uint64_t db, int acc) {
#define SYMM_WGMMA_CASE(A, B, F)                                                             \
    if constexpr (A_DT == A && B_DT == B && BN == 256) symm_wgmma_##F##_n256(d, da, db, acc); \
    if constexpr (A_DT == A && B_DT == B && BN == 128) symm_wgmma_##F##_n128(d, da, db, acc);
    SYMM_WGMMA_CASE(SYMM_DT_BF16, SYMM_DT_BF16, bf16)
    SYMM_WGMMA_CASE(SYMM_DT_F16, SYMM_DT_F16, f16)
    SYMM_WGMMA_CASE(SYMM_DT_E4M3, SYMM_DT_E4M3, e4m3_e4m3)
    SYMM_WGMMA_CASE(SYMM_DT_E4M3, SYMM_DT_E5M2, e4m3_e5m2)
    SYMM_WGMMA_CASE(SYMM_DT_E5M2, SYMM_DT_E4M3, e5m2_e4m3)
#undef SYMM_WGMMA_CASE
}

// The narrow peer tiles' wgmma (W = 232, 240 or 248 columns, 16-bit inputs) into
// the first W / 2 of the 256-wide tile's accumulators.
template <int A_DT, int B_DT, int W>
static __device__ __forceinline__ void symm_wgmma_narrow(float (&d)[128], uint64_t da, uint64_t db, int acc) {
    static_assert(A_DT == B_DT && (A_DT == SYMM_DT_BF16 || A_DT == SYMM_DT_F16) && (W == 232 || W == 240 || W == 248),
                  "narrow tiles: 16-bit inputs, 232, 240 or 248 columns");
    if constexpr (A_DT == SYMM_DT_BF16 && W == 232) symm_wgmma_bf16_n232(d, da, db, acc);
    if constexpr (A_DT == SYMM_DT_BF16 && W == 240) symm_wgmma_bf16_n240(d, da, db, acc);
    if constexpr (A_DT == SYMM_DT_BF16 && W == 248) symm_wgmma_bf16_n248(d, da, db, acc);
    if constexpr (A_DT == SYMM_DT_F16 && W == 232) symm_wgmma_f16_n232(d, da, db, acc);
    if constexpr (A_DT == SYMM_DT_F16 && W == 240) symm_wgmma_f16_n240(d, da, db, acc);
    if constexpr (A_DT == SYMM_DT_F16 && W == 248) symm_wgmma_f16_n248(d, da, db, acc);
}

#endif  // __CUDA_ARCH_FEAT_SM90_ALL
