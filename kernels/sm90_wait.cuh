// Waits of the fused Hopper matmul on words other GPUs (or copy engines)
// write: bounded by the call's timeout, recorded in the error record, and
// polled gently (relaxed loads with backoff, one acquire at the end), since
// every CTA of the grid may wait at once. sm_90a only.
#pragma once
#include "sm90_params.cuh"

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

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
        // release of a pushed tile's flag does); an
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


#endif  // __CUDA_ARCH_FEAT_SM90_ALL
