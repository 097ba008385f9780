// The fused all-gather's side of the Hopper matmul (ready != NULL): a
// chunk of A's rows arrives in `slices` slices of k, slice s of chunk c
// announced by ready[c * slices + s] != 0, written by the copy engine's
// stream after the data. Before loading a k-block of A for a tile of chunk
// c, the producer waits for the slice that holds it, so a tile waits only
// for its first slice, and the others land while it multiplies. With more
// than one slice the gathered A lies slice-major, [slices][m][k / slices]
// (tm_a is 3-D), so each slice of a chunk is one contiguous copy: pitched
// copies of narrow rows ran at half a copy engine's speed. This rank's own
// chunk is read from its own tensor map (the caller's shard, no copy), and
// never waited for. sm_90a only.
#pragma once
#include "sm90_wait.cuh"

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

// Waits for an arrival flag to be set (every CTA may wait at once: backs
// off to 1 us).
static __device__ bool symm_wait_nonzero(const uint32_t* flag, const symm_gemm_params& p, int peer) {
    return symm_wait_for(flag, [](uint32_t v) { return v != 0; }, p, peer, SYMM_SIGNAL_KIND_VALUE, 1024);
}

// The producer's waits of one CTA: which chunks it has seen whole, so a
// chunk's later tiles load without waiting again.
struct symm_gather {
    uint32_t landed = 0;  // bit per chunk

    // The first k-block of `chunk` at which a tile waits (kblocks: none).
    __device__ int first_wait(const symm_gemm_params& p, int chunk, bool local, int kblocks) const {
        return p.ready != nullptr && !local && !(landed >> chunk & 1) ? 0 : kblocks;
    }

    // At k-block kb == wait_kb: waits for the slice holding it, and returns
    // the next k-block to wait at.
    __device__ int wait(const symm_gemm_params& p, int chunk, int kb) {
        const int slice = kb / p.slice_kblocks;
        symm_wait_nonzero(&p.ready[chunk * p.slices + slice], p, chunk);
        // The rows were written by a copy engine; order our (async proxy)
        // TMA reads after the flag.
        asm volatile("fence.proxy.async.global;" ::: "memory");
        if (slice == p.slices - 1) landed |= 1u << chunk;
        return kb + p.slice_kblocks;
    }
};

#endif  // __CUDA_ARCH_FEAT_SM90_ALL
