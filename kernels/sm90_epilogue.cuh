// The fused Hopper matmul's epilogues: what a consumer warpgroup does with
// its 64 x BN accumulators once a tile's k-loop is done.
//   * symm_apply_scales: fp8's scales and bias, in place.
//   * symm_epilogue: stores from registers (C that TMA cannot address, and
//     the reduce-scatter without rs_push), optionally adding partial tiles.
//   * symm_epilogue_tma: through the warpgroup's staging area (or boxes
//     spread over the free ring) and TMA stores or reduce-adds: C, a peer's
//     inbox, or a peer's C. Tiles narrower than BN store their last box
//     shifted back to end with the tile.
//   * symm_add_box: a peer's partial box, loaded into the ring by TMA, added
//     to the accumulators (the reduce-scatter's own tiles).
// sm_90a only.
#pragma once
#include "sm90_ptx.cuh"
#include "sm90_scheduler.cuh"

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

// Accumulator fragment layout of wgmma m64nNk16 (f32): thread t of the
// warpgroup holds, for each 8-column block j, rows
// 16 * (t / 32) + (t % 32) / 4 (+ 8) and columns 8 * j + 2 * (t % 4) (+ 1):
// d[4j + 0..1] on the first row, d[4j + 2..3] on the row 8 below.
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

#endif  // __CUDA_ARCH_FEAT_SM90_ALL
