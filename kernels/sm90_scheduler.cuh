// The fused Hopper matmul's tile scheduler: which tile a CTA takes next.
//
// Every CTA walks one fixed list (tile = blockIdx.x + i * gridDim.x). The
// rows of A are split into `chunks` equal row chunks (one per rank in the
// fused operations) visited in `order`; a tile never straddles two chunks.
// The row tiles of all chunks, in that order, form one list cut into groups
// of GROUP_M, walked column by column so that tiles running at once share
// A's rows and B's columns in L2. A group may hold tiles of two chunks:
// with chunks of fewer than GROUP_M row tiles (a small M), the tiles that
// share B's columns still run together and B is read once. A
// reduce-scatter keeps each group within a chunk (its own chunk comes
// last, so its partials from the peers have the most time to land).
//
// Narrow tiles (232 to 248 columns) replace the BN-wide ones in two cases:
// the peers' chunks of a one-wave reduce-scatter (narrow peer tiles) and
// every chunk of a column cut. src/backend/cuda/sm90/tiling.rs mirrors this
// order (its host tests check the mirror). sm_90a only.
#pragma once
#include "sm90_params.cuh"

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

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
    // Narrow tiles (narrow_n 0: none): per row tile,
    // narrow_n tiles, the first narrow_extra of them narrow_w + 8 wide, the
    // last narrow_less narrow_w - 8. The peers' chunks of a reduce-scatter,
    // or with `cut` every chunk (the column cut).
    int32_t narrow_n, narrow_w, narrow_extra, narrow_less;
    bool cut;
    int32_t flags;      // rs: flags per source rank

    // `rs`: a reduce-scatter kernel's tiling (the kernel's MODE).
    __device__ symm_tiling(const symm_gemm_params& p, int bn, bool rs) {
        tiles_m = (p.chunk_rows + SYMM_GEMM_BM - 1) / SYMM_GEMM_BM;
        tiles_n = (p.n + bn - 1) / bn;
        per_chunk = tiles_m * tiles_n;
        total = per_chunk * p.chunks;
        rows = rs ? tiles_m : tiles_m * p.chunks;
        cut = !rs && p.cut_n > 0;
        narrow_n = rs && p.rs_push && p.world > 1 ? p.rs_narrow_n : (cut ? p.cut_n : 0);
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

#endif  // __CUDA_ARCH_FEAT_SM90_ALL
