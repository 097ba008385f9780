// One persistent matmul for Hopper (sm_90a) whose tiles can wait for their
// rows to arrive (all-gather + matmul) or push their results to the rank
// that reduces them (matmul + reduce-scatter). docs/sm90-kernel.md walks
// through the design; this header assembles the pieces into the kernel
// template, whose entry points gemm_sm90.cu (matmul) and gemm_sm90_rs.cu
// (reduce-scatter) instantiate, compiled apart:
//
//   sm90_params.cuh     constants, tensor maps, parameters (mirrored by
//                       src/backend/cuda/sm90/launch.rs), shared memory
//   sm90_ptx.cuh        mbarriers, TMA, wgmma and fences (PTX)
//   sm90_scheduler.cuh  the tile order every CTA walks (mirrored by
//                       src/backend/cuda/sm90/tiling.rs)
//   sm90_mainloop.cuh   the producer and the consumers' k-loop
//   sm90_epilogue.cuh   scales, stores from registers, TMA stores
//   sm90_wait.cuh       bounded waits on other GPUs' words
//   sm90_gather.cuh     the all-gather's waits for arriving rows
//   sm90_scatter.cuh    the reduce-scatter's pushes, flags, epochs, adds
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
// Structure (as CUTLASS's warp-specialized persistent kernels): 3
// warpgroups per CTA, one CTA per SM. Warpgroup 0 is the producer (one
// thread issues the TMA loads; with a reduce-scatter two more threads
// flag pushed tiles and wait for the peers); warpgroups 1 and 2 are
// consumers, each multiplying 64 rows of the 128-row tile and storing them.
// Edges: TMA fills out-of-range rows/columns/k with zeros, the epilogues
// mask rows past the chunk and columns past n. K must give 16-byte row
// strides (k % 8 == 0 for 16-bit types, k % 16 for 8-bit ones), which the
// host checks.
//
// Template parameters: the input types, the tile width BN, PROMOTE (exact
// fp8 accumulation) and MODE (symm_gemm_mode): a matmul (plain, gathered,
// column cut), or a matmul whose row chunks are reduce-scattered, each
// instantiation carrying only its own producer helpers and epilogue.
// Within a mode, the run-time parameters pick among ways that give the
// same result where the operands' alignment allows (TMA or register
// stores, pushes or stores from registers, how C is added). The narrow
// tiles' k-loops exist only where the host can ask for them (16-bit
// inputs, 256-wide tiles). Other architectures get empty entry points, so
// the modules load everywhere; the host launches them only after
// symm_gemm_sm90_probe reported the sm_90a code.
#pragma once
#include "sm90_params.cuh"
#include "sm90_mainloop.cuh"

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

// A compile-time tile width passed to a generic lambda.
template <int N>
struct symm_width {
    static constexpr int value = N;
};

template <int A_DT, int B_DT, int BN, bool PROMOTE, int MODE>
static __device__ __forceinline__ void symm_gemm_sm90(const symm_tmap* tm_a, const symm_tmap* tm_a_local,
                                                      const symm_tmap* tm_b, const symm_tmap* tm_c,
                                                      const symm_rs_maps* tm_rs, const symm_gemm_params& p) {
    using Cfg = symm_gemm_cfg<BN>;
    constexpr bool RS = MODE == SYMM_GEMM_REDUCE_SCATTER;
    extern __shared__ __align__(1024) unsigned char symm_gemm_smem[];
    // Aligned by pointer arithmetic, not through an integer, so the
    // compiler still knows these are shared memory (LDS/STS with 32-bit
    // addresses, not generic accesses whose 64-bit addresses spilled).
    unsigned char* ring = symm_gemm_smem + ((1024u - (symm_smem_addr(symm_gemm_smem) & 1023u)) & 1023u);
    unsigned char* staging = ring + Cfg::STAGES * Cfg::STAGE_BYTES;  // 1024-aligned
    uint64_t* full = (uint64_t*)(staging + SYMM_GEMM_EPI_BYTES);
    uint64_t* empty = full + Cfg::STAGES;
    symm_handoff* pushed = (symm_handoff*)(empty + Cfg::STAGES);  // rs_push: tiles to flag
    uint32_t* call_epoch = (uint32_t*)(pushed + 1);              // rs: this call's epoch
    uint64_t* peers_ready = (uint64_t*)(pushed + 1) + 1;         // rs: every peer's inbox is free

    const int wg = threadIdx.x / 128;
    if (threadIdx.x == 0) {
        symm_tmap_prefetch(tm_a);
        symm_tmap_prefetch(tm_b);
        if (!RS && p.local_chunk >= 0) symm_tmap_prefetch(tm_a_local);
        for (int s = 0; s < Cfg::STAGES; s++) {
            symm_mbar_init(&full[s], 1);
            symm_mbar_init(&empty[s], 2);  // one arrival per consumer warpgroup
        }
        symm_mbar_init(&pushed->full, 2);  // thread 0 of each consumer warpgroup
        symm_mbar_init(&pushed->empty, 1);
        symm_mbar_init(peers_ready, 1);
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
        // Read once for the CTA: the last CTA raises it when it finishes.
        if (RS && symm_rs_live(p)) *call_epoch = symm_rs_state_of(p, p.rank)->epoch + 1;
    }
    __syncthreads();

    const symm_tiling tiling(p, BN, RS);
    const bool rs_add = RS && symm_rs_pushes(p) && p.rs_c_store == SYMM_RS_C_ADD;
    // Elements of k per k-block: 64 of a 16-bit type, 128 of an 8-bit one.
    constexpr int BK = A_DT == SYMM_DT_E4M3 || A_DT == SYMM_DT_E5M2 ? SYMM_GEMM_BK_BYTES : SYMM_GEMM_BK_BYTES / 2;
    const int kblocks = (p.k + BK - 1) / BK;

    if (wg == 0) {
        // Producer: one thread issues every load, two help the
        // reduce-scatter; the rest only donate their registers.
        asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
        if constexpr (RS) symm_rs_producer_helpers(p, tiling, BN, rs_add, pushed, peers_ready, call_epoch);
        if (threadIdx.x == 0) {
            symm_produce<BN, BK, MODE>(p, tiling, kblocks, tm_a, tm_a_local, tm_b, tm_c, tm_rs, ring, full, empty, rs_add,
                                 call_epoch);
        }
        return;
    }

    // Consumers: warpgroup 1 takes rows 0-63 of each tile, warpgroup 2 rows 64-127.
    asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");
    const int slice = (wg - 1) * 64;
    const int t128 = threadIdx.x % 128;
    static_assert(!PROMOTE || (BK == SYMM_GEMM_BK_BYTES && BN == 128), "promotion: fp8, 128-wide tiles");
    symm_consumer_ring<A_DT, B_DT, BN> cr;
    cr.ring = ring;
    cr.full = full;
    cr.empty = empty;
    cr.slice = slice;
    cr.t128 = t128;
    cr.kblocks = kblocks;
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
            asm volatile("fence.proxy.async.global;" ::: "memory");
            symm_mbar_wait(&pushed->empty, pushed_phase ^ 1);
            symm_mbar_arrive(&pushed->full);
        }
        pushed_phase ^= 1;
        unflagged = false;
    };
    // This warpgroup's half of the staging area.
    unsigned char* mine = staging + (wg - 1) * (SYMM_GEMM_EPI_BYTES / 2);
    // symm_epilogue_tma for C's type, W columns of ACC from COL0 into MAP
    // (columns before N), through AREA boxes SPREAD bytes apart (0: two
    // boxes at a time).
#define SYMM_EPI_TMA_S(W, ACC, COL0, ROW, N, AREA, SPREAD, MAP, ALPHA, MODE)                                    \
    if (p.out_dtype == SYMM_DT_F32)                                                                            \
        symm_epilogue_tma<SYMM_DT_F32, W>(ACC, COL0, ROW, N, AREA, SPREAD, MAP, ALPHA, MODE, pending);       \
    else if (p.out_dtype == SYMM_DT_BF16)                                                                      \
        symm_epilogue_tma<SYMM_DT_BF16, W>(ACC, COL0, ROW, N, AREA, SPREAD, MAP, ALPHA, MODE, pending);      \
    else symm_epilogue_tma<SYMM_DT_F16, W>(ACC, COL0, ROW, N, AREA, SPREAD, MAP, ALPHA, MODE, pending)
#define SYMM_EPI_TMA_W(W, ACC, COL0, ROW, N, MAP, ALPHA, MODE) \
    SYMM_EPI_TMA_S(W, ACC, COL0, ROW, N, mine, 0, MAP, ALPHA, MODE)
    // The register epilogue for C's type.
#define SYMM_EPI_REGS(BASE, ROW_BASE, LD, ADDS, NADDS, ALPHA)                                              \
    if (p.out_dtype == SYMM_DT_F32)                                                                        \
        symm_epilogue<SYMM_DT_F32, BN>(acc, tile, p.n, slice, BASE, ROW_BASE, LD, ADDS, NADDS, ALPHA);    \
    else if (p.out_dtype == SYMM_DT_BF16)                                                                  \
        symm_epilogue<SYMM_DT_BF16, BN>(acc, tile, p.n, slice, BASE, ROW_BASE, LD, ADDS, NADDS, ALPHA);   \
    else symm_epilogue<SYMM_DT_F16, BN>(acc, tile, p.n, slice, BASE, ROW_BASE, LD, ADDS, NADDS, ALPHA)

    // A narrow tile (232 to 248 columns), start to end: a k-loop of its
    // own width on the first W / 2 of d, then its store by TMA, the last
    // box shifted back to end with the tile: into C (a column cut's tile)
    // or pushed to a peer (a narrow peer tile). `last`: the CTA's last
    // tile, after which the ring is free.
    auto narrow_tile = [&](const symm_tile& tile, auto width, float(&d)[BN / 2], bool last) {
        constexpr int W = decltype(width)::value;
        float(&dn)[W / 2] = *reinterpret_cast<float(*)[W / 2]>(&d);
        cr.template mainloop<W>(d);
        if constexpr (!RS) {
            SYMM_EPI_TMA_W(W, dn, tile.col0, tile.row0 + slice, min(p.n, tile.col0 + W), tm_c, p.alpha,
                           SYMM_EPI_STORE);
        } else {
            if (unflagged) flag_pushed_tile();
            symm_mbar_wait(peers_ready, 0);
            const int end = min(p.n, tile.col0 + W);
            const int row = tile.row0 - tile.chunk * p.chunk_rows + slice;
            // A 16-bit C's boxes of the CTA's last tile all at once, in this
            // warpgroup's rows of the ring's stages (A's half it alone reads),
            // free after the k-loop; else two at a time through the staging area.
            const bool spread = last && p.out_dtype != SYMM_DT_F32;
            unsigned char* area = spread ? ring + slice * SYMM_GEMM_BK_BYTES : mine;
            const int stride = spread ? Cfg::STAGE_BYTES : 0;
            SYMM_EPI_TMA_S(W, dn, tile.col0, row, end, area, stride, &tm_rs->push[tile.chunk], p.alpha,
                           SYMM_EPI_STORE);
            unflagged = true;
        }
    };
    // Narrow tiles (a matmul's column cut, a reduce-scatter's narrow peer
    // tiles) exist only in these kernels (the host sets them).
    constexpr bool NARROW = BN == 256 && !PROMOTE && A_DT == B_DT && (A_DT == SYMM_DT_BF16 || A_DT == SYMM_DT_F16);

    for (int t = blockIdx.x; t < tiling.total; t += gridDim.x) {
        const symm_tile tile = tiling.at(p, BN, t);
        const bool last = t + (int)gridDim.x >= tiling.total;
        // Declared per tile: nothing of the previous tile's is live into
        // the next one's k-loop.
        float d[BN / 2];
        if constexpr (NARROW) {
            if (tile.cols != BN) {
                if (tile.cols == 232) narrow_tile(tile, symm_width<232>{}, d, last);
                else if (tile.cols == 240) narrow_tile(tile, symm_width<240>{}, d, last);
                else narrow_tile(tile, symm_width<248>{}, d, last);
                continue;
            }
        }
        if constexpr (PROMOTE) {
            cr.mainloop_promoted(d, d1, promoted);
        } else {
            cr.template mainloop<BN>(d);
        }
        // The finished tile: the promoted sums (exact fp8), else d.
        float(&acc)[BN / 2] = PROMOTE ? promoted : d;
        if (p.scale_mode != SYMM_GEMM_SCALES_NONE) {
            // A peer's row scales came with its rows, before the flag the
            // producer waited on: acquire it here too before reading them.
            if (!RS && p.scale_mode == SYMM_GEMM_SCALES_ROW && p.ready != nullptr && tile.chunk != p.local_chunk)
                (void)symm_ld_acquire_sys(&p.ready[tile.chunk]);
            symm_apply_scales<BN>(acc, tile, p.n, slice, p);
        }
        const int dt = p.out_dtype;
#define SYMM_EPI_TMA(MAP, ROW, ALPHA, MODE) SYMM_EPI_TMA_W(BN, acc, tile.col0, ROW, p.n, MAP, ALPHA, MODE)
        if constexpr (!RS) {
            if (p.c_tma) {
                SYMM_EPI_TMA(tm_c, tile.row0 + slice, p.alpha, SYMM_EPI_STORE);
            } else {
                SYMM_EPI_REGS(p.c, 0, p.ldc, nullptr, 0, p.alpha);
            }
        } else {
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
                    unflagged = true;
                } else if (rs_add) {
                    // Our own rows, added into C once the peer's partials are
                    // there (its stores, flagged once complete). In the CTA's
                    // last tile the sums wait in the ring, free then, so that
                    // only the adds' issue follows the flags.
                    const bool staged = last && dt != SYMM_DT_F32;
                    unsigned char* area = ring + slice * SYMM_GEMM_BK_BYTES;
                    if (staged) {
                        SYMM_EPI_TMA_S(BN, acc, tile.col0, row, p.n, area, Cfg::STAGE_BYTES, tm_c, p.alpha,
                                       SYMM_EPI_STAGE);
                    }
                    uint32_t heard = 0;
                    if (t128 == 0) {
                        heard = symm_rs_wait_peer_stores(p, tiling, tile, BN, symm_rs_epoch(call_epoch));
                        // Their (async proxy) stores, then our adds.
                        asm volatile("fence.proxy.async.global;" ::: "memory");
                    }
                    if (!staged) {
                        SYMM_EPI_TMA(tm_c, row, p.alpha, SYMM_EPI_ADD);
                    } else if (t128 == 0) {
                        if (dt == SYMM_DT_BF16) {
                            symm_epilogue_add_staged<SYMM_DT_BF16, BN>(area, Cfg::STAGE_BYTES, tile.col0, row, p.n, tm_c);
                        } else {
                            symm_epilogue_add_staged<SYMM_DT_F16, BN>(area, Cfg::STAGE_BYTES, tile.col0, row, p.n, tm_c);
                        }
                    }
                    if (t128 == 0) symm_rs_check_tags(p, heard, symm_rs_epoch(call_epoch));
                } else {
                    // Our own rows: the peers' partials (scaled by alpha
                    // already) from the ring, added to ours, then out to C.
#pragma unroll
                    for (int i = 0; i < BN / 2; i++) acc[i] *= p.alpha;
                    const symm_partials parts(p, BN, Cfg::STAGE_BYTES);
                    const symm_tmap* in_ring = p.rs_c_store == SYMM_RS_C_RING ? tm_c : nullptr;
#define SYMM_ADD(DT)                                                                                            \
        symm_add_partials<DT, BN, Cfg::STAGES, Cfg::STAGE_BYTES>(acc, parts, tile, p.n, slice, ring, full, empty, \
                                                                 cr.stage, cr.phase, in_ring, row)
                    if (dt == SYMM_DT_F32) SYMM_ADD(SYMM_DT_F32);
                    else if (dt == SYMM_DT_BF16) SYMM_ADD(SYMM_DT_BF16);
                    else SYMM_ADD(SYMM_DT_F16);
#undef SYMM_ADD
                    // Stored from the ring already, else C's rows that TMA
                    // cannot address (this rank's own output, unlike the
                    // inboxes, may be misaligned): from registers.
                    if (!in_ring) SYMM_EPI_REGS(p.c, chunk_row0, p.ldc, nullptr, 0, 1.f);
                }
                continue;
            }
#undef SYMM_EPI_TMA
            // From registers (rows that TMA cannot address).
            const int64_t slot_elems = (int64_t)p.chunk_rows * p.n;
            const int elem = dt == SYMM_DT_F32 ? 4 : 2;
            if (tile.chunk != p.rank) {
                // A peer's rows: into its inbox slot for this rank (once the
                // peers' inboxes are free), then its flag.
                symm_mbar_wait(peers_ready, 0);
                const uint64_t dst = p.inbox[tile.chunk] + (uint64_t)(p.rank * slot_elems * elem);
                SYMM_EPI_REGS(dst, chunk_row0, p.n, nullptr, 0, p.alpha);
                symm_consumers_sync();
                if (threadIdx.x == 128) {
                    __threadfence_system();
                    symm_rs_store_tag(p, tile.chunk, symm_rs_epoch(call_epoch));
                    symm_st_release_sys(tiling.flag(p, tile.chunk, p.rank, tile.index), symm_rs_epoch(call_epoch));
                }
            } else {
                // Our own rows: wait for every peer's partial tile, then sum.
                symm_rs_take_peer_tiles(p, tiling, tile, symm_rs_epoch(call_epoch));
                uint64_t adds[SYMM_GEMM_MAX_CHUNKS];
                int nadds = 0;
                for (int src = 0; src < p.world; src++) {
                    if (src != p.rank) adds[nadds++] = p.inbox[p.rank] + (uint64_t)(src * slot_elems * elem);
                }
                // Peers' partials were scaled by alpha already; ours is scaled in
                // the epilogue before the adds.
                SYMM_EPI_REGS(p.c, chunk_row0, p.ldc, adds, nadds, p.alpha);
            }
        }
    }
#undef SYMM_EPI_REGS
#undef SYMM_EPI_TMA_W
#undef SYMM_EPI_TMA_S
    if (RS && unflagged) flag_pushed_tile();
    // The last stores must finish reading shared memory before the CTA exits.
    if (pending && t128 == 0) asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
    if (RS && symm_rs_live(p) && !symm_rs_pushes(p)) {
        // Both warpgroups have added every partial they loaded (with
        // rs_push the producer counts the CTA).
        symm_consumers_sync();
        if (threadIdx.x == 128) symm_rs_finish(p, symm_rs_epoch(call_epoch));
    }
}

#define SYMM_GEMM_ENTRY(NAME, A_DT, B_DT, BN, PROMOTE, MODE)                                                \
    extern "C" __global__ void __launch_bounds__(SYMM_GEMM_THREADS, 1)                                      \
        NAME(const __grid_constant__ symm_tmap tm_a, const __grid_constant__ symm_tmap tm_a_local,          \
             const __grid_constant__ symm_tmap tm_b, const __grid_constant__ symm_tmap tm_c,                \
             const __grid_constant__ symm_rs_maps tm_rs, const __grid_constant__ symm_gemm_params p) {      \
        symm_gemm_sm90<A_DT, B_DT, BN, PROMOTE, MODE>(&tm_a, &tm_a_local, &tm_b, &tm_c, &tm_rs, p);         \
    }

#else  // not sm_90a: the entry points exist (so the module loads) but do nothing.
#define SYMM_GEMM_ENTRY(NAME, A_DT, B_DT, BN, PROMOTE, MODE)                                                \
    extern "C" __global__ void NAME(const __grid_constant__ symm_tmap tm_a,                                 \
                                    const __grid_constant__ symm_tmap tm_a_local,                           \
                                    const __grid_constant__ symm_tmap tm_b,                                 \
                                    const __grid_constant__ symm_tmap tm_c,                                 \
                                    const __grid_constant__ symm_rs_maps tm_rs,                             \
                                    const __grid_constant__ symm_gemm_params p) {}
#endif

