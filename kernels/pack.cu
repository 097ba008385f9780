// Strided <-> contiguous copies: gather an N-d strided tensor into a
// contiguous row-major buffer ("pack"), or scatter a contiguous row-major
// buffer into a strided tensor ("unpack").
//
// The host (src/backend/cuda/pack.rs) normalizes the tensor first: it drops
// size-1 dimensions, merges dimensions that are contiguous with each other,
// and hands the kernels a description of rows: the innermost remaining
// dimension is a row, the others (at most 7) enumerate rows in row-major
// order. Strides are in BYTES and may be negative (the base address is that
// of element [0, ..., 0]).
//
// Entry points, all
//   (const unsigned char* src, unsigned char* dst, symm_pack_desc d, int scatter)
//   scatter == 0: src is strided, dst contiguous (pack);
//   scatter != 0: src contiguous, dst strided (unpack).
// * symm_pack_rows_v{1,2,4,8,16}: rows contiguous on the strided side
//   (element stride == element size); a row is row_units chunks of V bytes,
//   copied with V-byte accesses. The host picks the largest V dividing the
//   row's byte length, both base addresses and every outer stride.
// * symm_pack_strided_e{1,2,4,8}: rows strided on the strided side
//   (inner_stride bytes between elements); a row is row_units elements of
//   E bytes. Both base addresses must be E-aligned.
// * symm_pack_tiled_e{1,2,4,8}(src, dst, symm_tile_desc d): transposes,
//   i.e. rows strided on the strided side while another dimension has unit
//   stride there; see below. Same direction-free form: the descriptor gives
//   read and write strides.
//
// Work decomposition: rows are cut into segments of seg_units units; a team
// of 2^team_log2 threads (a power of two <= blockDim.x that divides it)
// copies one segment at a time, grid-stride over all rows * segs_per_row
// segments. Launch with SYMM_PACK_THREADS threads per block and any grid.
#include "common.cuh"

#define SYMM_PACK_THREADS 256
#define SYMM_PACK_MAX_OUTER 7

// Mirror: `PackDesc` in src/backend/cuda/pack.rs (160 bytes, align 8).
struct symm_pack_desc {
    uint64_t rows;          // number of rows (product of outer_shape)
    uint64_t row_units;     // units per row (V-byte chunks or E-byte elements)
    uint64_t segs_per_row;  // ceil(row_units / seg_units)
    uint64_t seg_units;     // units per segment
    int64_t inner_stride;   // strided kernels: bytes between a row's elements (strided side)
    int32_t outer_ndim;     // 0..SYMM_PACK_MAX_OUTER
    int32_t team_log2;      // log2(threads per team)
    uint64_t outer_shape[SYMM_PACK_MAX_OUTER];  // outermost first
    int64_t outer_stride[SYMM_PACK_MAX_OUTER];  // bytes, strided side
};
static_assert(sizeof(symm_pack_desc) == 160, "symm_pack_desc layout is shared with Rust");

template <int N>
struct alignas(N) symm_bytes {
    unsigned char b[N];
};

// Byte offset on the strided side of row `row` (row-major over outer dims).
template <typename I>
static __device__ __forceinline__ int64_t symm_pack_row_offset(const symm_pack_desc& d, I row) {
    int64_t off = 0;
#pragma unroll
    for (int k = SYMM_PACK_MAX_OUTER - 1; k >= 0; --k) {
        if (k < d.outer_ndim) {
            const I s = (I)d.outer_shape[k];
            const I q = row / s;
            off += (int64_t)(row - q * s) * d.outer_stride[k];
            row = q;
        }
    }
    return off;
}

// Calls f(strided_row_offset, row, first_unit, end_unit, lane, team) for every
// segment this team owns.
template <typename F>
static __device__ __forceinline__ void symm_pack_for_segments(const symm_pack_desc& d, F f) {
    const uint32_t team = 1u << d.team_log2;
    const uint32_t lane = threadIdx.x & (team - 1u);
    const uint64_t teams_per_block = blockDim.x >> d.team_log2;
    const uint64_t total_teams = teams_per_block * gridDim.x;
    const uint64_t total = d.rows * d.segs_per_row;
    const bool small = d.rows <= 0xffffffffull;
    for (uint64_t u = blockIdx.x * teams_per_block + (threadIdx.x >> d.team_log2); u < total;
         u += total_teams) {
        uint64_t row = u;
        uint64_t seg = 0;
        if (d.segs_per_row != 1) {
            row = u / d.segs_per_row;
            seg = u - row * d.segs_per_row;
        }
        const int64_t off = small ? symm_pack_row_offset<uint32_t>(d, (uint32_t)row)
                                  : symm_pack_row_offset<uint64_t>(d, row);
        const uint64_t first = seg * d.seg_units;
        const uint64_t end = first + d.seg_units < d.row_units ? first + d.seg_units : d.row_units;
        f(off, row, first, end, lane, team);
    }
}

template <int V>
static __device__ void symm_pack_rows_impl(const unsigned char* src, unsigned char* dst,
                                           const symm_pack_desc& d, int scatter) {
    typedef symm_bytes<V> T;
    const uint64_t row_bytes = d.row_units * V;
    symm_pack_for_segments(d, [&](int64_t off, uint64_t row, uint64_t first, uint64_t end,
                                  uint32_t lane, uint32_t team) {
        const uint64_t contig = row * row_bytes;
        if (scatter) {
            const T* s = (const T*)(src + contig);
            T* t = (T*)(dst + off);
            for (uint64_t c = first + lane; c < end; c += team) {
                t[c] = s[c];
            }
        } else {
            const T* s = (const T*)(src + off);
            T* t = (T*)(dst + contig);
            for (uint64_t c = first + lane; c < end; c += team) {
                t[c] = s[c];
            }
        }
    });
}

template <int E>
static __device__ void symm_pack_strided_impl(const unsigned char* src, unsigned char* dst,
                                              const symm_pack_desc& d, int scatter) {
    typedef symm_bytes<E> T;
    const uint64_t row_bytes = d.row_units * E;
    const int64_t inner = d.inner_stride;
    symm_pack_for_segments(d, [&](int64_t off, uint64_t row, uint64_t first, uint64_t end,
                                  uint32_t lane, uint32_t team) {
        const uint64_t contig = row * row_bytes;
        for (uint64_t c = first + lane; c < end; c += team) {
            const int64_t strided = off + (int64_t)c * inner;
            if (scatter) {
                *(T*)(dst + strided) = *(const T*)(src + contig + c * E);
            } else {
                *(T*)(dst + contig + c * E) = *(const T*)(src + strided);
            }
        }
    });
}

// ---------------------------------------------------------------------------
// Tiled transposes: rows strided on the strided side, but another dimension
// (i) has unit stride there. Each 32 x 32 tile of the (i, j = innermost) plane
// is read with threads running along the read side's unit-stride dimension
// and written along the write side's, through shared memory, so both sides
// are coalesced. Batch dimensions (the other outer ones) are enumerated in
// row-major order. Launch with SYMM_TILE_DIM x SYMM_TILE_ROWS threads.
// ---------------------------------------------------------------------------
#define SYMM_TILE_DIM 32
#define SYMM_TILE_ROWS 8
#define SYMM_TILE_MAX_BATCH 6

// Mirror: `TileDesc` in src/backend/cuda/pack.rs (232 bytes, align 8).
struct symm_tile_desc {
    uint64_t ni, nj;          // extent of the tile plane
    int64_t rs_i, rs_j;       // read side strides, bytes
    int64_t ws_i, ws_j;       // write side strides, bytes
    uint64_t tiles_i, tiles_j;
    uint64_t batch;           // product of batch_shape
    int32_t batch_ndim;       // 0..SYMM_TILE_MAX_BATCH
    int32_t read_fast_i;      // reads coalesced along i (else along j)
    int32_t write_fast_i;     // writes coalesced along i (else along j)
    int32_t reserved;
    uint64_t batch_shape[SYMM_TILE_MAX_BATCH];  // outermost first
    int64_t batch_rs[SYMM_TILE_MAX_BATCH];      // bytes
    int64_t batch_ws[SYMM_TILE_MAX_BATCH];      // bytes
};
static_assert(sizeof(symm_tile_desc) == 232, "symm_tile_desc layout is shared with Rust");

template <int E>
static __device__ void symm_pack_tiled_impl(const unsigned char* src, unsigned char* dst,
                                            const symm_tile_desc& d) {
    typedef symm_bytes<E> T;
    __shared__ T tile[SYMM_TILE_DIM][SYMM_TILE_DIM + 1];
    const uint32_t tx = threadIdx.x, ty = threadIdx.y;
    const uint64_t per_batch = d.tiles_i * d.tiles_j;
    const uint64_t total = d.batch * per_batch;
    for (uint64_t t = blockIdx.x; t < total; t += gridDim.x) {
        uint64_t b = t / per_batch;
        const uint64_t rest = t - b * per_batch;
        const uint64_t ti = rest / d.tiles_j;
        const uint64_t tj = rest - ti * d.tiles_j;
        int64_t ro = 0, wo = 0;
#pragma unroll
        for (int k = SYMM_TILE_MAX_BATCH - 1; k >= 0; --k) {
            if (k < d.batch_ndim) {
                const uint64_t q = b / d.batch_shape[k];
                const int64_t idx = (int64_t)(b - q * d.batch_shape[k]);
                ro += idx * d.batch_rs[k];
                wo += idx * d.batch_ws[k];
                b = q;
            }
        }
        const uint64_t i0 = ti * SYMM_TILE_DIM, j0 = tj * SYMM_TILE_DIM;
#pragma unroll
        for (int k = 0; k < SYMM_TILE_DIM; k += SYMM_TILE_ROWS) {
            const uint32_t il = d.read_fast_i ? tx : ty + k;
            const uint32_t jl = d.read_fast_i ? ty + k : tx;
            const uint64_t i = i0 + il, j = j0 + jl;
            if (i < d.ni && j < d.nj) {
                tile[il][jl] = *(const T*)(src + ro + (int64_t)i * d.rs_i + (int64_t)j * d.rs_j);
            }
        }
        __syncthreads();
#pragma unroll
        for (int k = 0; k < SYMM_TILE_DIM; k += SYMM_TILE_ROWS) {
            const uint32_t il = d.write_fast_i ? tx : ty + k;
            const uint32_t jl = d.write_fast_i ? ty + k : tx;
            const uint64_t i = i0 + il, j = j0 + jl;
            if (i < d.ni && j < d.nj) {
                *(T*)(dst + wo + (int64_t)i * d.ws_i + (int64_t)j * d.ws_j) = tile[il][jl];
            }
        }
        __syncthreads();
    }
}

#define SYMM_PACK_TILED(E)                                                                        \
    extern "C" __global__ void __launch_bounds__(SYMM_TILE_DIM* SYMM_TILE_ROWS)                   \
        symm_pack_tiled_e##E(const unsigned char* src, unsigned char* dst, symm_tile_desc d) {    \
        symm_pack_tiled_impl<E>(src, dst, d);                                                     \
    }

SYMM_PACK_TILED(1)
SYMM_PACK_TILED(2)
SYMM_PACK_TILED(4)
SYMM_PACK_TILED(8)

#define SYMM_PACK_ROWS(V)                                                                  \
    extern "C" __global__ void __launch_bounds__(SYMM_PACK_THREADS) symm_pack_rows_v##V(   \
        const unsigned char* src, unsigned char* dst, symm_pack_desc d, int scatter) {     \
        symm_pack_rows_impl<V>(src, dst, d, scatter);                                      \
    }

#define SYMM_PACK_STRIDED(E)                                                                 \
    extern "C" __global__ void __launch_bounds__(SYMM_PACK_THREADS) symm_pack_strided_e##E(  \
        const unsigned char* src, unsigned char* dst, symm_pack_desc d, int scatter) {       \
        symm_pack_strided_impl<E>(src, dst, d, scatter);                                     \
    }

SYMM_PACK_ROWS(1)
SYMM_PACK_ROWS(2)
SYMM_PACK_ROWS(4)
SYMM_PACK_ROWS(8)
SYMM_PACK_ROWS(16)

SYMM_PACK_STRIDED(1)
SYMM_PACK_STRIDED(2)
SYMM_PACK_STRIDED(4)
SYMM_PACK_STRIDED(8)
