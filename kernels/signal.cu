// Signal and barrier kernels over symmetric signal pads.
//
// Common arguments:
//   pads        device array of `world` addresses: pads[r] is rank r's signal
//               pad as mapped in this process (uint32 slots pad[channel][src]),
//               0 where rank r is on another host (not mapped here).
//   rank, world this rank and the group size.
//   channel     which row of slots to use (the host checks it is in range).
//   tag         the call's tag (never 0): what a put stores, and what a wait
//               expects; another call's there fails the wait (mismatch).
//   timeout_ns  how long to wait before giving up; 0 = SYMM_DEFAULT_TIMEOUT_NS.
//   err         this rank's symm_async_error in host-visible memory.
// On timeout a kernel records the failure in *err and returns; it never
// traps, so the context stays usable. See common.cuh for the protocol.
#include "common.cuh"

// Launch with one block of one thread.
extern "C" __global__ void symm_put_signal(const uint64_t* pads, int rank, int world, int peer,
                                           int channel, uint32_t tag, uint64_t timeout_ns,
                                           symm_async_error* err) {
    if (threadIdx.x != 0) {
        return;
    }
    if (!symm_args_valid(rank, world, peer)) {
        symm_record_error(err, SYMM_ASYNC_INVALID_ARG, rank, peer, channel, SYMM_SIGNAL_KIND_PUT, 0);
        return;
    }
    // Make everything this stream wrote before (earlier kernels and copies)
    // visible system-wide before the release of the flag.
    __threadfence_system();
    symm_signal_put(pads, rank, world, peer, channel, tag, timeout_ns, err);
}

// Launch with one block of one thread.
extern "C" __global__ void symm_wait_signal(const uint64_t* pads, int rank, int world, int peer,
                                            int channel, uint32_t tag, uint64_t timeout_ns,
                                            symm_async_error* err) {
    if (threadIdx.x != 0) {
        return;
    }
    if (!symm_args_valid(rank, world, peer)) {
        symm_record_error(err, SYMM_ASYNC_INVALID_ARG, rank, peer, channel, SYMM_SIGNAL_KIND_WAIT,
                          0);
        return;
    }
    symm_signal_wait(pads, rank, world, peer, channel, tag, timeout_ns, err);
    __threadfence_system();
}

// All ranks of the group meet: no rank leaves before every rank has entered,
// and memory operations of the stream before the barrier (on any rank) are
// visible to those after it (on any rank).
// Launch with one block of at least `world` threads (e.g. world rounded up
// to 32); thread t < world, t != rank, signals and then waits for peer t,
// unless peer t is on another host (its pad is 0): the barrier is over the
// ranks of this host.
extern "C" __global__ void symm_barrier(const uint64_t* pads, int rank, int world, int channel,
                                        uint32_t tag, uint64_t timeout_ns, symm_async_error* err) {
    const int peer = (int)threadIdx.x;
    if (!symm_args_valid(rank, world, 0) || (unsigned)world > blockDim.x) {
        if (peer == 0) {
            symm_record_error(err, SYMM_ASYNC_INVALID_ARG, rank, -1, channel, SYMM_SIGNAL_KIND_NONE,
                              0);
        }
        return;
    }
    const bool active = peer < world && peer != rank && pads[peer] != 0;
    if (active) {
        __threadfence_system();
        symm_signal_put(pads, rank, world, peer, channel, tag, timeout_ns, err);
    }
    __syncthreads();
    if (active) {
        symm_signal_wait(pads, rank, world, peer, channel, tag, timeout_ns, err);
    }
    __syncthreads();
    __threadfence_system();
}

// Waits until the 32-bit flag at `flag` (in any rank's symmetric buffer, as
// mapped here) is >= `value`, with acquire semantics at system scope, so data
// written before the flag by its writer is visible to this stream after.
// Unlike cuStreamWaitValue32 it gives up after `timeout_ns`, recording the
// failure (peer = the flag's owner rank, channel = -1) instead of hanging.
// Launch with one block of one thread.
extern "C" __global__ void symm_wait_value(const uint32_t* flag, uint32_t value, int rank, int owner,
                                           uint64_t timeout_ns, symm_async_error* err) {
    if (threadIdx.x != 0) {
        return;
    }
    if (timeout_ns == 0) {
        timeout_ns = SYMM_DEFAULT_TIMEOUT_NS;
    }
    const uint64_t start = symm_globaltimer_ns();
    uint64_t next_err_poll = start + SYMM_ERR_POLL_NS;
    uint32_t backoff = 8u;
    while (symm_ld_acquire_sys(flag) < value) {
        const uint64_t now = symm_globaltimer_ns();
        if (now - start >= timeout_ns) {
            symm_record_error(err, SYMM_ASYNC_TIMEOUT, rank, owner, -1, SYMM_SIGNAL_KIND_VALUE,
                              now - start);
            return;
        }
        if (now >= next_err_poll) {
            if (symm_error_pending(err)) {
                return;
            }
            next_err_poll = now + SYMM_ERR_POLL_NS;
        }
        __nanosleep(backoff);
        backoff = backoff < SYMM_MAX_BACKOFF_NS ? backoff * 2u : backoff;
    }
    __threadfence_system();
}

// Across hosts: the call tags of the members of one NCCL step, gathered
// by NCCL beside the step's data, against this rank's `tag`. A member in
// another call (ranks out of step between calls kept after their
// agreement) records SYMM_ASYNC_MISMATCH naming its group rank (`ranks`)
// on channel -4, which the host reports as an exchange across hosts.
// Launch with one block of one thread.
extern "C" __global__ void symm_check_tags(const uint32_t* tags, const int32_t* ranks, int count,
                                           uint32_t tag, int rank, symm_async_error* err) {
    if (threadIdx.x != 0) {
        return;
    }
    for (int i = 0; i < count; ++i) {
        if (tags[i] != tag) {
            symm_record_error(err, SYMM_ASYNC_MISMATCH, rank, ranks[i], -4, SYMM_SIGNAL_KIND_NONE, 0);
            return;
        }
    }
}
