// The fused reduce-scatter's side of the Hopper matmul (rs != 0): chunk c
// of the product's rows is rank c's output. Tiles of a peer's chunk are
// written (in C's type) into that peer's inbox slot for this rank, then
// flagged with a release store into the peer's tile flags; the tiles of
// this rank's own chunk come last in `order`, and each adds every peer's
// partial of the same tile to its accumulators before writing C.
//
// With rs_push (rows of whole 16-byte units, inboxes 16-byte aligned: alike
// on every rank) both are TMA's work: a peer's tile leaves by TMA stores
// from the staging area, which drain over NVLink while the consumers run
// the next tile's mainloop, and a producer warp that would otherwise idle
// sets its flag once they completed; for an own tile the producer waits
// for the peers' flags and loads their partial tiles into the ring behind
// the tile's k-blocks, so the consumers find them in shared memory. The
// sums go to C by TMA from the ring where they were added, or from
// registers where C's address or stride rule TMA out. Without rs_push
// (rows TMA cannot address), stores, flags and adds go from registers.
//
// At world 2 with every rank's C in symmetric memory and narrow peer tiles
// (SYMM_RS_C_ADD) the peer's tiles go straight into this rank's C, and the
// own tiles add their sums to them by TMA reduce-adds.
//
// Calls in sequence, with no barrier between them: each rank's state
// (symm_rs_state) counts its completed calls (`epoch`). A call is epoch
// e = epoch + 1 on every rank. A tile's flag is set to e when it lands, so
// flags never need resetting, and the reader waits for its flags to reach
// e. A rank pushes into a peer's inbox only once that peer's epoch has
// reached e - 1, that is, once the peer's previous call has read all of
// its inbox; the last CTA of a call to finish reading its inbox raises its
// rank's epoch (with rs_push, as soon as its consumers handed back the
// ring, beside their stores rather than after them). Neither depends on
// the previous call's shape, and both live in device memory, so graph
// replays keep them too. The state, its flags and the inbox must be memory
// no other work writes. sm_90a only.
//
// Call tags: ranks whose calls were both kept are not compared on the
// host, so ranks out of step (one in call X, a peer in call Y, with the
// same epoch) would sum each other's partials. Before the first flag a
// CTA sets in a peer's state in call e, it stores its call's tag there
// (tag[e & 1][rank]); a rank checks the tag of each peer whose flag it
// acquired, after its waits. Slots alternate with the epoch's parity:
// adding into C, a rank raises its epoch before its last checks, so the
// peer's next call may already store its tag; the call after that waits
// for this rank's next epoch, after this kernel. Another call's tag is
// recorded as a mismatch: the call's output is undefined and the failure
// comes with the next call, as after a timeout.
#pragma once
#include "sm90_epilogue.cuh"
#include "sm90_wait.cuh"

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

// This call's epoch, as the CTA read it at its start (in shared memory:
// read where used, not held, since a register live across the consumers'
// mainloop spilled).
static __device__ __forceinline__ uint32_t symm_rs_epoch(const uint32_t* call_epoch) {
    return *(volatile const uint32_t*)call_epoch;
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

// In a reduce-scatter kernel: are there peers (the epoch protocol above)?
static __device__ __forceinline__ bool symm_rs_live(const symm_gemm_params& p) {
    return p.world > 1;
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

// Stores the tag of call `epoch` into rank `dst`'s state before a flag
// there (a release store of the flag then publishes it).
static __device__ __forceinline__ void symm_rs_store_tag(const symm_gemm_params& p, int dst, uint32_t epoch) {
    symm_st_relaxed_sys(&symm_rs_state_of(p, dst)->tag[epoch & 1u][p.rank], p.rs_tag);
}

// After acquiring a flag of call `epoch` from each peer in `heard` (a bit
// per rank): records a mismatch where such a peer's tag is another call's.
static __device__ void symm_rs_check_tags(const symm_gemm_params& p, uint32_t heard, uint32_t epoch) {
    const symm_rs_state* st = symm_rs_state_of(p, p.rank);
    for (int src = 0; src < p.world; src++) {
        if ((heard >> src & 1u) && symm_ld_relaxed_sys(&st->tag[epoch & 1u][src]) != p.rs_tag) {
            symm_record_error(p.err, SYMM_ASYNC_MISMATCH, p.rank, src, SYMM_GEMM_CHANNEL, SYMM_SIGNAL_KIND_WAIT, 0);
        }
    }
}

// rs_push: the pushed tiles' flags, off the consumers' path. A producer
// warp that would otherwise idle walks the tile schedule beside the
// consumers and sets each pushed tile's flag once the consumers' TMA
// stores of it completed: the system fence and flag store per tile held
// both consumer warpgroups. The handoff is one slot
// deep: `full` when a tile is handed over, `empty` when the slot is free.
struct symm_handoff {
    uint64_t full, empty;
};

// In a reduce-scatter kernel: does it push its peers' tiles by TMA stores
// and sum its own rows from partials the producer loads into the ring
// (rs_push)?
static __device__ __forceinline__ bool symm_rs_pushes(const symm_gemm_params& p) {
    return p.rs_push && p.world > 1;
}

// The flagging warp: pushed.full completes when both consumer warpgroups'
// stores of the tile completed (their threads 0 arrive).
static __device__ void symm_rs_flag_pushed(const symm_gemm_params& p, const symm_tiling& tiling, int bn,
                                           symm_handoff* pushed, uint32_t epoch) {
    uint32_t phase = 0, told = 0;  // told: ranks this CTA stored its tag at
    for (int t = blockIdx.x; t < tiling.total; t += gridDim.x) {
        const symm_tile tile = tiling.at(p, bn, t);
        if (tile.chunk == p.rank) continue;
        symm_mbar_wait(&pushed->full, phase);
        if (!(told >> tile.chunk & 1u)) {
            told |= 1u << tile.chunk;
            symm_rs_store_tag(p, tile.chunk, epoch);
        }
        // The stores completed (and were fenced against the generic proxy)
        // before the arrivals this wait acquired, so the release, which is
        // cumulative, publishes them. No __threadfence_system: a
        // fence.sc.sys here, off the consumers' path, still cost the
        // kernel about 3%.
        symm_st_release_sys(tiling.flag(p, tile.chunk, p.rank, tile.index), epoch);
        symm_mbar_arrive(&pushed->empty);
        phase ^= 1;
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
// M = 512.
template <int DT, int BN, int STAGES, int STAGE_BYTES>
static __device__ __forceinline__ void symm_add_partials(float (&d)[BN / 2], const symm_partials& parts,
                                                         const symm_tile& tile, int n, int slice_row0,
                                                         unsigned char* ring, uint64_t* full, uint64_t* empty,
                                                         int& stage, uint32_t& phase, const symm_tmap* c_map,
                                                         int c_row) {
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
            if (in_stage == 0) symm_mbar_wait(&full[stage], phase);
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

// The producer warpgroup's helpers, while thread 0 issues the loads: with
// rs_add, thread 32 of CTA 0 announces that this call's kernel runs (the
// stream's earlier work with C is done: the peer may store into it); with
// rs_push, thread 32 then flags the pushed tiles; thread 64 waits until
// every peer's previous call has read its inbox and opens `peers_ready`.
// The consumers wait for that before their first store into a peer's
// inbox, not the producer before its first load, so the remote reads'
// latency (and a peer still finishing its previous call) hides behind the
// mainloop. A timeout is recorded; the tiles still go, so nobody hangs.
static __device__ void symm_rs_producer_helpers(const symm_gemm_params& p, const symm_tiling& tiling, int bn,
                                                bool rs_add, symm_handoff* pushed, uint64_t* peers_ready,
                                                const uint32_t* call_epoch) {
    if (threadIdx.x == 32 && rs_add && blockIdx.x == 0) {
        symm_st_release_sys(&symm_rs_state_of(p, p.rank)->started, symm_rs_epoch(call_epoch));
    }
    if (threadIdx.x == 32 && symm_rs_pushes(p)) symm_rs_flag_pushed(p, tiling, bn, pushed, symm_rs_epoch(call_epoch));
    if (threadIdx.x == 64 && symm_rs_live(p)) {
        for (int d = 0; d < p.world; d++) {
            if (d != p.rank) symm_wait_reach(&symm_rs_state_of(p, d)->epoch, symm_rs_epoch(call_epoch) - 1, p, d);
        }
        if (rs_add) {
            // Storing into a peer's C: once its call has started (within
            // microseconds of ours, long before the first push).
            for (int d = 0; d < p.world; d++) {
                if (d != p.rank) symm_wait_reach(&symm_rs_state_of(p, d)->started, symm_rs_epoch(call_epoch), p, d);
            }
            asm volatile("fence.proxy.async.global;" ::: "memory");
        }
        symm_mbar_arrive(peers_ready);
    }
}

// The producer, after one of this rank's own tiles' k-blocks (rs_push, not
// rs_add): its peers' partials, loaded into the ring, each box once the
// peer's flags of the tiles that hold it reached this call's epoch (with
// narrow peer tiles, two or more per own tile, the first ones' boxes load
// while the last ones still cross). After a timeout the loads still go, so
// nobody hangs. Boxes past n are not loaded (nor added). `heard` gains
// the peers whose flags were acquired (their tags are checked later).
template <int STAGES, int STAGE_BYTES>
static __device__ __forceinline__ void symm_rs_load_partials(const symm_gemm_params& p, const symm_tiling& tiling,
                                                             const symm_tile& tile, int bn, const symm_rs_maps* tm_rs,
                                                             unsigned char* ring, uint64_t* full, uint64_t* empty,
                                                             int& stage, uint32_t& phase, uint32_t epoch,
                                                             uint32_t& heard) {
    const symm_partials partials(p, bn, STAGE_BYTES);
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
                if (symm_wait_reach(tiling.flag(p, p.rank, peer, next), epoch, p, peer)) heard |= 1u << peer;
                // The peer's TMA stores were flagged after they completed:
                // order our (async proxy) loads after.
                asm volatile("fence.proxy.async.global;" ::: "memory");
            }
            symm_tma_load3(ring + stage * STAGE_BYTES + (b - b0) * 16384, &tm_rs->inbox, col, row, peer,
                           &full[stage]);
        }
        if (++stage == STAGES) {
            stage = 0;
            phase ^= 1;
        }
    }
}

// Without rs_push: waits (one thread) for every peer's partial of an own
// tile (its flag at this call's epoch); then both consumer warpgroups go.
static __device__ __forceinline__ void symm_rs_take_peer_tiles(const symm_gemm_params& p, const symm_tiling& tiling,
                                                               const symm_tile& tile, uint32_t epoch) {
    if (threadIdx.x == 128) {
        uint32_t heard = 0;
        for (int src = 0; src < p.world; src++) {
            if (src != p.rank && symm_wait_reach(tiling.flag(p, p.rank, src, tile.index), epoch, p, src)) {
                heard |= 1u << src;
            }
        }
        symm_rs_check_tags(p, heard, epoch);
    }
    symm_consumers_sync();
}

// SYMM_RS_C_ADD: waits until every peer's tiles over own tile `tile` (bn
// wide) are in C; returns the peers whose flags were acquired (their tags
// are checked after the adds are issued).
static __device__ __forceinline__ uint32_t symm_rs_wait_peer_stores(const symm_gemm_params& p,
                                                                    const symm_tiling& tiling, const symm_tile& tile,
                                                                    int bn, uint32_t epoch) {
    const int first = tiling.source_of(tile, tile.col0);
    const int last = tiling.source_of(tile, min(tile.col0 + bn, p.n) - 1);
    uint32_t heard = 0;
    for (int src = 0; src < p.world; src++) {
        if (src == p.rank) continue;
        for (int i = first; i <= last; i++) {
            if (symm_wait_reach(tiling.flag(p, p.rank, src, i), epoch, p, src)) heard |= 1u << src;
        }
    }
    return heard;
}

#endif  // __CUDA_ARCH_FEAT_SM90_ALL
