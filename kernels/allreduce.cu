// Device-side all-reduce: out = scale * sum over ranks of in, summed in f32 in
// rank order (every rank computes the same bits), optionally followed by the
// residual add and RMSNorm of inference engines; and that add + RMSNorm alone.
// Integers are summed exactly in their own width (wrapping modulo 2^bits),
// then divided by p.divisor (1: sum; the world: average), truncating toward
// zero.
//
// Entry points (DT = f32, bf16, f16 with f32 accumulation; IT = i8, u8, i32,
// i64, accumulated in the element's unsigned width):
//   symm_ar_one_shot_<DT|IT>(symm_ar_params p)
//   symm_ar_two_shot_<DT|IT>(symm_ar_params p)
//   symm_add_rmsnorm_<DT>(symm_rmsnorm_params p)
//   symm_ag_one_shot(symm_ar_params p)    the all-gather, see below
//   symm_ag_two_shot(symm_ar_params p)    the same by pieces, see below
//   symm_rs_one_shot_<DT>(symm_ar_params p)  the reduce-scatter, see below
//   symm_rs_two_shot_<DT>(symm_ar_params p)  the same by pieces, see below
//
// The all-reduce moves data through one symmetric scratch buffer per group
// (p.scratch[r]: rank r's, as mapped here), laid out by the host
// (AllReduceLayout in src/backend/mod.rs):
//   [0, 4)       the count of calls this rank made (u32);
//   [4, 8)       the blocks of the running call that finished (u32);
//   partials_off the fused norm's sums of squares, u64 {sum, seq} per block;
//   tags_off     the call tags: u64 {seq, tag} per (parity, src) at
//                tags_off + (parity * SYMM_AR_MAX_WORLD + src) * 8;
//   flags_off    u32 flags, flag(parity, k, c) at
//                ((parity * (world + 1) + k) * SYMM_AR_MAX_CHUNKS + c) * 4;
//   one_off      one-shot LL lines: slot (parity, src) at
//                one_off + (parity * world + src) * one_slot;
//   two_off      two-shot data: slot (parity, src) at
//                two_off + (parity * world + src) * two_slot, its first half
//                the parts src sent for this rank's chunks, its second half
//                src's reduced chunks.
// No other work than these kernels (the all-reduces and the all-gather)
// writes the buffer. Call number `seq` = count + 1 flags the
// data of a call and picks its parity (seq & 1): a rank can only be one call
// ahead of its peers (each call waits for data every peer sends in it), so
// two buffers in alternation are never overwritten while a peer reads them,
// and the calls need no barrier before or after. The last block to finish
// stores the count; the next call on the stream reads it, so graph replays
// count like eager calls.
//
// Call tags: p.tag hashes the arguments every rank agreed on. Before its
// data, a rank stores {seq, tag} into its tag word (parity, rank) in every
// rank it sends to; each block of the receiver waits for every peer's word
// of call seq and goes on only if it carries p.tag. Another tag means that
// peer is making a different call (ranks whose calls, each agreed before,
// went out of step): the block records SYMM_ASYNC_MISMATCH and skips its
// data phase (reading that call's data and writing the output from it; the
// all-gather has written this rank's own part by then), but still counts
// the call.
//
// One-shot (LL): each 8 bytes of the message travel as one 16-byte line
// {data0, seq, data1, seq} stored to every peer's slot (parity, rank); each
// 8-byte half is one store, so a reader that sees both flags equal to seq
// has the data. Every rank then polls its own slots (local memory) and
// reduces. With a norm (row bytes a multiple of 8), each block reduces whole
// rows (or, with p.segments = S > 1, one S-th of one row: a row's sum of
// squares then goes through this rank's partials, so that few rows still
// spread over as many SMs as the all-reduce alone), adds the residual,
// normalizes and scales by the weight.
//
// All-gather (symm_ag_one_shot): the one-shot with "place" for "sum". p.n is
// the bytes of every rank's input (bytes are bytes: any element type), and
// the output holds world * n: each rank pushes its lines into every peer's
// slot (parity, rank) as above, writes its own part straight from its input
// to output + rank * n, and writes slot src's lines to output + src * n as
// they arrive. Tails and unaligned ends take 2-byte accesses where n and
// both addresses are even, else 1-byte ones. The call count and parity are
// the all-reduce's, so gathers and all-reduces interleave freely.
// symm_ag_two_shot moves the same bytes as the reduce-scatter by pieces
// does (see below), placed instead of summed: plain stores, half the lines'
// traffic, for a flag per piece; the host picks one of the two
// by size.
//
// Reduce-scatter (symm_rs_one_shot_<DT>): the one-shot for one chunk per
// rank. The input holds world chunks of p.n elements, p.chunk_bytes apart
// (both 8-byte multiples, and the input 8-byte aligned: whole lines per
// chunk); each rank pushes chunk q's lines into rank q's slot (parity,
// rank) only, then sums its own chunk's lines over the ranks in rank order,
// as the all-reduce does, into the output (p.n elements). (world - 1) / world
// of the input leaves each rank instead of world - 1 times all of it.
// symm_rs_two_shot_<DT> moves the same chunks as the two-shot's phases A
// and B do (plain stores, a flag per piece; no lines), each chunk cut into
// pieces by its size alone; the host picks one of the two by size.
//
// Two-shot: chunks of chunk_bytes, chunk c owned by rank c % world, in
// groups of world chunks (c / world), a block taking whole groups. Phase A:
// each rank pushes its part of every chunk it does not own into the owner's
// slot (parity, rank), then sets flag(parity, rank, c) = seq there (a
// release, after a barrier behind the block's stores). Phase B: the owner
// waits for every peer's flag of its chunk, reduces it, writes its output
// and pushes the result into every peer's slot (parity, owner), second
// half, then sets
// flag(parity, world, c) = seq there. Phase C: each rank waits for that flag
// and copies the chunk from its scratch into its output. Every block does all
// its phase A before any wait, and the grid is at most one block per SM, so
// every block of every rank is resident and the waits always end.
//
// Waits give up after timeout_ns (0: SYMM_DEFAULT_TIMEOUT_NS), recording a
// timeout in the error record (channel SYMM_AR_CHANNEL), or within
// SYMM_ERR_POLL_NS once another failure is recorded; the output is then
// undefined and the group must be destroyed.
#include "common.cuh"
#include "dtype.cuh"

#define SYMM_AR_MAX_WORLD 16
#define SYMM_AR_THREADS 512
#define SYMM_AR_MAX_CHUNKS 4096
// Most blocks one row of the fused norm is split over.
#define SYMM_AR_MAX_SEGMENTS 8
// The error record's channel for the all-reduce's waits.
#define SYMM_AR_CHANNEL (-3)

// Kernel parameters (mirrored by ArParams in src/backend/cuda/all_reduce.rs).
struct symm_ar_params {
    uint64_t scratch[SYMM_AR_MAX_WORLD];
    uint64_t input;         // n contiguous elements
    uint64_t output;        // n contiguous elements (may be input)
    uint64_t residual;      // norm: n elements (rows of hidden)
    uint64_t weight;        // norm: hidden elements
    uint64_t residual_out;  // norm: n elements (may be residual)
    uint64_t err;           // symm_async_error*
    uint64_t n;
    uint64_t timeout_ns;
    uint64_t flags_off;
    uint64_t one_off;
    uint64_t one_slot;
    uint64_t two_off;
    uint64_t two_slot;
    uint64_t chunk_bytes;
    uint64_t partials_off;
    uint64_t tags_off;
    int32_t rank;
    int32_t world;
    uint32_t hidden;  // 0: no norm
    float scale;
    float eps;
    uint32_t divisor;  // integers: the sum is divided by this (>= 1)
    uint32_t segments; // norm: blocks per row (> 1: grid = rows * segments)
    uint32_t tag;      // the call's (never 0), see "Call tags" above
};

// out = residual_out / sqrt(mean(residual_out^2) + eps) * weight per row,
// residual_out = x + residual (mirrored by NormParams in all_reduce.rs).
// Row strides in elements; columns contiguous; residual_out may alias x or
// residual (each element is read before it is written, by one thread).
struct symm_rmsnorm_params {
    uint64_t out;
    uint64_t residual_out;
    uint64_t x;
    uint64_t residual;
    uint64_t weight;
    uint64_t rows;
    uint64_t ld_out;
    uint64_t ld_residual_out;
    uint64_t ld_x;
    uint64_t ld_residual;
    uint32_t hidden;
    float eps;
};

// ---------------------------------------------------------------------------
// Element types. Each has an accumulator type Acc, kPerLine elements per
// 8-byte line (two 32-bit words), and finish(), which turns a sum into the
// result. Floats: a 32-bit word holds 4 / size elements, summed in f32.
// ---------------------------------------------------------------------------
template <int DT>
struct symm_ar_dt {
    typedef float Acc;
    static constexpr bool kFloat = true;
    static constexpr int kSize = DT == SYMM_DT_F32 ? 4 : 2;
    static constexpr int kPerWord = 4 / kSize;
    static constexpr int kPerLine = 2 * kPerWord;
    static __device__ __forceinline__ void unpack(uint32_t w, float* f) {
        if constexpr (DT == SYMM_DT_F32) {
            f[0] = __uint_as_float(w);
        } else if constexpr (DT == SYMM_DT_BF16) {
            f[0] = __uint_as_float(w << 16);
            f[1] = __uint_as_float(w & 0xffff0000u);
        } else {
            f[0] = symm_f16_bits_to_f32(w & 0xffffu);
            f[1] = symm_f16_bits_to_f32(w >> 16);
        }
    }
    static __device__ __forceinline__ uint32_t pack(const float* f) {
        if constexpr (DT == SYMM_DT_F32) {
            return __float_as_uint(f[0]);
        } else if constexpr (DT == SYMM_DT_BF16) {
            return symm_pack_bf16x2(f[0], f[1]);
        } else {
            return symm_pack_f16x2(f[0], f[1]);
        }
    }
    static __device__ __forceinline__ float load(const unsigned char* p) {
        if constexpr (DT == SYMM_DT_F32) {
            return *(const volatile float*)p;
        } else if constexpr (DT == SYMM_DT_BF16) {
            return symm_bf16_bits_to_f32(*(const volatile unsigned short*)p);
        } else {
            return symm_f16_bits_to_f32(*(const volatile unsigned short*)p);
        }
    }
    static __device__ __forceinline__ void store(unsigned char* p, float v) {
        if constexpr (DT == SYMM_DT_F32) {
            *(float*)p = v;
        } else if constexpr (DT == SYMM_DT_BF16) {
            *(unsigned short*)p = symm_f32_to_bf16_bits(v);
        } else {
            *(unsigned short*)p = symm_f32_to_f16_bits(v);
        }
    }
    // v rounded to this type.
    static __device__ __forceinline__ float round(float v) {
        if constexpr (DT == SYMM_DT_F32) {
            return v;
        } else if constexpr (DT == SYMM_DT_BF16) {
            return symm_bf16_bits_to_f32(symm_f32_to_bf16_bits(v));
        } else {
            return symm_f16_bits_to_f32(symm_f32_to_f16_bits(v));
        }
    }
    static __device__ __forceinline__ void unpack_line(uint32_t d0, uint32_t d1, float* f) {
        unpack(d0, f);
        unpack(d1, f + kPerWord);
    }
    static __device__ __forceinline__ void pack_line(const float* f, uint32_t& d0, uint32_t& d1) {
        d0 = pack(f);
        d1 = pack(f + kPerWord);
    }
    static __device__ __forceinline__ float finish(float sum, const struct symm_ar_params& p) {
        return sum * p.scale;
    }
};

// The unsigned accumulator of S-byte integers.
template <int S>
struct symm_ar_uacc {
    typedef uint32_t T;
};
template <>
struct symm_ar_uacc<8> {
    typedef uint64_t T;
};

// Integers: lanes of the element's width, zero-extended into Acc (unsigned,
// so sums wrap; truncated to the width they are exact modulo 2^bits).
template <typename E>
struct symm_ar_int {
    typedef typename symm_ar_uacc<sizeof(E)>::T Acc;
    static constexpr bool kFloat = false;
    static constexpr int kSize = sizeof(E);
    static constexpr int kPerLine = 8 / kSize;
    static constexpr uint64_t kMask = kSize == 8 ? ~0ull : (1ull << (8 * kSize)) - 1;
    static __device__ __forceinline__ void unpack_line(uint32_t d0, uint32_t d1, Acc* a) {
        const uint64_t v = ((uint64_t)d1 << 32) | d0;
#pragma unroll
        for (int e = 0; e < kPerLine; ++e) {
            a[e] = (Acc)((v >> (8 * kSize * e)) & kMask);
        }
    }
    static __device__ __forceinline__ void pack_line(const Acc* a, uint32_t& d0, uint32_t& d1) {
        uint64_t v = 0;
#pragma unroll
        for (int e = 0; e < kPerLine; ++e) {
            v |= ((uint64_t)a[e] & kMask) << (8 * kSize * e);
        }
        d0 = (uint32_t)v;
        d1 = (uint32_t)(v >> 32);
    }
    static __device__ __forceinline__ Acc load(const unsigned char* p) {
        return (Acc)(*(const volatile E*)p) & (Acc)kMask;
    }
    static __device__ __forceinline__ void store(unsigned char* p, Acc v) { *(E*)p = (E)v; }
    // The wrapped sum (its low kSize bytes, as E) divided, truncating toward
    // zero as C division does.
    static __device__ __forceinline__ Acc finish(Acc sum, const struct symm_ar_params& p) {
        if (p.divisor <= 1u) {
            return sum;
        }
        const E v = (E)sum;
        return (Acc)(E)(v / (E)p.divisor);
    }
};

// ---------------------------------------------------------------------------
// Memory access.
// ---------------------------------------------------------------------------
struct symm_ar_u4 {
    uint32_t x, y, z, w;
};

static __device__ __forceinline__ void symm_ar_st_line(uint64_t addr, uint32_t d0, uint32_t d1,
                                                       uint32_t flag) {
    asm volatile("st.volatile.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(addr), "r"(d0), "r"(flag),
                 "r"(d1), "r"(flag)
                 : "memory");
}

static __device__ __forceinline__ symm_ar_u4 symm_ar_ld_line(uint64_t addr) {
    symm_ar_u4 v;
    asm volatile("ld.volatile.global.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(addr)
                 : "memory");
    return v;
}

// 16 bytes of scratch another rank wrote (L2, not a stale L1 line).
static __device__ __forceinline__ symm_ar_u4 symm_ar_ld_cg(uint64_t addr) {
    symm_ar_u4 v;
    asm volatile("ld.global.cg.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(addr)
                 : "memory");
    return v;
}

static __device__ __forceinline__ symm_ar_u4 symm_ar_ld16(uint64_t addr) {
    const uint4 v = *(const uint4*)addr;
    symm_ar_u4 r = {v.x, v.y, v.z, v.w};
    return r;
}

static __device__ __forceinline__ void symm_ar_st16(uint64_t addr, symm_ar_u4 v) {
    *(uint4*)addr = make_uint4(v.x, v.y, v.z, v.w);
}

// The 8 bytes at byte offset 8*i of an array of `bytes` bytes (the array
// aligned to its element size, S bytes): zero beyond the end, and S-byte
// (at most 2-byte) accesses where the array is not 8-byte aligned.
template <int S>
static __device__ __forceinline__ void symm_ar_ld8(uint64_t base, uint64_t i, uint64_t bytes,
                                                   uint32_t& d0, uint32_t& d1) {
    const uint64_t off = 8 * i;
    if ((base & 7u) == 0 && off + 8 <= bytes) {
        const uint2 v = *(const uint2*)(base + off);
        d0 = v.x;
        d1 = v.y;
        return;
    }
    if constexpr (S == 1) {
        uint64_t v = 0;
#pragma unroll
        for (int k = 0; k < 8; ++k) {
            if (off + k < bytes) {
                const uint64_t b = *(const unsigned char*)(base + off + k);
                v |= b << (8 * k);
            }
        }
        d0 = (uint32_t)v;
        d1 = (uint32_t)(v >> 32);
    } else {
        uint32_t h[4];
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            h[k] = off + 2 * k + 2 <= bytes ? *(const unsigned short*)(base + off + 2 * k) : 0u;
        }
        d0 = h[0] | (h[1] << 16);
        d1 = h[2] | (h[3] << 16);
    }
}

template <int S>
static __device__ __forceinline__ void symm_ar_st8(uint64_t base, uint64_t i, uint64_t bytes, uint32_t d0,
                                                   uint32_t d1) {
    const uint64_t off = 8 * i;
    if ((base & 7u) == 0 && off + 8 <= bytes) {
        *(uint2*)(base + off) = make_uint2(d0, d1);
        return;
    }
    if constexpr (S == 1) {
        const uint64_t v = ((uint64_t)d1 << 32) | d0;
#pragma unroll
        for (int k = 0; k < 8; ++k) {
            if (off + k < bytes) {
                *(unsigned char*)(base + off + k) = (unsigned char)(v >> (8 * k));
            }
        }
    } else {
        const uint32_t h[4] = {d0 & 0xffffu, d0 >> 16, d1 & 0xffffu, d1 >> 16};
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            if (off + 2 * k + 2 <= bytes) {
                *(unsigned short*)(base + off + 2 * k) = (unsigned short)h[k];
            }
        }
    }
}

// ---------------------------------------------------------------------------
// Waiting.
// ---------------------------------------------------------------------------
struct symm_ar_wait {
    uint64_t start;
    uint64_t next_err_poll;
    uint32_t spins;
};

static __device__ __forceinline__ void symm_ar_wait_begin(symm_ar_wait& w) {
    w.start = 0;
    w.spins = 0;
}

// Whether a wait must give up (timeout, recorded; or another failure
// recorded); the first call only starts the clock.
static __device__ bool symm_ar_timed_out(symm_ar_wait& w, uint64_t err_addr, uint64_t timeout_ns,
                                                      int rank, int peer) {
    const uint64_t now = symm_globaltimer_ns();
    if (w.start == 0) {
        w.start = now;
        w.next_err_poll = now + SYMM_ERR_POLL_NS;
        return false;
    }
    symm_async_error* err = (symm_async_error*)err_addr;
    const uint64_t timeout = timeout_ns ? timeout_ns : SYMM_DEFAULT_TIMEOUT_NS;
    if (now - w.start >= timeout) {
        symm_record_error(err, SYMM_ASYNC_TIMEOUT, rank, peer, SYMM_AR_CHANNEL, SYMM_SIGNAL_KIND_VALUE,
                          now - w.start);
        return true;
    }
    if (now >= w.next_err_poll) {
        if (symm_error_pending(err)) {
            return true;
        }
        w.next_err_poll = now + SYMM_ERR_POLL_NS;
    }
    return false;
}

// The time and error checks every 64 polls (the clock and the error record
// are slow to read).
static __device__ __forceinline__ bool symm_ar_keep_waiting(symm_ar_wait& w, const symm_ar_params& p,
                                                            int peer) {
    if ((++w.spins & 63u) != 1u) {
        return true;
    }
    return !symm_ar_timed_out(w, p.err, p.timeout_ns, p.rank, peer);
}

// Waits until the flag at `addr` (this rank's memory) reaches `seq`.
static __device__ void symm_ar_wait_flag(uint64_t addr, uint32_t seq, const symm_ar_params& p, int peer) {
    symm_ar_wait w;
    symm_ar_wait_begin(w);
    while ((int32_t)(symm_ld_acquire_sys((const uint32_t*)addr) - seq) < 0) {
        if (!symm_ar_keep_waiting(w, p, peer)) {
            return;
        }
    }
}

// The LL line at `addr` once both its flags read `seq` (or the wait gave up).
static __device__ __forceinline__ symm_ar_u4 symm_ar_poll_line(uint64_t addr, uint32_t seq,
                                                                const symm_ar_params& p, int peer) {
    symm_ar_u4 v = symm_ar_ld_line(addr);
    if (v.y == seq && v.w == seq) {
        return v;
    }
    symm_ar_wait w;
    symm_ar_wait_begin(w);
    for (;;) {
        v = symm_ar_ld_line(addr);
        if ((v.y == seq && v.w == seq) || !symm_ar_keep_waiting(w, p, peer)) {
            return v;
        }
    }
}

// ---------------------------------------------------------------------------
// The call count.
// ---------------------------------------------------------------------------
static __device__ __forceinline__ uint32_t symm_ar_begin(const symm_ar_params& p) {
    __shared__ uint32_t s_seq;
    if (threadIdx.x == 0) {
        s_seq = *(const volatile uint32_t*)p.scratch[p.rank] + 1u;
    }
    __syncthreads();
    return s_seq;
}

// The last block to finish stores the count (after every block read it).
static __device__ __forceinline__ void symm_ar_end(const symm_ar_params& p, uint32_t seq) {
    __syncthreads();
    if (threadIdx.x == 0) {
        uint32_t* header = (uint32_t*)p.scratch[p.rank];
        __threadfence();
        const uint32_t done = atomicAdd(header + 1, 1u);
        if (done == gridDim.x - 1) {
            __threadfence();
            *(volatile uint32_t*)(header + 1) = 0u;
            *(volatile uint32_t*)header = seq;
        }
    }
}

// ---------------------------------------------------------------------------
// Call tags (see the file's header).
// ---------------------------------------------------------------------------
static __device__ __forceinline__ uint64_t symm_ar_tag_word(const symm_ar_params& p, int owner, int parity,
                                                            int src) {
    return p.scratch[owner] + p.tags_off + ((uint64_t)parity * SYMM_AR_MAX_WORLD + src) * 8;
}

// Block 0 tells every peer which call this rank's data of call `seq` is.
static __device__ __forceinline__ void symm_ar_announce(const symm_ar_params& p, uint32_t seq) {
    const int k = (int)threadIdx.x + 1;
    if (blockIdx.x == 0 && k < p.world) {
        const int q = (p.rank + k) % p.world;
        *(volatile uint64_t*)symm_ar_tag_word(p, q, seq & 1u, p.rank) = (uint64_t)p.tag << 32 | seq;
    }
}

// Whether every peer announced call `seq` with this call's tag, for the
// whole block (false where a peer's tag differs, recorded, or a wait gave
// up).
static __device__ bool symm_ar_peers_agree(const symm_ar_params& p, uint32_t seq) {
    bool ok = true;
    const int src = (int)threadIdx.x;
    if (src < p.world && src != p.rank) {
        const volatile uint64_t* word = (const volatile uint64_t*)symm_ar_tag_word(p, p.rank, seq & 1u, src);
        uint64_t v = *word;
        symm_ar_wait w;
        symm_ar_wait_begin(w);
        while ((uint32_t)v != seq && symm_ar_keep_waiting(w, p, src)) {
            v = *word;
        }
        ok = (uint32_t)v == seq && (uint32_t)(v >> 32) == p.tag;
        if ((uint32_t)v == seq && !ok) {
            symm_record_error((symm_async_error*)p.err, SYMM_ASYNC_MISMATCH, p.rank, src, SYMM_AR_CHANNEL,
                              SYMM_SIGNAL_KIND_VALUE, 0);
        }
    }
    return __syncthreads_and(ok) != 0;
}

// Sum over the block's threads (every thread gets it).
static __device__ float symm_ar_block_sum(float v) {
    __shared__ float s_part[32];
    __shared__ float s_total;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        v += __shfl_xor_sync(0xffffffffu, v, o);
    }
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (lane == 0) {
        s_part[warp] = v;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        float t = 0.0f;
        for (int i = 0; i < (int)(blockDim.x + 31) / 32; ++i) {
            t += s_part[i];
        }
        s_total = t;
    }
    __syncthreads();
    const float t = s_total;
    __syncthreads();
    return t;
}

// 1 / sqrt(mean square + eps) of the row whose part this block holds (`ss`:
// each thread's sum of squares). Split rows: each block posts its part as
// one word {sum, seq} and reads its row's S parts in segment order, so
// every block of the row computes the same bits.
static __device__ float symm_ar_row_inv(const symm_ar_params& p, float ss, uint32_t seq) {
    float total = symm_ar_block_sum(ss);
    const uint32_t S = p.segments;
    if (S > 1) {
        __shared__ float s_part[SYMM_AR_MAX_SEGMENTS];
        volatile uint64_t* parts = (volatile uint64_t*)(p.scratch[p.rank] + p.partials_off) + blockIdx.x / S * S;
        if (threadIdx.x == 0) {
            parts[blockIdx.x % S] = ((uint64_t)seq << 32) | __float_as_uint(total);
        }
        if (threadIdx.x < S) {
            uint64_t v = parts[threadIdx.x];
            if ((uint32_t)(v >> 32) != seq) {
                symm_ar_wait w;
                symm_ar_wait_begin(w);
                do {
                    v = parts[threadIdx.x];
                } while ((uint32_t)(v >> 32) != seq && symm_ar_keep_waiting(w, p, p.rank));
            }
            s_part[threadIdx.x] = __uint_as_float((uint32_t)v);
        }
        __syncthreads();
        total = 0.0f;
        for (uint32_t s = 0; s < S; ++s) {
            total += s_part[s];
        }
    }
    return 1.0f / sqrtf(total / (float)p.hidden + p.eps);
}

// ---------------------------------------------------------------------------
// One-shot.
// ---------------------------------------------------------------------------
static __device__ __forceinline__ uint64_t symm_ar_one_slot(const symm_ar_params& p, int owner, int parity,
                                                            int src) {
    return p.scratch[owner] + p.one_off + ((uint64_t)parity * p.world + src) * p.one_slot;
}

// Lines i0 + l * stride (l < L; those at or beyond `end` are skipped)
// reduced over the ranks into acc[l], in T::Acc (8 / size elements each),
// in rank order. Each rank's L lines are all requested before any is waited
// for, so a thread pays one memory latency per rank, not one per line.
template <typename T, int L>
static __device__ __forceinline__ void symm_ar_lines(const symm_ar_params& p, uint64_t i0, uint64_t stride,
                                                     uint64_t end, uint64_t bytes, uint32_t seq, int parity,
                                                     typename T::Acc (*acc)[T::kPerLine]) {
    constexpr int E = T::kPerLine;
#pragma unroll
    for (int l = 0; l < L; ++l) {
#pragma unroll
        for (int e = 0; e < E; ++e) {
            acc[l][e] = 0;
        }
    }
    for (int r = 0; r < p.world; ++r) {
        const uint64_t slot = symm_ar_one_slot(p, p.rank, parity, r);
        symm_ar_u4 v[L];
#pragma unroll
        for (int l = 0; l < L; ++l) {
            const uint64_t i = i0 + l * stride;
            if (i >= end) {
                continue;
            }
            if (r == p.rank) {
                symm_ar_ld8<T::kSize>(p.input, i, bytes, v[l].x, v[l].z);
            } else {
                v[l] = symm_ar_ld_line(slot + 16 * i);
            }
        }
#pragma unroll
        for (int l = 0; l < L; ++l) {
            const uint64_t i = i0 + l * stride;
            if (i >= end) {
                continue;
            }
            if (r != p.rank && !(v[l].y == seq && v[l].w == seq)) {
                v[l] = symm_ar_poll_line(slot + 16 * i, seq, p, r);
            }
            typename T::Acc f[E];
            T::unpack_line(v[l].x, v[l].z, f);
#pragma unroll
            for (int e = 0; e < E; ++e) {
                acc[l][e] += f[e];
            }
        }
    }
#pragma unroll
    for (int l = 0; l < L; ++l) {
#pragma unroll
        for (int e = 0; e < E; ++e) {
            acc[l][e] = T::finish(acc[l][e], p);
        }
    }
}

// Every line of the message (`lines` of `bytes`) summed over the ranks and
// written to p.output, L lines per thread in flight.
template <typename T>
static __device__ __forceinline__ void symm_ar_sum_lines(const symm_ar_params& p, uint64_t lines, uint64_t bytes,
                                                         uint32_t seq, int parity) {
    constexpr int E = T::kPerLine, L = 4;
    const uint64_t gtid = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x;
    const uint64_t gstride = (uint64_t)gridDim.x * blockDim.x;
    for (uint64_t i0 = gtid; i0 < lines; i0 += L * gstride) {
        typename T::Acc acc[L][E];
        symm_ar_lines<T, L>(p, i0, gstride, lines, bytes, seq, parity, acc);
#pragma unroll
        for (int l = 0; l < L; ++l) {
            if (i0 + l * gstride < lines) {
                uint32_t d0, d1;
                T::pack_line(acc[l], d0, d1);
                symm_ar_st8<T::kSize>(p.output, i0 + l * gstride, bytes, d0, d1);
            }
        }
    }
}

// Lines per thread a row of the fused norm keeps in registers (rows of up
// to 4 * 8 * SYMM_AR_THREADS bytes; longer rows are read back).
#define SYMM_AR_ROW_LINES 4

// Lines [j0, j1) of row `row` of the fused form (float types): residual_out
// = sum + residual, out = rmsnorm(residual_out) * weight, the values kept in
// registers.
template <typename T>
static __device__ void symm_ar_norm_row_short(const symm_ar_params& p, uint64_t row, uint64_t j0, uint64_t j1,
                                              uint64_t bytes, uint32_t seq, int parity) {
    constexpr int E = T::kPerLine, L = SYMM_AR_ROW_LINES;
    const uint64_t row_lines = (uint64_t)p.hidden * T::kSize / 8;
    const uint64_t first = row * row_lines;
    const uint64_t wbytes = (uint64_t)p.hidden * T::kSize;
    // The residual and weight are requested before the peers' lines.
    uint32_t res[L][2], w[L][2];
#pragma unroll
    for (int l = 0; l < L; ++l) {
        const uint64_t j = j0 + threadIdx.x + (uint64_t)l * blockDim.x;
        if (j < j1) {
            symm_ar_ld8<T::kSize>(p.residual, first + j, bytes, res[l][0], res[l][1]);
            symm_ar_ld8<T::kSize>(p.weight, j, wbytes, w[l][0], w[l][1]);
        }
    }
    float acc[L][E];
    symm_ar_lines<T, L>(p, first + j0 + threadIdx.x, blockDim.x, first + j1, bytes, seq, parity, acc);
    float ss = 0.0f;
#pragma unroll
    for (int l = 0; l < L; ++l) {
        const uint64_t j = j0 + threadIdx.x + (uint64_t)l * blockDim.x;
        if (j >= j1) {
            continue;
        }
        float r[E];
        T::unpack_line(res[l][0], res[l][1], r);
#pragma unroll
        for (int e = 0; e < E; ++e) {
            acc[l][e] = T::round(T::round(acc[l][e]) + r[e]);
            ss += acc[l][e] * acc[l][e];
        }
        uint32_t d0, d1;
        T::pack_line(acc[l], d0, d1);
        symm_ar_st8<T::kSize>(p.residual_out, first + j, bytes, d0, d1);
    }
    const float inv = symm_ar_row_inv(p, ss, seq);
#pragma unroll
    for (int l = 0; l < L; ++l) {
        const uint64_t j = j0 + threadIdx.x + (uint64_t)l * blockDim.x;
        if (j >= j1) {
            continue;
        }
        float wf[E];
        T::unpack_line(w[l][0], w[l][1], wf);
#pragma unroll
        for (int e = 0; e < E; ++e) {
            acc[l][e] = acc[l][e] * inv * wf[e];
        }
        uint32_t d0, d1;
        T::pack_line(acc[l], d0, d1);
        symm_ar_st8<T::kSize>(p.output, first + j, bytes, d0, d1);
    }
}

// As symm_ar_norm_row_short for rows too long for registers: residual_out
// is written, then read back.
template <typename T>
static __device__ void symm_ar_norm_row_long(const symm_ar_params& p, uint64_t row, uint64_t j0, uint64_t j1,
                                             uint64_t bytes, uint32_t seq, int parity) {
    constexpr int E = T::kPerLine;
    const uint64_t row_lines = (uint64_t)p.hidden * T::kSize / 8;
    const uint64_t first = row * row_lines;
    const uint64_t wbytes = (uint64_t)p.hidden * T::kSize;
    float ss = 0.0f;
    for (uint64_t j = j0 + threadIdx.x; j < j1; j += blockDim.x) {
        float acc[1][E];
        symm_ar_lines<T, 1>(p, first + j, 0, first + row_lines, bytes, seq, parity, acc);
        uint32_t r0, r1;
        symm_ar_ld8<T::kSize>(p.residual, first + j, bytes, r0, r1);
        float res[E];
        T::unpack_line(r0, r1, res);
#pragma unroll
        for (int e = 0; e < E; ++e) {
            acc[0][e] = T::round(T::round(acc[0][e]) + res[e]);
            ss += acc[0][e] * acc[0][e];
        }
        uint32_t d0, d1;
        T::pack_line(acc[0], d0, d1);
        symm_ar_st8<T::kSize>(p.residual_out, first + j, bytes, d0, d1);
    }
    const float inv = symm_ar_row_inv(p, ss, seq);
    for (uint64_t j = j0 + threadIdx.x; j < j1; j += blockDim.x) {
        uint32_t r0, r1, w0, w1;
        symm_ar_ld8<T::kSize>(p.residual_out, first + j, bytes, r0, r1);
        symm_ar_ld8<T::kSize>(p.weight, j, wbytes, w0, w1);
        float r[E], w[E];
        T::unpack_line(r0, r1, r);
        T::unpack_line(w0, w1, w);
#pragma unroll
        for (int e = 0; e < E; ++e) {
            r[e] = r[e] * inv * w[e];
        }
        uint32_t d0, d1;
        T::pack_line(r, d0, d1);
        symm_ar_st8<T::kSize>(p.output, first + j, bytes, d0, d1);
    }
}

template <typename T>
static __device__ void symm_ar_one_shot_impl(const symm_ar_params& p) {
    const uint64_t bytes = p.n * T::kSize;
    const uint64_t lines = (bytes + 7) / 8;
    const uint64_t gtid = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x;
    const uint64_t gstride = (uint64_t)gridDim.x * blockDim.x;
    // The first line's data is loaded while the call count is read.
    uint32_t first0 = 0, first1 = 0;
    if (gtid < lines) {
        symm_ar_ld8<T::kSize>(p.input, gtid, bytes, first0, first1);
    }
    const uint32_t seq = symm_ar_begin(p);
    const int parity = seq & 1u;
    symm_ar_announce(p, seq);
    // Push this rank's lines to every peer.
    if (p.world > 1) {
        for (uint64_t i = gtid; i < lines; i += gstride) {
            uint32_t d0 = first0, d1 = first1;
            if (i != gtid) {
                symm_ar_ld8<T::kSize>(p.input, i, bytes, d0, d1);
            }
            for (int k = 1; k < p.world; ++k) {
                const int q = (p.rank + k) % p.world;
                symm_ar_st_line(symm_ar_one_slot(p, q, parity, p.rank) + 16 * i, d0, d1, seq);
            }
        }
    }
    // A block whose peers are in another call skips its data phase (the
    // count still moves on, so the header stays consistent).
    if (symm_ar_peers_agree(p, seq)) {
        if (!T::kFloat || p.hidden == 0) {
            symm_ar_sum_lines<T>(p, lines, bytes, seq, parity);
        } else if constexpr (T::kFloat) {
            // Segment blockIdx.x % S of rows blockIdx.x / S + k * (grid / S) (row
            // bytes are a multiple of 8: the host checks; S > 1 only with one row
            // per block, so each block posts one partial per call).
            const uint64_t row_lines = (uint64_t)p.hidden * T::kSize / 8;
            const uint64_t rows = p.n / p.hidden;
            const uint32_t S = p.segments;
            const uint64_t seg_lines = (row_lines + S - 1) / S;
            const uint64_t j0 = min(row_lines, (blockIdx.x % S) * seg_lines), j1 = min(row_lines, j0 + seg_lines);
            const bool short_rows = seg_lines <= (uint64_t)SYMM_AR_ROW_LINES * blockDim.x;
            for (uint64_t row = blockIdx.x / S; row < rows; row += gridDim.x / S) {
                if (short_rows) {
                    symm_ar_norm_row_short<T>(p, row, j0, j1, bytes, seq, parity);
                } else {
                    symm_ar_norm_row_long<T>(p, row, j0, j1, bytes, seq, parity);
                }
            }
        }
    }
    symm_ar_end(p, seq);
}

// ---------------------------------------------------------------------------
// Add + RMSNorm alone (after a two-shot, or rows the one-shot cannot fuse).
// ---------------------------------------------------------------------------
// 16-byte vectors per thread a row keeps in registers (rows of up to
// 4 * 16 * SYMM_AR_THREADS bytes; longer or unaligned rows take the
// element-wise path).
#define SYMM_NORM_VECS 4

// One row with 16-byte accesses, its values in registers: every load of the
// row is issued before the first sum.
template <typename T>
static __device__ void symm_add_rmsnorm_row_vec(const symm_rmsnorm_params& p, const unsigned char* x,
                                                const unsigned char* res, unsigned char* ro, unsigned char* out) {
    constexpr int K = SYMM_NORM_VECS, E = 4 * T::kPerWord;
    const uint32_t vecs = p.hidden * T::kSize / 16;
    symm_ar_u4 xv[K], rv[K], wv[K];
#pragma unroll
    for (int k = 0; k < K; ++k) {
        const uint32_t v = threadIdx.x + k * blockDim.x;
        if (v < vecs) {
            xv[k] = symm_ar_ld16((uint64_t)(x + 16 * v));
            rv[k] = symm_ar_ld16((uint64_t)(res + 16 * v));
            wv[k] = symm_ar_ld16(p.weight + 16 * v);
        }
    }
    float acc[K][E];
    float ss = 0.0f;
#pragma unroll
    for (int k = 0; k < K; ++k) {
        const uint32_t v = threadIdx.x + k * blockDim.x;
        if (v >= vecs) {
            continue;
        }
        float a[E], b[E];
        const uint32_t xw[4] = {xv[k].x, xv[k].y, xv[k].z, xv[k].w};
        const uint32_t rw[4] = {rv[k].x, rv[k].y, rv[k].z, rv[k].w};
#pragma unroll
        for (int q = 0; q < 4; ++q) {
            T::unpack(xw[q], a + q * T::kPerWord);
            T::unpack(rw[q], b + q * T::kPerWord);
        }
        uint32_t o[4];
#pragma unroll
        for (int e = 0; e < E; ++e) {
            acc[k][e] = T::round(a[e] + b[e]);
            ss += acc[k][e] * acc[k][e];
        }
#pragma unroll
        for (int q = 0; q < 4; ++q) {
            o[q] = T::pack(acc[k] + q * T::kPerWord);
        }
        symm_ar_st16((uint64_t)(ro + 16 * v), symm_ar_u4{o[0], o[1], o[2], o[3]});
    }
    const float inv = 1.0f / sqrtf(symm_ar_block_sum(ss) / (float)p.hidden + p.eps);
#pragma unroll
    for (int k = 0; k < K; ++k) {
        const uint32_t v = threadIdx.x + k * blockDim.x;
        if (v >= vecs) {
            continue;
        }
        float w[E];
        const uint32_t ww[4] = {wv[k].x, wv[k].y, wv[k].z, wv[k].w};
#pragma unroll
        for (int q = 0; q < 4; ++q) {
            T::unpack(ww[q], w + q * T::kPerWord);
        }
#pragma unroll
        for (int e = 0; e < E; ++e) {
            acc[k][e] = acc[k][e] * inv * w[e];
        }
        uint32_t o[4];
#pragma unroll
        for (int q = 0; q < 4; ++q) {
            o[q] = T::pack(acc[k] + q * T::kPerWord);
        }
        symm_ar_st16((uint64_t)(out + 16 * v), symm_ar_u4{o[0], o[1], o[2], o[3]});
    }
}

// Whether rows take the 16-byte path (row and strides 16-byte multiples,
// the row short enough for registers).
template <typename T>
static __device__ __forceinline__ bool symm_add_rmsnorm_vec(const symm_rmsnorm_params& p) {
    constexpr int S = T::kSize;
    const uint64_t row_bytes = (uint64_t)p.hidden * S;
    return row_bytes % 16 == 0 && row_bytes <= 16ull * SYMM_NORM_VECS * blockDim.x &&
           ((p.out | p.residual_out | p.x | p.residual | p.weight) & 15u) == 0 &&
           ((p.ld_out | p.ld_residual_out | p.ld_x | p.ld_residual) * S) % 16 == 0;
}

// Row `row`, by the whole block.
template <typename T>
static __device__ void symm_add_rmsnorm_row(const symm_rmsnorm_params& p, uint64_t row, bool vec) {
    constexpr int S = T::kSize;
    const unsigned char* x = (const unsigned char*)(p.x + row * p.ld_x * S);
    const unsigned char* res = (const unsigned char*)(p.residual + row * p.ld_residual * S);
    unsigned char* ro = (unsigned char*)(p.residual_out + row * p.ld_residual_out * S);
    unsigned char* out = (unsigned char*)(p.out + row * p.ld_out * S);
    if (vec) {
        symm_add_rmsnorm_row_vec<T>(p, x, res, ro, out);
        return;
    }
    float ss = 0.0f;
    for (uint32_t i = threadIdx.x; i < p.hidden; i += blockDim.x) {
        const float r = T::round(T::load(x + i * S) + T::load(res + i * S));
        T::store(ro + i * S, r);
        ss += r * r;
    }
    const float inv = 1.0f / sqrtf(symm_ar_block_sum(ss) / (float)p.hidden + p.eps);
    for (uint32_t i = threadIdx.x; i < p.hidden; i += blockDim.x) {
        const float r = T::load(ro + i * S);
        T::store(out + i * S, r * inv * T::load((const unsigned char*)(p.weight + i * S)));
    }
}

template <typename T>
static __device__ void symm_add_rmsnorm_impl(const symm_rmsnorm_params& p) {
    const bool vec = symm_add_rmsnorm_vec<T>(p);
    for (uint64_t row = blockIdx.x; row < p.rows; row += gridDim.x) {
        symm_add_rmsnorm_row<T>(p, row, vec);
    }
}

// ---------------------------------------------------------------------------
// All-gather: the one-shot's lines, placed instead of summed. S: the access
// width of tails and unaligned ends (1 or 2 bytes).
// ---------------------------------------------------------------------------
template <int S>
static __device__ void symm_ag_one_shot_impl(const symm_ar_params& p) {
    constexpr int L = 4;
    const uint64_t bytes = p.n;
    const uint64_t lines = (bytes + 7) / 8;
    const uint64_t gtid = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x;
    const uint64_t gstride = (uint64_t)gridDim.x * blockDim.x;
    const int W = p.world, me = p.rank;
    // The first line's data is loaded while the call count is read.
    uint32_t first0 = 0, first1 = 0;
    if (gtid < lines) {
        symm_ar_ld8<S>(p.input, gtid, bytes, first0, first1);
    }
    const uint32_t seq = symm_ar_begin(p);
    const int parity = seq & 1u;
    symm_ar_announce(p, seq);
    // This rank's lines to every peer, and to its own part of the output.
    const uint64_t own = p.output + (uint64_t)me * bytes;
    for (uint64_t i = gtid; i < lines; i += gstride) {
        uint32_t d0 = first0, d1 = first1;
        if (i != gtid) {
            symm_ar_ld8<S>(p.input, i, bytes, d0, d1);
        }
        for (int k = 1; k < W; ++k) {
            const int q = (me + k) % W;
            symm_ar_st_line(symm_ar_one_slot(p, q, parity, me) + 16 * i, d0, d1, seq);
        }
        symm_ar_st8<S>(own, i, bytes, d0, d1);
    }
    // A block whose peers are in another call skips its data phase (the
    // count still moves on, so the header stays consistent).
    if (symm_ar_peers_agree(p, seq)) {
        // Every peer's lines, from this rank's slots to their part: L lines
        // requested before any is waited for.
        for (int k = 1; k < W; ++k) {
            const int src = (me + W - k) % W;
            const uint64_t slot = symm_ar_one_slot(p, me, parity, src);
            const uint64_t dst = p.output + (uint64_t)src * bytes;
            for (uint64_t i0 = gtid; i0 < lines; i0 += L * gstride) {
                symm_ar_u4 v[L];
    #pragma unroll
                for (int l = 0; l < L; ++l) {
                    const uint64_t i = i0 + l * gstride;
                    if (i < lines) {
                        v[l] = symm_ar_ld_line(slot + 16 * i);
                    }
                }
    #pragma unroll
                for (int l = 0; l < L; ++l) {
                    const uint64_t i = i0 + l * gstride;
                    if (i >= lines) {
                        continue;
                    }
                    if (!(v[l].y == seq && v[l].w == seq)) {
                        v[l] = symm_ar_poll_line(slot + 16 * i, seq, p, src);
                    }
                    symm_ar_st8<S>(dst, i, bytes, v[l].x, v[l].z);
                }
            }
        }
    }
    symm_ar_end(p, seq);
}

// ---------------------------------------------------------------------------
// Two-shot.
// ---------------------------------------------------------------------------
static __device__ __forceinline__ uint64_t symm_ar_two_slot(const symm_ar_params& p, int owner, int parity,
                                                            int src) {
    return p.scratch[owner] + p.two_off + ((uint64_t)parity * p.world + src) * p.two_slot;
}

static __device__ __forceinline__ uint64_t symm_ar_flag(const symm_ar_params& p, int owner, int parity, int k,
                                                        uint64_t c) {
    return p.scratch[owner] + p.flags_off +
           (((uint64_t)parity * (p.world + 1) + k) * SYMM_AR_MAX_CHUNKS + c) * 4;
}

// Copies `len` bytes with the block's threads: 16-byte accesses when both
// ends are aligned, four in flight per thread, else 2-byte ones, and 1-byte
// ones for an odd end or address (1-byte elements). `cg`: the source is
// scratch that another rank wrote.
static __device__ void symm_ar_block_copy(uint64_t dst, uint64_t src, uint64_t len, bool cg) {
    uint64_t from = 0;
    if (((dst | src) & 15u) == 0) {
        constexpr int U = 4;
        const uint64_t vecs = len / 16, step = blockDim.x;
        uint64_t v = threadIdx.x;
        for (; v + (U - 1) * step < vecs; v += U * step) {
            symm_ar_u4 x[U];
#pragma unroll
            for (int u = 0; u < U; ++u) {
                const uint64_t at = src + 16 * (v + u * step);
                x[u] = cg ? symm_ar_ld_cg(at) : symm_ar_ld16(at);
            }
#pragma unroll
            for (int u = 0; u < U; ++u) {
                symm_ar_st16(dst + 16 * (v + u * step), x[u]);
            }
        }
        for (; v < vecs; v += step) {
            symm_ar_st16(dst + 16 * v, cg ? symm_ar_ld_cg(src + 16 * v) : symm_ar_ld16(src + 16 * v));
        }
        from = vecs * 16;
    }
    if (((dst | src) & 1u) == 0) {
        for (uint64_t o = from + 2 * threadIdx.x; o + 1 < len; o += 2 * blockDim.x) {
            *(unsigned short*)(dst + o) = *(const volatile unsigned short*)(src + o);
        }
        from = len & ~(uint64_t)1;
    }
    for (uint64_t o = from + threadIdx.x; o < len; o += blockDim.x) {
        *(unsigned char*)(dst + o) = *(const volatile unsigned char*)(src + o);
    }
}

// A chunk this rank owns: the sum of every rank's part (this rank's at
// `in`, each peer's in this rank's slot (parity, peer) at `slot_off`),
// written to `out` and, with kSend, to every peer's slot (parity, rank),
// second half.
template <typename T, bool kSend>
static __device__ void symm_ar_reduce_chunk(const symm_ar_params& p, int parity, uint64_t in, uint64_t out,
                                            uint64_t len, uint64_t slot_off) {
    typedef typename T::Acc Acc;
    const int W = p.world;
    const uint64_t half = p.two_slot / 2;
    if (((in | out) & 15u) == 0) {
        constexpr int L = T::kPerLine, E = 2 * L;
        const uint64_t vecs = len / 16;
        for (uint64_t v = threadIdx.x; v < vecs; v += blockDim.x) {
            Acc acc[E];
#pragma unroll
            for (int e = 0; e < E; ++e) {
                acc[e] = 0;
            }
            for (int r = 0; r < W; ++r) {
                const symm_ar_u4 x = r == p.rank
                                         ? symm_ar_ld16(in + 16 * v)
                                         : symm_ar_ld_cg(symm_ar_two_slot(p, p.rank, parity, r) + slot_off + 16 * v);
                Acc f[E];
                T::unpack_line(x.x, x.y, f);
                T::unpack_line(x.z, x.w, f + L);
#pragma unroll
                for (int e = 0; e < E; ++e) {
                    acc[e] += f[e];
                }
            }
#pragma unroll
            for (int e = 0; e < E; ++e) {
                acc[e] = T::finish(acc[e], p);
            }
            symm_ar_u4 o;
            T::pack_line(acc, o.x, o.y);
            T::pack_line(acc + L, o.z, o.w);
            symm_ar_st16(out + 16 * v, o);
            for (int k = 1; kSend && k < W; ++k) {
                const int q = (p.rank + k) % W;
                symm_ar_st16(symm_ar_two_slot(p, q, parity, p.rank) + half + slot_off + 16 * v, o);
            }
        }
        // A tail of fewer than 16 bytes: element by element below.
        in += vecs * 16;
        out += vecs * 16;
        len -= vecs * 16;
        slot_off += vecs * 16;
    }
    const uint64_t count = len / T::kSize;
    for (uint64_t e = threadIdx.x; e < count; e += blockDim.x) {
        const uint64_t o = e * T::kSize;
        Acc acc = 0;
        for (int r = 0; r < W; ++r) {
            acc += r == p.rank ? T::load((const unsigned char*)(in + o))
                               : T::load((const unsigned char*)(symm_ar_two_slot(p, p.rank, parity, r) + slot_off + o));
        }
        acc = T::finish(acc, p);
        T::store((unsigned char*)(out + o), acc);
        for (int k = 1; kSend && k < W; ++k) {
            const int q = (p.rank + k) % W;
            T::store((unsigned char*)(symm_ar_two_slot(p, q, parity, p.rank) + half + slot_off + o), acc);
        }
    }
}

template <typename T>
static __device__ void symm_ar_two_shot_impl(const symm_ar_params& p) {
    const uint32_t seq = symm_ar_begin(p);
    const int parity = seq & 1u;
    symm_ar_announce(p, seq);
    const int W = p.world, me = p.rank;
    const uint64_t bytes = p.n * T::kSize;
    const uint64_t C = p.chunk_bytes;
    const uint64_t chunks = (bytes + C - 1) / C;
    // Chunk c = g * W + owner: a block takes whole groups g, so that it pays
    // one barrier per phase, not one per chunk.
    const uint64_t groups = (chunks + W - 1) / W;
    const uint64_t half = p.two_slot / 2;
    auto len_of = [&](uint64_t c) { return bytes - c * C < C ? bytes - c * C : C; };
    // A: this rank's part of every chunk a peer owns, to that peer.
    for (uint64_t g = blockIdx.x; g < groups; g += gridDim.x) {
        for (int k = 1; k < W; ++k) {
            const int owner = (me + k) % W;
            const uint64_t c = g * W + owner;
            if (c < chunks) {
                symm_ar_block_copy(symm_ar_two_slot(p, owner, parity, me) + g * C, p.input + c * C, len_of(c), false);
            }
        }
    }
    // The block's stores, then released flags (see symm_pieces_flag).
    __syncthreads();
    if (threadIdx.x == 0) {
        for (uint64_t g = blockIdx.x; g < groups; g += gridDim.x) {
            for (int k = 1; k < W; ++k) {
                const int owner = (me + k) % W;
                if (g * W + owner < chunks) {
                    symm_st_release_sys((uint32_t*)symm_ar_flag(p, owner, parity, me, g * W + owner), seq);
                }
            }
        }
    }
    // A block whose peers are in another call skips its data phase (the
    // count still moves on, so the header stays consistent).
    if (symm_ar_peers_agree(p, seq)) {
        // B: the chunks this rank owns, reduced and sent to every peer.
        bool sent = false;
        for (uint64_t g = blockIdx.x; g < groups; g += gridDim.x) {
            const uint64_t c = g * W + me;
            if (c >= chunks) {
                continue;
            }
            if ((int)threadIdx.x < W && (int)threadIdx.x != me) {
                symm_ar_wait_flag(symm_ar_flag(p, me, parity, threadIdx.x, c), seq, p, threadIdx.x);
            }
            __syncthreads();
            symm_ar_reduce_chunk<T, true>(p, parity, p.input + c * C, p.output + c * C, len_of(c), g * C);
            sent = true;
        }
        __syncthreads();
        if (threadIdx.x == 0 && sent) {
            for (uint64_t g = blockIdx.x; g < groups; g += gridDim.x) {
                if (g * W + me < chunks) {
                    for (int k = 1; k < W; ++k) {
                        const int q = (me + k) % W;
                        symm_st_release_sys((uint32_t*)symm_ar_flag(p, q, parity, W, g * W + me), seq);
                    }
                }
            }
        }
        // C: the peers' reduced chunks, from this rank's scratch to the output.
        for (uint64_t g = blockIdx.x; g < groups; g += gridDim.x) {
            if ((int)threadIdx.x < W && (int)threadIdx.x != me && g * W + threadIdx.x < chunks) {
                symm_ar_wait_flag(symm_ar_flag(p, me, parity, W, g * W + threadIdx.x), seq, p, threadIdx.x);
            }
            __syncthreads();
            for (int k = 1; k < W; ++k) {
                const int owner = (me + k) % W;
                const uint64_t c = g * W + owner;
                if (c < chunks) {
                    symm_ar_block_copy(p.output + c * C, symm_ar_two_slot(p, me, parity, owner) + half + g * C,
                                       len_of(c), true);
                }
            }
        }
    }
    symm_ar_end(p, seq);
}

template <typename T>
static __device__ void symm_rs_one_shot_impl(const symm_ar_params& p) {
    const uint64_t bytes = p.n * T::kSize;
    const uint64_t lines = bytes / 8;
    const uint64_t gtid = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x;
    const uint64_t gstride = (uint64_t)gridDim.x * blockDim.x;
    const uint32_t seq = symm_ar_begin(p);
    const int parity = seq & 1u;
    symm_ar_announce(p, seq);
    for (int k = 1; k < p.world; ++k) {
        const int q = (p.rank + k) % p.world;
        const uint64_t src = p.input + q * p.chunk_bytes;
        const uint64_t slot = symm_ar_one_slot(p, q, parity, p.rank);
        for (uint64_t i = gtid; i < lines; i += gstride) {
            const uint2 v = *(const uint2*)(src + 8 * i);
            symm_ar_st_line(slot + 16 * i, v.x, v.y, seq);
        }
    }
    // A block whose peers are in another call skips its data phase (the
    // count still moves on, so the header stays consistent).
    if (symm_ar_peers_agree(p, seq)) {
        // symm_ar_lines reads this rank's own lines at p.input.
        symm_ar_params own = p;
        own.input = p.input + p.rank * p.chunk_bytes;
        symm_ar_sum_lines<T>(own, lines, bytes, seq, parity);
    }
    symm_ar_end(p, seq);
}

// The reduce-scatter's pieces: at most this many per chunk, each at least
// SYMM_RS_MIN_PIECE bytes, a multiple of 16 (a function of the chunk's
// bytes alone: every rank cuts alike, whatever its grid).
#define SYMM_RS_PIECES 128
#define SYMM_RS_MIN_PIECE 4096

static __device__ __forceinline__ uint64_t symm_rs_piece_bytes(uint64_t bytes) {
    const uint64_t each = (bytes + SYMM_RS_PIECES - 1) / SYMM_RS_PIECES;
    return ((each > SYMM_RS_MIN_PIECE ? each : SYMM_RS_MIN_PIECE) + 15) / 16 * 16;
}

// After a block's stores of its pieces (blockIdx.x, + gridDim.x, ...) to
// every peer: flag(parity, rank, i) = seq in each peer's buffer for each
// of them. The barrier orders every thread's stores before thread 0's
// flags, and a release is cumulative: a peer that acquires a flag sees the
// stores without a system fence first, which cost 1-1.6 us a call at
// 128 KiB-2 MiB (bench/probes/rs_latency_probe.cu).
static __device__ void symm_pieces_flag(const symm_ar_params& p, int parity, uint32_t seq, uint64_t pieces) {
    __syncthreads();
    if (threadIdx.x == 0) {
        for (uint64_t i = blockIdx.x; i < pieces; i += gridDim.x) {
            for (int k = 1; k < p.world; ++k) {
                symm_st_release_sys((uint32_t*)symm_ar_flag(p, (p.rank + k) % p.world, parity, p.rank, i), seq);
            }
        }
    }
}

// Until every peer has flagged piece i in this rank's buffer (thread t
// waits for rank t's flag), then the block reads it.
static __device__ void symm_pieces_wait(const symm_ar_params& p, int parity, uint32_t seq, uint64_t i) {
    if ((int)threadIdx.x < p.world && (int)threadIdx.x != p.rank) {
        symm_ar_wait_flag(symm_ar_flag(p, p.rank, parity, threadIdx.x, i), seq, p, threadIdx.x);
    }
    __syncthreads();
}

// Reduce-scatter by pieces (symm_rs_two_shot_<DT>): the two-shot's phases
// A and B for one chunk per rank, laid out as the one-shot's (p.n elements
// per chunk, p.chunk_bytes apart in the input). A: each rank copies its
// piece i of chunk q into rank q's two-shot slot (parity, rank) and sets
// flag(parity, rank, i) there; B: it waits for every peer's flag of each
// of its pieces and sums them with its own chunk into the output. Plain
// stores: half the LL lines' traffic, for a flag per piece.
template <typename T>
static __device__ void symm_rs_two_shot_impl(const symm_ar_params& p) {
    const uint32_t seq = symm_ar_begin(p);
    const int parity = seq & 1u;
    symm_ar_announce(p, seq);
    const int W = p.world, me = p.rank;
    const uint64_t bytes = p.n * T::kSize;
    const uint64_t P = symm_rs_piece_bytes(bytes);
    const uint64_t pieces = (bytes + P - 1) / P;
    auto len_of = [&](uint64_t i) { return bytes - i * P < P ? bytes - i * P : P; };
    for (uint64_t i = blockIdx.x; i < pieces; i += gridDim.x) {
        for (int k = 1; k < W; ++k) {
            const int q = (me + k) % W;
            symm_ar_block_copy(symm_ar_two_slot(p, q, parity, me) + i * P, p.input + q * p.chunk_bytes + i * P,
                               len_of(i), false);
        }
    }
    symm_pieces_flag(p, parity, seq, pieces);
    // A block whose peers are in another call skips its data phase (the
    // count still moves on, so the header stays consistent).
    if (symm_ar_peers_agree(p, seq)) {
        for (uint64_t i = blockIdx.x; i < pieces; i += gridDim.x) {
            symm_pieces_wait(p, parity, seq, i);
            symm_ar_reduce_chunk<T, false>(p, parity, p.input + me * p.chunk_bytes + i * P, p.output + i * P,
                                           len_of(i), i * P);
        }
    }
    symm_ar_end(p, seq);
}

// All-gather by pieces (symm_ag_two_shot): the reduce-scatter by pieces
// with "place" for "sum". Each rank copies piece i of its input (p.n bytes)
// into every peer's two-shot slot (parity, rank) and its own part of the
// output, and sets flag(parity, rank, i) in the peers' buffers; then it waits
// for every peer's flag of each piece and copies the piece from slot
// (parity, peer) to output + peer * n.
static __device__ void symm_ag_two_shot_impl(const symm_ar_params& p) {
    const uint32_t seq = symm_ar_begin(p);
    const int parity = seq & 1u;
    symm_ar_announce(p, seq);
    const int W = p.world, me = p.rank;
    const uint64_t bytes = p.n;
    const uint64_t P = symm_rs_piece_bytes(bytes);
    const uint64_t pieces = (bytes + P - 1) / P;
    auto len_of = [&](uint64_t i) { return bytes - i * P < P ? bytes - i * P : P; };
    for (uint64_t i = blockIdx.x; i < pieces; i += gridDim.x) {
        for (int k = 1; k < W; ++k) {
            symm_ar_block_copy(symm_ar_two_slot(p, (me + k) % W, parity, me) + i * P, p.input + i * P, len_of(i),
                               false);
        }
        symm_ar_block_copy(p.output + me * bytes + i * P, p.input + i * P, len_of(i), false);
    }
    symm_pieces_flag(p, parity, seq, pieces);
    // As in symm_rs_two_shot_impl: a block whose peers are in another call
    // skips its data phase.
    if (symm_ar_peers_agree(p, seq)) {
        for (uint64_t i = blockIdx.x; i < pieces; i += gridDim.x) {
            symm_pieces_wait(p, parity, seq, i);
            for (int k = 1; k < W; ++k) {
                const int src = (me + W - k) % W;
                symm_ar_block_copy(p.output + src * bytes + i * P, symm_ar_two_slot(p, me, parity, src) + i * P,
                                   len_of(i), true);
            }
        }
    }
    symm_ar_end(p, seq);
}

#define SYMM_AR_ENTRY(SUFFIX, T)                                                                       \
    extern "C" __global__ void __launch_bounds__(SYMM_AR_THREADS, 1) symm_ar_one_shot_##SUFFIX(          \
        const symm_ar_params p) {                                                                      \
        symm_ar_one_shot_impl<T>(p);                                                                   \
    }                                                                                                  \
    extern "C" __global__ void __launch_bounds__(SYMM_AR_THREADS, 1) symm_ar_two_shot_##SUFFIX(          \
        const symm_ar_params p) {                                                                      \
        symm_ar_two_shot_impl<T>(p);                                                                   \
    }
#define SYMM_AR_FLOAT_ENTRY(SUFFIX, T)                                                                  \
    extern "C" __global__ void __launch_bounds__(SYMM_AR_THREADS, 1) symm_add_rmsnorm_##SUFFIX(          \
        const symm_rmsnorm_params p) {                                                                 \
        symm_add_rmsnorm_impl<T>(p);                                                                   \
    }                                                                                                  \
    extern "C" __global__ void __launch_bounds__(SYMM_AR_THREADS, 1) symm_rs_one_shot_##SUFFIX(          \
        const symm_ar_params p) {                                                                      \
        symm_rs_one_shot_impl<T>(p);                                                                   \
    }                                                                                                  \
    extern "C" __global__ void __launch_bounds__(SYMM_AR_THREADS, 1) symm_rs_two_shot_##SUFFIX(          \
        const symm_ar_params p) {                                                                      \
        symm_rs_two_shot_impl<T>(p);                                                                   \
    }

extern "C" __global__ void __launch_bounds__(SYMM_AR_THREADS, 1) symm_ag_two_shot(const symm_ar_params p) {
    symm_ag_two_shot_impl(p);
}

extern "C" __global__ void __launch_bounds__(SYMM_AR_THREADS, 1) symm_ag_one_shot(const symm_ar_params p) {
    if (((p.input | p.output | p.n) & 1u) == 0) {
        symm_ag_one_shot_impl<2>(p);
    } else {
        symm_ag_one_shot_impl<1>(p);
    }
}

SYMM_AR_ENTRY(f32, symm_ar_dt<SYMM_DT_F32>)
SYMM_AR_ENTRY(bf16, symm_ar_dt<SYMM_DT_BF16>)
SYMM_AR_ENTRY(f16, symm_ar_dt<SYMM_DT_F16>)
SYMM_AR_FLOAT_ENTRY(f32, symm_ar_dt<SYMM_DT_F32>)
SYMM_AR_FLOAT_ENTRY(bf16, symm_ar_dt<SYMM_DT_BF16>)
SYMM_AR_FLOAT_ENTRY(f16, symm_ar_dt<SYMM_DT_F16>)
SYMM_AR_ENTRY(i8, symm_ar_int<signed char>)
SYMM_AR_ENTRY(u8, symm_ar_int<unsigned char>)
SYMM_AR_ENTRY(i32, symm_ar_int<int32_t>)
SYMM_AR_ENTRY(i64, symm_ar_int<int64_t>)
#undef SYMM_AR_ENTRY
#undef SYMM_AR_FLOAT_ENTRY
