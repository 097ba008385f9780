// The fused Hopper matmul's mainloop: the producer, whose one thread
// issues every TMA load of A and B k-blocks into a STAGES-deep ring of
// shared memory (each stage completed on a `full` mbarrier), and the
// consumers' k-loop, which multiplies a stage with wgmma straight from
// shared memory (128-byte swizzle) and hands it back on an `empty` mbarrier.
// sm_90a only.
#pragma once
#include "sm90_gather.cuh"
#include "sm90_scatter.cuh"

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

// How many k-blocks before a tile's last one its epilogue's maps are
// fetched (symm_prefetch_epilogue_maps): early enough for the fetch, late
// enough that the k-loop's A and B maps have not pushed them out since.
#define SYMM_TMAP_PREFETCH_KB 8

// Run by the producer a few k-blocks before `tile`'s epilogue: fetches the
// maps that epilogue copies through (symm_tmap_prefetch).
template <int MODE>
static __device__ __forceinline__ void symm_prefetch_epilogue_maps(const symm_gemm_params& p, const symm_tile& tile,
                                                                   const symm_tmap* tm_c, const symm_rs_maps* tm_rs) {
    if constexpr (MODE == SYMM_GEMM_MATMUL) {
        if (p.c_tma) symm_tmap_prefetch(tm_c);
    } else if (symm_rs_pushes(p)) {
        if (tile.chunk != p.rank) {
            symm_tmap_prefetch(&tm_rs->push[tile.chunk]);
        } else {
            symm_tmap_prefetch(&tm_rs->inbox);
            if (p.rs_c_store != SYMM_RS_C_REGISTERS) symm_tmap_prefetch(tm_c);
        }
    }
}

// The producer (one thread of warpgroup 0): every tile's k-blocks of A and
// B, in the scheduler's order, each k-block of a gathered chunk's rows once
// its slice has arrived; behind an own tile's k-blocks (rs_push) the peers'
// partials. `BK`: elements of k per k-block; MODE: the kernel's.
template <int BN, int BK, int MODE>
static __device__ __forceinline__ void symm_produce(const symm_gemm_params& p, const symm_tiling& tiling, int kblocks,
                                                    const symm_tmap* tm_a, const symm_tmap* tm_a_local,
                                                    const symm_tmap* tm_b, const symm_tmap* tm_c,
                                                    const symm_rs_maps* tm_rs, unsigned char* ring, uint64_t* full,
                                                    uint64_t* empty, bool rs_add, const uint32_t* call_epoch) {
    using Cfg = symm_gemm_cfg<BN>;
    constexpr int STAGES = Cfg::STAGES;
    constexpr bool RS = MODE == SYMM_GEMM_REDUCE_SCATTER;  // no gathered rows, partials to load
    int stage = 0;
    uint32_t phase = 0;
    uint32_t heard = 0;  // rs: peers whose flags the partials' loads acquired
    symm_gather gather;
    for (int t = blockIdx.x; t < tiling.total; t += gridDim.x) {
        const symm_tile tile = tiling.at(p, BN, t);
        const bool local = !RS && tile.chunk == p.local_chunk;
        // The k-block at which this tile next waits for a slice of its
        // rows (kblocks: none left to wait for).
        int wait_kb = RS ? kblocks : gather.first_wait(p, tile.chunk, local, kblocks);
        const symm_tmap* map_a = local ? tm_a_local : tm_a;
        const int a_row = local ? tile.row0 - tile.chunk * p.chunk_rows : tile.row0;
        const bool sliced = !RS && !local && p.slices > 1;  // A's rows from the slice-major gathered copy
        for (int kb = 0; kb < kblocks; kb++) {
            if (kb == max(0, kblocks - SYMM_TMAP_PREFETCH_KB)) symm_prefetch_epilogue_maps<MODE>(p, tile, tm_c, tm_rs);
            if (!RS && kb == wait_kb) wait_kb = gather.wait(p, tile.chunk, kb);
            unsigned char* a = ring + stage * Cfg::STAGE_BYTES;
            symm_mbar_wait(&empty[stage], phase ^ 1);
            symm_mbar_expect_tx(&full[stage], Cfg::STAGE_BYTES);
            if (sliced) {
                symm_tma_load3(a, map_a, kb % p.slice_kblocks * BK, a_row, kb / p.slice_kblocks, &full[stage]);
            } else {
                symm_tma_load(a, map_a, kb * BK, a_row, &full[stage]);
            }
            symm_tma_load(a + Cfg::A_BYTES, tm_b, kb * BK, tile.col0, &full[stage]);
            if (++stage == STAGES) {
                stage = 0;
                phase ^= 1;
            }
        }
        if (RS && symm_rs_pushes(p) && tile.chunk == p.rank && !rs_add) {
            symm_rs_load_partials<STAGES, Cfg::STAGE_BYTES>(p, tiling, tile, BN, tm_rs, ring, full, empty, stage,
                                                            phase, symm_rs_epoch(call_epoch), heard);
        }
    }
    if (RS && symm_rs_pushes(p)) {
        // Every stage handed back: the consumers have read all that the
        // ring brought, the peers' partials included, so this CTA's inbox
        // reads are over. Counted here, beside the consumers' stores
        // rather than after them.
        for (int s = 0; s < STAGES; s++) {
            symm_mbar_wait(&empty[stage], phase ^ 1);
            if (++stage == STAGES) {
                stage = 0;
                phase ^= 1;
            }
        }
        symm_rs_check_tags(p, heard, symm_rs_epoch(call_epoch));
        symm_rs_finish(p, symm_rs_epoch(call_epoch));
    }
}

// A consumer warpgroup's view of the ring: `slice` (0 or 64) is its rows
// of each tile; stage and phase advance as the producer's do.
template <int A_DT, int B_DT, int BN>
struct symm_consumer_ring {
    using Cfg = symm_gemm_cfg<BN>;
    unsigned char* ring;
    uint64_t* full;
    uint64_t* empty;
    int slice, t128, kblocks;
    int stage = 0;
    uint32_t phase = 0;

    __device__ void advance() {
        if (++stage == Cfg::STAGES) {
            stage = 0;
            phase ^= 1;
        }
    }

    __device__ void release(int s) const {
        if (t128 == 0) symm_mbar_arrive(&empty[s]);
    }

    // Waits for the stage's data, then issues its k-block's wgmmas into acc
    // (added to acc's contents when accumulate, else starting afresh), W
    // columns wide (BN, or a narrow tile's W into acc's first W / 2).
    template <int W>
    __device__ __forceinline__ void issue(float (&acc)[BN / 2], bool accumulate) {
        symm_mbar_wait(&full[stage], phase);
        symm_wgmma_fence();
        const unsigned char* a = ring + stage * Cfg::STAGE_BYTES + slice * SYMM_GEMM_BK_BYTES;
        const unsigned char* b = ring + stage * Cfg::STAGE_BYTES + Cfg::A_BYTES;
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
    }

    // A tile's k-loop into acc, W columns wide (a narrow tile's wgmma names
    // all of acc as operands: with only the ones it writes, ptxas
    // serialized the wgmmas (C7515), and with an array of its own it kept
    // both arrays' registers and spilled).
    template <int W>
    __device__ __forceinline__ void mainloop(float (&acc)[BN / 2]) {
        int prev = -1;
        for (int kb = 0; kb < kblocks; kb++) {
            issue<W>(acc, kb != 0);
            // Keep one k-block of wgmma in flight; the one before it is
            // done reading its stage, which goes back to the producer.
            symm_wgmma_wait<1>();
            if (prev >= 0) release(prev);
            prev = stage;
            advance();
        }
        symm_wgmma_wait<0>();
        if (prev >= 0) release(prev);
    }

    // Exact fp8: each k-block's partial sum afresh into one of two sets (d
    // for even k-blocks, d1 for odd), added into `promoted` once done while
    // the next k-block runs in the other set: 2-4% faster than one set with
    // a full wait per k-block (as CUTLASS and DeepGEMM). Nothing but wgmma
    // writes d and d1: ptxas serializes the wgmmas if other code defines
    // their accumulators (C7514).
    __device__ __forceinline__ void mainloop_promoted(float (&d)[BN / 2], float (&d1)[BN / 2],
                                                      float (&promoted)[BN / 2]) {
#pragma unroll
        for (int i = 0; i < BN / 2; i++) promoted[i] = 0.f;
        auto promote = [&](float(&acc)[BN / 2]) {
            symm_fence_operand(acc);
#pragma unroll
            for (int i = 0; i < BN / 2; i++) promoted[i] += acc[i];
            symm_fence_operand(acc);
        };
        // d holds k-block kb (in flight) at the top of each pass; the pairs
        // are peeled so every wait has a fixed count (ptxas tracks which
        // set a wait completes only then).
        int s0 = stage, s1;
        symm_fence_operand(d);
        issue<BN>(d, false);
        advance();
        int kb = 0;
        for (; kb + 2 < kblocks; kb += 2) {
            s1 = stage;
            symm_fence_operand(d1);
            issue<BN>(d1, false);
            advance();
            symm_wgmma_wait<1>();
            release(s0);
            promote(d);
            s0 = stage;
            issue<BN>(d, false);
            advance();
            symm_wgmma_wait<1>();
            release(s1);
            promote(d1);
        }
        if (kb + 1 < kblocks) {
            s1 = stage;
            symm_fence_operand(d1);
            issue<BN>(d1, false);
            advance();
            symm_wgmma_wait<1>();
            release(s0);
            promote(d);
            symm_wgmma_wait<0>();
            release(s1);
            promote(d1);
        } else {
            symm_wgmma_wait<0>();
            release(s0);
            promote(d);
        }
    }
};

#endif  // __CUDA_ARCH_FEAT_SM90_ALL
