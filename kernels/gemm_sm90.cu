// One persistent matmul for Hopper (sm_90a) whose tiles can wait for their
// rows to arrive (all-gather + matmul) or push their results to the rank
// that reduces them (matmul + reduce-scatter).
//
//   C[m, n] = A[m, k] * B[n, k]^T      A row-major, B "K-major" (a Linear
//                                      weight [n, k], i.e. B = W.t()), f32
//                                      accumulation, C f32, bf16 or f16.
//
// Inputs: bf16 or f16 (both alike), or fp8 (e4m3 / e5m2, as torch._scaled_mm:
// not both e5m2) with f32 scales, tensor-wise or one per row of A and
// column of B, and an optional bias of C's type: C = sa * sb * A B^T + bias.
// A k-block is 128 bytes of each row either way (64 or 128 elements), so
// the ring, the swizzle and the wgmma descriptors are the same; an 8-bit
// wgmma takes k = 32 per instruction where a 16-bit one takes 16. The
// tensor cores add fp8 products into their accumulators with about 14 bits
// of mantissa (truncating), so by default (the `_exact` kernels, as
// cuBLASLt unless fast_accum) each k-block's partial sum is added into f32
// registers of their own; that takes more accumulators, which only the
// 128-wide tile has room for. Without (torch's use_fast_accum) the
// accumulators run through the whole k. A separate kernel, not a runtime
// flag: ptxas serializes wgmma issued on paths that diverge at run time.
//
// Structure (as CUTLASS's warp-specialized persistent kernels):
//   * 3 warpgroups per CTA, one CTA per SM: warpgroup 0 is the producer (one
//     thread issues TMA loads of A and B k-blocks into a STAGES-deep
//     shared-memory ring, each stage completed on an mbarrier); warpgroups 1
//     and 2 are consumers, each multiplying 64 rows of the 128-row tile with
//     wgmma (B and A straight from shared memory, 128-byte swizzle) and
//     handing the stage back on an "empty" mbarrier.
//   * Tiles are walked in a fixed order by every CTA (tile = blockIdx.x +
//     i * gridDim.x), grouped along M for L2 reuse. The rows of A are split
//     into `chunks` equal row chunks (one per rank in the fused operations)
//     visited in `order`; a tile never straddles two chunks. The row tiles
//     of all chunks, in that order, form one list cut into groups of
//     GROUP_M, so a group may hold tiles of two chunks: with chunks of
//     fewer than GROUP_M row tiles (a small M), the tiles that share B's
//     columns still run together and B is read once. The reduce-scatter
//     keeps each group within a chunk (its own chunk comes last).
//   * Edges: TMA fills out-of-range rows/columns/k with zeros, the epilogue
//     masks rows past the chunk and columns past n. K must give 16-byte row
//     strides (k % 8 == 0 for 16-bit types, k % 16 for 8-bit ones), which
//     the host checks.
//
// Fused all-gather (ready != NULL): a chunk arrives in `slices` slices of
// k (columns), slice s announced by ready[c * slices + s] != 0, written by
// the copy engine that pulled it, after the data. Before loading a k-block
// of A for a tile of chunk c, the producer waits (acquire, system scope,
// bounded by the timeout) for the slice that holds it. A tile so waits
// only for its first slice, not for the whole chunk: the others land while
// it multiplies, which lets a chunk's tiles run in the first wave beside
// the local ones (see the tile order). With more than one slice, the
// gathered A lies slice-major, [slices][m][k / slices] (tm_a is 3-D), so
// that each slice of a chunk is one contiguous copy: pitched copies of
// narrow rows ran at half a copy engine's speed (one H100, from pinned
// host memory). The local chunk is read from its own tensor map (the
// caller's shard, no copy).
//
// Fused reduce-scatter (rs != 0): chunk c of the rows is rank c's output.
// Tiles of a peer's chunk are written (in C's dtype) into that peer's inbox
// slot for this rank, then flagged with a release store into the peer's tile
// flags (see "Calls in sequence" below). The tiles of this rank's own chunk
// come last in `order`; each adds every peer's partial of the same tile to
// its accumulators before writing the output. With rs_push (rows of whole
// 16-byte units, inboxes at 16-byte aligned addresses: the same on every
// rank, which the narrow tiles below rely on) both are TMA's work, as in a
// plain matmul's epilogue: a peer's tile leaves by TMA stores from the
// staging area, which drain over NVLink while the consumers run the next
// tile's mainloop, and a warp that would otherwise idle sets its flag once
// they completed (stores from registers and a fence per tile kept both
// consumer warpgroups waiting on NVLink, and every CTA sent its tile at
// once); for an own tile the producer waits for the peers' flags and loads
// their partial tiles into the ring behind the tile's k-blocks, so the
// consumers find them in shared memory, with no load latency of their own to
// wait on; the sums go to C by TMA where C's address and stride allow,
// from the ring where they were added (rs_c_store), else from registers.
// Without rs_push, stores, flags and adds go from registers.
//
// Narrow peer tiles (rs_narrow_n != 0, rs_push, 16-bit inputs, 256-wide
// tiles): where one wave of 256-wide tiles leaves SMs idle (mm_rs at
// M = 512: 128 tiles on 132 SMs), the peers' chunks are cut into more,
// narrower tiles (rs_narrow_n per row tile, rs_narrow_w wide, the first
// few 8 more columns, the last rs_narrow_less 8 fewer: 232, 240 and 248 at
// n = 8192) that take those SMs, so they finish their k-loop a few percent
// before this rank's own 256-wide tiles and their pushes cross NVLink
// while the own tiles still multiply. Three widths, so that the k-loops
// end a few us apart and the link drains each group's pushes before the
// next one's come, instead of taking all of them at once; every tile still
// reads B's k-blocks with the others of its columns, in step. Their TMA
// stores cover the tile in boxes of 128 bytes of a row, the last one
// shifted back to end with the tile (not into the next tile's columns;
// copying those columns with the threads' stores took ~2 us more per tile,
// bench/KERNELS.md v23). An own tile waits for the flags of every
// narrow tile its columns overlap. The tiling is the shape's alone, so
// every rank cuts the chunks alike. At world 2 with every rank's C in
// symmetric memory (rs_c_store SYMM_RS_C_ADD), the narrow tiles store
// straight into the peer's C instead of its inbox, and the own tiles add
// their sums to them by TMA reduce-adds (bench/KERNELS.md v28b).
//
// Column cut (cut_n != 0, not rs, 16-bit inputs and C stored by TMA,
// 256-wide tiles): a persistent grid of S CTAs over T tiles takes
// ceil(T / S) tiles' time, so where T is just over a multiple of S (4096
// tiles of 128 x 256 on 132 SMs: 31.03 waves, the 32nd nearly empty) the
// columns are cut into a few more, narrower tiles (232 to 256 columns,
// the narrow peer tiles' k-loops) that fill the waves: 34 per row tile of
// 240 or 248 columns there, whose busiest CTA computes 7952 columns
// against 8192. The host picks the cut from the grid
// (Sm90Matmul::column_cut); a tile narrower than BN is stored like a
// narrow peer tile, the last box shifted back to end with it.
//
// Calls in sequence, with no barrier between them: each rank's state
// (symm_rs_state) counts its completed calls (`epoch`). A call is epoch
// e = epoch + 1 on every rank. A tile's flag is set to e when it lands, so
// flags never need resetting, and the reader waits for its flags to reach
// e. A rank pushes into a peer's inbox only once that peer's epoch has
// reached e - 1, that is, once the peer's previous call has read all of
// its inbox; the last CTA of a call to finish reading its inbox raises its
// rank's epoch (with rs_push, as soon as its consumers handed back the ring,
// beside their stores: counted after them, the last CTA's fence and release
// added ~2 us to the kernel, bench/KERNELS.md "v18").
// Neither depends on the previous call's shape, and both live in device
// memory, so graph replays keep them too. The state, its flags and the
// inbox must be memory no other work writes.
#include "common.cuh"
#include "dtype.cuh"
#include "wgmma.cuh"

#define SYMM_GEMM_MAX_CHUNKS 16
#define SYMM_GEMM_BM 128
// A k-block: 128 bytes of each row of A and B (the 128-byte swizzle's width).
#define SYMM_GEMM_BK_BYTES 128
#define SYMM_GEMM_THREADS 384
// Tiles of a group of this many row-tiles are visited column by column, so
// concurrently running tiles share A rows and B columns in L2.
#define SYMM_GEMM_GROUP_M 8
// Signal channel named in timeout errors of the fused matmul's waits.
#define SYMM_GEMM_CHANNEL (-2)
// Trace (p.trace != 0, a profiling aid): per CTA, SYMM_GEMM_TRACE_SLOTS
// u64, the %globaltimer (ns) at these points of its last tile, 0 where not
// reached. Mirrored by `sm90_trace.rs`.
#define SYMM_GEMM_TRACE_SLOTS 15
#define SYMM_TRACE_START 0        // the CTA's barriers are set up
#define SYMM_TRACE_MAINLOOP 1     // warpgroup 1's last wgmma done
#define SYMM_TRACE_EPILOGUE 2     // warpgroup 1's stores issued (a peer's inbox, or C)
#define SYMM_TRACE_PUSHED 3       // rs: warpgroup 1's stores into a peer's inbox complete
#define SYMM_TRACE_FLAGGED 4      // rs: that tile's flag set
#define SYMM_TRACE_PARTIALS 5     // rs: an own tile's peer flags all seen, its loads issued (producer)
#define SYMM_TRACE_CHUNK 6        // the last tile's chunk + 1 (not a time)
#define SYMM_TRACE_END 7          // warpgroup 1 done
#define SYMM_TRACE_ADDED 8        // rs: an own tile's peer partials added (from the ring: and stored, the stores done reading) (warpgroup 1)
#define SYMM_TRACE_DRAINED 9      // warpgroup 1's last stores done reading shared memory
#define SYMM_TRACE_READY 10       // rs, a narrow peer tile: warpgroup 1 past the wait for the peers' inboxes
#define SYMM_TRACE_BOXES 11       // rs, a narrow peer tile: warpgroup 1's TMA stores issued (as EPILOGUE since v23)
#define SYMM_TRACE_HANDED 12      // rs: the flagging warp saw both warpgroups' stores complete (its release next)
#define SYMM_TRACE_LANDED 13      // rs, an own tile: warpgroup 1 found its first stage of partials landed in the ring
#define SYMM_TRACE_LANDED_ALL 14  // rs, an own tile: ... and its last stage

// A CUtensorMap (cuTensorMapEncodeTiled), opaque to the kernel.
struct alignas(64) symm_tmap {
    uint64_t opaque[16];
};

// rs_push: the reduce-scatter's TMA maps. inbox: this rank's inbox,
// [world][chunk_rows][n] of C's type, boxes of 128 rows x 128 bytes of one
// slot; push[d]: rank d's inbox slot for this rank, [chunk_rows][n], boxes
// of 64 rows x 128 bytes (push[rank] unused).
struct symm_rs_maps {
    symm_tmap inbox;
    symm_tmap push[SYMM_GEMM_MAX_CHUNKS];
};

// Reduce-scatter: a rank's state, followed by its tile flags, u32
// [world][tiles per chunk], flag[src][tile] the epoch in which rank src's
// partial of that tile landed. Zeroed once, when the memory is made.
struct symm_rs_state {
    uint32_t epoch;     // calls completed (every CTA done reading the inbox)
    uint32_t finished;  // CTAs of the running call done reading it
    uint32_t started;   // SYMM_RS_C_ADD: calls whose kernel has started (C free for the peer)
    uint32_t pad[61];   // the flags start 256 bytes in
};
#define SYMM_RS_STATE_BYTES 256
static_assert(sizeof(symm_rs_state) == SYMM_RS_STATE_BYTES, "the flags follow the state");

// Mirrored by `GemmParams` in src/backend/cuda/sm90_gemm.rs (#[repr(C)]).
struct symm_gemm_params {
    int32_t m, n, k;
    int32_t out_dtype;     // SYMM_DT_*
    uint64_t c;            // C (plain) or this rank's output chunk (rs)
    int64_t ldc;           // elements
    int32_t chunks;        // row chunks of A (1 for a plain matmul)
    int32_t chunk_rows;    // rows per chunk (the last one may be shorter)
    int32_t order[SYMM_GEMM_MAX_CHUNKS];  // chunk visited at position i
    int32_t local_chunk;   // chunk read through tm_a_local (-1: none)
    int32_t rs;            // 1: reduce-scatter epilogue
    const uint32_t* ready; // all-gather arrival flags per chunk (NULL: none)
    int32_t rank, world;
    uint64_t inbox[SYMM_GEMM_MAX_CHUNKS];       // rs: rank d's inbox, [world][chunk_rows][n] of C's dtype
    uint64_t rs_state[SYMM_GEMM_MAX_CHUNKS];    // rs: rank d's symm_rs_state and tile flags
    float alpha;           // scales the product (1/world for an average)
    int32_t c_tma;         // 1: plain C stored through tm_c (TMA, via shared memory)
    uint64_t timeout_ns;
    symm_async_error* err;
    // fp8 only (scale_mode != 0): C = alpha * (sa * sb * A B^T + bias).
    const float* a_scale;  // one f32, or (row-wise) one per row of A
    const float* b_scale;  // one f32, or (row-wise) one per column of C
    uint64_t bias;         // 0, or n elements of C's dtype
    int64_t a_scale_slot;  // row-wise: distance between chunks' row scales (gathered into slots)
    int32_t scale_mode;    // SYMM_GEMM_SCALES_*
    int32_t rs_push;       // rs: 1 = through TMA and shared memory (tm_rs; see above)
    int32_t slices;        // all-gather: k-slices per chunk, flags ready[chunk * slices + slice]
    int32_t slice_kblocks; // all-gather: k-blocks per slice (slices > 1: tm_a is [slices][m][k / slices])
    uint64_t trace;        // 0, or [gridDim.x][SYMM_GEMM_TRACE_SLOTS] u64 (see SYMM_GEMM_TRACE_SLOTS)
    int32_t rs_narrow_n;   // rs_push: tiles per row tile of a peer's chunk (0: as wide as the own ones)
    int32_t rs_narrow_w;   // their width (a multiple of 8; the first few are 8 wider, to cover n, see rs_narrow_less)
    int32_t rs_c_store;    // rs_push: how this rank's own rows reach C (SYMM_RS_C_*)
    int32_t rs_push_ring;  // narrow peer tiles, 16-bit C: 1 = a CTA's last one pushed from the ring (all boxes at once)
    int32_t rs_narrow_less; // narrow peer tiles: the last this many of a row tile are 8 columns narrower
    int32_t cut_n;         // not rs: tiles per row tile of a column cut (0: BN wide; see "Column cut")
    int32_t cut_w;         // their width (a multiple of 8; the first few are 8 wider, to cover n)
};
// rs_c_store: from registers (C that TMA cannot address), through the
// staging area and tm_c, or by tm_c from the ring where the peers'
// partials were added (symm_add_partials).
#define SYMM_RS_C_REGISTERS 0
#define SYMM_RS_C_STAGED 1
#define SYMM_RS_C_RING 2
// Or through C itself: C lies in symmetric memory (tm_rs push[d] is rank
// d's C); the peer stores its partials straight into C once this rank's
// call has started (symm_rs_state.started), and each own tile, once the
// peer's flags of it are set, adds its sums into them by TMA reduce-adds:
// no partial is loaded back. World 2 (one peer per tile).
#define SYMM_RS_C_ADD 3

// Records `value` in this CTA's trace slot (when tracing).
static __device__ __forceinline__ void symm_trace(const symm_gemm_params& p, int slot, uint64_t value) {
    if (p.trace) ((uint64_t*)p.trace)[(uint64_t)blockIdx.x * SYMM_GEMM_TRACE_SLOTS + slot] = value;
}
static __device__ __forceinline__ void symm_trace_now(const symm_gemm_params& p, int slot) {
    if (p.trace) symm_trace(p, slot, symm_globaltimer_ns());
}
#define SYMM_GEMM_SCALES_NONE 0
#define SYMM_GEMM_SCALES_TENSOR 1
#define SYMM_GEMM_SCALES_ROW 2

// Which SASS the driver loaded: 1 when this module has the sm_90a kernels.
extern "C" __global__ void symm_gemm_sm90_probe(int32_t* out) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    *out = 1;
#else
    *out = 0;
#endif
}

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

// ---------------------------------------------------------------------------
// mbarriers, TMA and wgmma plumbing (PTX).
// ---------------------------------------------------------------------------
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

// A compile-time tile width passed to a generic lambda.
template <int N>
struct symm_width {
    static constexpr int value = N;
};

// ---------------------------------------------------------------------------
// Tile order.
// ---------------------------------------------------------------------------
struct symm_tile {
    int32_t chunk;     // row chunk (rank) the tile belongs to
    int32_t index;     // tile index within its chunk (for rs flags)
    int32_t row0;      // first row in A / C coordinates
    int32_t row_end;   // one past the last valid row (chunk end or m)
    int32_t col0;
    int32_t cols;      // the tile's width: the kernel's BN, or a narrow peer tile's
};

struct symm_tiling {
    int32_t tiles_m;    // row tiles per chunk
    int32_t tiles_n;
    int32_t per_chunk;  // tiles_m * tiles_n
    int32_t total;
    int32_t rows;       // row tiles grouped together: a chunk's (rs) or all of them
    // Narrow tiles (see the header; narrow_n 0: none): per row tile,
    // narrow_n tiles, the first narrow_extra of them narrow_w + 8 wide, the
    // last narrow_less narrow_w - 8. The peers' chunks of a reduce-scatter,
    // or with `cut` every chunk (the column cut).
    int32_t narrow_n, narrow_w, narrow_extra, narrow_less;
    bool cut;
    int32_t flags;      // rs: flags per source rank

    __device__ symm_tiling(const symm_gemm_params& p, int bn) {
        tiles_m = (p.chunk_rows + SYMM_GEMM_BM - 1) / SYMM_GEMM_BM;
        tiles_n = (p.n + bn - 1) / bn;
        per_chunk = tiles_m * tiles_n;
        total = per_chunk * p.chunks;
        rows = p.rs ? tiles_m : tiles_m * p.chunks;
        cut = !p.rs && p.cut_n > 0;
        narrow_n = p.rs && p.rs_push && p.world > 1 ? p.rs_narrow_n : (cut ? p.cut_n : 0);
        narrow_w = cut ? p.cut_w : p.rs_narrow_w;
        narrow_less = narrow_n ? p.rs_narrow_less : 0;
        narrow_extra = narrow_n ? (p.n + 7) / 8 - narrow_n * (narrow_w / 8) + narrow_less : 0;
        flags = per_chunk;
        if (cut) {
            tiles_n = narrow_n;
            per_chunk = tiles_m * tiles_n;
            total = per_chunk * p.chunks;
        } else if (narrow_n) {
            total = per_chunk + (p.chunks - 1) * tiles_m * narrow_n;
            flags = tiles_m * max(tiles_n, narrow_n);
        }
    }

    // rs: the flag of tile `index` of `dst`'s rows, sent by rank `src`.
    __device__ uint32_t* flag(const symm_gemm_params& p, int dst, int src, int index) const {
        return (uint32_t*)(p.rs_state[dst] + SYMM_RS_STATE_BYTES) + (int64_t)src * flags + index;
    }

    // Narrow peer tiles: the first column of tile i of a row tile, and the
    // tile holding column c.
    __device__ int narrow_col0(int i) const {
        return i * narrow_w + 8 * min(i, narrow_extra) - 8 * max(0, i - (narrow_n - narrow_less));
    }
    __device__ int narrow_of(int c) const {
        const int wide = narrow_extra * (narrow_w + 8);
        const int plain = narrow_n - narrow_less;  // the first narrower tile
        const int mid = wide + (plain - narrow_extra) * narrow_w;
        if (c < wide) return c / (narrow_w + 8);
        return c < mid ? narrow_extra + (c - wide) / narrow_w : plain + (c - mid) / (narrow_w - 8);
    }
    __device__ int narrow_cols(int i) const {
        return narrow_w + (i < narrow_extra ? 8 : 0) - (i >= narrow_n - narrow_less ? 8 : 0);
    }

    // rs: the peers' tile that holds column c of own tile `tile` (its index
    // in the peers' numbering): the same tile, or with narrow peer tiles
    // the one that covers c.
    __device__ int source_of(const symm_tile& tile, int c) const {
        return narrow_n ? (tile.index / tiles_n) * narrow_n + narrow_of(c) : tile.index;
    }

    // Tile t: groups of GROUP_M row tiles (of `rows`, the list of row tiles
    // in visiting order) walked column by column.
    __device__ symm_tile at(const symm_gemm_params& p, int bn, int t) const {
        if (narrow_n && !cut) return at_narrow(p, bn, t);
        const int span = rows * tiles_n;  // tiles in one run of the list
        const int in_span = t % span;
        const int group = SYMM_GEMM_GROUP_M * tiles_n;
        const int first_m = (in_span / group) * SYMM_GEMM_GROUP_M;
        const int group_m = min(rows - first_m, SYMM_GEMM_GROUP_M);
        const int in_group = in_span % group;
        const int row = (t / span) * rows + first_m + in_group % group_m;  // in the whole list
        const int tm = row % tiles_m;
        const int tn = in_group / group_m;
        symm_tile tile;
        tile.chunk = p.order[row / tiles_m];
        tile.index = tm * tiles_n + tn;
        place_rows(p, tile, tm);
        tile.col0 = cut ? narrow_col0(tn) : tn * bn;
        tile.cols = cut ? narrow_cols(tn) : bn;
        return tile;
    }

    // The rows of row tile `tm` of `tile.chunk`.
    __device__ static void place_rows(const symm_gemm_params& p, symm_tile& tile, int tm) {
        const int chunk_row0 = tile.chunk * p.chunk_rows;
        tile.row0 = chunk_row0 + tm * SYMM_GEMM_BM;
        tile.row_end = min(chunk_row0 + p.chunk_rows, p.m);
    }

    // With narrow peer tiles (one wave, so the order only keeps each
    // column's row tiles together): the peers' tiles in `order`, then the
    // own chunk's.
    __device__ symm_tile at_narrow(const symm_gemm_params& p, int bn, int t) const {
        const int peer_tiles = tiles_m * narrow_n, peer_total = (p.chunks - 1) * peer_tiles;
        symm_tile tile;
        int tm, tn;
        if (t < peer_total) {
            tile.chunk = p.order[t / peer_tiles];
            tm = t % peer_tiles % tiles_m;
            tn = t % peer_tiles / tiles_m;
            tile.index = tm * narrow_n + tn;
            tile.col0 = narrow_col0(tn);
            tile.cols = narrow_cols(tn);
        } else {
            tile.chunk = p.order[p.chunks - 1];
            tm = (t - peer_total) % tiles_m;
            tn = (t - peer_total) / tiles_m;
            tile.index = tm * tiles_n + tn;
            tile.col0 = tn * bn;
            tile.cols = bn;
        }
        place_rows(p, tile, tm);
        return tile;
    }
};

// ---------------------------------------------------------------------------
// Epilogue: accumulator fragment layout of wgmma m64nNk16 (f32): thread t
// of the warpgroup holds, for each 8-column block j, rows
// 16 * (t / 32) + (t % 32) / 4 (+ 8) and columns 8 * j + 2 * (t % 4) (+ 1):
// d[4j + 0..1] on the first row, d[4j + 2..3] on the row 8 below.
// ---------------------------------------------------------------------------
template <int DT>
static __device__ __forceinline__ void symm_store2(uint64_t base, int64_t idx, float x, float y, bool both,
                                                   bool vec) {
    if constexpr (DT == SYMM_DT_F32) {
        float* p = (float*)base + idx;
        if (both && vec) {
            *(float2*)p = make_float2(x, y);
        } else {
            p[0] = x;
            if (both) p[1] = y;
        }
    } else {
        unsigned short* p = (unsigned short*)base + idx;
        if (both && vec) {
            *(uint32_t*)p = DT == SYMM_DT_BF16 ? symm_pack_bf16x2(x, y) : symm_pack_f16x2(x, y);
        } else {
            p[0] = DT == SYMM_DT_BF16 ? symm_f32_to_bf16_bits(x) : symm_f32_to_f16_bits(x);
            if (both) p[1] = DT == SYMM_DT_BF16 ? symm_f32_to_bf16_bits(y) : symm_f32_to_f16_bits(y);
        }
    }
}

// Adds two elements at `idx` of `base` (a peer's partial tile, written over
// NVLink) to x, y; read through L2 only, never a stale L1 line.
template <int DT>
static __device__ __forceinline__ void symm_load2_add(uint64_t base, int64_t idx, float& x, float& y, bool both) {
    if constexpr (DT == SYMM_DT_F32) {
        const float* p = (const float*)base + idx;
        x += __ldcg(p);
        if (both) y += __ldcg(p + 1);
    } else {
        const unsigned short* p = (const unsigned short*)base + idx;
        const uint32_t a = __ldcg(p), b = both ? __ldcg(p + 1) : 0u;
        x += DT == SYMM_DT_BF16 ? symm_bf16_bits_to_f32(a) : symm_f16_bits_to_f32(a);
        if (both) y += DT == SYMM_DT_BF16 ? symm_bf16_bits_to_f32(b) : symm_f16_bits_to_f32(b);
    }
}

// Transposes 4 x 4 values within each quad of lanes: afterwards lane q of
// the quad holds what lanes 0..3 held at index q. Applied to accumulators of
// 4 consecutive 8-column blocks, lane q then holds 8 consecutive columns of
// its row (block q), which it writes with one 16-byte access: a warp writes
// 64 contiguous bytes per row instead of 16, which matters most for the
// partial tiles pushed to a peer over NVLink.
static __device__ __forceinline__ void symm_quad_transpose(float (&v)[4], int q) {
    const unsigned all = 0xffffffffu;
    const bool odd = q & 1, high = q & 2;
    float s0 = odd ? v[0] : v[1], s1 = odd ? v[2] : v[3];
    float r0 = __shfl_xor_sync(all, s0, 1), r1 = __shfl_xor_sync(all, s1, 1);
    if (odd) {
        v[0] = r0;
        v[2] = r1;
    } else {
        v[1] = r0;
        v[3] = r1;
    }
    s0 = high ? v[0] : v[2];
    s1 = high ? v[1] : v[3];
    r0 = __shfl_xor_sync(all, s0, 2);
    r1 = __shfl_xor_sync(all, s1, 2);
    if (high) {
        v[0] = r0;
        v[1] = r1;
    } else {
        v[2] = r0;
        v[3] = r1;
    }
}

// 8 consecutive 16-bit values: out[i] += the f32 of element i at p (16-byte
// aligned), read through L2 only (a peer's partial tile, written over NVLink).
template <int DT>
static __device__ __forceinline__ void symm_add8(const void* p, float (&x)[8]) {
    const uint4 v = __ldcg((const uint4*)p);
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; i++) {
        x[2 * i] += DT == SYMM_DT_BF16 ? symm_bf16_bits_to_f32(w[i] & 0xffffu) : symm_f16_bits_to_f32(w[i] & 0xffffu);
        x[2 * i + 1] += DT == SYMM_DT_BF16 ? symm_bf16_bits_to_f32(w[i] >> 16) : symm_f16_bits_to_f32(w[i] >> 16);
    }
}

// Writes (rows tile.row0 + slice .. tile.row_end, columns col0 .. n) of the
// accumulators into `base` + (row - row_base) * ld + col, after scaling by
// alpha and adding the partial tiles at `adds[0..nadds)` (same layout).
// 16-bit outputs with 16-byte aligned rows take the quad-transposed path.
template <int DT, int BN>
static __device__ __forceinline__ void symm_epilogue(const float (&d)[BN / 2], const symm_tile& tile, int n,
                                                     int slice_row0, uint64_t base, int64_t row_base, int64_t ld,
                                                     const uint64_t* adds, int nadds, float alpha) {
    const int t = threadIdx.x % 128;
    const int q = t % 4;
    const int r0 = tile.row0 + slice_row0 + 16 * (t / 32) + (t % 32) / 4;
    bool wide = DT != SYMM_DT_F32 && ld % 8 == 0 && base % 16 == 0;
    for (int s = 0; s < nadds; s++) wide = wide && adds[s] % 16 == 0;
    if (wide) {
#pragma unroll
        for (int i = 0; i < BN / 32; i++) {
#pragma unroll
            for (int h = 0; h < 2; h++) {
                float lo[4], hi[4];
#pragma unroll
                for (int jj = 0; jj < 4; jj++) {
                    lo[jj] = d[4 * (4 * i + jj) + 2 * h] * alpha;
                    hi[jj] = d[4 * (4 * i + jj) + 2 * h + 1] * alpha;
                }
                symm_quad_transpose(lo, q);
                symm_quad_transpose(hi, q);
                const int row = r0 + 8 * h;
                const int col = tile.col0 + 32 * i + 8 * q;
                if (row >= tile.row_end || col >= n) continue;
                float x[8];
#pragma unroll
                for (int kk = 0; kk < 4; kk++) {
                    x[2 * kk] = lo[kk];
                    x[2 * kk + 1] = hi[kk];
                }
                const int64_t idx = (int64_t)(row - row_base) * ld + col;
                unsigned short* out = (unsigned short*)base + idx;
                if (col + 8 <= n) {
                    for (int s = 0; s < nadds; s++) symm_add8<DT>((const unsigned short*)adds[s] + idx, x);
                    uint4 v;
                    if constexpr (DT == SYMM_DT_BF16) {
                        v = make_uint4(symm_pack_bf16x2(x[0], x[1]), symm_pack_bf16x2(x[2], x[3]),
                                       symm_pack_bf16x2(x[4], x[5]), symm_pack_bf16x2(x[6], x[7]));
                    } else {
                        v = make_uint4(symm_pack_f16x2(x[0], x[1]), symm_pack_f16x2(x[2], x[3]),
                                       symm_pack_f16x2(x[4], x[5]), symm_pack_f16x2(x[6], x[7]));
                    }
                    *(uint4*)out = v;
                } else {
                    // The last, partial group of columns: element by element.
                    for (int e = 0; col + e < n; e++) {
                        float y = x[e];
                        for (int s = 0; s < nadds; s++) {
                            const uint32_t b = __ldcg((const unsigned short*)adds[s] + idx + e);
                            y += DT == SYMM_DT_BF16 ? symm_bf16_bits_to_f32(b) : symm_f16_bits_to_f32(b);
                        }
                        out[e] = DT == SYMM_DT_BF16 ? symm_f32_to_bf16_bits(y) : symm_f32_to_f16_bits(y);
                    }
                }
            }
        }
        return;
    }
    const bool vec = (ld % 2 == 0) && (base % (DT == SYMM_DT_F32 ? 8 : 4) == 0);
#pragma unroll
    for (int j = 0; j < BN / 8; j++) {
        const int col = tile.col0 + 8 * j + 2 * q;
        if (col >= n) continue;
        const bool both = col + 1 < n;
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const int row = r0 + 8 * h;
            if (row >= tile.row_end) continue;
            float x = d[4 * j + 2 * h] * alpha, y = d[4 * j + 2 * h + 1] * alpha;
            const int64_t idx = (int64_t)(row - row_base) * ld + col;
            for (int s = 0; s < nadds; s++) symm_load2_add<DT>(adds[s], idx, x, y, both);
            symm_store2<DT>(base, idx, x, y, both, vec);
        }
    }
}

// fp8: scales (and adds the bias to) this thread's accumulators in place,
// d = sa * sb * d + bias, with the fragment layout above; alpha is left to
// the epilogue. Row-wise scales of a tile's rows are those of its chunk,
// which the all-gather put in slot `chunk` (a_scale_slot apart).
template <int BN>
static __device__ __forceinline__ void symm_apply_scales(float (&d)[BN / 2], const symm_tile& tile, int n,
                                                         int slice_row0, const symm_gemm_params& p) {
    const int t = threadIdx.x % 128, q = t % 4;
    const int r0 = tile.row0 + slice_row0 + 16 * (t / 32) + (t % 32) / 4;
    const bool row_wise = p.scale_mode == SYMM_GEMM_SCALES_ROW;
    float sa[2];
    if (row_wise) {
        const float* rows = p.a_scale + (int64_t)tile.chunk * (p.a_scale_slot - p.chunk_rows);
#pragma unroll
        for (int h = 0; h < 2; h++) sa[h] = r0 + 8 * h < tile.row_end ? rows[r0 + 8 * h] : 0.f;
    } else {
        sa[0] = sa[1] = p.a_scale[0] * p.b_scale[0];
    }
    const bool has_bias = p.bias != 0;
    if (!row_wise && !has_bias) {
#pragma unroll
        for (int i = 0; i < BN / 2; i++) d[i] *= sa[0];
        return;
    }
    // Column scales and bias, 8 column blocks (16 values) at a time, the
    // next group's loads issued before this group's multiplies: with the
    // ring taking nearly all of L1 for shared memory, each load is an L2
    // round trip, and loaded one after another between the multiplies they
    // cost up to 24% of a 16384 x 4096 x 8192 matmul. Columns past n read
    // column n - 1 (the epilogue drops them).
    const int dt = p.out_dtype;
    auto load = [&](int j0, float (&sb)[16], float (&bias)[16]) {
#pragma unroll
        for (int e = 0; e < 16; e++) {
            const int c = min(tile.col0 + 8 * (j0 + e / 2) + 2 * q + e % 2, n - 1);
            sb[e] = row_wise ? __ldg(p.b_scale + c) : 1.f;
            bias[e] = !has_bias                ? 0.f
                      : dt == SYMM_DT_F32      ? __ldg((const float*)p.bias + c)
                      : dt == SYMM_DT_BF16     ? symm_bf16_bits_to_f32(__ldg((const unsigned short*)p.bias + c))
                                               : symm_f16_bits_to_f32(__ldg((const unsigned short*)p.bias + c));
        }
    };
    float sb[2][16], bias[2][16];
    load(0, sb[0], bias[0]);
#pragma unroll
    for (int g = 0; g < BN / 64; g++) {
        if (g + 1 < BN / 64) load(8 * (g + 1), sb[(g + 1) % 2], bias[(g + 1) % 2]);
#pragma unroll
        for (int jj = 0; jj < 8; jj++) {
#pragma unroll
            for (int h = 0; h < 2; h++) {
#pragma unroll
                for (int i = 0; i < 2; i++) {
                    float& x = d[4 * (8 * g + jj) + 2 * h + i];
                    x = x * (sa[h] * sb[g % 2][2 * jj + i]) + bias[g % 2][2 * jj + i];
                }
            }
        }
    }
}

// Waits until this warpgroup's TMA stores (issued by its thread 0) finished
// reading its staging area.
static __device__ __forceinline__ void symm_staging_read_done(int t) {
    if (t == 0) asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
}

// Where C's fragment pair (row, 8-column block jj of a 256-byte piece, lane
// q) lies in the staging area, and a peer's partial tile in the ring: boxes
// of 128-byte rows in TMA's 128-byte swizzle (16-byte unit u of row r at
// unit u ^ (r % 8)). A 16-bit pair is 4 bytes (a block is one unit, eight
// blocks a box), an f32 pair 8 (a block two units, four a box).
template <int ELEM>
static __device__ __forceinline__ int symm_swizzled(int row, int jj, int q) {
    constexpr int BLOCKS = 16 / ELEM;  // 8-column blocks per 128-byte box row
    const int box = jj / BLOCKS, b = jj % BLOCKS;
    const int unit = ELEM == 2 ? b : 2 * b + q / 2;
    const int within = ELEM == 2 ? 4 * q : 8 * (q % 2);
    return box * 8192 + row * 128 + ((unit ^ (row % 8)) * 16) + within;
}

// Epilogue through shared memory and TMA stores: each consumer warpgroup
// converts its 64 rows, 256 bytes of each row at a time (128 columns of a
// 16-bit C, 64 of f32), into two 64-row boxes of its 16 KiB staging area
// (conflict-free for 16-bit C: the 8 rows a warp writes land in 8 different
// 16-byte units), and its thread 0 stores them at column col0 + ..., row
// `row` of `map`: C, or (reduce-scatter) a peer's inbox slot for this rank.
// The stores drain while the warpgroup goes on to its next tile; the
// staging area is reused only after they finished reading it. TMA clips
// rows and columns past the map's.
//
// With `spread` (bytes), box i lies at staging + i * spread instead, each
// in a place of its own (a free ring's stages), so no piece waits for the
// previous one's stores to read theirs: a narrow peer tile's pushes, whose
// reads wait on NVLink.
//
// `mode`: SYMM_EPI_STORE; SYMM_EPI_ADD, the boxes added into the map's
// memory (SYMM_RS_C_ADD); or SYMM_EPI_STAGE, the boxes only written
// (spread, for symm_epilogue_add_staged to add once their destination is
// ready). Adds are for tiles of whole boxes only (own tiles): a shifted
// last box would add the columns it shares with the box before twice.
#define SYMM_GEMM_EPI_BYTES (2 * 16384)
#define SYMM_EPI_STORE 0
#define SYMM_EPI_ADD 1
#define SYMM_EPI_STAGE 2

// Column of box `bi` of a BN-wide tile (see symm_epilogue_tma's SHIFT).
template <int ELEM, int BN>
struct symm_epi_boxes {
    static constexpr int BLOCKS = 32 / ELEM;  // 8-column blocks per 256-byte piece
    static constexpr int PER_BOX = BLOCKS / 2;
    static constexpr int NB = BN / 8, LAST = (NB - 1) / PER_BOX, SHIFT = (PER_BOX - NB % PER_BOX) % PER_BOX;
    static __device__ __forceinline__ int col(int col0, int bi) {
        return col0 + (bi * PER_BOX - (bi == LAST ? SHIFT : 0)) * 8;
    }
};

template <int DT, int BN>
static __device__ __forceinline__ void symm_epilogue_tma(const float (&d)[BN / 2], int col0, int row, int n,
                                                         unsigned char* staging, int spread, const symm_tmap* map,
                                                         float alpha, int mode, bool& pending) {
    constexpr int ELEM = DT == SYMM_DT_F32 ? 4 : 2;
    using Boxes = symm_epi_boxes<ELEM, BN>;
    constexpr int BLOCKS = Boxes::BLOCKS;
    constexpr int PER_BOX = Boxes::PER_BOX;
    const int t = threadIdx.x % 128, q = t % 4;
    const int bar = 1 + threadIdx.x / 128;  // named barriers 2, 3: one per consumer warpgroup
    const int r0 = 16 * (t / 32) + (t % 32) / 4;
    // 256-byte pieces of a row (a narrow tile's last one in part).
    constexpr int PIECES = (BN / 8 + BLOCKS - 1) / BLOCKS;
    // A width that is not a whole number of boxes (a narrow peer tile): its
    // last box starts SHIFT blocks early, to end with the tile, so TMA
    // stores every column and none of the next tile's; the SHIFT blocks it
    // shares with the box before are written by both, with the same values.
    constexpr int NB = Boxes::NB, LAST = Boxes::LAST, SHIFT = Boxes::SHIFT;
    static_assert(SHIFT == 0 || LAST % 2 == 1, "the shifted box and the one before share a piece");
    auto put = [&](unsigned char* at, int j, int hh) {
        const float x = d[4 * j + 2 * hh] * alpha, y = d[4 * j + 2 * hh + 1] * alpha;
        if constexpr (DT == SYMM_DT_F32) {
            *(float2*)at = make_float2(x, y);
        } else {
            *(uint32_t*)at = DT == SYMM_DT_BF16 ? symm_pack_bf16x2(x, y) : symm_pack_f16x2(x, y);
        }
    };
#pragma unroll
    for (int h = 0; h < PIECES; h++) {
        if (pending && !spread) {
            symm_staging_read_done(t);
            asm volatile("bar.sync %0, 128;" ::"r"(bar) : "memory");
        }
        auto box = [&](int b) { return spread ? staging + (2 * h + b) * spread : staging + b * 8192; };
#pragma unroll
        for (int jj = 0; jj < BLOCKS; jj++) {
            const int j = BLOCKS * h + jj;
            if (j >= NB) break;
            const int at = jj % PER_BOX + (j / PER_BOX == LAST ? SHIFT : 0);
#pragma unroll
            for (int hh = 0; hh < 2; hh++) put(box(jj / PER_BOX) + symm_swizzled<ELEM>(r0 + 8 * hh, at, q), j, hh);
        }
        if (SHIFT && h == LAST / 2) {
#pragma unroll
            for (int s = 0; s < SHIFT; s++) {
#pragma unroll
                for (int hh = 0; hh < 2; hh++) {
                    put(box(1) + symm_swizzled<ELEM>(r0 + 8 * hh, s, q), LAST * PER_BOX - SHIFT + s, hh);
                }
            }
        }
        // Our generic-proxy writes, then the async proxy (TMA) reads them.
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
        asm volatile("bar.sync %0, 128;" ::"r"(bar) : "memory");
        if (t == 0 && mode != SYMM_EPI_STAGE) {
            for (int b = 0; b < 2; b++) {
                const int bi = 2 * h + b;
                const int col = Boxes::col(col0, bi);
                if (bi <= LAST && col < n) {
                    if (mode == SYMM_EPI_ADD) symm_tma_reduce_add(map, box(b), col, row);
                    else symm_tma_store(map, box(b), col, row);
                }
            }
            asm volatile("cp.async.bulk.commit_group;" ::: "memory");
        }
        pending = true;
    }
}

// Adds the boxes symm_epilogue_tma staged (SYMM_EPI_STAGE, `spread` bytes
// apart) into `map`'s memory; by the warpgroup's thread 0.
template <int DT, int BN>
static __device__ __forceinline__ void symm_epilogue_add_staged(const unsigned char* staging, int spread, int col0,
                                                                int row, int n, const symm_tmap* map) {
    using Boxes = symm_epi_boxes<DT == SYMM_DT_F32 ? 4 : 2, BN>;
    for (int bi = 0; bi <= Boxes::LAST; bi++) {
        const int col = Boxes::col(col0, bi);
        if (col < n) symm_tma_reduce_add(map, staging + bi * spread, col, row);
    }
    asm volatile("cp.async.bulk.commit_group;" ::: "memory");
}

// Reduce-scatter, this rank's own rows: adds a peer's partial of box `bx`
// of the tile (128 rows x 128 bytes of C's type, which the producer loaded
// into the ring by TMA, swizzled) to this warpgroup's accumulators, and
// with `write_back` puts the sums in C's type where the partial was (this
// warpgroup's 64 rows of the box: then in a TMA store's layout for C).
template <int DT, int BN>
static __device__ __forceinline__ void symm_add_box(float (&d)[BN / 2], unsigned char* box, int bx, int slice_row0,
                                                    bool write_back) {
    constexpr int ELEM = DT == SYMM_DT_F32 ? 4 : 2;
    constexpr int BLOCKS = 16 / ELEM;  // 8-column blocks per box
    const int t = threadIdx.x % 128, q = t % 4;
    const int r0 = slice_row0 + 16 * (t / 32) + (t % 32) / 4;
#pragma unroll
    for (int jj = 0; jj < BLOCKS; jj++) {
        const int j = bx * BLOCKS + jj;
#pragma unroll
        for (int hh = 0; hh < 2; hh++) {
            unsigned char* at = box + symm_swizzled<ELEM>(r0 + 8 * hh, jj, q);
            float& x = d[4 * j + 2 * hh];
            float& y = d[4 * j + 2 * hh + 1];
            if constexpr (DT == SYMM_DT_F32) {
                const float2 v = *(const float2*)at;
                x += v.x;
                y += v.y;
                if (write_back) *(float2*)at = make_float2(x, y);
            } else {
                const uint32_t v = *(const uint32_t*)at;
                x += DT == SYMM_DT_BF16 ? symm_bf16_bits_to_f32(v & 0xffffu) : symm_f16_bits_to_f32(v & 0xffffu);
                y += DT == SYMM_DT_BF16 ? symm_bf16_bits_to_f32(v >> 16) : symm_f16_bits_to_f32(v >> 16);
                if (write_back) *(uint32_t*)at = DT == SYMM_DT_BF16 ? symm_pack_bf16x2(x, y) : symm_pack_f16x2(x, y);
            }
        }
    }
}

// rs_push: the peers' partials of one of this rank's own tiles travel
// through the ring after the tile's k-blocks, as 16 KiB boxes (128 rows x
// 128 bytes of C's type, `per_tile` of them per peer), `per_stage` to a
// stage; the producer and the consumers walk them alike.
struct symm_partials {
    int per_tile, per_stage, total;

    __device__ symm_partials(const symm_gemm_params& p, int bn, int stage_bytes) {
        per_tile = bn * (p.out_dtype == SYMM_DT_F32 ? 4 : 2) / 128;
        per_stage = stage_bytes / 16384;
        total = per_tile * (p.world - 1);
    }
};

// Reduce-scatter, one of this rank's own tiles (rs_push): adds every
// peer's partial, loaded by the producer into the ring behind the tile's
// k-blocks (symm_partials), to this warpgroup's accumulators, handing each
// stage back once the warpgroup read it.
//
// With `c_map` (rs_c_store SYMM_RS_C_RING) the sums go to C from the ring
// itself: the last peer's boxes, once added (after every other peer's),
// take the sums in their place, and the warpgroup's thread 0 stores them
// by TMA at row `c_row` of C, a stage at a time. The stages that hold
// them go back to the producer once the stores have read them. This saves
// the staging area's two rounds (write, store, wait for the store to read
// it, write again), which were ~2 us of the kernel's last path at mm_rs
// M = 512 (bench/KERNELS.md v17's stamps).
template <int DT, int BN, int STAGES, int STAGE_BYTES>
static __device__ __forceinline__ void symm_add_partials(float (&d)[BN / 2], const symm_partials& parts,
                                                         const symm_tile& tile, int n, int slice_row0,
                                                         unsigned char* ring, uint64_t* full, uint64_t* empty,
                                                         int& stage, uint32_t& phase, const symm_tmap* c_map,
                                                         int c_row, const symm_gemm_params& p) {
    constexpr int ELEM = DT == SYMM_DT_F32 ? 4 : 2;
    constexpr int PER_TILE = BN * ELEM / 128;  // parts.per_tile
    const int bar = 1 + threadIdx.x / 128;  // named barriers 2, 3: one per consumer warpgroup
    const int t = threadIdx.x % 128;
    const int sums_from = c_map ? parts.total - PER_TILE : parts.total;  // boxes that take the sums
    int in_stage = 0;    // boxes of the current stage read
    int held = 0;        // stages kept for the stores of the sums, from held0
    int held0 = 0;
    for (int b0 = 0; b0 < parts.total; b0 += PER_TILE) {
#pragma unroll
        for (int bx = 0; bx < PER_TILE; bx++) {
            if (in_stage == 0) {
                symm_mbar_wait(&full[stage], phase);
                if (threadIdx.x == 128) {
                    if (b0 + bx == 0) symm_trace_now(p, SYMM_TRACE_LANDED);
                    symm_trace_now(p, SYMM_TRACE_LANDED_ALL);
                }
            }
            unsigned char* box = ring + stage * STAGE_BYTES + in_stage * 16384;
            const bool sums = b0 >= sums_from;
            if (tile.col0 + bx * (128 / ELEM) < n) symm_add_box<DT, BN>(d, box, bx, slice_row0, sums);
            if (++in_stage == parts.per_stage || b0 + bx + 1 == parts.total) {
                // Our reads and writes (generic proxy) before the producer's
                // next TMA writes or our TMA stores (async proxy).
                asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
                asm volatile("bar.sync %0, 128;" ::"r"(bar) : "memory");
                const int stage_b0 = b0 + bx + 1 - in_stage;  // the stage's first box
                if (stage_b0 + in_stage > sums_from) {
                    // Holds sums: stored now, handed back after.
                    if (t == 0) {
                        for (int i = max(0, sums_from - stage_b0); i < in_stage; i++) {
                            const int col = tile.col0 + (stage_b0 + i - sums_from) * (128 / ELEM);
                            if (col < n) {
                                symm_tma_store(c_map, ring + stage * STAGE_BYTES + i * 16384 + slice_row0 * 128,
                                               col, c_row);
                            }
                        }
                        asm volatile("cp.async.bulk.commit_group;" ::: "memory");
                    }
                    if (held++ == 0) held0 = stage;
                } else if (t == 0) {
                    symm_mbar_arrive(&empty[stage]);
                }
                if (++stage == STAGES) {
                    stage = 0;
                    phase ^= 1;
                }
                in_stage = 0;
            }
        }
    }
    if (held) {
        symm_staging_read_done(t);
        asm volatile("bar.sync %0, 128;" ::"r"(bar) : "memory");
        for (int i = 0; i < held && t == 0; i++) symm_mbar_arrive(&empty[(held0 + i) % STAGES]);
    }
}

// Waits until done(*word) (acquire, system scope), or times out (recorded
// in err as a wait of `kind` for `peer`, returns false): a missing peer
// never hangs the kernel. Polls with relaxed loads and backs off (64 ns
// doubling to `cap`), then acquires once: up to every CTA of the grid waits
// here at once, and a tight loop of system-scope acquires from all of them
// slowed the copies being waited for and the CTAs still computing
// (profiled: a 4 MB pull at 23 GB/s).
template <class Done>
static __device__ bool symm_wait_for(const uint32_t* word, Done done, const symm_gemm_params& p, int peer,
                                     uint32_t kind, uint32_t cap) {
    uint64_t timeout = p.timeout_ns ? p.timeout_ns : SYMM_DEFAULT_TIMEOUT_NS;
    if (done(symm_ld_acquire_sys(word))) return true;
    const uint64_t start = symm_globaltimer_ns();
    uint64_t next_err_poll = start + SYMM_ERR_POLL_NS;
    uint32_t backoff = 64;
    for (;;) {
        __nanosleep(backoff);
        backoff = backoff < cap ? 2 * backoff : backoff;
        // Acquired by a load of the word, not a fence: fence.acq_rel.sys
        // is a MEMBAR.ALL.SYS, which took ~3 us beside the matmul (as the
        // release of a pushed tile's flag does, bench/KERNELS.md v24); an
        // acquire load is LDG.STRONG.SYS and an L1 invalidation (SASS).
        // It reads the value seen or a later one: the words only grow.
        if (done(symm_ld_relaxed_sys(word)) && done(symm_ld_acquire_sys(word))) return true;
        const uint64_t now = symm_globaltimer_ns();
        if (now - start >= timeout) {
            symm_record_error(p.err, SYMM_ASYNC_TIMEOUT, p.rank, peer, SYMM_GEMM_CHANNEL, kind, now - start);
            return false;
        }
        if (now >= next_err_poll) {
            if (symm_error_pending(p.err)) return false;
            next_err_poll = now + SYMM_ERR_POLL_NS;
        }
    }
}

// All-gather: waits for an arrival flag to be set (every CTA may wait
// at once: backs off to 1 us).
static __device__ bool symm_wait_nonzero(const uint32_t* flag, const symm_gemm_params& p, int peer) {
    return symm_wait_for(flag, [](uint32_t v) { return v != 0; }, p, peer, SYMM_SIGNAL_KIND_VALUE, 1024);
}

// Reduce-scatter: waits for a flag or epoch to reach `target` (in the
// order of a u32 that wraps, as the epochs do). One thread of the own
// tiles' CTAs polls a word in its own GPU's memory, on the kernel's last
// path: backs off to 256 ns only (about half the backoff is the delay
// between a flag landing and its wait seeing it).
static __device__ bool symm_wait_reach(const uint32_t* word, uint32_t target, const symm_gemm_params& p, int peer) {
    return symm_wait_for(word, [target](uint32_t v) { return (int32_t)(v - target) >= 0; }, p, peer,
                         SYMM_SIGNAL_KIND_WAIT, 256);
}

// Is this a reduce-scatter with peers (the epoch protocol above)?
static __device__ __forceinline__ bool symm_rs_live(const symm_gemm_params& p) {
    return p.rs && p.world > 1;
}

static __device__ __forceinline__ symm_rs_state* symm_rs_state_of(const symm_gemm_params& p, int rank) {
    return (symm_rs_state*)p.rs_state[rank];
}

// Run by one thread per CTA once its CTA has read all it reads of the inbox
// (the producer with rs_push, else a consumer): the last CTA raises this
// rank's epoch, which lets the peers' next call push.
static __device__ void symm_rs_finish(const symm_gemm_params& p, uint32_t epoch) {
    symm_rs_state* st = symm_rs_state_of(p, p.rank);
    __threadfence();  // this CTA's reads before its count
    if (atomicAdd(&st->finished, 1u) == gridDim.x - 1) {
        __threadfence();  // every CTA's count (and reads) before the epoch
        st->finished = 0;  // read again only by the next call, after this kernel
        symm_st_release_sys(&st->epoch, epoch);
    }
}

// rs_push: the pushed tiles' flags, off the consumers' path. A producer
// warp that would otherwise idle walks the tile schedule beside the
// consumers and sets each pushed tile's flag once the consumers' TMA
// stores of it completed: the system fence and flag store per tile held
// both consumer warpgroups (bench/KERNELS.md). The handoff is one slot
// deep: `full` when a tile is handed over, `empty` when the slot is free.
struct symm_handoff {
    uint64_t full, empty;
};

// Does this kernel push its peers' tiles by TMA stores and sum its own
// rows from partials the producer loads into the ring (rs_push)?
static __device__ __forceinline__ bool symm_rs_pushes(const symm_gemm_params& p) {
    return p.rs && p.rs_push && p.world > 1;
}

// The flagging warp: pushed.full completes when both consumer warpgroups'
// stores of the tile completed (their threads 0 arrive).
static __device__ void symm_rs_flag_pushed(const symm_gemm_params& p, const symm_tiling& tiling, int bn,
                                           symm_handoff* pushed, uint32_t epoch) {
    uint32_t phase = 0;
    for (int t = blockIdx.x; t < tiling.total; t += gridDim.x) {
        const symm_tile tile = tiling.at(p, bn, t);
        if (tile.chunk == p.rank) continue;
        symm_mbar_wait(&pushed->full, phase);
        symm_trace_now(p, SYMM_TRACE_HANDED);
        // The stores completed (and were fenced against the generic proxy)
        // before the arrivals this wait acquired, so the release, which is
        // cumulative, publishes them. No __threadfence_system: a
        // fence.sc.sys here, off the consumers' path, still cost the
        // kernel about 3% (bench/KERNELS.md).
        symm_st_release_sys(tiling.flag(p, tile.chunk, p.rank, tile.index), epoch);
        symm_trace_now(p, SYMM_TRACE_FLAGGED);
        symm_mbar_arrive(&pushed->empty);
        phase ^= 1;
    }
}

// How many k-blocks before a tile's last one its epilogue's maps are
// fetched (symm_prefetch_epilogue_maps): early enough for the fetch, late
// enough that the k-loop's A and B maps have not pushed them out since.
#define SYMM_TMAP_PREFETCH_KB 8

// Run by the producer a few k-blocks before `tile`'s epilogue: fetches the
// maps that epilogue copies through (symm_tmap_prefetch).
static __device__ __forceinline__ void symm_prefetch_epilogue_maps(const symm_gemm_params& p, const symm_tile& tile,
                                                                   const symm_tmap* tm_c, const symm_rs_maps* tm_rs) {
    if (symm_rs_pushes(p)) {
        if (tile.chunk != p.rank) {
            symm_tmap_prefetch(&tm_rs->push[tile.chunk]);
        } else {
            symm_tmap_prefetch(&tm_rs->inbox);
            if (p.rs_c_store != SYMM_RS_C_REGISTERS) symm_tmap_prefetch(tm_c);
        }
    } else if (p.c_tma) {
        symm_tmap_prefetch(tm_c);
    }
}

// ---------------------------------------------------------------------------
// The kernel.
// ---------------------------------------------------------------------------
template <int BN>
struct symm_gemm_cfg {
    static constexpr int STAGES = BN == 256 ? 4 : 6;
    static constexpr int A_BYTES = SYMM_GEMM_BM * SYMM_GEMM_BK_BYTES;
    static constexpr int B_BYTES = BN * SYMM_GEMM_BK_BYTES;
    static constexpr int STAGE_BYTES = A_BYTES + B_BYTES;
    // Ring, epilogue staging, then 2 * STAGES mbarriers of the ring, the
    // rs_push flag handoff's two, the call's epoch (8 bytes) and the
    // peers-ready mbarrier; +1024 to align the ring for the swizzle.
    static constexpr int SMEM_BYTES = STAGES * STAGE_BYTES + SYMM_GEMM_EPI_BYTES + (2 * STAGES + 4) * 8 + 1024;
};

template <int A_DT, int B_DT, int BN, bool PROMOTE>
static __device__ __forceinline__ void symm_gemm_sm90(const symm_tmap* tm_a, const symm_tmap* tm_a_local,
                                                      const symm_tmap* tm_b, const symm_tmap* tm_c,
                                                      const symm_rs_maps* tm_rs, const symm_gemm_params& p) {
    using Cfg = symm_gemm_cfg<BN>;
    constexpr int STAGES = Cfg::STAGES;
    extern __shared__ __align__(1024) unsigned char symm_gemm_smem[];
    // Aligned by pointer arithmetic, not through an integer, so the
    // compiler still knows these are shared memory (LDS/STS with 32-bit
    // addresses, not generic accesses whose 64-bit addresses spilled).
    unsigned char* ring = symm_gemm_smem + ((1024u - (symm_smem_addr(symm_gemm_smem) & 1023u)) & 1023u);
    unsigned char* staging = ring + STAGES * Cfg::STAGE_BYTES;  // 1024-aligned
    uint64_t* full = (uint64_t*)(staging + SYMM_GEMM_EPI_BYTES);
    uint64_t* empty = full + STAGES;
    symm_handoff* pushed = (symm_handoff*)(empty + STAGES);  // rs_push: tiles to flag
    uint32_t* call_epoch = (uint32_t*)(pushed + 1);         // rs: this call's epoch
    uint64_t* peers_ready = (uint64_t*)(pushed + 1) + 1;    // rs: every peer's inbox is free
    auto stage_a = [&](int s) { return ring + s * Cfg::STAGE_BYTES; };
    auto stage_b = [&](int s) { return ring + s * Cfg::STAGE_BYTES + Cfg::A_BYTES; };

    const int wg = threadIdx.x / 128;
    if (threadIdx.x == 0) {
        symm_tmap_prefetch(tm_a);
        symm_tmap_prefetch(tm_b);
        if (p.local_chunk >= 0) symm_tmap_prefetch(tm_a_local);
        for (int s = 0; s < STAGES; s++) {
            symm_mbar_init(&full[s], 1);
            symm_mbar_init(&empty[s], 2);  // one arrival per consumer warpgroup
        }
        symm_mbar_init(&pushed->full, 2);  // thread 0 of each consumer warpgroup
        symm_mbar_init(&pushed->empty, 1);
        symm_mbar_init(peers_ready, 1);
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
        // Read once for the CTA: the last CTA raises it when it finishes.
        if (symm_rs_live(p)) *call_epoch = symm_rs_state_of(p, p.rank)->epoch + 1;
    }
    __syncthreads();
    if (threadIdx.x == 0) symm_trace_now(p, SYMM_TRACE_START);
    // Read where used, not held: a register live across the consumers'
    // mainloop spilled (ptxas, n256 kernels).
    auto rs_epoch = [&]() { return *(volatile uint32_t*)call_epoch; };

    const symm_tiling tiling(p, BN);
    const bool rs_add = symm_rs_pushes(p) && p.rs_c_store == SYMM_RS_C_ADD;
    // Elements of k per k-block: 64 of a 16-bit type, 128 of an 8-bit one.
    constexpr int BK = A_DT == SYMM_DT_E4M3 || A_DT == SYMM_DT_E5M2 ? SYMM_GEMM_BK_BYTES : SYMM_GEMM_BK_BYTES / 2;
    const int kblocks = (p.k + BK - 1) / BK;

    if (wg == 0) {
        // Producer: one thread issues every load; with rs_push, the first
        // lane of warp 1 sets the pushed tiles' flags; the rest only donate
        // their registers to the consumers.
        asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
        if (threadIdx.x == 32 && rs_add && blockIdx.x == 0) {
            // This call's kernel runs, so the stream's earlier work with C
            // is done: the peer may store into it.
            symm_st_release_sys(&symm_rs_state_of(p, p.rank)->started, rs_epoch());
        }
        if (threadIdx.x == 32 && symm_rs_pushes(p)) symm_rs_flag_pushed(p, tiling, BN, pushed, rs_epoch());
        if (threadIdx.x == 64 && symm_rs_live(p)) {
            // Every peer's previous call has read its inbox: the consumers
            // wait for this before their first store into a peer's inbox,
            // not the producer before its first load, so the remote reads'
            // latency (and a peer still finishing its previous call) hides
            // behind the mainloop. A timeout is recorded; the tiles still
            // go, so nobody hangs.
            for (int d = 0; d < p.world; d++) {
                if (d != p.rank) symm_wait_reach(&symm_rs_state_of(p, d)->epoch, rs_epoch() - 1, p, d);
            }
            if (rs_add) {
                // Storing into a peer's C: once its call has started (within
                // microseconds of ours, long before the first push).
                for (int d = 0; d < p.world; d++) {
                    if (d != p.rank) symm_wait_reach(&symm_rs_state_of(p, d)->started, rs_epoch(), p, d);
                }
                asm volatile("fence.proxy.async.global;" ::: "memory");
            }
            symm_mbar_arrive(peers_ready);
        }
        if (threadIdx.x != 0) return;
        int stage = 0;
        uint32_t phase = 0;
        auto advance = [&]() {
            if (++stage == STAGES) {
                stage = 0;
                phase ^= 1;
            }
        };
        uint32_t landed = 0;  // all-gather: chunks seen whole (bit per chunk)
        for (int t = blockIdx.x; t < tiling.total; t += gridDim.x) {
            const symm_tile tile = tiling.at(p, BN, t);
            symm_trace(p, SYMM_TRACE_CHUNK, tile.chunk + 1);
            const bool local = tile.chunk == p.local_chunk;
            // The k-block at which this tile next waits for a slice of its
            // rows (kblocks: none left to wait for).
            int wait_kb = p.ready != nullptr && !local && !(landed >> tile.chunk & 1) ? 0 : kblocks;
            const symm_tmap* map_a = local ? tm_a_local : tm_a;
            const int a_row = local ? tile.row0 - tile.chunk * p.chunk_rows : tile.row0;
            const bool sliced = !local && p.slices > 1;  // A's rows from the slice-major gathered copy
            for (int kb = 0; kb < kblocks; kb++) {
                if (kb == max(0, kblocks - SYMM_TMAP_PREFETCH_KB)) symm_prefetch_epilogue_maps(p, tile, tm_c, tm_rs);
                if (kb == wait_kb) {
                    const int slice = kb / p.slice_kblocks;
                    symm_wait_nonzero(&p.ready[tile.chunk * p.slices + slice], p, tile.chunk);
                    // The rows were written by a copy engine; order our
                    // (async proxy) TMA reads after the flag.
                    asm volatile("fence.proxy.async.global;" ::: "memory");
                    wait_kb += p.slice_kblocks;
                    if (slice == p.slices - 1) landed |= 1u << tile.chunk;
                }
                symm_mbar_wait(&empty[stage], phase ^ 1);
                symm_mbar_expect_tx(&full[stage], Cfg::STAGE_BYTES);
                if (sliced) {
                    symm_tma_load3(stage_a(stage), map_a, kb % p.slice_kblocks * BK, a_row, kb / p.slice_kblocks,
                                   &full[stage]);
                } else {
                    symm_tma_load(stage_a(stage), map_a, kb * BK, a_row, &full[stage]);
                }
                symm_tma_load(stage_b(stage), tm_b, kb * BK, tile.col0, &full[stage]);
                advance();
            }
            if (!symm_rs_pushes(p) || tile.chunk != p.rank || rs_add) continue;
            // One of our own tiles: its peers' partials, loaded behind the
            // k-blocks, each box once the peer's flags of the tiles that
            // hold it reached this call's epoch (with narrow peer tiles,
            // two or more per own tile, the first ones' boxes load while
            // the last ones still cross). After a timeout the loads still
            // go, so nobody hangs. Boxes past n are not loaded (nor added).
            const symm_partials partials(p, BN, Cfg::STAGE_BYTES);
            const int box_cols = 128 / (p.out_dtype == SYMM_DT_F32 ? 4 : 2);
            const int first = tiling.source_of(tile, tile.col0);  // each peer's first flag of the tile
            int next = first;  // the current peer's next flag to wait for
            const int row = tile.row0 - tile.chunk * p.chunk_rows;
            for (int b0 = 0; b0 < partials.total; b0 += partials.per_stage) {
                const int end = min(b0 + partials.per_stage, partials.total);
                int loads = 0;
                for (int b = b0; b < end; b++) loads += tile.col0 + (b % partials.per_tile) * box_cols < p.n;
                symm_mbar_wait(&empty[stage], phase ^ 1);
                symm_mbar_expect_tx(&full[stage], loads * 16384);
                for (int b = b0; b < end; b++) {
                    const int src = b / partials.per_tile, col = tile.col0 + (b % partials.per_tile) * box_cols;
                    const int peer = src < p.rank ? src : src + 1;
                    if (b % partials.per_tile == 0) next = first;
                    if (col >= p.n) continue;
                    const int need = tiling.source_of(tile, min(col + box_cols, p.n) - 1);
                    for (; next <= need; next++) {
                        symm_wait_reach(tiling.flag(p, p.rank, peer, next), rs_epoch(), p, peer);
                        // The peer's TMA stores were flagged after they
                        // completed: order our (async proxy) loads after.
                        asm volatile("fence.proxy.async.global;" ::: "memory");
                    }
                    symm_tma_load3(stage_a(stage) + (b - b0) * 16384, &tm_rs->inbox, col, row, peer, &full[stage]);
                }
                advance();
            }
            symm_trace_now(p, SYMM_TRACE_PARTIALS);
        }
        if (symm_rs_pushes(p)) {
            // Every stage handed back: the consumers have read all that the
            // ring brought, the peers' partials included, so this CTA's
            // inbox reads are over. Counted here, beside the consumers'
            // stores rather than after them.
            for (int s = 0; s < STAGES; s++) {
                symm_mbar_wait(&empty[stage], phase ^ 1);
                advance();
            }
            symm_rs_finish(p, rs_epoch());
        }
        return;
    }

    // Consumers: warpgroup 1 takes rows 0-63 of each tile, warpgroup 2 rows 64-127.
    asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");
    const int slice = (wg - 1) * 64;
    const int t128 = threadIdx.x % 128;
    static_assert(!PROMOTE || (BK == SYMM_GEMM_BK_BYTES && BN == 128), "promotion: fp8, 128-wide tiles");
    // Exact fp8: the k-blocks' sums, which the epilogue then reads.
    float promoted[BN / 2];
    float d1[PROMOTE ? BN / 2 : 1];  // exact fp8: odd k-blocks' partial sums
    bool pending = false;  // this warpgroup's TMA stores may still read its staging
    // rs_push: a peer tile whose stores were issued but not yet flagged.
    bool unflagged = false;
    uint32_t pushed_phase = 0;  // parity of the flag handoff's next use
    // Hands `unflagged` to the flagging warp once this warpgroup's stores
    // of it completed (a whole mainloop after thread 0 issued them).
    auto flag_pushed_tile = [&]() {
        if (t128 == 0) {
            asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
            if (wg == 1) symm_trace_now(p, SYMM_TRACE_PUSHED);
            asm volatile("fence.proxy.async.global;" ::: "memory");
            symm_mbar_wait(&pushed->empty, pushed_phase ^ 1);
            symm_mbar_arrive(&pushed->full);
        }
        pushed_phase ^= 1;
        unflagged = false;
    };
    int stage = 0;
    uint32_t phase = 0;
    auto advance = [&]() {
        if (++stage == STAGES) {
            stage = 0;
            phase ^= 1;
        }
    };
    // Waits for the stage's data, then issues its k-block's wgmmas into acc
    // (added to acc's contents when accumulate, else starting afresh), as
    // wide as acc (W / 2 accumulators: BN, or a narrow peer tile's W).
    auto issue_w = [&](auto width, float(&acc)[BN / 2], bool accumulate) {
        constexpr int W = decltype(width)::value;
        symm_mbar_wait(&full[stage], phase);
        symm_wgmma_fence();
        const unsigned char* a = stage_a(stage) + slice * SYMM_GEMM_BK_BYTES;
        const unsigned char* b = stage_b(stage);
#pragma unroll
        for (int kk = 0; kk < SYMM_GEMM_BK_BYTES / 32; kk++) {
            // One wgmma per 32 bytes of k along the swizzled 128-byte row.
            const uint64_t da = symm_smem_desc(a + 32 * kk), db = symm_smem_desc(b + 32 * kk);
            if constexpr (W == BN) {
                symm_wgmma<A_DT, B_DT, BN>(acc, da, db, accumulate || kk != 0);
            } else {
                symm_wgmma_narrow<A_DT, B_DT, W>(acc, da, db, accumulate || kk != 0);
            }
        }
        symm_wgmma_commit();
    };
    auto issue = [&](float(&acc)[BN / 2], bool accumulate) { issue_w(symm_width<BN>{}, acc, accumulate); };
    // The k-loop of a tile into acc (not the fp8 exact kernels').
    auto mainloop = [&](auto width, float(&acc)[BN / 2]) {
        int prev = -1;
        for (int kb = 0; kb < kblocks; kb++) {
            issue_w(width, acc, kb != 0);
            // Keep one k-block of wgmma in flight; the one before it is
            // done reading its stage, which goes back to the producer.
            symm_wgmma_wait<1>();
            if (prev >= 0 && t128 == 0) symm_mbar_arrive(&empty[prev]);
            prev = stage;
            advance();
        }
        symm_wgmma_wait<0>();
        if (prev >= 0 && t128 == 0) symm_mbar_arrive(&empty[prev]);
    };

    // Narrow peer tiles exist only in these kernels (the host sets them).
    constexpr bool NARROW = BN == 256 && !PROMOTE && A_DT == B_DT && (A_DT == SYMM_DT_BF16 || A_DT == SYMM_DT_F16);
    // Waits for every peer's partial of an own-rows tile (its flag at this
    // call's epoch).
    auto take_peer_tiles = [&](const symm_tile& tile) {
        if (threadIdx.x == 128) {
            for (int src = 0; src < p.world; src++) {
                if (src != p.rank) symm_wait_reach(tiling.flag(p, p.rank, src, tile.index), rs_epoch(), p, src);
            }
        }
        symm_consumers_sync();
    };
    // SYMM_RS_C_ADD: waits until every peer's tiles over own tile `tile`
    // are in C.
    auto wait_peer_stores = [&](const symm_tile& tile) {
        const int first = tiling.source_of(tile, tile.col0);
        const int last = tiling.source_of(tile, min(tile.col0 + BN, p.n) - 1);
        for (int src = 0; src < p.world; src++) {
            if (src == p.rank) continue;
            for (int i = first; i <= last; i++) symm_wait_reach(tiling.flag(p, p.rank, src, i), rs_epoch(), p, src);
        }
    };
    // A narrow peer tile (see the header), start to end: a k-loop of its own
    // width on the first W / 2 of d, then its push by TMA, the last box
    // shifted to end with the tile (symm_epilogue_tma); or a tile of the
    // column cut, stored into C the same way. Its
    // wgmma names all of d as operands: with only the ones it writes, ptxas
    // serialized the wgmmas (C7515), and with an array of its own it kept
    // both arrays' registers and spilled thousands of bytes.
    // symm_epilogue_tma for C's type, W columns of ACC from COL0 into MAP
    // (columns before N), through AREA boxes SPREAD bytes apart (0: this
    // warpgroup's staging area `mine`, two boxes at a time).
#define SYMM_EPI_TMA_S(W, ACC, COL0, ROW, N, AREA, SPREAD, MAP, ALPHA, MODE)                                    \
    if (p.out_dtype == SYMM_DT_F32)                                                                            \
        symm_epilogue_tma<SYMM_DT_F32, W>(ACC, COL0, ROW, N, AREA, SPREAD, MAP, ALPHA, MODE, pending);       \
    else if (p.out_dtype == SYMM_DT_BF16)                                                                      \
        symm_epilogue_tma<SYMM_DT_BF16, W>(ACC, COL0, ROW, N, AREA, SPREAD, MAP, ALPHA, MODE, pending);      \
    else symm_epilogue_tma<SYMM_DT_F16, W>(ACC, COL0, ROW, N, AREA, SPREAD, MAP, ALPHA, MODE, pending)
#define SYMM_EPI_TMA_W(W, ACC, COL0, ROW, N, MAP, ALPHA, MODE) \
    SYMM_EPI_TMA_S(W, ACC, COL0, ROW, N, mine, 0, MAP, ALPHA, MODE)
    // `last`: the CTA's last tile, after which the ring is free.
    auto narrow_tile = [&](const symm_tile& tile, auto width, float(&d)[BN / 2], bool last) {
        constexpr int W = decltype(width)::value;
        float(&dn)[W / 2] = *reinterpret_cast<float(*)[W / 2]>(&d);
        mainloop(width, d);
        if (threadIdx.x == 128) symm_trace_now(p, SYMM_TRACE_MAINLOOP);
        if (tiling.cut) {
            // A tile of the column cut: into C, stored as a peer's is pushed.
            unsigned char* mine = staging + (wg - 1) * (SYMM_GEMM_EPI_BYTES / 2);
            SYMM_EPI_TMA_W(W, dn, tile.col0, tile.row0 + slice, min(p.n, tile.col0 + W), tm_c, p.alpha,
                           SYMM_EPI_STORE);
            if (threadIdx.x == 128) symm_trace_now(p, SYMM_TRACE_EPILOGUE);
            return;
        }
        if (unflagged) flag_pushed_tile();
        symm_mbar_wait(peers_ready, 0);
        if (threadIdx.x == 128) symm_trace_now(p, SYMM_TRACE_READY);
        const int elem = p.out_dtype == SYMM_DT_F32 ? 4 : 2;
        const int end = min(p.n, tile.col0 + W);
        const int row = tile.row0 - tile.chunk * p.chunk_rows + slice;
        // The boxes in this warpgroup's rows of the ring's stages (A's
        // half it alone reads), where the ring is free after the k-loop and
        // holds them (a 16-bit C's 4 boxes), else through the staging area.
        const bool spread = p.rs_push_ring && last && elem == 2;
        unsigned char* area = spread ? ring + slice * SYMM_GEMM_BK_BYTES : staging + (wg - 1) * (SYMM_GEMM_EPI_BYTES / 2);
        const int stride = spread ? Cfg::STAGE_BYTES : 0;
        SYMM_EPI_TMA_S(W, dn, tile.col0, row, end, area, stride, &tm_rs->push[tile.chunk], p.alpha,
                       SYMM_EPI_STORE);
        if (threadIdx.x == 128) symm_trace_now(p, SYMM_TRACE_BOXES);
        if (threadIdx.x == 128) symm_trace_now(p, SYMM_TRACE_EPILOGUE);
        unflagged = true;
    };
    for (int t = blockIdx.x; t < tiling.total; t += gridDim.x) {
        const symm_tile tile = tiling.at(p, BN, t);
        // Declared per tile: nothing of the previous tile's is live into
        // the next one's k-loop.
        float d[BN / 2];
        if constexpr (NARROW) {
            if (tile.cols != BN) {
                const bool last = t + (int)gridDim.x >= tiling.total;
                if (tile.cols == 232) narrow_tile(tile, symm_width<232>{}, d, last);
                else if (tile.cols == 240) narrow_tile(tile, symm_width<240>{}, d, last);
                else narrow_tile(tile, symm_width<248>{}, d, last);
                continue;
            }
        }
        if constexpr (PROMOTE) {
            // Each k-block's partial sum afresh into one of two sets (d for
            // even k-blocks, d1 for odd), added into `promoted` once done
            // while the next k-block runs in the other set. Measured 2-4%
            // faster than one set with a full wait per k-block (as CUTLASS
            // and DeepGEMM), within one run (bench/KERNELS.md, f6). Nothing
            // but wgmma writes d and d1: ptxas serializes the wgmmas if
            // other code defines their accumulators (C7514).
#pragma unroll
            for (int i = 0; i < BN / 2; i++) promoted[i] = 0.f;
            auto promote = [&](float(&acc)[BN / 2]) {
                symm_fence_operand(acc);
#pragma unroll
                for (int i = 0; i < BN / 2; i++) promoted[i] += acc[i];
                symm_fence_operand(acc);
            };
            // d holds k-block kb (in flight) at the top of each pass; the
            // pairs are peeled so every wait has a fixed count (ptxas
            // tracks which set a wait completes only then).
            int s0 = stage, s1;
            symm_fence_operand(d);
            issue(d, false);
            advance();
            int kb = 0;
            for (; kb + 2 < kblocks; kb += 2) {
                s1 = stage;
                symm_fence_operand(d1);
                issue(d1, false);
                advance();
                symm_wgmma_wait<1>();
                if (t128 == 0) symm_mbar_arrive(&empty[s0]);
                promote(d);
                s0 = stage;
                issue(d, false);
                advance();
                symm_wgmma_wait<1>();
                if (t128 == 0) symm_mbar_arrive(&empty[s1]);
                promote(d1);
            }
            if (kb + 1 < kblocks) {
                s1 = stage;
                symm_fence_operand(d1);
                issue(d1, false);
                advance();
                symm_wgmma_wait<1>();
                if (t128 == 0) symm_mbar_arrive(&empty[s0]);
                promote(d);
                symm_wgmma_wait<0>();
                if (t128 == 0) symm_mbar_arrive(&empty[s1]);
                promote(d1);
            } else {
                symm_wgmma_wait<0>();
                if (t128 == 0) symm_mbar_arrive(&empty[s0]);
                promote(d);
            }
        }
        if constexpr (!PROMOTE) {
            mainloop(symm_width<BN>{}, d);
        }

        if (threadIdx.x == 128) symm_trace_now(p, SYMM_TRACE_MAINLOOP);
        // The finished tile: the promoted sums (exact fp8), else d.
        float(&acc)[BN / 2] = PROMOTE ? promoted : d;
        if (p.scale_mode != SYMM_GEMM_SCALES_NONE) {
            // A peer's row scales came with its rows, before the flag the
            // producer waited on: acquire it here too before reading them.
            if (p.scale_mode == SYMM_GEMM_SCALES_ROW && p.ready != nullptr && tile.chunk != p.local_chunk)
                (void)symm_ld_acquire_sys(&p.ready[tile.chunk]);
            symm_apply_scales<BN>(acc, tile, p.n, slice, p);
        }
        const int dt = p.out_dtype;
        unsigned char* mine = staging + (wg - 1) * (SYMM_GEMM_EPI_BYTES / 2);
#define SYMM_EPI_TMA(MAP, ROW, ALPHA, MODE) SYMM_EPI_TMA_W(BN, acc, tile.col0, ROW, p.n, MAP, ALPHA, MODE)
        if (p.c_tma) {
            SYMM_EPI_TMA(tm_c, tile.row0 + slice, p.alpha, SYMM_EPI_STORE);
            if (threadIdx.x == 128) symm_trace_now(p, SYMM_TRACE_EPILOGUE);
            continue;
        }
        if (!p.rs) {
#define SYMM_EPI(DT) symm_epilogue<DT, BN>(acc, tile, p.n, slice, p.c, 0, p.ldc, nullptr, 0, p.alpha)
            if (dt == SYMM_DT_F32) SYMM_EPI(SYMM_DT_F32);
            else if (dt == SYMM_DT_BF16) SYMM_EPI(SYMM_DT_BF16);
            else SYMM_EPI(SYMM_DT_F16);
#undef SYMM_EPI
            continue;
        }
        const int64_t chunk_row0 = (int64_t)tile.chunk * p.chunk_rows;
        if (symm_rs_pushes(p)) {
            // The previous peer tile's stores completed during this tile's mainloop.
            if (unflagged) flag_pushed_tile();
            const int row = tile.row0 - (int)chunk_row0 + slice;  // in the chunk
            if (tile.chunk != p.rank) {
                // A peer's rows: into its inbox slot for this rank (once the
                // peers' inboxes are free); flagged at the next tile's
                // epilogue (or the end).
                symm_mbar_wait(peers_ready, 0);
                SYMM_EPI_TMA(&tm_rs->push[tile.chunk], row, p.alpha, SYMM_EPI_STORE);
                if (threadIdx.x == 128) symm_trace_now(p, SYMM_TRACE_EPILOGUE);
                unflagged = true;
            } else if (rs_add) {
                // Our own rows, added into C once the peer's partials are
                // there (its stores, flagged once complete). In the CTA's
                // last tile the sums wait in the ring, free then, so that
                // only the adds' issue follows the flags.
                const bool staged = p.rs_push_ring && t + (int)gridDim.x >= tiling.total && dt != SYMM_DT_F32;
                unsigned char* area = ring + slice * SYMM_GEMM_BK_BYTES;
                if (staged) {
                    SYMM_EPI_TMA_S(BN, acc, tile.col0, row, p.n, area, Cfg::STAGE_BYTES, tm_c, p.alpha,
                                   SYMM_EPI_STAGE);
                }
                if (t128 == 0) {
                    wait_peer_stores(tile);
                    // Their (async proxy) stores, then our adds.
                    asm volatile("fence.proxy.async.global;" ::: "memory");
                }
                if (threadIdx.x == 128) symm_trace_now(p, SYMM_TRACE_ADDED);
                if (!staged) {
                    SYMM_EPI_TMA(tm_c, row, p.alpha, SYMM_EPI_ADD);
                } else if (t128 == 0) {
                    if (dt == SYMM_DT_BF16) {
                        symm_epilogue_add_staged<SYMM_DT_BF16, BN>(area, Cfg::STAGE_BYTES, tile.col0, row, p.n, tm_c);
                    } else {
                        symm_epilogue_add_staged<SYMM_DT_F16, BN>(area, Cfg::STAGE_BYTES, tile.col0, row, p.n, tm_c);
                    }
                }
                if (threadIdx.x == 128) symm_trace_now(p, SYMM_TRACE_EPILOGUE);
            } else {
                // Our own rows: the peers' partials (scaled by alpha
                // already) from the ring, added to ours, then out to C.
#pragma unroll
                for (int i = 0; i < BN / 2; i++) acc[i] *= p.alpha;
                const symm_partials parts(p, BN, Cfg::STAGE_BYTES);
                const symm_tmap* in_ring = p.rs_c_store == SYMM_RS_C_RING ? tm_c : nullptr;
#define SYMM_ADD(DT)                                                                                            \
    symm_add_partials<DT, BN, STAGES, Cfg::STAGE_BYTES>(acc, parts, tile, p.n, slice, ring, full, empty, stage, \
                                                        phase, in_ring, row, p)
                if (dt == SYMM_DT_F32) SYMM_ADD(SYMM_DT_F32);
                else if (dt == SYMM_DT_BF16) SYMM_ADD(SYMM_DT_BF16);
                else SYMM_ADD(SYMM_DT_F16);
#undef SYMM_ADD
                if (threadIdx.x == 128) symm_trace_now(p, SYMM_TRACE_ADDED);
                if (in_ring) {
                    // Stored from the ring already.
                } else if (p.rs_c_store == SYMM_RS_C_STAGED) {
                    SYMM_EPI_TMA(tm_c, row, 1.f, SYMM_EPI_STORE);
                } else {
                    // C's rows that TMA cannot address (this rank's own
                    // output, unlike the inboxes, may be misaligned).
#define SYMM_EPI(DT) symm_epilogue<DT, BN>(acc, tile, p.n, slice, p.c, chunk_row0, p.ldc, nullptr, 0, 1.f)
                    if (dt == SYMM_DT_F32) SYMM_EPI(SYMM_DT_F32);
                    else if (dt == SYMM_DT_BF16) SYMM_EPI(SYMM_DT_BF16);
                    else SYMM_EPI(SYMM_DT_F16);
#undef SYMM_EPI
                }
                if (threadIdx.x == 128) symm_trace_now(p, SYMM_TRACE_EPILOGUE);
            }
            continue;
        }
#undef SYMM_EPI_TMA
#undef SYMM_EPI_TMA_W
#undef SYMM_EPI_TMA_S
        // From registers (rows that TMA cannot address, or for comparison).
        const int64_t slot_elems = (int64_t)p.chunk_rows * p.n;
        const int elem = dt == SYMM_DT_F32 ? 4 : 2;
        if (tile.chunk != p.rank) {
            // A peer's rows: into its inbox slot for this rank (once the
            // peers' inboxes are free), then its flag.
            symm_mbar_wait(peers_ready, 0);
            const uint64_t dst = p.inbox[tile.chunk] + (uint64_t)(p.rank * slot_elems * elem);
#define SYMM_EPI(DT) symm_epilogue<DT, BN>(acc, tile, p.n, slice, dst, chunk_row0, p.n, nullptr, 0, p.alpha)
            if (dt == SYMM_DT_F32) SYMM_EPI(SYMM_DT_F32);
            else if (dt == SYMM_DT_BF16) SYMM_EPI(SYMM_DT_BF16);
            else SYMM_EPI(SYMM_DT_F16);
#undef SYMM_EPI
            symm_consumers_sync();
            if (threadIdx.x == 128) {
                __threadfence_system();
                symm_st_release_sys(tiling.flag(p, tile.chunk, p.rank, tile.index), rs_epoch());
            }
        } else {
            // Our own rows: wait for every peer's partial tile, then sum.
            take_peer_tiles(tile);
            uint64_t adds[SYMM_GEMM_MAX_CHUNKS];
            int nadds = 0;
            for (int src = 0; src < p.world; src++) {
                if (src != p.rank) adds[nadds++] = p.inbox[p.rank] + (uint64_t)(src * slot_elems * elem);
            }
            // Peers' partials were scaled by alpha already; ours is scaled in
            // the epilogue before the adds.
#define SYMM_EPI(DT) symm_epilogue<DT, BN>(acc, tile, p.n, slice, p.c, chunk_row0, p.ldc, adds, nadds, p.alpha)
            if (dt == SYMM_DT_F32) SYMM_EPI(SYMM_DT_F32);
            else if (dt == SYMM_DT_BF16) SYMM_EPI(SYMM_DT_BF16);
            else SYMM_EPI(SYMM_DT_F16);
#undef SYMM_EPI
        }
    }
    if (unflagged) flag_pushed_tile();
    // The last stores must finish reading shared memory before the CTA exits.
    if (pending && t128 == 0) asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
    if (threadIdx.x == 128) symm_trace_now(p, SYMM_TRACE_DRAINED);
    if (symm_rs_live(p) && !symm_rs_pushes(p)) {
        // Both warpgroups have added every partial they loaded (with
        // rs_push the producer counts the CTA, above).
        symm_consumers_sync();
        if (threadIdx.x == 128) symm_rs_finish(p, rs_epoch());
    }
    if (threadIdx.x == 128) symm_trace_now(p, SYMM_TRACE_END);
}

#define SYMM_GEMM_ENTRY(NAME, A_DT, B_DT, BN, PROMOTE)                                                      \
    extern "C" __global__ void __launch_bounds__(SYMM_GEMM_THREADS, 1)                                      \
        NAME(const __grid_constant__ symm_tmap tm_a, const __grid_constant__ symm_tmap tm_a_local,          \
             const __grid_constant__ symm_tmap tm_b, const __grid_constant__ symm_tmap tm_c,                \
             const __grid_constant__ symm_rs_maps tm_rs, const __grid_constant__ symm_gemm_params p) {      \
        symm_gemm_sm90<A_DT, B_DT, BN, PROMOTE>(&tm_a, &tm_a_local, &tm_b, &tm_c, &tm_rs, p);               \
    }

#else  // not sm_90a: the entry points exist (so the module loads) but do nothing; the host
       // only launches them after symm_gemm_sm90_probe reported the sm_90a code.
#define SYMM_GEMM_ENTRY(NAME, A_DT, B_DT, BN, PROMOTE)                                                      \
    extern "C" __global__ void NAME(const __grid_constant__ symm_tmap tm_a,                                 \
                                    const __grid_constant__ symm_tmap tm_a_local,                           \
                                    const __grid_constant__ symm_tmap tm_b,                                 \
                                    const __grid_constant__ symm_tmap tm_c,                                 \
                                    const __grid_constant__ symm_rs_maps tm_rs,                             \
                                    const __grid_constant__ symm_gemm_params p) {}
#endif

SYMM_GEMM_ENTRY(symm_gemm_sm90_bf16_n256, SYMM_DT_BF16, SYMM_DT_BF16, 256, false)
SYMM_GEMM_ENTRY(symm_gemm_sm90_bf16_n128, SYMM_DT_BF16, SYMM_DT_BF16, 128, false)
SYMM_GEMM_ENTRY(symm_gemm_sm90_f16_n256, SYMM_DT_F16, SYMM_DT_F16, 256, false)
SYMM_GEMM_ENTRY(symm_gemm_sm90_f16_n128, SYMM_DT_F16, SYMM_DT_F16, 128, false)
// fp8: fast accumulation (both tiles), and exact (`_exact`, 128-wide).
SYMM_GEMM_ENTRY(symm_gemm_sm90_e4m3_e4m3_n256, SYMM_DT_E4M3, SYMM_DT_E4M3, 256, false)
SYMM_GEMM_ENTRY(symm_gemm_sm90_e4m3_e4m3_n128, SYMM_DT_E4M3, SYMM_DT_E4M3, 128, false)
SYMM_GEMM_ENTRY(symm_gemm_sm90_e4m3_e4m3_n128_exact, SYMM_DT_E4M3, SYMM_DT_E4M3, 128, true)
SYMM_GEMM_ENTRY(symm_gemm_sm90_e4m3_e5m2_n256, SYMM_DT_E4M3, SYMM_DT_E5M2, 256, false)
SYMM_GEMM_ENTRY(symm_gemm_sm90_e4m3_e5m2_n128, SYMM_DT_E4M3, SYMM_DT_E5M2, 128, false)
SYMM_GEMM_ENTRY(symm_gemm_sm90_e4m3_e5m2_n128_exact, SYMM_DT_E4M3, SYMM_DT_E5M2, 128, true)
SYMM_GEMM_ENTRY(symm_gemm_sm90_e5m2_e4m3_n256, SYMM_DT_E5M2, SYMM_DT_E4M3, 256, false)
SYMM_GEMM_ENTRY(symm_gemm_sm90_e5m2_e4m3_n128, SYMM_DT_E5M2, SYMM_DT_E4M3, 128, false)
SYMM_GEMM_ENTRY(symm_gemm_sm90_e5m2_e4m3_n128_exact, SYMM_DT_E5M2, SYMM_DT_E4M3, 128, true)
