// The fused Hopper matmul's launch interface: its constants, the tensor
// maps and parameters the host passes (mirrored field for field by
// src/backend/cuda/sm90/launch.rs), the reduce-scatter's per-rank state and
// the CTA's shared-memory layout. Host-visible: no sm_90a code here.
#pragma once
#include "common.cuh"
#include "dtype.cuh"

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
// Shared memory staging C for TMA stores: 16 KiB per consumer warpgroup.
#define SYMM_GEMM_EPI_BYTES (2 * 16384)

// A CUtensorMap (cuTensorMapEncodeTiled), opaque to the kernel.
struct alignas(64) symm_tmap {
    uint64_t opaque[16];
};

// rs_push: the reduce-scatter's TMA maps. inbox: this rank's inbox,
// [world][chunk_rows][n] of C's type, boxes of 128 rows x 128 bytes of one
// slot; push[d]: rank d's inbox slot for this rank (or, SYMM_RS_C_ADD, rank
// d's C), [chunk_rows][n], boxes of 64 rows x 128 bytes (push[rank] unused).
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
    uint32_t tag[2][SYMM_GEMM_MAX_CHUNKS];  // tag[e & 1][src]: the tag rank src's call e stored before its flags
    uint32_t pad[61 - 2 * SYMM_GEMM_MAX_CHUNKS];  // the flags start 256 bytes in
};
#define SYMM_RS_STATE_BYTES 256
static_assert(sizeof(symm_rs_state) == SYMM_RS_STATE_BYTES, "the flags follow the state");

// Mirrored by `Params` in src/backend/cuda/sm90/launch.rs (#[repr(C)]; the
// offsets asserted below are asserted there too).
struct symm_gemm_params {
    int32_t m, n, k;
    int32_t out_dtype;     // SYMM_DT_*
    uint64_t c;            // C (plain) or this rank's output chunk (rs)
    int64_t ldc;           // elements
    int32_t chunks;        // row chunks of A (1 for a plain matmul)
    int32_t chunk_rows;    // rows per chunk (the last one may be shorter)
    int32_t order[SYMM_GEMM_MAX_CHUNKS];  // chunk visited at position i
    int32_t local_chunk;   // chunk read through tm_a_local (-1: none)
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
    int32_t rs_push;       // reduce-scatter: 1 = through TMA and shared memory (tm_rs)
    int32_t slices;        // all-gather: k-slices per chunk, flags ready[chunk * slices + slice]
    int32_t slice_kblocks; // all-gather: k-blocks per slice (slices > 1: tm_a is [slices][m][k / slices])
    int32_t rs_narrow_n;   // rs_push: tiles per row tile of a peer's chunk (0: as wide as the own ones)
    int32_t rs_narrow_w;   // their width (a multiple of 8; the first few are 8 wider, to cover n)
    int32_t rs_narrow_less; // narrow peer tiles: the last this many of a row tile are 8 columns narrower
    int32_t rs_c_store;    // rs_push: how this rank's own rows reach C (SYMM_RS_C_*)
    int32_t cut_n;         // not rs: tiles per row tile of a column cut (0: BN wide)
    int32_t cut_w;         // their width (a multiple of 8; the first few are 8 wider, to cover n)
    uint32_t rs_tag;       // rs: the call's tag (never 0), stored beside the pushed tiles' flags
};
static_assert(sizeof(symm_gemm_params) == 488, "mirrored by launch.rs");
static_assert(__builtin_offsetof(symm_gemm_params, order) == 40, "mirrored by launch.rs");
static_assert(__builtin_offsetof(symm_gemm_params, ready) == 112, "mirrored by launch.rs");
static_assert(__builtin_offsetof(symm_gemm_params, inbox) == 128, "mirrored by launch.rs");
static_assert(__builtin_offsetof(symm_gemm_params, alpha) == 384, "mirrored by launch.rs");
static_assert(__builtin_offsetof(symm_gemm_params, a_scale) == 408, "mirrored by launch.rs");
static_assert(__builtin_offsetof(symm_gemm_params, scale_mode) == 440, "mirrored by launch.rs");
static_assert(__builtin_offsetof(symm_gemm_params, rs_narrow_n) == 456, "mirrored by launch.rs");
static_assert(__builtin_offsetof(symm_gemm_params, cut_w) == 476, "mirrored by launch.rs");
static_assert(__builtin_offsetof(symm_gemm_params, rs_tag) == 480, "mirrored by launch.rs");

// rs_c_store, with rs_push: how this rank's own rows reach C.
// From registers: C that TMA cannot address (misaligned).
#define SYMM_RS_C_REGISTERS 0
// By TMA stores of tm_c from the ring, where the peers' partials were
// added (symm_add_partials).
#define SYMM_RS_C_RING 2
// Through C itself: C lies in symmetric memory (tm_rs push[d] is rank d's
// C); the peer stores its partials straight into C once this rank's call
// has started (symm_rs_state.started), and each own tile, once the peer's
// flags of it are set, adds its sums into them by TMA reduce-adds: no
// partial is loaded back. World 2 (one peer per tile).
#define SYMM_RS_C_ADD 3

// What an entry point does with its tiles (the kernel's MODE): a matmul,
// whose tiles go to C (plain, gathered or column cut), or a matmul whose
// row chunks are reduce-scattered over the ranks (rank d sums chunk d).
enum symm_gemm_mode { SYMM_GEMM_MATMUL = 0, SYMM_GEMM_REDUCE_SCATTER = 1 };

#define SYMM_GEMM_SCALES_NONE 0
#define SYMM_GEMM_SCALES_TENSOR 1
#define SYMM_GEMM_SCALES_ROW 2

// Shared memory of a CTA with BN-wide tiles.
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
